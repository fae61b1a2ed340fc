//! Size checks on what an untrusted template builds.
//!
//! minijinja's fuel counts instructions, not bytes, and its `~`, `+` and
//! string `*` allocate whatever they are asked to: `{% set ns.s = ns.s ~ ns.s %}`
//! in a loop doubles a string per iteration and reaches gigabytes long
//! before fuel runs out. The sandbox (`sandbox.rs`) compiles those operators
//! into calls of the guard functions registered here, which refuse to build
//! a string longer than the limit or a sequence with more items than the
//! limit and otherwise compute what the operator computes. Filters and
//! Python-style methods that can inflate a string or allocate by a number
//! they are given (`replace`, `join`, `indent`, `center`, `format`, `batch`,
//! `map`, …) get the same checks before they run; every other call's result
//! is checked after it (`__flatrun_check`). Everything built is counted in
//! the render's [`Budget`].

use std::sync::{Arc, OnceLock};

use minijinja::value::ValueKind;
use minijinja::{Environment, ErrorKind, Expression, Value};

use super::budget::{Budget, text_len_within};
use super::sandbox::{ADD_FN, CHECK_FN, CLOSE_FN, CONCAT_FN, MUL_FN, OPEN_FN};

/// Marker that tells size-limit errors apart from other render errors.
pub(crate) const TOO_LARGE: &str = "flatrun limit: ";

/// The error a guard returns when a value would be too large.
pub(crate) fn too_large(what: String) -> minijinja::Error {
    minijinja::Error::new(ErrorKind::InvalidOperation, format!("{TOO_LARGE}{what}"))
}

/// Length of a value's text as `~` writes it, or `limit + 1` when longer
/// (measured without building the text).
fn text_len(v: &Value, limit: usize) -> u128 {
    text_len_within(v, limit).map_or(limit as u128 + 1, |n| n as u128)
}

/// Text weight of a sequence or map: its strings plus two bytes of quotes
/// or separators per item, walked without recursion and stopped once past
/// `limit`. A list can hold the same long string many times at the cost of
/// one pointer each; any filter that turns it into text (`string`, `upper`,
/// `tojson`, …) would then build all the copies, so lists are held to the
/// string limit by weight. Each item visited is charged to the budget.
fn weight(v: &Value, limit: usize, budget: &Budget) -> Result<u128, minijinja::Error> {
    let mut total = 0u128;
    let mut pending = vec![v.clone()];
    let mut visited = 0usize;
    while let Some(v) = pending.pop() {
        if total > limit as u128 {
            break;
        }
        visited += 1;
        match v.kind() {
            ValueKind::String => total += v.as_str().map_or(0, str::len) as u128 + 2,
            // Lazy sequences (`a + b`, `a * n`) are walked too when they are sized
            // (one-shot iterators have no length and are not consumed).
            ValueKind::Seq | ValueKind::Iterable if v.len().is_some() => {
                total += 2;
                // Each item weighs at least two bytes: take no more than can fit.
                let fit = (limit as u128).saturating_sub(total) / 2 + 1;
                pending.extend(v.try_iter()?.take(fit.min(usize::MAX as u128) as usize));
            }
            ValueKind::Map => {
                total += 2;
                let fit = (limit as u128).saturating_sub(total) / 4 + 1;
                for key in v.try_iter()?.take(fit.min(usize::MAX as u128) as usize) {
                    let value = v.get_item(&key)?;
                    pending.push(key);
                    pending.push(value);
                }
            }
            // Numbers, booleans, none, callables, one-shot iterators (not consumed).
            _ => total += 8,
        }
    }
    budget.inspect(visited)?;
    Ok(total)
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

/// Evaluate `expr` over variables `a`, `b`, `c`, `d` in the plain environment
/// (each expression is compiled once).
fn eval_plain(expr: &'static str, vars: [Value; 4]) -> Result<Value, minijinja::Error> {
    type Cache = std::sync::Mutex<Vec<(&'static str, Arc<Expression<'static, 'static>>)>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let cached = {
        let list = cache.lock().unwrap_or_else(|e| e.into_inner());
        list.iter()
            .find(|(e, _)| *e == expr)
            .map(|(_, c)| c.clone())
    };
    let compiled = match cached {
        Some(compiled) => compiled,
        None => {
            let compiled = Arc::new(plain().compile_expression(expr)?);
            let mut list = cache.lock().unwrap_or_else(|e| e.into_inner());
            list.push((expr, compiled.clone()));
            compiled
        }
    };
    let [a, b, c, d] = vars;
    compiled.eval(minijinja::context! { a => a, b => b, c => c, d => d })
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
        total += text_len(&item, limit) + if i > 0 { sep.len() as u128 } else { 0 };
        if total > limit as u128 {
            break;
        }
    }
    Ok(total)
}

