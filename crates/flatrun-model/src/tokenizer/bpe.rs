//! Byte-level BPE (`tokenizer.ggml.model = gpt2`) on the `tokenizers` crate:
//! its `BPE` model built from the GGUF tokens and merges, behind a pre-tokenizer
//! made of the regex `Split`s llama.cpp uses for the vocabulary's `pre` value
//! followed by the GPT-2 byte-to-character mapping.

use tokenizers::models::bpe::{Vocab as BpeVocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::SplitDelimiterBehavior;

use super::pre_tokenizer::PreTokenizerSpec;
use super::vocab::Vocab;
use super::TokenizerError;

/// A byte-level BPE text encoder (special tokens are handled by the caller).
#[derive(Clone)]
pub(crate) struct ByteLevelBpe {
    inner: tokenizers::Tokenizer,
}

impl ByteLevelBpe {
    /// Build from the vocabulary and the GGUF merge list (`"left right"`, rank = index).
    pub fn new(
        vocab: &Vocab,
        merges: &[String],
        spec: &PreTokenizerSpec,
        pre_name: &str,
    ) -> Result<ByteLevelBpe, TokenizerError> {
        // Token texts of a byte-level vocabulary are already in GPT-2's
        // printable-byte alphabet, which is what the `tokenizers` BPE expects.
        let bpe_vocab: BpeVocab = vocab
            .texts
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let mut pairs = Vec::with_capacity(merges.len());
        for merge in merges {
            // llama.cpp splits at the first space after the first byte.
            let Some(split) = merge.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                continue;
            };
            let (left, right) = (&merge[..split], &merge[split + 1..]);
            // A merge whose parts or result are not tokens can never apply
            // (llama.cpp ignores it too); the `tokenizers` builder rejects it.
            if vocab.ids.contains_key(left)
                && vocab.ids.contains_key(right)
                && vocab.ids.contains_key(&format!("{left}{right}"))
            {
                pairs.push((left.to_string(), right.to_string()));
            }
        }
        let model = BPE::builder()
            .vocab_and_merges(bpe_vocab, pairs)
            .ignore_merges(spec.ignore_merges)
            .build()
            .map_err(|e| TokenizerError::Machinery(format!("building the BPE model: {e}")))?;
        let mut steps = Vec::with_capacity(spec.regexes.len() + 1);
        for (index, regex) in spec.regexes.iter().enumerate() {
            let split = Split::new(
                SplitPattern::Regex(regex.clone()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(|e| TokenizerError::BadRegex {
                pre: pre_name.to_string(),
                index,
                what: e.to_string(),
            })?;
            steps.push(PreTokenizerWrapper::Split(split));
        }
        steps.push(PreTokenizerWrapper::ByteLevel(ByteLevel::new(
            false, false, false,
        )));
        let mut inner = tokenizers::Tokenizer::new(model);
        inner.with_pre_tokenizer(Some(PreTokenizerWrapper::Sequence(Sequence::new(steps))));
        Ok(ByteLevelBpe { inner })
    }

    /// Append the ids of one piece of plain text.
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        if text.is_empty() {
            return Ok(());
        }
        let encoding = self
            .inner
            .encode_fast(text, false)
            .map_err(|e| TokenizerError::Machinery(format!("encoding: {e}")))?;
        out.extend_from_slice(encoding.get_ids());
        Ok(())
    }
}
