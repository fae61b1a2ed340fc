//! The `tokenizer.ggml.*` keys of a GGUF, written from a Hugging Face
//! directory's `tokenizer.json` and `tokenizer_config.json` as llama.cpp's
//! converter writes them: the vocabulary by id, token types (added special
//! tokens are control tokens, other added tokens user-defined), the merges,
//! the special token ids and the pre-tokenizer's llama.cpp name.
//!
//! Two kinds of `tokenizer.json` are understood: byte-level BPE (GGUF model
//! `gpt2`) and SentencePiece-style BPE with byte fallback (`llama`: pieces
//! scored so that llama.cpp's score-ordered merging follows the merge ranks).

use std::path::Path;

use flatrun_format::MetaValue;
use serde_json::Value;

use super::TokenizerError;

/// llama.cpp's token types.
const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER_DEFINED: i32 = 4;
const UNUSED: i32 = 5;
const BYTE: i32 = 6;

/// The `tokenizer.ggml.*` keys (and `tokenizer.chat_template` when the
/// directory has a template) for the tokenizer in `dir`, the vocabulary
/// padded to `vocab_size` tokens (the embedding's rows) with unused
/// `[PAD{id}]` tokens, as the converter pads it.
pub fn gguf_tokenizer_keys(
    dir: &Path,
    vocab_size: usize,
) -> Result<Vec<(String, MetaValue)>, TokenizerError> {
    let path = dir.join("tokenizer.json");
    let json = read_json(&path)?.ok_or_else(|| TokenizerError::HfFile {
        path: path.clone(),
        what: "file not found".into(),
    })?;
    let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
    let bad = |what: String| TokenizerError::HfFile {
        path: path.clone(),
        what,
    };
    let model = json.get("model").ok_or_else(|| bad("no `model`".into()))?;
    if model.get("type").and_then(Value::as_str) != Some("BPE") {
        return Err(bad(format!(
            "model type {} cannot be written as a GGUF vocabulary (BPE only)",
            model.get("type").unwrap_or(&Value::Null)
        )));
    }

    // Tokens by id: the model's vocabulary, then the added tokens.
    let mut tokens: Vec<Option<String>> = Vec::new();
    let mut put = |id: usize, text: &str| {
        if tokens.len() <= id {
            tokens.resize(id + 1, None);
        }
        tokens[id] = Some(text.to_string());
    };
    let vocab = model
        .get("vocab")
        .and_then(Value::as_object)
        .ok_or_else(|| bad("no `model.vocab`".into()))?;
    for (text, id) in vocab {
        let id = id
            .as_u64()
            .ok_or_else(|| bad(format!("vocab entry {text:?} has no id")))?;
        put(id as usize, text);
    }
    let mut added = Vec::new();
    for t in json
        .get("added_tokens")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let (Some(id), Some(text)) = (
            t.get("id").and_then(Value::as_u64),
            t.get("content").and_then(Value::as_str),
        ) else {
            continue;
        };
        let special = t.get("special").and_then(Value::as_bool).unwrap_or(false);
        put(id as usize, text);
        added.push((id as usize, special));
    }
    if tokens.len() < vocab_size {
        tokens.resize(vocab_size, None);
    }
    let unused: Vec<bool> = tokens.iter().map(Option::is_none).collect();
    let tokens: Vec<String> = tokens
        .into_iter()
        .enumerate()
        .map(|(i, t)| t.unwrap_or_else(|| format!("[PAD{i}]")))
        .collect();
    let id_of = |text: &str| tokens.iter().position(|t| t == text);

    let merges: Vec<String> = model
        .get("merges")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(|m| match m {
            Value::String(s) => Some(s.clone()),
            Value::Array(pair) => match (pair.first(), pair.get(1)) {
                (Some(Value::String(a)), Some(Value::String(b))) => Some(format!("{a} {b}")),
                _ => None,
            },
            _ => None,
        })
        .collect();

    let byte_fallback = model
        .get("byte_fallback")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    let unk = model
        .get("unk_token")
        .and_then(Value::as_str)
        .and_then(id_of);
    let mut types: Vec<i32> = unused
        .iter()
        .map(|&u| if u { UNUSED } else { NORMAL })
        .collect();
    if byte_fallback {
        for (ty, t) in types.iter_mut().zip(&tokens) {
            if t.len() == 6 && t.starts_with("<0x") && t.ends_with('>') {
                *ty = BYTE;
            }
        }
    }
    for &(id, special) in &added {
        types[id] = if special { CONTROL } else { USER_DEFINED };
    }
    if let Some(u) = unk {
        types[u] = UNKNOWN;
    }

    let mut keys: Vec<(String, MetaValue)> = Vec::new();
    let mut key = |k: &str, v: MetaValue| keys.push((format!("tokenizer.ggml.{k}"), v));
    let strings =
        |v: &[String]| MetaValue::Array(v.iter().cloned().map(MetaValue::String).collect());
    if byte_fallback {
        key("model", MetaValue::String("llama".into()));
        key("pre", MetaValue::String("default".into()));
        key("tokens", strings(&tokens));
        key(
            "scores",
            MetaValue::Array(
                merge_scores(&tokens, &merges)
                    .into_iter()
                    .map(MetaValue::F32)
                    .collect(),
            ),
        );
        key(
            "token_type",
            MetaValue::Array(types.into_iter().map(MetaValue::I32).collect()),
        );
        let prepends = json
            .get("normalizer")
            .is_some_and(|n| n.to_string().contains("\"Prepend\""));
        key("add_space_prefix", MetaValue::Bool(prepends));
    } else {
        let pre = pre_tokenizer_name(json.get("pre_tokenizer").unwrap_or(&Value::Null))
            .ok_or_else(|| {
                bad(format!(
                    "its pre-tokenizer {} is not one llama.cpp names",
                    json.get("pre_tokenizer").unwrap_or(&Value::Null)
                ))
            })?;
        key("model", MetaValue::String("gpt2".into()));
        key("pre", MetaValue::String(pre.into()));
        key("tokens", strings(&tokens));
        key(
            "token_type",
            MetaValue::Array(types.into_iter().map(MetaValue::I32).collect()),
        );
        key("merges", strings(&merges));
    }

    // Special tokens by their text in tokenizer_config.json.
    let special = |name: &str| -> Option<usize> {
        let v = config.get(name)?;
        let text = v
            .as_str()
            .or_else(|| v.get("content").and_then(Value::as_str))?;
        id_of(text)
    };
    for (name, gguf) in [
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ] {
        if let Some(id) = special(name) {
            key(gguf, MetaValue::U32(id as u32));
        }
    }
    for flag in ["add_bos_token", "add_eos_token"] {
        if let Some(b) = config.get(flag).and_then(Value::as_bool) {
            key(flag, MetaValue::Bool(b));
        }
    }
    if let Some(template) = chat_template_source(dir, &config)? {
        keys.push((
            "tokenizer.chat_template".into(),
            MetaValue::String(template),
        ));
    }
    Ok(keys)
}

