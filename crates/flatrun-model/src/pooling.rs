//! How a sequence's final hidden states become one embedding vector: the
//! GGUF key `{arch}.pooling_type`, as llama.cpp numbers it (0 none, 1 mean,
//! 2 cls, 3 last, 4 rank). A decoder model without the key is mean pooled.

use crate::error::ModelError;

/// The pooling of a model's final-normed hidden states.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Pooling {
    /// One vector per token, no sequence embedding.
    None,
    /// The mean over every position (the default).
    #[default]
    Mean,
    /// The first position's state.
    Cls,
    /// The last position's state (causal embedding models such as
    /// Qwen3-Embedding).
    Last,
    /// A reranker's classification head.
    Rank,
}

impl Pooling {
    /// The pooling for llama.cpp's `pooling_type` code.
    pub fn from_code(code: u64) -> Result<Pooling, ModelError> {
        Ok(match code {
            0 => Pooling::None,
            1 => Pooling::Mean,
            2 => Pooling::Cls,
            3 => Pooling::Last,
            4 => Pooling::Rank,
            other => {
                return Err(ModelError::BadValue {
                    key: "pooling_type".into(),
                    what: format!("unknown pooling type {other} (llama.cpp defines 0 to 4)"),
                });
            }
        })
    }

    /// Its name as `inspect` and error messages print it.
    pub fn name(self) -> &'static str {
        match self {
            Pooling::None => "none",
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
            Pooling::Rank => "rank",
        }
    }

    /// Whether one vector per sequence comes out of it.
    pub fn pools(self) -> bool {
        matches!(self, Pooling::Mean | Pooling::Cls | Pooling::Last)
    }

    /// The L2-normalized pooled vector of `states` (`positions × dim`, row
    /// major); `None` for the poolings that give no sequence vector, or
    /// when there are no positions. Sums run in f64; a zero vector stays
    /// zero.
    pub fn pool(self, states: &[f32], dim: usize) -> Option<Vec<f32>> {
        if dim == 0 || states.len() < dim || !self.pools() {
            return None;
        }
        let rows = states.len() / dim;
        let picked = match self {
            Pooling::Cls => &states[..dim],
            Pooling::Last => &states[(rows - 1) * dim..rows * dim],
            _ => &states[..rows * dim],
        };
        let mut sum = vec![0.0f64; dim];
        for row in picked.chunks_exact(dim) {
            for (s, &x) in sum.iter_mut().zip(row) {
                *s += f64::from(x);
            }
        }
        let norm = sum.iter().map(|x| x * x).sum::<f64>().sqrt();
        let scale = if norm > 0.0 { 1.0 / norm } else { 0.0 };
        Some(sum.iter().map(|&x| (x * scale) as f32).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STATES: [f32; 6] = [3.0, 0.0, 0.0, 4.0, 1.0, 1.0];

    #[test]
    fn each_pooling_picks_its_rows_and_normalizes() {
        let mean = Pooling::Mean.pool(&STATES, 2).unwrap();
        let s = (16.0f32 + 25.0).sqrt();
        assert!((mean[0] - 4.0 / s).abs() < 1e-6 && (mean[1] - 5.0 / s).abs() < 1e-6);
        assert_eq!(Pooling::Cls.pool(&STATES, 2).unwrap(), vec![1.0, 0.0]);
        let last = Pooling::Last.pool(&STATES, 2).unwrap();
        assert!((last[0] - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6);
        assert_eq!(Pooling::None.pool(&STATES, 2), None);
        assert_eq!(Pooling::Rank.pool(&STATES, 2), None);
        assert_eq!(Pooling::Mean.pool(&[], 2), None);
        assert_eq!(Pooling::Mean.pool(&[0.0, 0.0], 2).unwrap(), vec![0.0, 0.0]);
    }

    /// A llama GGUF header with `pooling_type` set to `code`, if any.
    fn llama_config(code: Option<u32>) -> crate::error::Result<crate::ModelConfig> {
        use flatrun_format::{MetaValue, Metadata};
        let mut entries = vec![
            (
                "general.architecture".to_string(),
                MetaValue::String("llama".into()),
            ),
            ("llama.block_count".into(), MetaValue::U32(2)),
            ("llama.embedding_length".into(), MetaValue::U32(64)),
            ("llama.feed_forward_length".into(), MetaValue::U32(128)),
            ("llama.attention.head_count".into(), MetaValue::U32(4)),
            (
                "llama.attention.layer_norm_rms_epsilon".into(),
                MetaValue::F32(1e-5),
            ),
        ];
        if let Some(code) = code {
            entries.push(("llama.pooling_type".into(), MetaValue::U32(code)));
        }
        crate::ModelConfig::from_gguf(&Metadata { entries })
    }

    #[test]
    fn gguf_pooling_type_is_read_and_defaults_to_mean() {
        assert_eq!(llama_config(None).unwrap().pooling, Pooling::Mean);
        assert_eq!(llama_config(Some(3)).unwrap().pooling, Pooling::Last);
        assert_eq!(llama_config(Some(2)).unwrap().pooling, Pooling::Cls);
        let error = llama_config(Some(7)).unwrap_err().to_string();
        assert!(error.contains("pooling"), "{error}");
    }

    #[test]
    fn codes_follow_llama_cpp() {
        let names: Vec<_> = (0..5)
            .map(|c| Pooling::from_code(c).unwrap().name())
            .collect();
        assert_eq!(names, ["none", "mean", "cls", "last", "rank"]);
        assert!(Pooling::from_code(9).is_err());
    }
}
