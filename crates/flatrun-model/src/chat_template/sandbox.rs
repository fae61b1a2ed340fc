//! Compiling an untrusted template into instrumented VM instructions.
//!
//! minijinja has no hooks for operators, for raw template text or for
//! captured output, so the sandbox compiles the template itself (with
//! minijinja's own parser and code generator, `unstable_machinery`) and
//! rewrites the instruction stream before running it:
//!
//! - `~`, `+` and `*` become calls of size-checked guard functions;
//! - raw template text is emitted through the formatter like any value, so
//!   the formatter sees (and counts) every byte written anywhere;
//! - entering and leaving a capture (`{% set %}` blocks, `{% filter %}`
//!   blocks) or a macro body (macros, `{% call %}` bodies) open and close a
//!   buffer in the render's [`Budget`](super::budget::Budget), so every
//!   captured string is held under the limit while it grows;
//! - the result of every filter, function, method and macro call and of
//!   every list or map literal is checked (string size, item count) and
//!   counted towards the render's total.
//!
//! Jump targets and macro entry points are remapped to the new positions;
//! each instruction keeps its source line and span, so errors point at the
//! template line as before.

use std::collections::BTreeMap;

use minijinja::machinery::ast::{self, CallArg, Expr, Stmt};
use minijinja::machinery::{CodeGenerator, Instruction, Instructions, WhitespaceConfig, parse};
use minijinja::syntax::SyntaxConfig;
use minijinja::{ErrorKind, Value};

/// Guard functions the rewritten instructions call (names a template may not use).
pub(crate) const CONCAT_FN: &str = "__flatrun_concat";
pub(crate) const ADD_FN: &str = "__flatrun_add";
pub(crate) const MUL_FN: &str = "__flatrun_mul";
pub(crate) const CHECK_FN: &str = "__flatrun_check";
pub(crate) const OPEN_FN: &str = "__flatrun_open";
pub(crate) const CLOSE_FN: &str = "__flatrun_close";
const RESERVED_PREFIX: &str = "__flatrun";

/// A template's instrumented instructions (root and `{% block %}`s).
pub(crate) struct Compiled<'s> {
    pub instructions: Instructions<'s>,
    pub blocks: BTreeMap<&'s str, Instructions<'s>>,
}

/// Parse and compile `source` the way Hugging Face configures Jinja
/// (`trim_blocks`, `lstrip_blocks`), then instrument the instructions.
// `SyntaxConfig` has fields when minijinja's `custom_syntax` feature is on.
#[allow(clippy::default_constructed_unit_structs)]
pub(crate) fn compile<'s>(
    name: &'s str,
    source: &'s str,
    max_constant_bytes: usize,
) -> Result<Compiled<'s>, minijinja::Error> {
    let ast = parse(
        source,
        name,
        SyntaxConfig::default(),
        WhitespaceConfig {
            keep_trailing_newline: false,
            lstrip_blocks: true,
            trim_blocks: true,
        },
    )?;
    check_constants(&ast, max_constant_bytes)?;
    let mut generator = CodeGenerator::new(name, source);
    generator.compile_stmt(&ast);
    let (instructions, blocks) = generator.finish();
    reject_reserved_names(&instructions)?;
    for block in blocks.values() {
        reject_reserved_names(block)?;
    }
    Ok(Compiled {
        instructions: instrument(&instructions),
        blocks: blocks
            .iter()
            .map(|(name, block)| (*name, instrument(block)))
            .collect(),
    })
}

/// minijinja's code generator folds constant expressions: it evaluates
/// `'x' * 90000000 ~ 'y'` while compiling, before any guard could run. Every
/// operator whose operands are constants is sized first (without
/// evaluating it) and the template is refused when the value would be
/// larger than `limit`.
fn check_constants(template: &Stmt<'_>, limit: usize) -> Result<(), minijinja::Error> {
    let mut operators = Vec::new();
    visit_stmt(template, &mut operators);
    for expr in operators {
        if let Some(size) = constant_size(expr)
            && size.peak > limit as u128
        {
            return Err(super::guard::too_large(format!(
                "a constant expression would build {} bytes (limit {limit}){}",
                size.peak,
                line_suffix(expr)
            )));
        }
    }
    Ok(())
}

fn line_suffix(expr: &Expr<'_>) -> String {
    format!(" (line {})", expr.span().start_line)
}

/// The text size of a constant expression's value and the largest value
/// built on the way (both upper bounds).
#[derive(Clone, Copy)]
struct ConstantSize {
    size: u128,
    peak: u128,
}

