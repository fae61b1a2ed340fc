//! Tokenizers built from what a checkpoint carries: GGUF `tokenizer.ggml.*`
//! metadata (byte-level BPE and SentencePiece) or a Hugging Face
//! `tokenizer.json`, agreeing with llama.cpp token for token.
//!
//! ```no_run
//! use flatrun_model::tokenizer::{StreamDecoder, Tokenizer};
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! # let metadata = flatrun_format::Metadata::default();
//! let tok = Tokenizer::from_gguf_metadata(&metadata)?;
//! let ids = tok.encode("<|im_start|>user\nHi!<|im_end|>", true, true)?;
//! let mut stream = StreamDecoder::new(&tok);
//! let mut text = String::new();
//! for &id in &ids {
//!     text.extend(stream.push(id));
//! }
//! text.push_str(&stream.finish());
//! # Ok(()) }
//! ```

mod bpe;
mod byte_level;
mod error;
mod gguf_keys;
mod hash;
mod hf;
mod pre_tokenizer;
mod special;
mod splitter;
mod spm;
mod stream;
mod text_table;
mod vocab;

pub use error::TokenizerError;
pub use gguf_keys::gguf_tokenizer_keys;
pub use stream::StreamDecoder;
pub use vocab::TokenKind;

use std::path::Path;

use flatrun_format::Metadata;

use bpe::ByteLevelBpe;
use special::{Fragment, SpecialTokens};
use text_table::ByteTable;
use vocab::{MetaReader, Vocab};

/// How ids are turned into text pieces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum PieceStyle {
    /// GPT-2 byte-level characters (`Ġ` = space).
    ByteLevel,
    /// SentencePiece: `▁` = space, `<0xNN>` byte tokens.
    SentencePiece,
}

/// The text encoder behind a tokenizer.
#[derive(Clone)]
enum Engine {
    /// GGUF byte-level BPE on the `tokenizers` crate.
    ByteLevelBpe(Box<ByteLevelBpe>),
    /// GGUF SentencePiece, merged by score.
    SentencePiece(Box<spm::SentencePiece>),
    /// A Hugging Face `tokenizer.json`, run by the `tokenizers` crate
    /// (with special tokens encoded as text: they are cut out beforehand).
    HuggingFace(Box<tokenizers::Tokenizer>),
}

/// A tokenizer: text ↔ token ids.
#[derive(Clone)]
pub struct Tokenizer {
    vocab: Vocab,
    engine: Engine,
    specials: SpecialTokens,
    style: PieceStyle,
    /// Ids prepended / appended when `add_special` is set.
    prefix: Vec<u32>,
    suffix: Vec<u32>,
    /// SentencePiece: prepend a space to text at the start and after a special token.
    add_space_prefix: bool,
    /// Bytes each token renders as (control tokens as their text).
    pieces: ByteTable,
    kind: String,
    warnings: Vec<String>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("kind", &self.kind)
            .field("vocab_size", &self.vocab.len())
            .finish_non_exhaustive()
    }
}