/// A bound on what `format` (printf `%` or `str.format` `{}`) can build:
/// every placeholder may write the longest argument padded to the largest
/// number in the format string (widths and precisions).
fn formatted_bound(format: &str, args: &[Value], limit: usize) -> u128 {
    let placeholders = format.bytes().filter(|&b| b == b'%' || b == b'{').count() as u128;
    let longest_arg = args.iter().map(|a| text_len(a, limit)).max().unwrap_or(0);
    let widest = format
        .split(|c: char| !c.is_ascii_digit())
        .filter(|digits| !digits.is_empty())
        .map(|digits| digits.parse::<u128>().unwrap_or(u128::MAX / 4))
        .max()
        .unwrap_or(0);
    format.len() as u128 + placeholders.saturating_mul(longest_arg.saturating_add(widest))
}

/// Register the guard functions, filters and methods with their limits.
pub(crate) fn add_guards(
    env: &mut Environment<'_>,
    limits: super::TemplateLimits,
    budget: Arc<Budget>,
) {
    use minijinja::State;
    use minijinja::value::{Kwargs, Rest};
    let (max_bytes, max_items) = (limits.max_string_bytes, limits.max_items);
    let none = || Value::from(());
    // Captures and macro calls.
    let b = budget.clone();
    env.add_function(OPEN_FN, move || {
        b.open();
        Value::from(())
    });
    let b = budget.clone();
    env.add_function(CLOSE_FN, move || {
        b.close();
        Value::from(())
    });
    // Results of calls and literals.
    let b = budget.clone();
    env.add_function(CHECK_FN, move |v: Value| {
        match v.kind() {
            ValueKind::String => {
                let len = v.as_str().map_or(0, str::len);
                check("a string", len as u128, max_bytes)?;
                b.charge(len)?;
            }
            ValueKind::Seq | ValueKind::Map | ValueKind::Iterable => {
                check("a sequence", v.len().unwrap_or(0) as u128, max_items)?;
                check("a sequence's text", weight(&v, max_bytes, &b)?, max_bytes)?;
            }
            _ => {}
        }
        Ok::<_, minijinja::Error>(v)
    });
    // Operators.
    let b = budget.clone();
    env.add_function(CONCAT_FN, move |a: Value, c: Value| {
        let size = text_len(&a, max_bytes) + text_len(&c, max_bytes);
        check("`~`", size, max_bytes)?;
        b.charge(size as usize)?;
        Ok::<_, minijinja::Error>(Value::from(format!("{a}{c}")))
    });
    let b = budget.clone();
    env.add_function(ADD_FN, move |a: Value, c: Value| {
        match (a.as_str(), c.as_str()) {
            (Some(x), Some(y)) => {
                let size = x.len() as u128 + y.len() as u128;
                check("`+`", size, max_bytes)?;
                b.charge(size as usize)?;
            }
            _ => {
                if let (Some(x), Some(y)) = (a.len(), c.len()) {
                    check("`+`", x as u128 + y as u128, max_items)?;
                    let text = weight(&a, max_bytes, &b)? + weight(&c, max_bytes, &b)?;
                    check("`+`", text, max_bytes)?;
                }
            }
        }
        eval_plain("a + b", [a, c, none(), none()])
    });
    let b = budget.clone();
    env.add_function(MUL_FN, move |a: Value, c: Value| {
        let (sized, count) = if a.as_i64().is_some() {
            (&c, &a)
        } else {
            (&a, &c)
        };
        if let (Some(n), Some(len)) = (count.as_i64(), sized.len()) {
            let n = n.max(0) as u128;
            match sized.as_str() {
                Some(s) => {
                    check("`*`", s.len() as u128 * n, max_bytes)?;
                    b.charge((s.len() as u128 * n) as usize)?;
                }
                None => {
                    check("`*`", len as u128 * n, max_items)?;
                    if n > 0 {
                        let per_copy = max_bytes / n.min(max_bytes as u128) as usize;
                        check("`*`", weight(sized, per_copy, &b)? * n, max_bytes)?;
                    }
                }
            }
        }
        eval_plain("a * b", [a, c, none(), none()])
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
    env.add_filter("list", move |v: Value| {
        if let Some(text) = v.as_str() {
            check("`list`", text.chars().count() as u128, max_items)?;
        }
        eval_plain("a|list", [v, none(), none(), none()])
    });
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
    env.add_filter("format", move |v: String, args: Rest<Value>| {
        check("`format`", formatted_bound(&v, &args, max_bytes), max_bytes)?;
        eval_plain(
            "a|format(*b)",
            [Value::from(v), Value::from(args.0), none(), none()],
        )
    });
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
                ("format", args) => check(
                    "`format`",
                    formatted_bound(text, args, max_bytes),
                    max_bytes,
                )?,
                _ => {}
            }
        }
        minijinja_contrib::pycompat::unknown_method_callback(state, value, method, args)
    });
}