/// Values this small are safe to evaluate to learn a repeat count.
const SMALL_CONSTANT: u128 = 40;

/// The size of what minijinja's constant folding would compute for `expr`,
/// or `None` when `expr` is not constant.
fn constant_size(expr: &Expr<'_>) -> Option<ConstantSize> {
    let leaf = |size: u128| ConstantSize { size, peak: size };
    match expr {
        Expr::Const(c) => Some(leaf(match c.value.as_str() {
            Some(text) => text.len() as u128,
            None => SMALL_CONSTANT,
        })),
        Expr::List(list) => {
            let mut total = 2u128;
            for item in &list.items {
                total += constant_size(item)?.size + 2;
            }
            Some(leaf(total))
        }
        Expr::Map(map) => {
            let mut total = 2u128;
            for item in map.keys.iter().chain(&map.values) {
                total += constant_size(item)?.size + 2;
            }
            Some(leaf(total))
        }
        Expr::UnaryOp(u) => constant_size(&u.expr).map(|s| ConstantSize {
            size: s.size + 1,
            peak: s.peak + 1,
        }),
        Expr::BinOp(b) => {
            let (left, right) = (constant_size(&b.left)?, constant_size(&b.right)?);
            let count = |side: &Expr<'_>, size: ConstantSize| {
                (size.peak <= SMALL_CONSTANT)
                    .then(|| side.as_const())
                    .flatten()
                    .and_then(|v| v.as_i64())
                    .map(|n| n.max(0) as u128)
            };
            let size = match b.op {
                ast::BinOpKind::Concat | ast::BinOpKind::Add => left.size + right.size,
                ast::BinOpKind::Mul => match (count(&b.left, left), count(&b.right, right)) {
                    (Some(_), Some(_)) => SMALL_CONSTANT,
                    (Some(n), None) => right.size.saturating_mul(n),
                    (None, Some(n)) => left.size.saturating_mul(n),
                    (None, None) => left.size.max(right.size),
                },
                _ => left.size.max(right.size).max(SMALL_CONSTANT),
            };
            Some(ConstantSize {
                size,
                peak: size.max(left.peak).max(right.peak),
            })
        }
        _ => None,
    }
}

fn visit_stmts<'a, 's>(stmts: &'a [Stmt<'s>], out: &mut Vec<&'a Expr<'s>>) {
    for stmt in stmts {
        visit_stmt(stmt, out);
    }
}

fn visit_stmt<'a, 's>(stmt: &'a Stmt<'s>, out: &mut Vec<&'a Expr<'s>>) {
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

fn visit_macro<'a, 's>(m: &'a ast::Macro<'s>, out: &mut Vec<&'a Expr<'s>>) {
    for e in m.args.iter().chain(&m.defaults) {
        visit_expr(e, out);
    }
    visit_stmts(&m.body, out);
}

fn visit_call<'a, 's>(c: &'a ast::Call<'s>, out: &mut Vec<&'a Expr<'s>>) {
    visit_expr(&c.expr, out);
    visit_args(&c.args, out);
}

fn visit_args<'a, 's>(args: &'a [CallArg<'s>], out: &mut Vec<&'a Expr<'s>>) {
    for arg in args {
        match arg {
            CallArg::Pos(e)
            | CallArg::Kwarg(_, e)
            | CallArg::PosSplat(e)
            | CallArg::KwargSplat(e) => visit_expr(e, out),
        }
    }
}

