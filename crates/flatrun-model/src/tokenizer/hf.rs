//! Tokenizers of Hugging Face directories (SafeTensors / MLX checkpoints):
//! `tokenizer.json` run by the `tokenizers` crate, special tokens and BOS/EOS
//! from `tokenizer_config.json` / `generation_config.json`.

use std::path::{Path, PathBuf};

use serde_json::Value;

use super::vocab::{TokenKind, Vocab};
use super::{Engine, PieceStyle, SpecialTokens, Tokenizer, TokenizerError, render_piece};

pub(crate) fn from_hf_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
    let tokenizer_path = dir.join("tokenizer.json");
    let mut json = read_json(&tokenizer_path)?.ok_or_else(|| TokenizerError::HfFile {
        path: tokenizer_path.clone(),
        what: "file not found".into(),
    })?;
    let config = read_json(&dir.join("tokenizer_config.json"))?.unwrap_or(Value::Null);
    let generation = read_json(&dir.join("generation_config.json"))?.unwrap_or(Value::Null);

    // Added tokens (id, text, special) as the file declares them. We cut them
    // out of the text ourselves, with llama.cpp's rules, so the crate is told
    // they are all special and asked not to split on special tokens.
    let mut added: Vec<(u32, String, bool)> = Vec::new();
    if let Some(list) = json.get_mut("added_tokens").and_then(Value::as_array_mut) {
        for token in list {
            let id = token.get("id").and_then(Value::as_u64);
            let content = token
                .get("content")
                .and_then(Value::as_str)
                .map(str::to_string);
            let special = token
                .get("special")
                .and_then(Value::as_bool)
                .unwrap_or(false);
            if let (Some(id), Some(content)) = (id, content) {
                added.push((id as u32, content, special));
            }
            if let Some(obj) = token.as_object_mut() {
                obj.insert("special".into(), Value::Bool(true));
            }
        }
    }
    let bytes = serde_json::to_vec(&json).map_err(|e| TokenizerError::HfFile {
        path: tokenizer_path.clone(),
        what: e.to_string(),
    })?;
    let mut hf = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TokenizerError::HfFile {
        path: tokenizer_path.clone(),
        what: e.to_string(),
    })?;

    // The vocabulary, added tokens included, indexed by id.
    let with_added = hf.get_vocab(true);
    let size = with_added
        .values()
        .map(|&id| id as usize + 1)
        .max()
        .unwrap_or(0);
    let mut texts: Vec<String> = (0..size).map(|i| format!("[EMPTY_{i}]")).collect();
    let mut kinds = vec![TokenKind::Normal; size];
    for (text, &id) in &with_added {
        texts[id as usize] = text.clone();
        if text.len() == 6 && text.starts_with("<0x") && text.ends_with('>') {
            kinds[id as usize] = TokenKind::Byte;
        }
    }
    for (id, _, special) in &added {
        if let Some(kind) = kinds.get_mut(*id as usize) {
            *kind = if *special {
                TokenKind::Control
            } else {
                TokenKind::UserDefined
            };
        }
    }

    // BOS/EOS by their text in tokenizer_config.json.
    let token_by_name = |name: &str| -> Option<u32> {
        let v = config.get(name)?;
        let text = v
            .as_str()
            .or_else(|| v.get("content").and_then(Value::as_str))?;
        with_added.get(text).copied()
    };
    let bos = token_by_name("bos_token");
    let eos = token_by_name("eos_token");
    let unk = token_by_name("unk_token");
    let mut extra_stops: Vec<u32> = match generation.get("eos_token_id") {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => Vec::new(),
    };
    extra_stops.retain(|&id| (id as usize) < size);
    let scores = vec![0.0; size];
    let vocab = Vocab::new(
        texts.iter().map(String::as_str).collect(),
        scores,
        kinds,
        bos,
        eos,
        unk,
        &extra_stops,
    );

    // How pieces render: byte-level if the decoder says so, SentencePiece otherwise.
    let decoder = json
        .get("decoder")
        .map(|d| d.to_string())
        .unwrap_or_default();
    let normalizer = json
        .get("normalizer")
        .map(|d| d.to_string())
        .unwrap_or_default();
    let pre_tokenizer = json
        .get("pre_tokenizer")
        .map(|d| d.to_string())
        .unwrap_or_default();
    let style = if decoder.contains("ByteLevel") || pre_tokenizer.contains("ByteLevel") {
        PieceStyle::ByteLevel
    } else {
        PieceStyle::SentencePiece
    };
    let adds_space = style == PieceStyle::SentencePiece
        && (normalizer.contains("Prepend")
            || pre_tokenizer.contains("\"prepend_scheme\":\"always\"")
            || pre_tokenizer.contains("\"prepend_scheme\":\"first\""));
    let model_type = json
        .get("model")
        .and_then(|m| m.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("unknown")
        .to_string();

    // BOS/EOS the post-processor adds: compare an encoding with and without them.
    let probe = |add: bool| {
        hf.encode_fast("a", add)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError::Machinery(e.to_string()))
    };
    let (plain, full) = (probe(false)?, probe(true)?);
    let (prefix, suffix) = match full
        .windows(plain.len().max(1))
        .position(|w| w == plain.as_slice())
    {
        Some(at) if !plain.is_empty() => (full[..at].to_vec(), full[at + plain.len()..].to_vec()),
        _ => (Vec::new(), Vec::new()),
    };
    let add_bos = config.get("add_bos_token").and_then(Value::as_bool);
    let prefix = match (add_bos, bos) {
        (Some(true), Some(b)) if prefix.is_empty() => vec![b],
        (Some(false), _) => Vec::new(),
        _ => prefix,
    };

    // Special tokens are cut out by us; inside text the crate must not split them.
    hf.set_encode_special_tokens(true);
    // Control-ness after llama.cpp's name rules (FIM and end-of-turn markers are control).
    let specials = SpecialTokens::from_vocab(&vocab, false);
    let pieces = (0..vocab.len())
        .map(|id| render_piece(&vocab, style, id))
        .collect();
    Ok(Tokenizer {
        vocab,
        engine: Engine::HuggingFace(Box::new(hf)),
        specials,
        style,
        prefix,
        suffix,
        add_space_prefix: adds_space,
        pieces,
        kind: format!("Hugging Face tokenizer.json ({model_type})"),
        warnings: Vec::new(),
    })
}

fn read_json(path: &PathBuf) -> Result<Option<Value>, TokenizerError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|e| TokenizerError::HfFile {
                path: path.clone(),
                what: e.to_string(),
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(TokenizerError::HfFile {
            path: path.clone(),
            what: e.to_string(),
        }),
    }
}
