//! Typed access to checkpoint metadata ([`Metadata`], [`MetaValue`]).
//!
//! Getters are lenient about the stored width: `get_u64` accepts any
//! non-negative integer type, `get_f32` any numeric type. The `require_*`
//! variants turn a missing or mistyped key into [`FormatError::Metadata`]
//! naming the key.

use crate::{FormatError, MetaValue, Metadata, Result};

impl MetaValue {
    /// GGUF-style name of the value's type (`"u32"`, `"string"`, `"array"`…).
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F32(_) => "f32",
            MetaValue::F64(_) => "f64",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(_) => "array",
        }
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    /// Any integer as `i128` (wide enough for every stored integer type).
    fn as_i128(&self) -> Option<i128> {
        Some(match *self {
            MetaValue::U8(v) => v.into(),
            MetaValue::I8(v) => v.into(),
            MetaValue::U16(v) => v.into(),
            MetaValue::I16(v) => v.into(),
            MetaValue::U32(v) => v.into(),
            MetaValue::I32(v) => v.into(),
            MetaValue::U64(v) => v.into(),
            MetaValue::I64(v) => v.into(),
            _ => return None,
        })
    }

    /// Any non-negative integer as `u64`.
    pub fn as_u64(&self) -> Option<u64> {
        self.as_i128().and_then(|v| u64::try_from(v).ok())
    }

    /// Any integer that fits as `i64`.
    pub fn as_i64(&self) -> Option<i64> {
        self.as_i128().and_then(|v| i64::try_from(v).ok())
    }

    /// Any integer that fits as `i32`.
    pub fn as_i32(&self) -> Option<i32> {
        self.as_i128().and_then(|v| i32::try_from(v).ok())
    }

    /// Any numeric value as `f64`.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i128().map(|v| v as f64),
        }
    }

    /// Any numeric value as `f32`.
    pub fn as_f32(&self) -> Option<f32> {
        self.as_f64().map(|v| v as f32)
    }

    /// The boolean, if this is one.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            MetaValue::Bool(b) => Some(*b),
            _ => None,
        }
    }

    /// The elements, if this is an array.
    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

impl Metadata {
    /// Empty metadata.
    pub fn new() -> Metadata {
        Metadata::default()
    }