/// The chat template the directory itself holds (`chat_template.jinja`, or
/// `chat_template` in `tokenizer_config.json`), not a built-in one.
fn chat_template_source(dir: &Path, config: &Value) -> Result<Option<String>, TokenizerError> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.is_file() {
        return std::fs::read_to_string(&jinja)
            .map(Some)
            .map_err(|e| TokenizerError::HfFile {
                path: jinja,
                what: e.to_string(),
            });
    }
    Ok(match config.get("chat_template") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .or(list.first())
            .and_then(|t| t.get("template"))
            .and_then(Value::as_str)
            .map(str::to_string),
        _ => None,
    })
}

/// llama.cpp's `tokenizer.ggml.pre` for a byte-level `pre_tokenizer`, told
/// apart by its structure and split regex.
fn pre_tokenizer_name(pre: &Value) -> Option<&'static str> {
    let kind = |v: &Value| v.get("type").and_then(Value::as_str).map(str::to_string);
    let steps: Vec<&Value> = match kind(pre).as_deref() {
        Some("Sequence") => pre.get("pretokenizers")?.as_array()?.iter().collect(),
        Some(_) => vec![pre],
        None => return None,
    };
    let byte_level_regex = |v: &Value| {
        kind(v).as_deref() == Some("ByteLevel")
            && v.get("use_regex").and_then(Value::as_bool).unwrap_or(true)
    };
    let split_regex = |v: &Value| -> Option<String> {
        (kind(v).as_deref() == Some("Split"))
            .then(|| v.get("pattern")?.get("Regex")?.as_str().map(str::to_string))
            .flatten()
    };
    match steps.as_slice() {
        [b] if byte_level_regex(b) => Some("gpt-2"),
        [d, b]
            if kind(d).as_deref() == Some("Digits")
                && d.get("individual_digits").and_then(Value::as_bool) == Some(true)
                && byte_level_regex(b) =>
        {
            Some("smollm")
        }
        [s, b] if kind(b).as_deref() == Some("ByteLevel") && !byte_level_regex(b) => {
            let regex = split_regex(s)?;
            if regex.contains(r"\p{N}{1,3}") {
                Some("llama-bpe")
            } else if regex.contains(r"\p{N}|") && regex.contains(r"[^\r\n\p{L}\p{N}]?\p{L}+") {
                Some("qwen2")
            } else {
                None
            }
        }
        _ => None,
    }
}

