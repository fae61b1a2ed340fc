//! The token table read from GGUF metadata: texts, scores, attributes and the
//! special ids, with llama.cpp's rules for which tokens are control tokens and
//! which ids end a generation.

use std::collections::BTreeSet;

use flatrun_format::{MetaValue, Metadata};

use super::TokenizerError;
use super::text_table::{TextIndex, TextTable};

/// GGUF `tokenizer.ggml.token_type` values.
pub(crate) mod token_type {
    pub const NORMAL: i32 = 1;
    pub const UNKNOWN: i32 = 2;
    pub const CONTROL: i32 = 3;
    pub const USER_DEFINED: i32 = 4;
    pub const UNUSED: i32 = 5;
    pub const BYTE: i32 = 6;
}

/// What kind of token an id is; decides splitting and rendering.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenKind {
    /// Ordinary text piece.
    Normal,
    /// The unknown token.
    Unknown,
    /// A control token (`<|im_start|>`, `<bos>`…): parsed only when asked,
    /// rendered only when special tokens are not skipped.
    Control,
    /// A user-defined token: always matched verbatim in text, rendered as text.
    UserDefined,
    /// Reserved, never produced by encoding.
    Unused,
    /// A byte-fallback token `<0xNN>`.
    Byte,
}

impl TokenKind {
    fn from_gguf(t: i32) -> TokenKind {
        match t {
            token_type::NORMAL => TokenKind::Normal,
            token_type::UNKNOWN => TokenKind::Unknown,
            token_type::CONTROL => TokenKind::Control,
            token_type::USER_DEFINED => TokenKind::UserDefined,
            token_type::UNUSED => TokenKind::Unused,
            token_type::BYTE => TokenKind::Byte,
            // NORMAL and the undefined/unknown type numbers behave as text.
            _ => TokenKind::Normal,
        }
    }
}

/// Token texts that llama.cpp treats as end-of-generation (and forces to be
/// control tokens) whatever their GGUF type says.
pub(crate) const END_OF_GENERATION_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<｜end▁of▁sentence｜>",
    "</s>",
    "<eos>",
    "[EOS]",
    "<|return|>",
    "<|call|>",
];

/// Fill-in-the-middle tokens that llama.cpp also stops on (pad, repo, file separator).
const FIM_STOP_TEXTS: &[&str] = &[
    "<|fim_pad|>",
    "<fim-pad>",
    "<fim_pad>",
    "<PAD>",
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
    "<|file_sep|>",
];

/// Other fill-in-the-middle markers that llama.cpp forces to control tokens.
const FIM_CONTROL_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
];

/// The token table of one model.
#[derive(Clone, Debug)]
pub(crate) struct Vocab {
    pub texts: TextTable,
    pub scores: Vec<f32>,
    pub kinds: Vec<TokenKind>,
    pub ids: TextIndex,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub unk: Option<u32>,
    pub stop_ids: Vec<u32>,
}

impl Vocab {
    /// Build the table from texts, scores and kinds, then apply llama.cpp's
    /// name-based rules: end-of-turn and fill-in-the-middle markers become
    /// control tokens, and every end-of-generation id becomes a stop id.
    pub fn new(
        mut texts: TextTable,
        scores: Vec<f32>,
        mut kinds: Vec<TokenKind>,
        bos: Option<u32>,
        eos: Option<u32>,
        unk: Option<u32>,
        extra_stop_ids: &[u32],
    ) -> Vocab {
        texts.shrink_to_fit();
        let ids = TextIndex::build(&texts);
        let mut stops: BTreeSet<u32> = extra_stop_ids.iter().copied().collect();
        stops.extend(eos);
        for text in END_OF_GENERATION_TEXTS.iter().chain(FIM_STOP_TEXTS) {
            if let Some(id) = ids.get(&texts, text) {
                stops.insert(id);
            }
        }
        for text in END_OF_GENERATION_TEXTS
            .iter()
            .chain(FIM_STOP_TEXTS)
            .chain(FIM_CONTROL_TEXTS)
        {
            if let Some(id) = ids.get(&texts, text) {
                kinds[id as usize] = TokenKind::Control;
            }
        }
        let n = texts.len() as u32;
        stops.retain(|&id| id < n);
        Vocab {
            texts,
            scores,
            kinds,
            ids,
            bos,
            eos,
            unk,
            stop_ids: stops.into_iter().collect(),
        }
    }

