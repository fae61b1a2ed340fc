//! Bounds on what an untrusted template can build in memory.
//!
//! minijinja's fuel counts instructions, not bytes, and its `~`, `+` and
//! string `*` allocate whatever they are asked to: `{% set ns.s = ns.s ~ ns.s %}`
//! in a loop doubles a string per iteration and reaches gigabytes long
//! before fuel runs out. There is no hook for operators, so before a template
//! is compiled its binary `~`, `+` and `*` are rewritten into calls of guard
//! functions (`a ~ b` becomes `__flatrun_concat((a), (b))`), found with
//! minijinja's own parser so that precedence and nesting are exactly its
//! own. The guards refuse to build a string longer than the limit or a
//! sequence with more items than the limit, and otherwise compute what the
//! operator computes. Filters and Python-style methods that can inflate a
//! string or allocate by a number they are given (`replace`, `join`,
//! `indent`, `center`, `batch`, …) get the same checks in `chat_template.rs`.

use std::sync::OnceLock;

use minijinja::machinery::ast::{self, CallArg, Expr, Stmt};
use minijinja::machinery::{parse, WhitespaceConfig};
use minijinja::syntax::SyntaxConfig;
use minijinja::{Environment, ErrorKind, Value};

/// The guard functions the rewritten operators call.
pub(crate) const CONCAT_FN: &str = "__flatrun_concat";
pub(crate) const ADD_FN: &str = "__flatrun_add";
pub(crate) const MUL_FN: &str = "__flatrun_mul";

/// Marker that tells size-limit errors apart from other render errors.
pub(crate) const TOO_LARGE: &str = "flatrun limit: ";

/// The error a guard returns when a value would be too large.
pub(crate) fn too_large(what: String) -> minijinja::Error {
    minijinja::Error::new(ErrorKind::InvalidOperation, format!("{TOO_LARGE}{what}"))
}

/// One operator to rewrite: its span and its operands' spans (byte offsets).
/// The left operand runs from the start of the operator's span to the
/// operator, the right one from the operator to the end of the span (so
/// parentheses around an operand stay with it; the span of a postfix
/// expression like `messages[0]` does not always cover its base).
struct Rewrite {
    function: &'static str,
    symbol: char,
    whole: (usize, usize),
    /// Where the left operand's own span ends; the operator follows.
    left_end: usize,
    left: (usize, usize),
    right: (usize, usize),
}

/// `source` with every binary `~`, `+` and `*` replaced by a guard call.
/// Fails when the template does not parse (the caller reports that as a
/// syntax error from compiling the original).
// `SyntaxConfig` has fields when minijinja's `custom_syntax` feature is on.
#[allow(clippy::default_constructed_unit_structs)]
pub(crate) fn rewrite_operators(source: &str) -> Result<String, minijinja::Error> {
    let ast = parse(
        source,
        "chat_template",
        SyntaxConfig::default(),
        WhitespaceConfig {
            keep_trailing_newline: false,
            lstrip_blocks: true,
            trim_blocks: true,
        },
    )?;
    let mut rewrites = Vec::new();
    visit_stmt(&ast, &mut rewrites);
    if rewrites.is_empty() {
        return Ok(source.to_string());
    }
    // Between the left operand and the operator there are only closing
    // parentheses and whitespace.
    for r in &mut rewrites {
        let operator = source
            .get(r.left_end..r.whole.1)
            .and_then(|rest| rest.find(r.symbol))
            .map(|at| r.left_end + at);
        if let Some(at) = operator {
            r.left = (r.whole.0, at);
            r.right = (at + r.symbol.len_utf8(), r.whole.1);
        } else {
            r.left = (1, 0); // marks it unsound below
        }
    }
    if !spans_are_sound(source, &rewrites) {
        return Err(minijinja::Error::new(
            ErrorKind::SyntaxError,
            "the template's operators could not be located for the sandbox",
        ));
    }
    // Outer operators first: by start, then the longest.
    rewrites.sort_by_key(|r| (r.whole.0, std::cmp::Reverse(r.whole.1)));
    let mut out = String::with_capacity(source.len() + rewrites.len() * 24);
    render(source, &rewrites, (0, source.len()), &mut out);
    Ok(out)
}