/// Scores of SentencePiece-style pieces such that merging the adjacent pair
/// whose result scores highest (llama.cpp's SentencePiece tokenizer) merges
/// in the order of the BPE merge ranks: a piece made by merge `r` (its first)
/// scores `-r`; pieces no merge makes score below every merged one.
fn merge_scores(tokens: &[String], merges: &[String]) -> Vec<f32> {
    let floor = -(merges.len() as f32) - 1.0;
    let mut scores = vec![floor; tokens.len()];
    let ids: std::collections::HashMap<&str, usize> = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| (t.as_str(), i))
        .collect();
    for (rank, m) in merges.iter().enumerate().rev() {
        let Some((a, b)) = m.split_once(' ') else {
            continue;
        };
        if let Some(&id) = ids.get(format!("{a}{b}").as_str()) {
            scores[id] = -(rank as f32);
        }
    }
    scores
}

fn read_json(path: &Path) -> Result<Option<Value>, TokenizerError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| TokenizerError::HfFile {
                path: path.to_path_buf(),
                what: format!("invalid JSON: {e}"),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(TokenizerError::HfFile {
            path: path.to_path_buf(),
            what: e.to_string(),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pre_tokenizers_are_named_as_llama_cpp_names_them() {
        let byte_level = json!({"type": "ByteLevel", "use_regex": true});
        assert_eq!(pre_tokenizer_name(&byte_level), Some("gpt-2"));
        let smollm = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Digits", "individual_digits": true}, byte_level]});
        assert_eq!(pre_tokenizer_name(&smollm), Some("smollm"));
        let qwen2 = json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"}},
            {"type": "ByteLevel", "use_regex": false}]});
        assert_eq!(pre_tokenizer_name(&qwen2), Some("qwen2"));
        assert_eq!(pre_tokenizer_name(&json!({"type": "Whitespace"})), None);
        assert_eq!(pre_tokenizer_name(&Value::Null), None);
    }

    #[test]
    fn merged_pieces_score_by_their_first_merge() {
        let tokens: Vec<String> = ["a", "b", "ab", "abb", "zz"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let merges = vec!["a b".to_string(), "ab b".to_string(), "a b".to_string()];
        let s = merge_scores(&tokens, &merges);
        assert_eq!(s[2], 0.0);
        assert_eq!(s[3], -1.0);
        assert!(s[4] < s[3] && s[0] == s[4]);
    }

    #[test]
    fn a_byte_level_directory_gives_gpt2_keys() {
        let dir = tempfile::tempdir().unwrap();
        let tok = json!({
            "added_tokens": [{"id": 3, "content": "<|end|>", "special": true},
                             {"id": 4, "content": "<x>", "special": false}],
            "pre_tokenizer": {"type": "ByteLevel", "use_regex": true},
            "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]}
        });
        std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).unwrap();
        let config =
            json!({"eos_token": "<|end|>", "add_bos_token": false, "chat_template": "{{ x }}"});
        std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string()).unwrap();
        let keys = gguf_tokenizer_keys(dir.path(), 6).unwrap();
        let get = |k: &str| keys.iter().find(|(n, _)| n == k).map(|(_, v)| v.clone());
        assert_eq!(
            get("tokenizer.ggml.model"),
            Some(MetaValue::String("gpt2".into()))
        );
        assert_eq!(
            get("tokenizer.ggml.pre"),
            Some(MetaValue::String("gpt-2".into()))
        );
        assert_eq!(get("tokenizer.ggml.eos_token_id"), Some(MetaValue::U32(3)));
        assert_eq!(
            get("tokenizer.ggml.add_bos_token"),
            Some(MetaValue::Bool(false))
        );
        assert_eq!(
            get("tokenizer.ggml.token_type"),
            Some(MetaValue::Array(
                [1, 1, 1, 3, 4, 5].into_iter().map(MetaValue::I32).collect()
            ))
        );
        assert_eq!(
            get("tokenizer.ggml.merges"),
            Some(MetaValue::Array(vec![MetaValue::String("a b".into())]))
        );
        assert_eq!(
            get("tokenizer.chat_template"),
            Some(MetaValue::String("{{ x }}".into()))
        );
    }
}