    pub fn len(&self) -> usize {
        self.texts.len()
    }

    pub fn kind(&self, id: u32) -> Option<TokenKind> {
        self.kinds.get(id as usize).copied()
    }

    pub fn id(&self, text: &str) -> Option<u32> {
        self.ids.get(&self.texts, text)
    }

    /// The stored text of `id` (`None` outside the vocabulary).
    pub fn text(&self, id: u32) -> Option<&str> {
        self.texts.get(id as usize)
    }
}

/// Typed look-ups into GGUF metadata, with errors naming the key.
pub(crate) struct MetaReader<'m> {
    md: &'m Metadata,
}

impl<'m> MetaReader<'m> {
    pub fn new(md: &'m Metadata) -> Self {
        MetaReader { md }
    }

    pub fn get(&self, key: &str) -> Option<&'m MetaValue> {
        self.md
            .entries
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v)
    }

    pub fn str(&self, key: &str) -> Result<Option<&'m str>, TokenizerError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::String(s)) => Ok(Some(s.as_str())),
            Some(other) => Err(bad(
                key,
                format!("expected a string, found {}", value_kind(other)),
            )),
        }
    }

    pub fn bool(&self, key: &str) -> Result<Option<bool>, TokenizerError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Bool(b)) => Ok(Some(*b)),
            Some(v) => as_i64(v)
                .map(|x| Some(x != 0))
                .ok_or_else(|| bad(key, "expected a bool".into())),
        }
    }

    /// A token id; out-of-range or negative values are ignored like llama.cpp does.
    pub fn token_id(&self, key: &str, n_tokens: usize) -> Result<Option<u32>, TokenizerError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => {
                let x = as_i64(v).ok_or_else(|| {
                    bad(key, format!("expected an integer, found {}", value_kind(v)))
                })?;
                Ok((x >= 0 && (x as u64) < n_tokens as u64).then_some(x as u32))
            }
        }
    }

    fn array(&self, key: &str) -> Result<Option<&'m [MetaValue]>, TokenizerError> {
        match self.get(key) {
            None => Ok(None),
            Some(MetaValue::Array(a)) => Ok(Some(a.as_slice())),
            Some(other) => Err(bad(
                key,
                format!("expected an array, found {}", value_kind(other)),
            )),
        }
    }

    /// The strings of an array, borrowed from the metadata.
    pub fn str_refs(&self, key: &str) -> Result<Option<Vec<&'m str>>, TokenizerError> {
        let Some(items) = self.array(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                MetaValue::String(s) => Ok(s.as_str()),
                other => Err(bad(
                    key,
                    format!(
                        "element {i}: expected a string, found {}",
                        value_kind(other)
                    ),
                )),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    pub fn str_array(&self, key: &str) -> Result<Option<Vec<String>>, TokenizerError> {
        let Some(items) = self.array(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                MetaValue::String(s) => Ok(s.clone()),
                other => Err(bad(
                    key,
                    format!(
                        "element {i}: expected a string, found {}",
                        value_kind(other)
                    ),
                )),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    pub fn f32_array(&self, key: &str) -> Result<Option<Vec<f32>>, TokenizerError> {
        let Some(items) = self.array(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                MetaValue::F32(x) => Ok(*x),
                MetaValue::F64(x) => Ok(*x as f32),
                other => as_i64(other).map(|x| x as f32).ok_or_else(|| {
                    bad(
                        key,
                        format!(
                            "element {i}: expected a number, found {}",
                            value_kind(other)
                        ),
                    )
                }),
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }

    pub fn i32_array(&self, key: &str) -> Result<Option<Vec<i32>>, TokenizerError> {
        let Some(items) = self.array(key)? else {
            return Ok(None);
        };
        items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                as_i64(v).map(|x| x as i32).ok_or_else(|| {
                    bad(
                        key,
                        format!("element {i}: expected an integer, found {}", value_kind(v)),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some)
    }
}

/// Read the GGUF token table (`tokenizer.ggml.*`).
pub(crate) fn vocab_from_gguf(
    r: &MetaReader<'_>,
    spm_defaults: bool,
) -> Result<Vocab, TokenizerError> {
    let key = "tokenizer.ggml.tokens";
    // Borrowed from the metadata and copied once into the compact table.
    let strs = r
        .str_refs(key)?
        .ok_or_else(|| TokenizerError::MissingKey { key: key.into() })?;
    let n = strs.len();
    if n == 0 {
        return Err(bad(key, "the token list is empty".into()));
    }
    let mut texts = TextTable::with_capacity(n, strs.iter().map(|s| s.len()).sum());
    for (i, t) in strs.iter().enumerate() {
        // llama.cpp renames empty tokens so that every text is a distinct key.
        if t.is_empty() {
            texts.push(&format!("[EMPTY_{i}]"));
        } else {
            texts.push(t);
        }
    }
    drop(strs);
    let scores = match r.f32_array("tokenizer.ggml.scores")? {
        Some(s) if s.len() >= n => s[..n].to_vec(),
        Some(s) => {
            return Err(bad(
                "tokenizer.ggml.scores",
                format!("{} scores for {n} tokens", s.len()),
            ));
        }
        None => vec![0.0; n],
    };
    let kinds = match r.i32_array("tokenizer.ggml.token_type")? {
        Some(t) if t.len() >= n => t[..n].iter().map(|&x| TokenKind::from_gguf(x)).collect(),
        Some(t) => {
            return Err(bad(
                "tokenizer.ggml.token_type",
                format!("{} types for {n} tokens", t.len()),
            ));
        }
        None => vec![TokenKind::Normal; n],
    };
    // SentencePiece vocabularies default to <unk>=0, <s>=1, </s>=2.
    let (def_bos, def_eos, def_unk) = if spm_defaults && n > 2 {
        (Some(1), Some(2), Some(0))
    } else {
        (None, None, None)
    };
    let bos = r.token_id("tokenizer.ggml.bos_token_id", n)?.or(def_bos);
    let eos = r.token_id("tokenizer.ggml.eos_token_id", n)?.or(def_eos);
    let unk = r
        .token_id("tokenizer.ggml.unknown_token_id", n)?
        .or(def_unk);
    let mut extra = Vec::new();
    for k in [
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
        "tokenizer.ggml.fim_pad_token_id",
        "tokenizer.ggml.fim_rep_token_id",
        "tokenizer.ggml.fim_sep_token_id",
    ] {
        extra.extend(r.token_id(k, n)?);
    }
    Ok(Vocab::new(texts, scores, kinds, bos, eos, unk, &extra))
}

fn as_i64(v: &MetaValue) -> Option<i64> {
    Some(match v {
        MetaValue::U8(x) => *x as i64,
        MetaValue::I8(x) => *x as i64,
        MetaValue::U16(x) => *x as i64,
        MetaValue::I16(x) => *x as i64,
        MetaValue::U32(x) => *x as i64,
        MetaValue::I32(x) => *x as i64,
        MetaValue::U64(x) => i64::try_from(*x).ok()?,
        MetaValue::I64(x) => *x,
        MetaValue::Bool(b) => *b as i64,
        _ => return None,
    })
}

fn value_kind(v: &MetaValue) -> &'static str {
    match v {
        MetaValue::String(_) => "a string",
        MetaValue::Array(_) => "an array",
        MetaValue::Bool(_) => "a bool",
        MetaValue::F32(_) | MetaValue::F64(_) => "a float",
        _ => "an integer",
    }
}

fn bad(key: &str, what: String) -> TokenizerError {
    TokenizerError::BadMetadata {
        key: key.into(),
        what,
    }
}