impl Tokenizer {
    /// Build from GGUF metadata (`tokenizer.ggml.model`, `tokens`, `scores`,
    /// `token_type`, `merges`, `pre`, special ids and flags).
    pub fn from_gguf_metadata(md: &Metadata) -> Result<Tokenizer, TokenizerError> {
        let r = MetaReader::new(md);
        let model = r
            .str("tokenizer.ggml.model")?
            .ok_or_else(|| TokenizerError::MissingKey {
                key: "tokenizer.ggml.model".into(),
            })?;
        let mut warnings = Vec::new();
        let model_name = r
            .str("general.name")
            .ok()
            .flatten()
            .unwrap_or("")
            .to_lowercase();
        let phi3 = model_name.contains("phi-3") || model_name.contains("phi3");
        match model {
            "gpt2" => {
                let vocab = vocab::vocab_from_gguf(&r, false)?;
                let pre = r.str("tokenizer.ggml.pre")?.unwrap_or("default");
                let spec = match pre_tokenizer::spec_for(pre) {
                    Some(spec) => spec,
                    None => {
                        warnings.push(format!("unknown pre-tokenizer `{pre}`: using `default`; token ids may differ from the model's training tokenizer"));
                        pre_tokenizer::spec_for("default").ok_or_else(|| {
                            TokenizerError::Machinery("no default pre-tokenizer".into())
                        })?
                    }
                };
                let merges = r.str_array("tokenizer.ggml.merges")?.ok_or_else(|| {
                    TokenizerError::MissingKey {
                        key: "tokenizer.ggml.merges".into(),
                    }
                })?;
                let engine = ByteLevelBpe::new(&vocab, &merges, &spec, pre)?;
                let add_bos = r
                    .bool("tokenizer.ggml.add_bos_token")?
                    .unwrap_or(spec.add_bos_default);
                let add_eos = r.bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
                let kind = format!("gpt2 BPE ({})", spec.family);
                Ok(Self::assemble(
                    vocab,
                    Engine::ByteLevelBpe(Box::new(engine)),
                    PieceStyle::ByteLevel,
                    add_bos,
                    add_eos,
                    false,
                    phi3,
                    kind,
                    warnings,
                ))
            }
            "llama" => {
                let vocab = vocab::vocab_from_gguf(&r, true)?;
                let add_bos = r.bool("tokenizer.ggml.add_bos_token")?.unwrap_or(true);
                let add_eos = r.bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false);
                let add_space_prefix = r.bool("tokenizer.ggml.add_space_prefix")?.unwrap_or(true);
                let engine = spm::SentencePiece::new(&vocab);
                Ok(Self::assemble(
                    vocab,
                    Engine::SentencePiece(Box::new(engine)),
                    PieceStyle::SentencePiece,
                    add_bos,
                    add_eos,
                    add_space_prefix,
                    phi3,
                    "SentencePiece".into(),
                    warnings,
                ))
            }
            other => Err(TokenizerError::UnsupportedModel(other.to_string())),
        }
    }

    /// Build from a Hugging Face directory: `tokenizer.json`, plus
    /// `tokenizer_config.json` and `generation_config.json` when present.
    pub fn from_hf_dir(dir: &Path) -> Result<Tokenizer, TokenizerError> {
        hf::from_hf_dir(dir)
    }

    #[allow(clippy::too_many_arguments)]
    fn assemble(
        vocab: Vocab,
        engine: Engine,
        style: PieceStyle,
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        phi3_rules: bool,
        kind: String,
        mut warnings: Vec<String>,
    ) -> Tokenizer {
        let specials = SpecialTokens::from_vocab(&vocab, phi3_rules);
        let mut prefix = Vec::new();
        let mut suffix = Vec::new();
        if add_bos {
            match vocab.bos {
                Some(b) => prefix.push(b),
                None => {
                    warnings.push("add_bos_token is set but the vocabulary has no BOS id".into())
                }
            }
        }
        if add_eos {
            match vocab.eos {
                Some(e) => suffix.push(e),
                None => {
                    warnings.push("add_eos_token is set but the vocabulary has no EOS id".into())
                }
            }
        }
        let pieces = (0..vocab.len())
            .map(|id| render_piece(&vocab, style, id))
            .collect();
        Tokenizer {
            vocab,
            engine,
            specials,
            style,
            prefix,
            suffix,
            add_space_prefix,
            pieces,
            kind,
            warnings,
        }
    }

    /// Token ids of `text`. `add_special` adds BOS/EOS as the model's
    /// metadata asks; `parse_special` recognizes control tokens such as
    /// `<|im_start|>` in the text (otherwise they are encoded as plain text;
    /// user-defined tokens are always recognized, as in llama.cpp).
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special {
            out.extend_from_slice(&self.prefix);
        }
        // SentencePiece prefixes a space at the start and after each special token.
        let mut after_special = true;
        for fragment in self.specials.partition(text, parse_special) {
            match fragment {
                Fragment::Token(id) => {
                    out.push(id);
                    after_special = true;
                }
                Fragment::Text { start, end } => {
                    self.encode_plain(&text[start..end], after_special, &mut out)?;
                    after_special = false;
                }
            }
        }
        if add_special {
            out.extend_from_slice(&self.suffix);
        }
        Ok(out)
    }

    /// Encode text that contains no special tokens.
    fn encode_plain(
        &self,
        text: &str,
        after_special: bool,
        out: &mut Vec<u32>,
    ) -> Result<(), TokenizerError> {
        match &self.engine {
            Engine::ByteLevelBpe(bpe) => {
                bpe.encode(&self.vocab, text, out);
                Ok(())
            }
            Engine::SentencePiece(sentence_piece) => {
                let mut escaped = String::with_capacity(text.len() + 3);
                if self.add_space_prefix && after_special {
                    escaped.push('▁');
                }
                for c in text.chars() {
                    escaped.push(if c == ' ' { '▁' } else { c });
                }
                sentence_piece.encode(&self.vocab, &escaped, out);
                Ok(())
            }
            Engine::HuggingFace(hf) => {
                let encoding = hf
                    .encode_fast(text, false)
                    .map_err(|e| TokenizerError::Machinery(format!("encoding: {e}")))?;
                out.extend_from_slice(encoding.get_ids());
                Ok(())
            }
        }
    }

    /// Text of `ids`. With `skip_special`, control and unknown tokens are
    /// left out. Invalid UTF-8 (a sequence cut in the middle) becomes U+FFFD.
    /// SentencePiece's added leading space is removed again.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        let mut first = true;
        for &id in ids {
            let kind = self.vocab.kind(id).ok_or(TokenizerError::IdOutOfRange {
                id,
                vocab_size: self.vocab.len(),
            })?;
            if skip_special && matches!(kind, TokenKind::Control | TokenKind::Unknown) {
                continue;
            }
            let piece = self.pieces.get(id as usize).unwrap_or_default();
            if first
                && self.add_space_prefix
                && piece.first() == Some(&b' ')
                && !matches!(kind, TokenKind::Control)
            {
                bytes.extend_from_slice(&piece[1..]);
            } else {
                bytes.extend_from_slice(piece);
            }
            first = false;
        }
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    }

    /// Raw bytes of one token as it is emitted (control tokens as their text;
    /// empty for an id outside the vocabulary).
    pub fn token_to_piece(&self, id: u32) -> Vec<u8> {
        self.pieces
            .get(id as usize)
            .map(<[u8]>::to_vec)
            .unwrap_or_default()
    }

    /// The token's text as stored in the vocabulary (`Ġhello`, `▁the`, `<0x0A>`).
    pub fn token_text(&self, id: u32) -> Option<&str> {
        self.vocab.text(id)
    }

    /// The id of a vocabulary entry by its stored text.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.vocab.id(text)
    }

    /// What kind of token an id is.
    pub fn token_kind(&self, id: u32) -> Option<TokenKind> {
        self.vocab.kind(id)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// `"gpt2 BPE (qwen2)"`, `"SentencePiece"`, `"Hugging Face tokenizer.json (BPE)"`…
    pub fn kind(&self) -> &str {
        &self.kind
    }

    pub fn bos(&self) -> Option<u32> {
        self.vocab.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.vocab.eos
    }

    /// Every id that ends a generation (EOS, EOT, `<|im_end|>`, `<end_of_turn>`…), sorted.
    pub fn stop_ids(&self) -> &[u32] {
        &self.vocab.stop_ids
    }

    /// Whether `id` is a control (or unknown) token, hidden when decoding with `skip_special`.
    pub fn is_special(&self, id: u32) -> bool {
        matches!(
            self.vocab.kind(id),
            Some(TokenKind::Control | TokenKind::Unknown)
        )
    }

    /// Whether BOS/EOS are added by `encode(.., add_special = true, ..)`.
    pub fn adds_bos(&self) -> bool {
        !self.prefix.is_empty()
    }

    pub fn adds_eos(&self) -> bool {
        !self.suffix.is_empty()
    }

    /// Problems noticed while building (an unknown pre-tokenizer, a missing BOS…).
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Whether the tokenizer strips the SentencePiece leading space of the first piece.
    pub(crate) fn strips_leading_space(&self) -> bool {
        self.add_space_prefix && self.style == PieceStyle::SentencePiece
    }
}

/// The bytes one token renders as, following llama.cpp's `token_to_piece`.
fn render_piece(vocab: &Vocab, style: PieceStyle, id: usize) -> Vec<u8> {
    let text = vocab.text(id as u32).unwrap_or("");
    match vocab.kinds[id] {
        TokenKind::Control | TokenKind::Unknown | TokenKind::UserDefined => {
            text.as_bytes().to_vec()
        }
        TokenKind::Unused => Vec::new(),
        TokenKind::Byte => parse_byte_token(text)
            .map(|b| vec![b])
            .unwrap_or_else(|| text.as_bytes().to_vec()),
        TokenKind::Normal => match style {
            PieceStyle::ByteLevel => byte_level::decode_byte_level(text),
            PieceStyle::SentencePiece => text.replace('▁', " ").into_bytes(),
        },
    }
}

/// The byte of a `<0xNN>` token.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    u8::from_str_radix(hex, 16).ok()
}