/// Append `source[range]` with the outermost rewrites inside it applied.
/// Offsets were checked by the caller (char boundaries within the source).
fn render(source: &str, rewrites: &[Rewrite], range: (usize, usize), out: &mut String) {
    let mut at = range.0;
    for (i, r) in rewrites.iter().enumerate() {
        // Skip rewrites outside the range or inside one already applied.
        if r.whole.0 < at || r.whole.1 > range.1 {
            continue;
        }
        out.push_str(&source[at..r.whole.0]);
        let inner = nested_in(rewrites, i);
        out.push_str(r.function);
        out.push_str("((");
        render(source, inner, r.left, out);
        out.push_str("), (");
        render(source, inner, r.right, out);
        out.push_str("))");
        // Keep line numbers: the newlines between the operands (around the
        // operator and inside dropped parentheses) go after the call.
        let newlines = |(a, b): (usize, usize)| source[a..b].matches('\n').count();
        let dropped = newlines(r.whole)
            .saturating_sub(newlines(r.left))
            .saturating_sub(newlines(r.right));
        out.extend(std::iter::repeat_n('\n', dropped));
        at = r.whole.1;
    }
    out.push_str(&source[at..range.1]);
}

/// The rewrites inside rewrite `i` (the list is sorted by start, outer first,
/// so they follow it and start before it ends).
fn nested_in(rewrites: &[Rewrite], i: usize) -> &[Rewrite] {
    let end = rewrites[i].whole.1;
    let from = i + 1;
    let count = rewrites[from..]
        .iter()
        .position(|r| r.whole.0 >= end)
        .unwrap_or(rewrites.len() - from);
    &rewrites[from..from + count]
}

/// Whether every span is a well-formed range of char boundaries of `source`
/// with the operands inside the operator's span.
fn spans_are_sound(source: &str, rewrites: &[Rewrite]) -> bool {
    let ok =
        |(a, b): (usize, usize)| a <= b && source.is_char_boundary(a) && source.is_char_boundary(b);
    rewrites.iter().all(|r| {
        ok(r.whole)
            && ok(r.left)
            && ok(r.right)
            && r.whole.0 <= r.left.0
            && r.left.1 <= r.right.0
            && r.right.1 <= r.whole.1
    })
}

fn offsets(span: minijinja::machinery::Span) -> (usize, usize) {
    (span.start_offset as usize, span.end_offset as usize)
}

