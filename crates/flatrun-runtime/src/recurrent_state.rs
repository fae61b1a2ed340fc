//! The recurrent-state cache of one sequence of a hybrid model (Qwen3.5):
//! for each gated delta-net layer, the last `d_conv − 1` conv inputs and one
//! `S_v × S_k` state matrix per value head, in f32 (as llama.cpp keeps them).
//!
//! Unlike a KV cache it does not grow with the sequence (a few hundred KiB
//! per layer for real models), so it stays resident in every residency mode.
//! It also cannot be rewound: a state mixes every token seen so far. When a
//! sequence is truncated the state is marked *stale*, and the executor
//! rebuilds it by replaying the kept tokens before the next step.

use flatrun_model::ModelConfig;
use flatrun_model::arch::delta_net::{DeltaNetConfig, DeltaNetState};

/// The recurrent states of every delta-net layer of one sequence.
#[derive(Clone, Debug, Default)]
pub struct RecurrentState {
    /// Per layer: its state, or `None` for attention layers.
    layers: Vec<Option<DeltaNetState>>,
    /// Set when the sequence was truncated: the states describe tokens that
    /// are gone and must be rebuilt from the kept ones.
    stale: bool,
}

impl RecurrentState {
    /// The (zero) states of a model's delta-net layers; empty for models
    /// without any.
    pub fn new(cfg: &ModelConfig) -> RecurrentState {
        RecurrentState::for_layers(cfg.delta_net.as_ref())
    }

    /// The (zero) states of the layers `cfg` marks recurrent.
    pub fn for_layers(cfg: Option<&DeltaNetConfig>) -> RecurrentState {
        let layers = match cfg {
            Some(cfg) => cfg
                .recurrent_layers
                .iter()
                .map(|&recurrent| recurrent.then(|| DeltaNetState::new(cfg)))
                .collect(),
            None => Vec::new(),
        };
        RecurrentState {
            layers,
            stale: false,
        }
    }

    /// Whether the model has any recurrent layer.
    pub fn is_used(&self) -> bool {
        self.layers.iter().any(Option::is_some)
    }

    /// The state of layer `il`, if it is a delta-net layer.
    pub fn layer_mut(&mut self, il: usize) -> Option<&mut DeltaNetState> {
        self.layers.get_mut(il).and_then(Option::as_mut)
    }

    /// Bytes of every layer's state.
    pub fn bytes(&self) -> usize {
        self.layers.iter().flatten().map(DeltaNetState::bytes).sum()
    }

    /// Back to the state before the first token.
    pub fn reset(&mut self) {
        self.layers
            .iter_mut()
            .flatten()
            .for_each(DeltaNetState::reset);
        self.stale = false;
    }

    /// Record that the sequence lost tokens the states have absorbed.
    pub fn mark_stale(&mut self) {
        if self.is_used() {
            self.stale = true;
        }
    }

    /// Whether the states must be rebuilt before the next step.
    pub fn is_stale(&self) -> bool {
        self.stale
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holds_the_recurrent_layers_only_and_tracks_staleness() {
        let cfg = DeltaNetConfig {
            d_conv: 4,
            head_k_dim: 8,
            head_v_dim: 8,
            n_k_heads: 1,
            n_v_heads: 2,
            recurrent_layers: vec![true, false],
        };
        let mut state = RecurrentState::for_layers(Some(&cfg));
        assert!(state.layer_mut(0).is_some() && state.layer_mut(1).is_none());
        // (4 − 1) × (2·8 + 16) conv values + 2 × 8 × 8 state values, f32.
        assert_eq!(state.bytes(), (3 * 32 + 128) * 4);
        state.mark_stale();
        assert!(state.is_stale());
        state.reset();
        assert!(!state.is_stale());
    }
}
