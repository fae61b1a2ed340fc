//! Per-render accounting of the bytes an untrusted template writes and builds.
//!
//! Every byte a template writes goes into one buffer: the rendered output, or
//! the buffer of an open capture (`{% set x %}…{% endset %}`, `{% filter %}`
//! blocks) or macro call (macros, `{% call %}` bodies and `caller()`).
//! [`Budget`] keeps a stack of those buffers' sizes, so that the output and
//! every captured string are held under their limits *while they grow*, and
//! a running total of all bytes the render has written or built (operators,
//! filters, functions, captures), which bounds the memory and the copying a
//! render can cause however many strings it keeps.

use std::fmt;
use std::sync::Mutex;

use minijinja::value::ValueKind;
use minijinja::{AutoEscape, Output, State, Value};

use super::TemplateLimits;
use super::guard::too_large;

/// Sizes of the open buffers and the render's total.
#[derive(Debug)]
struct Ledger {
    /// Bytes written into each open buffer: `[0]` is the output, then the
    /// captures and macro calls, innermost last.
    open: Vec<usize>,
    /// Bytes written or built since the render started.
    total: u128,
    /// Items of sequences and maps walked to weigh them.
    inspected: u64,
}

/// Items a render may walk to weigh the sequences it builds (a few tenths
/// of a second of work at most).
const MAX_INSPECTED_ITEMS: u64 = 1 << 25;

/// The byte budget of one render (shared by the environment's callbacks).
#[derive(Debug)]
pub(crate) struct Budget {
    limits: TemplateLimits,
    ledger: Mutex<Ledger>,
}

impl Budget {
    pub fn new(limits: TemplateLimits) -> Budget {
        Budget {
            limits,
            ledger: Mutex::new(Ledger {
                open: vec![0],
                total: 0,
                inspected: 0,
            }),
        }
    }

    fn ledger(&self) -> std::sync::MutexGuard<'_, Ledger> {
        // A poisoned lock only means a callback panicked; the counts are still usable.
        self.ledger.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A capture or macro call starts writing into a buffer of its own.
    pub fn open(&self) {
        self.ledger().open.push(0);
    }

    /// The innermost capture or macro call ended (the output is never closed).
    pub fn close(&self) {
        let mut ledger = self.ledger();
        if ledger.open.len() > 1 {
            ledger.open.pop();
        }
    }

    /// Bytes that may still be written into the innermost buffer.
    fn room(&self, ledger: &Ledger) -> usize {
        let (written, limit) = self.innermost(ledger);
        let total_room = (self.limits.max_total_bytes as u128).saturating_sub(ledger.total);
        limit
            .saturating_sub(written)
            .min(total_room.min(usize::MAX as u128) as usize)
    }

    /// Size and limit of the innermost buffer.
    fn innermost(&self, ledger: &Ledger) -> (usize, usize) {
        match ledger.open.as_slice() {
            [output] => (*output, self.limits.max_output_bytes),
            [.., inner] => (*inner, self.limits.max_string_bytes),
            [] => (0, self.limits.max_output_bytes),
        }
    }

    /// The error for writing `more` bytes when they do not fit.
    fn overflow(&self, ledger: &Ledger, more: usize) -> minijinja::Error {
        let (written, limit) = self.innermost(ledger);
        if written as u128 + more as u128 > limit as u128 {
            if ledger.open.len() <= 1 {
                too_large(format!("output exceeds {limit} bytes"))
            } else {
                too_large(format!(
                    "a captured block or macro output would exceed {limit} bytes"
                ))
            }
        } else {
            self.total_exceeded()
        }
    }

    fn total_exceeded(&self) -> minijinja::Error {
        too_large(format!(
            "the template built more than {} bytes in total",
            self.limits.max_total_bytes
        ))
    }

    /// Record `bytes` written into the innermost buffer.
    fn commit(&self, ledger: &mut Ledger, bytes: usize) {
        if let Some(inner) = ledger.open.last_mut() {
            *inner += bytes;
        }
        ledger.total += bytes as u128;
    }