fn visit_stmts(stmts: &[Stmt<'_>], out: &mut Vec<Rewrite>) {
    for stmt in stmts {
        visit_stmt(stmt, out);
    }
}

fn visit_stmt(stmt: &Stmt<'_>, out: &mut Vec<Rewrite>) {
    match stmt {
        Stmt::Template(t) => visit_stmts(&t.children, out),
        Stmt::EmitExpr(e) => visit_expr(&e.expr, out),
        Stmt::EmitRaw(_) | Stmt::Continue(_) | Stmt::Break(_) => {}
        Stmt::ForLoop(f) => {
            visit_expr(&f.target, out);
            visit_expr(&f.iter, out);
            if let Some(filter) = &f.filter_expr {
                visit_expr(filter, out);
            }
            visit_stmts(&f.body, out);
            visit_stmts(&f.else_body, out);
        }
        Stmt::IfCond(i) => {
            visit_expr(&i.expr, out);
            visit_stmts(&i.true_body, out);
            visit_stmts(&i.false_body, out);
        }
        Stmt::WithBlock(w) => {
            for (target, value) in &w.assignments {
                visit_expr(target, out);
                visit_expr(value, out);
            }
            visit_stmts(&w.body, out);
        }
        Stmt::Set(s) => {
            visit_expr(&s.target, out);
            visit_expr(&s.expr, out);
        }
        Stmt::SetBlock(s) => {
            visit_expr(&s.target, out);
            if let Some(filter) = &s.filter {
                visit_expr(filter, out);
            }
            visit_stmts(&s.body, out);
        }
        Stmt::AutoEscape(a) => {
            visit_expr(&a.enabled, out);
            visit_stmts(&a.body, out);
        }
        Stmt::FilterBlock(f) => {
            visit_expr(&f.filter, out);
            visit_stmts(&f.body, out);
        }
        Stmt::Block(b) => visit_stmts(&b.body, out),
        Stmt::Import(i) => {
            visit_expr(&i.expr, out);
            visit_expr(&i.name, out);
        }
        Stmt::FromImport(i) => {
            visit_expr(&i.expr, out);
            for (name, alias) in &i.names {
                visit_expr(name, out);
                if let Some(alias) = alias {
                    visit_expr(alias, out);
                }
            }
        }
        Stmt::Extends(e) => visit_expr(&e.name, out),
        Stmt::Include(i) => visit_expr(&i.name, out),
        Stmt::Macro(m) => visit_macro(m, out),
        Stmt::CallBlock(c) => {
            visit_call(&c.call, out);
            visit_macro(&c.macro_decl, out);
        }
        Stmt::Do(d) => visit_call(&d.call, out),
    }
}

fn visit_macro(m: &ast::Macro<'_>, out: &mut Vec<Rewrite>) {
    for e in m.args.iter().chain(&m.defaults) {
        visit_expr(e, out);
    }
    visit_stmts(&m.body, out);
}

fn visit_call(c: &ast::Call<'_>, out: &mut Vec<Rewrite>) {
    visit_expr(&c.expr, out);
    visit_args(&c.args, out);
}

fn visit_args(args: &[CallArg<'_>], out: &mut Vec<Rewrite>) {
    for arg in args {
        match arg {
            CallArg::Pos(e)
            | CallArg::Kwarg(_, e)
            | CallArg::PosSplat(e)
            | CallArg::KwargSplat(e) => visit_expr(e, out),
        }
    }
}

fn visit_expr(expr: &Expr<'_>, out: &mut Vec<Rewrite>) {
    match expr {
        Expr::Var(_) | Expr::Const(_) => {}
        Expr::Slice(s) => {
            visit_expr(&s.expr, out);
            for e in [&s.start, &s.stop, &s.step].into_iter().flatten() {
                visit_expr(e, out);
            }
        }
        Expr::UnaryOp(u) => visit_expr(&u.expr, out),
        Expr::BinOp(b) => {
            let function = match b.op {
                ast::BinOpKind::Concat => Some((CONCAT_FN, '~')),
                ast::BinOpKind::Add => Some((ADD_FN, '+')),
                ast::BinOpKind::Mul => Some((MUL_FN, '*')),
                _ => None,
            };
            if let Some((function, symbol)) = function {
                out.push(Rewrite {
                    function,
                    symbol,
                    whole: offsets(b.span()),
                    left_end: offsets(b.left.span()).1,
                    left: (0, 0),
                    right: (0, 0),
                });
            }
            visit_expr(&b.left, out);
            visit_expr(&b.right, out);
        }
        Expr::Compare(c) => {
            visit_expr(&c.expr, out);
            for op in &c.ops {
                visit_expr(&op.expr, out);
            }
        }
        Expr::IfExpr(i) => {
            visit_expr(&i.test_expr, out);
            visit_expr(&i.true_expr, out);
            if let Some(e) = &i.false_expr {
                visit_expr(e, out);
            }
        }
        Expr::Filter(f) => {
            if let Some(e) = &f.expr {
                visit_expr(e, out);
            }
            visit_args(&f.args, out);
        }
        Expr::Test(t) => {
            visit_expr(&t.expr, out);
            visit_args(&t.args, out);
        }
        Expr::GetAttr(g) => visit_expr(&g.expr, out),
        Expr::GetItem(g) => {
            visit_expr(&g.expr, out);
            visit_expr(&g.subscript_expr, out);
        }
        Expr::Call(c) => {
            visit_expr(&c.expr, out);
            visit_args(&c.args, out);
        }
        Expr::List(l) => {
            for e in &l.items {
                visit_expr(e, out);
            }
        }
        Expr::Map(m) => {
            for e in m.keys.iter().chain(&m.values) {
                visit_expr(e, out);
            }
        }
    }
}

/// Length of a value's text as `~` would write it.
fn text_len(v: &Value) -> usize {
    match v.as_str() {
        Some(s) => s.len(),
        None => v.to_string().len(),
    }
}

/// A plain environment (builtins only) that computes what the guarded
/// operators, filters and methods compute once their sizes are checked.
fn plain() -> &'static Environment<'static> {
    static ENV: OnceLock<Environment<'static>> = OnceLock::new();
    ENV.get_or_init(|| {
        let mut env = Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env
    })
}

/// Evaluate `expr` over variables `a`, `b`, `c`, `d` in the plain environment.
fn eval_plain(expr: &str, vars: [Value; 4]) -> Result<Value, minijinja::Error> {
    let [a, b, c, d] = vars;
    plain()
        .compile_expression(expr)?
        .eval(minijinja::context! { a => a, b => b, c => c, d => d })
}

fn check(what: &str, size: u128, limit: usize) -> Result<(), minijinja::Error> {
    if size > limit as u128 {
        return Err(too_large(format!(
            "{what} would build {size} bytes or items (limit {limit})"
        )));
    }
    Ok(())
}

/// Size of `text.replace(from, to)`.
fn replaced_len(text: &str, from: &str, to: &str) -> u128 {
    let count = if from.is_empty() {
        text.chars().count() as u128 + 1
    } else {
        text.matches(from).count() as u128
    };
    text.len() as u128 + count * to.len() as u128
}

/// Size of `items|join(sep)`, stopping once past `limit`.
fn joined_len(items: &Value, sep: &str, limit: usize) -> Result<u128, minijinja::Error> {
    let mut total = 0u128;
    for (i, item) in items.try_iter()?.enumerate() {
        total += text_len(&item) as u128 + if i > 0 { sep.len() as u128 } else { 0 };
        if total > limit as u128 {
            break;
        }
    }
    Ok(total)
}

/// Register the guard functions, filters and methods with their limits.
pub(crate) fn add_guards(env: &mut Environment<'_>, limits: super::TemplateLimits) {
    use minijinja::value::Kwargs;
    use minijinja::State;
    let (max_bytes, max_items) = (limits.max_string_bytes, limits.max_items);
    let none = || Value::from(());
    // Operators.
    env.add_function(CONCAT_FN, move |a: Value, b: Value| {
        check(
            "`~`",
            text_len(&a) as u128 + text_len(&b) as u128,
            max_bytes,
        )?;
        Ok::<_, minijinja::Error>(Value::from(format!("{a}{b}")))
    });
    env.add_function(ADD_FN, move |a: Value, b: Value| {
        match (a.as_str(), b.as_str()) {
            (Some(x), Some(y)) => check("`+`", x.len() as u128 + y.len() as u128, max_bytes)?,
            _ => {
                if let (Some(x), Some(y)) = (a.len(), b.len()) {
                    check("`+`", x as u128 + y as u128, max_items)?;
                }
            }
        }
        eval_plain("a + b", [a, b, none(), none()])
    });
    env.add_function(MUL_FN, move |a: Value, b: Value| {
        let (sized, count) = if a.as_i64().is_some() {
            (&b, &a)
        } else {
            (&a, &b)
        };
        if let (Some(n), Some(len)) = (count.as_i64(), sized.len()) {
            let n = n.max(0) as u128;
            match sized.as_str() {
                Some(s) => check("`*`", s.len() as u128 * n, max_bytes)?,
                None => check("`*`", len as u128 * n, max_items)?,
            }
        }
        eval_plain("a * b", [a, b, none(), none()])
    });
    // Filters that allocate by a count or width they are given.
    env.add_filter(
        "batch",
        move |v: Value, count: usize, fill: Option<Value>| {
            check("`batch`", count as u128, max_items)?;
            eval_plain(
                "a|batch(b, c)",
                [v, Value::from(count), fill.unwrap_or_else(none), none()],
            )
        },
    );
    env.add_filter(
        "slice",
        move |v: Value, count: usize, fill: Option<Value>| {
            check("`slice`", count as u128, max_items)?;
            eval_plain(
                "a|slice(b, c)",
                [v, Value::from(count), fill.unwrap_or_else(none), none()],
            )
        },
    );
    env.add_filter(
        "indent",
        move |v: String,
              width: Option<usize>,
              first: Option<bool>,
              blank: Option<bool>,
              kwargs: Kwargs| {
            let width = width.unwrap_or(4);
            let first = kwargs
                .get::<Option<bool>>("first")?
                .or(first)
                .unwrap_or(false);
            let blank = kwargs
                .get::<Option<bool>>("blank")?
                .or(blank)
                .unwrap_or(false);
            kwargs.assert_all_used()?;
            let lines = v.lines().count() as u128 + 1;
            check(
                "`indent`",
                v.len() as u128 + lines * width as u128,
                max_bytes,
            )?;
            eval_plain(
                "a|indent(b, first=c, blank=d)",
                [
                    Value::from(v),
                    Value::from(width),
                    Value::from(first),
                    Value::from(blank),
                ],
            )
        },
    );
    // Filters that inflate text.
    env.add_filter("replace", move |v: String, from: String, to: String| {
        check("`replace`", replaced_len(&v, &from, &to), max_bytes)?;
        eval_plain(
            "a|replace(b, c)",
            [Value::from(v), Value::from(from), Value::from(to), none()],
        )
    });
    env.add_filter(
        "join",
        move |state: &State, v: Value, sep: Option<String>| {
            let _ = state;
            let sep = sep.unwrap_or_default();
            check("`join`", joined_len(&v, &sep, max_bytes)?, max_bytes)?;
            eval_plain("a|join(b)", [v, Value::from(sep), none(), none()])
        },
    );
    // `lipsum(n)` writes n paragraphs; chat templates have no use for it.
    env.add_function("lipsum", || -> Result<Value, minijinja::Error> {
        Err(minijinja::Error::new(
            ErrorKind::UnknownFunction,
            "lipsum is not available in chat templates",
        ))
    });
    // Python string methods, with the same checks for the inflating ones.
    env.set_unknown_method_callback(move |state, value, method, args| {
        if let Some(text) = value.as_str() {
            match (method, args) {
                ("replace", [from, to, ..]) => check(
                    "`replace`",
                    replaced_len(text, &from.to_string(), &to.to_string()),
                    max_bytes,
                )?,
                ("join", [items, ..]) => {
                    check("`join`", joined_len(items, text, max_bytes)?, max_bytes)?
                }
                ("center" | "ljust" | "rjust" | "zfill", [width, ..]) => check(
                    "padding",
                    width.as_i64().unwrap_or(0).max(0) as u128,
                    max_bytes,
                )?,
                _ => {}
            }
        }
        minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
    });
}