fn visit_expr<'a, 's>(expr: &'a Expr<'s>, out: &mut Vec<&'a Expr<'s>>) {
    match expr {
        Expr::Var(_) | Expr::Const(_) => {}
        Expr::Slice(s) => {
            visit_expr(&s.expr, out);
            for e in [&s.start, &s.stop, &s.step].into_iter().flatten() {
                visit_expr(e, out);
            }
        }
        Expr::UnaryOp(u) => {
            out.push(expr);
            visit_expr(&u.expr, out);
        }
        Expr::BinOp(b) => {
            out.push(expr);
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

/// A template must not name (and so shadow or call) the guard functions.
fn reject_reserved_names(instructions: &Instructions<'_>) -> Result<(), minijinja::Error> {
    for index in 0..instructions.len() as u32 {
        let name = match instructions.get(index) {
            Some(
                Instruction::Lookup(name)
                | Instruction::StoreLocal(name)
                | Instruction::CallFunction(name, _)
                | Instruction::Enclose(name)
                | Instruction::BuildMacro(name, _, _),
            ) => *name,
            _ => continue,
        };
        if name.starts_with(RESERVED_PREFIX) {
            return Err(minijinja::Error::new(
                ErrorKind::SyntaxError,
                format!("the name `{name}` is reserved by the sandbox"),
            ));
        }
    }
    Ok(())
}

/// What one original instruction becomes.
fn expand<'s>(instruction: &Instruction<'s>) -> Vec<Instruction<'s>> {
    let call = |name: &'s str, args: u16| Instruction::CallFunction(name, Some(args));
    match instruction {
        Instruction::StringConcat => vec![call(CONCAT_FN, 2)],
        Instruction::Add => vec![call(ADD_FN, 2)],
        Instruction::Mul => vec![call(MUL_FN, 2)],
        // Raw text goes through the formatter (a safe string is never escaped).
        Instruction::EmitRaw(text) => vec![
            Instruction::LoadConst(Value::from_safe_string(text.to_string())),
            Instruction::Emit,
        ],
        Instruction::BeginCapture(mode) => vec![
            call(OPEN_FN, 0),
            Instruction::DiscardTop,
            Instruction::BeginCapture(*mode),
        ],
        Instruction::EndCapture => vec![
            call(CLOSE_FN, 0),
            Instruction::DiscardTop,
            Instruction::EndCapture,
        ],
        // `Return` ends a macro body.
        Instruction::Return => vec![
            call(CLOSE_FN, 0),
            Instruction::DiscardTop,
            Instruction::Return,
        ],
        Instruction::ApplyFilter(..)
        | Instruction::CallFunction(..)
        | Instruction::CallMethod(..)
        | Instruction::CallObject(..)
        | Instruction::BuildList(..)
        | Instruction::BuildMap(..) => vec![instruction.clone(), call(CHECK_FN, 1)],
        other => vec![other.clone()],
    }
}

/// The instructions with guards inserted and every jump target moved.
fn instrument<'s>(old: &Instructions<'s>) -> Instructions<'s> {
    let count = old.len();
    let original = |index: usize| old.get(index as u32);
    // Macro bodies open a buffer when they are entered (only calls enter
    // them there: the code generator jumps over a body, and no jump of the
    // body's own code targets its first instruction).
    let mut macro_entry = vec![false; count + 1];
    for index in 0..count {
        if let Some(Instruction::BuildMacro(_, entry, _)) = original(index)
            && let Some(flag) = macro_entry.get_mut(*entry as usize)
        {
            *flag = true;
        }
    }
    let expanded: Vec<Vec<Instruction<'s>>> = (0..count)
        .map(|index| original(index).map(expand).unwrap_or_default())
        .collect();
    // New positions: where a jump to each old instruction lands, and where a
    // macro call enters it (before the buffer is opened).
    let entry_len = 2;
    let mut jump_to = Vec::with_capacity(count + 1);
    let mut enter_at = Vec::with_capacity(count + 1);
    let mut position = 0u32;
    for (index, sequence) in expanded.iter().enumerate() {
        enter_at.push(position);
        if macro_entry[index] {
            position += entry_len;
        }
        jump_to.push(position);
        position += sequence.len() as u32;
    }
    enter_at.push(position);
    jump_to.push(position);
    let moved = |target: u32| jump_to.get(target as usize).copied().unwrap_or(target);
    let entered = |target: u32| enter_at.get(target as usize).copied().unwrap_or(target);

    let mut new = Instructions::new(old.name(), old.source());
    for (index, sequence) in expanded.into_iter().enumerate() {
        let span = old.get_span(index as u32);
        let line = old.get_line(index as u32);
        let mut add = |instruction: Instruction<'s>| match (span, line) {
            (Some(span), _) => new.add_with_span(instruction, span),
            (None, Some(line)) => new.add_with_line(instruction, line as u16),
            (None, None) => new.add(instruction),
        };
        if macro_entry[index] {
            add(Instruction::CallFunction(OPEN_FN, Some(0)));
            add(Instruction::DiscardTop);
        }
        for instruction in sequence {
            add(match instruction {
                Instruction::Jump(t) => Instruction::Jump(moved(t)),
                Instruction::JumpIfFalse(t) => Instruction::JumpIfFalse(moved(t)),
                Instruction::JumpIfFalseOrPop(t) => Instruction::JumpIfFalseOrPop(moved(t)),
                Instruction::JumpIfTrueOrPop(t) => Instruction::JumpIfTrueOrPop(moved(t)),
                Instruction::Iterate(t) => Instruction::Iterate(moved(t)),
                Instruction::BuildMacro(name, t, flags) => {
                    Instruction::BuildMacro(name, entered(t), flags)
                }
                other => other,
            });
        }
    }
    new
}