    /// Record `bytes` of strings built outside any buffer (operators, filters).
    pub fn charge(&self, bytes: usize) -> Result<(), minijinja::Error> {
        let mut ledger = self.ledger();
        ledger.total += bytes as u128;
        if ledger.total > self.limits.max_total_bytes as u128 {
            return Err(self.total_exceeded());
        }
        Ok(())
    }

    /// Record `items` walked to weigh a sequence.
    pub fn inspect(&self, items: usize) -> Result<(), minijinja::Error> {
        let mut ledger = self.ledger();
        ledger.inspected += items as u64;
        if ledger.inspected > MAX_INSPECTED_ITEMS {
            return Err(too_large(format!(
                "the template walked more than {MAX_INSPECTED_ITEMS} items of the sequences it built"
            )));
        }
        Ok(())
    }

    /// The formatter: write `value` like minijinja's `escape_formatter` does,
    /// counting the bytes and refusing those that do not fit (checked while
    /// writing, so a huge value is never materialized).
    pub fn emit(
        &self,
        out: &mut Output,
        state: &State,
        value: &Value,
    ) -> Result<(), minijinja::Error> {
        let mut ledger = self.ledger();
        let room = self.room(&ledger);
        // Fast path: strings (and everything else without escaping) stream
        // through a writer that stops at the limit.
        let escaping = state.auto_escape() != AutoEscape::None
            && !(value.kind() == ValueKind::String && value.is_safe());
        if !escaping {
            if let Some(text) = value.as_str() {
                if text.len() > room {
                    return Err(self.overflow(&ledger, text.len()));
                }
                out.write_str(text)?;
                self.commit(&mut ledger, text.len());
                return Ok(());
            }
            let mut capped = Capped {
                out: Some(out),
                room,
                written: 0,
            };
            if fmt::write(&mut capped, format_args!("{value}")).is_err() {
                let more = capped.written.saturating_add(1);
                return Err(self.overflow(&ledger, more));
            }
            let written = capped.written;
            self.commit(&mut ledger, written);
            return Ok(());
        }
        // Escaping (inside `{% autoescape %}`): bound the unescaped text
        // first; escaping grows it at most six times.
        let mut measure = Capped {
            out: None,
            room: room / 6,
            written: 0,
        };
        if fmt::write(&mut measure, format_args!("{value}")).is_err() {
            return Err(self.overflow(&ledger, room.saturating_add(1)));
        }
        let mut escaped = String::new();
        minijinja::escape_formatter(
            &mut minijinja::machinery::make_string_output(&mut escaped),
            state,
            value,
        )?;
        if escaped.len() > room {
            return Err(self.overflow(&ledger, escaped.len()));
        }
        out.write_str(&escaped)?;
        self.commit(&mut ledger, escaped.len());
        Ok(())
    }
}

/// A `fmt::Write` that forwards to the output (or only counts, without
/// one) and fails once more than `room` bytes would be written.
struct Capped<'o, 'a> {
    out: Option<&'o mut Output<'a>>,
    room: usize,
    written: usize,
}

impl fmt::Write for Capped<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        if s.len() > self.room.saturating_sub(self.written) {
            self.written = self.written.saturating_add(s.len());
            return Err(fmt::Error);
        }
        if let Some(out) = self.out.as_deref_mut() {
            out.write_str(s)?;
        }
        self.written += s.len();
        Ok(())
    }
}

/// Length of `value` as text (`~`, `join` and the formatter write it this
/// way), or `None` when it is longer than `limit`: measured without
/// building the text, so a list holding the same long string a million
/// times costs at most `limit` bytes of formatting to reject.
pub(crate) fn text_len_within(value: &Value, limit: usize) -> Option<usize> {
    if let Some(text) = value.as_str() {
        return (text.len() <= limit).then_some(text.len());
    }
    let mut measure = Capped {
        out: None,
        room: limit,
        written: 0,
    };
    fmt::write(&mut measure, format_args!("{value}"))
        .ok()
        .map(|_| measure.written)
}