    /// Append a key (later duplicates are shadowed by the first).
    pub fn push(&mut self, key: impl Into<String>, value: MetaValue) {
        self.entries.push((key.into(), value));
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no keys.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Keys and values in file order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &MetaValue)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The value stored under `key`.
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// Whether `key` is present.
    pub fn contains(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key)?.as_str()
    }
    /// Any non-negative integer type.
    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key)?.as_u64()
    }
    /// Any integer type, as `usize`.
    pub fn get_usize(&self, key: &str) -> Option<usize> {
        self.get_u64(key).and_then(|v| usize::try_from(v).ok())
    }
    /// Any integer type that fits `i64`.
    pub fn get_i64(&self, key: &str) -> Option<i64> {
        self.get(key)?.as_i64()
    }
    /// Any numeric type.
    pub fn get_f32(&self, key: &str) -> Option<f32> {
        self.get(key)?.as_f32()
    }
    /// Any numeric type.
    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key)?.as_f64()
    }
    pub fn get_bool(&self, key: &str) -> Option<bool> {
        self.get(key)?.as_bool()
    }
    /// An array whose elements are all strings.
    pub fn get_str_array(&self, key: &str) -> Option<Vec<&str>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(MetaValue::as_str)
            .collect()
    }
    /// An array whose elements are all numeric.
    pub fn get_f32_array(&self, key: &str) -> Option<Vec<f32>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(MetaValue::as_f32)
            .collect()
    }
    /// An array whose elements are all integers fitting `i32`.
    pub fn get_i32_array(&self, key: &str) -> Option<Vec<i32>> {
        self.get(key)?
            .as_array()?
            .iter()
            .map(MetaValue::as_i32)
            .collect()
    }
    /// Length of the array under `key`.
    pub fn get_array_len(&self, key: &str) -> Option<usize> {
        Some(self.get(key)?.as_array()?.len())
    }

    /// `Metadata` error for `key`: missing, or present with the wrong type.
    fn wrong(&self, key: &str, expected: &str) -> FormatError {
        let what = match self.get(key) {
            None => "missing".to_string(),
            Some(MetaValue::Array(a)) => {
                let inner = a.first().map_or("empty", MetaValue::type_name);
                format!("expected {expected}, found array of {inner}")
            }
            Some(v) => format!("expected {expected}, found {}", v.type_name()),
        };
        FormatError::Metadata {
            key: key.to_string(),
            what,
        }
    }

    pub fn require(&self, key: &str) -> Result<&MetaValue> {
        self.get(key).ok_or_else(|| self.wrong(key, "a value"))
    }
    pub fn require_str(&self, key: &str) -> Result<&str> {
        self.get_str(key).ok_or_else(|| self.wrong(key, "string"))
    }
    pub fn require_u64(&self, key: &str) -> Result<u64> {
        self.get_u64(key)
            .ok_or_else(|| self.wrong(key, "non-negative integer"))
    }
    pub fn require_usize(&self, key: &str) -> Result<usize> {
        self.get_usize(key)
            .ok_or_else(|| self.wrong(key, "non-negative integer"))
    }
    pub fn require_f32(&self, key: &str) -> Result<f32> {
        self.get_f32(key).ok_or_else(|| self.wrong(key, "number"))
    }
    pub fn require_bool(&self, key: &str) -> Result<bool> {
        self.get_bool(key).ok_or_else(|| self.wrong(key, "bool"))
    }
    pub fn require_str_array(&self, key: &str) -> Result<Vec<&str>> {
        self.get_str_array(key)
            .ok_or_else(|| self.wrong(key, "array of strings"))
    }
    pub fn require_f32_array(&self, key: &str) -> Result<Vec<f32>> {
        self.get_f32_array(key)
            .ok_or_else(|| self.wrong(key, "array of numbers"))
    }
    pub fn require_i32_array(&self, key: &str) -> Result<Vec<i32>> {
        self.get_i32_array(key)
            .ok_or_else(|| self.wrong(key, "array of 32-bit integers"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Metadata {
        let mut m = Metadata::new();
        m.push("general.architecture", MetaValue::String("llama".into()));
        m.push("llama.block_count", MetaValue::U32(30));
        m.push("neg", MetaValue::I32(-1));
        m.push("llama.rope.freq_base", MetaValue::F32(100000.0));
        m.push("flag", MetaValue::Bool(true));
        m.push(
            "tokens",
            MetaValue::Array(vec![
                MetaValue::String("a".into()),
                MetaValue::String("b".into()),
            ]),
        );
        m.push(
            "types",
            MetaValue::Array(vec![MetaValue::I32(1), MetaValue::U8(3)]),
        );
        m
    }

    #[test]
    fn getters_accept_any_width() {
        let m = sample();
        assert_eq!(m.get_str("general.architecture"), Some("llama"));
        assert_eq!(m.get_u64("llama.block_count"), Some(30));
        assert_eq!(m.get_u64("neg"), None);
        assert_eq!(m.get_i64("neg"), Some(-1));
        assert_eq!(m.get_f32("llama.block_count"), Some(30.0));
        assert_eq!(m.get_f32("llama.rope.freq_base"), Some(100000.0));
        assert_eq!(m.get_bool("flag"), Some(true));
        assert_eq!(m.get_str_array("tokens"), Some(vec!["a", "b"]));
        assert_eq!(m.get_i32_array("types"), Some(vec![1, 3]));
        assert_eq!(m.get_f32_array("types"), Some(vec![1.0, 3.0]));
        assert_eq!(m.get_str_array("types"), None);
    }

    #[test]
    fn require_names_the_key() {
        let m = sample();
        let err = m.require_u64("llama.context_length").unwrap_err();
        assert!(matches!(&err, FormatError::Metadata { key, what }
            if key == "llama.context_length" && what == "missing"));
        let err = m.require_str("llama.block_count").unwrap_err();
        assert!(err.to_string().contains("llama.block_count"));
        assert!(err.to_string().contains("found u32"));
    }
}
