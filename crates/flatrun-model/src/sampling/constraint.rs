//! Constrained decoding: a [`TokenConstraint`] (a grammar's state) gives the
//! mask of tokens allowed next and follows the tokens chosen. The sampler
//! applies the mask ([`crate::sampling::Sampler::sample_allowed`]); the
//! mask of the next token can be computed on another thread while the
//! layers run ([`TokenConstraint::compute_mask`] is separate from reading
//! it).

use std::fmt::Debug;

/// The state of one constrained generation.
pub trait TokenConstraint: Send {
    /// Computes the mask of the next token (the expensive part; may run on
    /// another thread while the model computes the logits).
    fn compute_mask(&mut self) -> Result<(), String>;
    /// The mask computed last: bit `i % 32` of word `i / 32` allows token `i`.
    /// `None` allows every token.
    fn mask(&self) -> Option<&[u32]>;
    /// Takes the chosen token into the state.
    fn accept(&mut self, token: u32) -> Result<(), String>;
    /// True once the grammar is complete and allows nothing more: the
    /// generation ends.
    fn is_finished(&self) -> bool;
}

/// Makes a fresh [`TokenConstraint`] for each sequence of a request.
pub trait ConstraintFactory: Send + Sync + Debug {
    fn start(&self) -> Result<Box<dyn TokenConstraint>, String>;
}

/// A vocabulary as a grammar sees it: every token's bytes in id order,
/// special tokens (which grammars never produce as text) marked with a
/// leading `0xFF` byte (never valid UTF-8), and the end-of-generation token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Vocabulary {
    pub tokens: Vec<Vec<u8>>,
    pub eos: u32,
}

impl Vocabulary {
    /// The byte that marks a special token.
    pub const SPECIAL: u8 = 0xFF;
}
