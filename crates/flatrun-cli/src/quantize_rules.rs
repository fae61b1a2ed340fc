//! Which type each tensor gets in a quantization mix, as `llama-quantize`
//! chooses it without an importance matrix: the mixes (`Q4_K_M`, `Q3_K_S`…)
//! and their file-type ids, which tensors are quantized at all, the
//! per-tensor upgrades of the `_S`/`_M`/`_L` mixes (attention V, FFN down,
//! attention output, the output head and tied embeddings), and the
//! fallbacks when a row does not hold whole blocks.

use flatrun_format::GgmlType;

/// A quantization mix: its name, `general.file_type` id and base type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mix {
    pub name: &'static str,
    pub ftype: u32,
    pub base: GgmlType,
}

/// The mixes `flatrun quantize` offers.
pub const MIXES: &[Mix] = &[
    Mix {
        name: "Q4_0",
        ftype: 2,
        base: GgmlType::Q4_0,
    },
    Mix {
        name: "Q4_1",
        ftype: 3,
        base: GgmlType::Q4_1,
    },
    Mix {
        name: "Q8_0",
        ftype: 7,
        base: GgmlType::Q8_0,
    },
    Mix {
        name: "Q5_0",
        ftype: 8,
        base: GgmlType::Q5_0,
    },
    Mix {
        name: "Q5_1",
        ftype: 9,
        base: GgmlType::Q5_1,
    },
    Mix {
        name: "Q2_K",
        ftype: 10,
        base: GgmlType::Q2_K,
    },
    Mix {
        name: "Q3_K_S",
        ftype: 11,
        base: GgmlType::Q3_K,
    },
    Mix {
        name: "Q3_K_M",
        ftype: 12,
        base: GgmlType::Q3_K,
    },
    Mix {
        name: "Q3_K_L",
        ftype: 13,
        base: GgmlType::Q3_K,
    },
    Mix {
        name: "Q4_K_S",
        ftype: 14,
        base: GgmlType::Q4_K,
    },
    Mix {
        name: "Q4_K_M",
        ftype: 15,
        base: GgmlType::Q4_K,
    },
    Mix {
        name: "Q5_K_S",
        ftype: 16,
        base: GgmlType::Q5_K,
    },
    Mix {
        name: "Q5_K_M",
        ftype: 17,
        base: GgmlType::Q5_K,
    },
    Mix {
        name: "Q6_K",
        ftype: 18,
        base: GgmlType::Q6_K,
    },
    Mix {
        name: "IQ4_NL",
        ftype: 25,
        base: GgmlType::IQ4_NL,
    },
    Mix {
        name: "Q1_0",
        ftype: 40,
        base: GgmlType::Q1_0,
    },
];

impl Mix {
    /// The mix named `name` (case-insensitive; `Q3_K` is `Q3_K_M`, `Q4_K`
    /// `Q4_K_M`, `Q5_K` `Q5_K_M`, as in llama-quantize).
    pub fn parse(name: &str) -> Option<Mix> {
        let upper = name.to_ascii_uppercase();
        let upper = match upper.as_str() {
            "Q3_K" => "Q3_K_M",
            "Q4_K" => "Q4_K_M",
            "Q5_K" => "Q5_K_M",
            other => other,
        };
        MIXES.iter().copied().find(|m| m.name == upper)
    }

    fn is(&self, name: &str) -> bool {
        self.name == name
    }
}

/// What kind of tensor a name is, for the rules.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Category {
    TokenEmbd,
    Output,
    AttnV,
    AttnK,
    AttnQ,
    AttnOutput,
    FfnUp,
    FfnGate,
    FfnDown,
    Other,
}

fn category(name: &str) -> Category {
    match name {
        "output.weight" => Category::Output,
        "token_embd.weight" | "per_layer_token_embd.weight" => Category::TokenEmbd,
        _ if name.contains("attn_qkv.weight")
            || name.contains("attn_kv_b.weight")
            || name.contains("attn_v.weight") =>
        {
            Category::AttnV
        }
        _ if name.contains("attn_k.weight") => Category::AttnK,
        _ if name.contains("attn_q.weight") => Category::AttnQ,
        _ if name.contains("attn_output.weight") => Category::AttnOutput,
        _ if name.contains("ffn_up") => Category::FfnUp,
        _ if name.contains("ffn_gate") => Category::FfnGate,
        _ if name.contains("ffn_down") => Category::FfnDown,
        _ => Category::Other,
    }
}

/// Whether llama-quantize quantizes a tensor at all: 2-D or more, named
/// `*weight`, not a norm, a router, a positional embedding or one of the
/// small special tensors it keeps as they are.
pub fn quantizable(name: &str, n_dims: usize) -> bool {
    const KEEP: &[&str] = &[
        "_norm.weight",
        "ffn_gate_inp.weight",
        "ffn_gate_tid2eid.weight",
        "altup",
        "laurel",
        "per_layer_model_proj",
        "ssm_conv1d",
        "shortconv.conv.weight",
        "indexer.k_proj.weight",
        "indexer.q_proj.weight",
        "time_mix_",
        "attn_rel_b.weight",
        ".position_embd",
        ".rel_pos",
        ".patch_embd",
        ".patch_merger",
    ];
    n_dims >= 2
        && name.ends_with("weight")
        && !KEEP.iter().any(|k| name.contains(k))
        && name != "position_embd.weight"
        && name != "token_types.weight"
}

/// Facts about the model the rules read.
#[derive(Clone, Copy, Debug)]
pub struct ModelFacts {
    pub falcon: bool,
    /// Query heads per KV head.
    pub n_gqa: usize,
    pub n_expert: usize,
    pub n_layer: usize,
    /// No `output.weight`: the embeddings double as the output head.
    pub tied_embeddings: bool,
    /// How many attention-V-like tensors the model has.
    pub n_attention_wv: usize,
}

/// The per-tensor choice, with the counters llama-quantize keeps while it
/// walks the tensors in its order (see [`llama_order`]).
pub struct Chooser {
    mix: Mix,
    facts: ModelFacts,
    i_attention_wv: usize,
    i_ffn_down: usize,
    i_ffn_gate: usize,
    i_ffn_up: usize,
}

fn use_more_bits(i: usize, n: usize) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i as isize - (n / 8) as isize) % 3 == 2
}

impl Chooser {
    pub fn new(mix: Mix, facts: ModelFacts) -> Chooser {
        Chooser {
            mix,
            facts,
            i_attention_wv: 0,
            i_ffn_down: 0,
            i_ffn_gate: 0,
            i_ffn_up: 0,
        }
    }

    /// The layer of a tensor for the FFN rules: the running count, or for
    /// MoE models the `blk.N.` of its name.
    fn layer(&self, counter: usize, name: &str) -> usize {
        if self.facts.n_expert > 1 {
            name.strip_prefix("blk.")
                .and_then(|r| r.split('.').next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(counter)
        } else {
            counter
        }
    }

    /// The type of tensor `name` (ggml dims `ne`), currently `current`;
    /// `None` when its rows fit neither the type nor a fallback.
    pub fn choose(&mut self, name: &str, ne: &[u64], current: GgmlType) -> Option<GgmlType> {
        if !quantizable(name, ne.len()) {
            return Some(current);
        }
        let ty = self.by_role(name, ne[0]);
        fallback(ty, ne[0])
    }

    fn by_role(&mut self, name: &str, ne0: u64) -> GgmlType {
        let m = self.mix;
        let f = self.facts;
        let mut ty = m.base;
        let cat = category(name);
        if cat == Category::Output || (f.tied_embeddings && cat == Category::TokenEmbd) {
            if f.falcon || !ne0.is_multiple_of(ty.block_size() as u64) {
                ty = GgmlType::Q8_0;
            } else if ty != GgmlType::Q8_0 {
                ty = GgmlType::Q6_K;
            }
            return ty;
        }
        match cat {
            Category::TokenEmbd => {}
            Category::AttnV => {
                if m.is("Q2_K") {
                    ty = if f.n_gqa >= 4 {
                        GgmlType::Q4_K
                    } else {
                        GgmlType::Q3_K
                    };
                } else if m.is("Q3_K_M") {
                    ty = if self.i_attention_wv < 2 {
                        GgmlType::Q5_K
                    } else {
                        GgmlType::Q4_K
                    };
                } else if m.is("Q3_K_L") || (m.is("IQ4_NL") && f.n_gqa >= 4) {
                    ty = GgmlType::Q5_K;
                } else if (m.is("Q4_K_M") || m.is("Q5_K_M"))
                    && use_more_bits(self.i_attention_wv, f.n_attention_wv)
                {
                    ty = GgmlType::Q6_K;
                } else if m.is("Q4_K_S") && self.i_attention_wv < 4 {
                    ty = GgmlType::Q5_K;
                }
                if f.n_expert == 8 {
                    ty = GgmlType::Q8_0;
                }
                self.i_attention_wv += 1;
            }
            Category::AttnK => {
                if f.n_expert == 8 {
                    ty = GgmlType::Q8_0;
                }
            }
            Category::AttnQ | Category::Other => {}
            Category::FfnDown => {
                let i = self.layer(self.i_ffn_down, name);
                let n = f.n_layer;
                if m.is("Q2_K") {
                    ty = GgmlType::Q3_K;
                } else if m.is("Q3_K_M") {
                    ty = if i < n / 16 {
                        GgmlType::Q5_K
                    } else if !f.falcon || use_more_bits(i, n) {
                        GgmlType::Q4_K
                    } else {
                        GgmlType::Q3_K
                    };
                } else if m.is("Q3_K_L") {
                    ty = if f.falcon {
                        GgmlType::Q4_K
                    } else {
                        GgmlType::Q5_K
                    };
                } else if m.is("Q4_K_M") {
                    if f.falcon {
                        ty = if i < n / 16 {
                            GgmlType::Q6_K
                        } else if use_more_bits(i, n) {
                            GgmlType::Q5_K
                        } else {
                            GgmlType::Q4_K
                        };
                    } else if use_more_bits(i, n) {
                        ty = GgmlType::Q6_K;
                    }
                } else if i < n / 8 && m.is("IQ4_NL") {
                    ty = GgmlType::Q5_K;
                } else if m.is("Q5_K_M") && use_more_bits(i, n) {
                    ty = GgmlType::Q6_K;
                } else if m.is("Q4_K_S") && !f.falcon && i < n / 8 {
                    ty = GgmlType::Q5_K;
                }
                self.i_ffn_down += 1;
            }
            Category::AttnOutput => {
                if !f.falcon {
                    if f.n_expert == 8 {
                        if ["Q2_K", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M"]
                            .iter()
                            .any(|n| m.is(n))
                        {
                            ty = GgmlType::Q5_K;
                        }
                    } else if m.is("Q2_K") {
                        ty = GgmlType::Q3_K;
                    } else if m.is("Q3_K_M") {
                        ty = GgmlType::Q4_K;
                    } else if m.is("Q3_K_L") {
                        ty = GgmlType::Q5_K;
                    }
                } else if m.is("Q3_K_L") {
                    ty = GgmlType::Q4_K;
                }
            }
            Category::FfnGate => self.i_ffn_gate += 1,
            Category::FfnUp => self.i_ffn_up += 1,
            Category::Output => {}
        }
        // The fused QKV projection is also an attention-V-like tensor above;
        // llama-quantize's separate QKV branch is unreachable for it.
        ty
    }
}

/// llama-quantize's fallback when a row (`ne0` values) does not hold whole
/// blocks of `ty`: K-quants to a 32-block type (Q2_K and Q3_K to Q4_0,
/// Q4_K to Q5_0, Q5_K to Q5_1, Q6_K to Q8_0), then F16.
/// Types of other block sizes (Q1_0's 128) have no fallback: `None`.
pub fn fallback(ty: GgmlType, ne0: u64) -> Option<GgmlType> {
    if ne0.is_multiple_of(ty.block_size() as u64) {
        return Some(ty);
    }
    let next = match ty {
        GgmlType::Q2_K | GgmlType::Q3_K => GgmlType::Q4_0,
        GgmlType::Q4_K => GgmlType::Q5_0,
        GgmlType::Q5_K => GgmlType::Q5_1,
        GgmlType::Q6_K => GgmlType::Q8_0,
        other if other.block_size() <= 32 => other,
        _ => return None,
    };
    Some(if ne0.is_multiple_of(next.block_size() as u64) {
        next
    } else {
        GgmlType::F16
    })
}

/// The order llama-quantize walks (and writes) tensors: those outside the
/// layers first, then by layer number, by name within each.
pub fn llama_order(names: &[&str]) -> Vec<usize> {
    let layer = |n: &str| -> i64 {
        n.strip_prefix("blk.")
            .and_then(|r| r.split('.').next())
            .and_then(|d| d.parse().ok())
            .unwrap_or(-1)
    };
    let mut order: Vec<usize> = (0..names.len()).collect();
    order.sort_by(|&a, &b| {
        layer(names[a])
            .cmp(&layer(names[b]))
            .then_with(|| names[a].cmp(names[b]))
    });
    order
}

#[cfg(test)]
mod tests {
    use super::*;

    fn facts(n_layer: usize) -> ModelFacts {
        ModelFacts {
            falcon: false,
            n_gqa: 3,
            n_expert: 0,
            n_layer,
            tied_embeddings: true,
            n_attention_wv: n_layer,
        }
    }

    #[test]
    fn q4_k_m_gives_more_bits_to_some_v_and_down_layers_and_the_head() {
        let mut c = Chooser::new(Mix::parse("q4_k_m").unwrap(), facts(24));
        assert_eq!(
            c.choose("token_embd.weight", &[1024, 1000], GgmlType::F16),
            Some(GgmlType::Q6_K)
        );
        // A head whose rows do not hold K-quant blocks is Q8_0.
        assert_eq!(
            c.choose("output.weight", &[896, 1000], GgmlType::F16),
            Some(GgmlType::Q8_0)
        );
        assert_eq!(
            c.choose("blk.0.attn_norm.weight", &[896], GgmlType::F32),
            Some(GgmlType::F32)
        );
        // Layers 0..3, 21..24 and every third in between get Q6_K.
        let v: Vec<Option<GgmlType>> = (0..24)
            .map(|_| c.choose("blk.x.attn_v.weight", &[1024, 128], GgmlType::F16))
            .collect();
        assert_eq!(v[0], Some(GgmlType::Q6_K));
        assert_eq!(v[3], Some(GgmlType::Q4_K));
        assert_eq!(v[5], Some(GgmlType::Q6_K));
        assert_eq!(v[23], Some(GgmlType::Q6_K));
        assert_eq!(
            c.choose("blk.0.attn_q.weight", &[1024, 1024], GgmlType::F16),
            Some(GgmlType::Q4_K)
        );
    }

    #[test]
    fn rows_that_do_not_hold_a_block_fall_back() {
        assert_eq!(fallback(GgmlType::Q4_K, 576), Some(GgmlType::Q5_0));
        assert_eq!(fallback(GgmlType::Q2_K, 576), Some(GgmlType::Q4_0));
        assert_eq!(fallback(GgmlType::Q3_K, 576), Some(GgmlType::Q4_0));
        assert_eq!(fallback(GgmlType::Q6_K, 576), Some(GgmlType::Q8_0));
        assert_eq!(fallback(GgmlType::Q5_K, 576), Some(GgmlType::Q5_1));
        assert_eq!(fallback(GgmlType::Q4_K, 100), Some(GgmlType::F16));
        assert_eq!(fallback(GgmlType::Q4_0, 100), Some(GgmlType::F16));
        assert_eq!(fallback(GgmlType::Q4_K, 512), Some(GgmlType::Q4_K));
        assert_eq!(fallback(GgmlType::Q1_0, 576), None);
    }

    #[test]
    fn llama_order_puts_globals_first_then_layers() {
        let names = [
            "blk.10.a",
            "output.weight",
            "blk.2.b",
            "blk.2.a",
            "token_embd.weight",
        ];
        let order: Vec<&str> = llama_order(&names).into_iter().map(|i| names[i]).collect();
        assert_eq!(
            order,
            [
                "output.weight",
                "token_embd.weight",
                "blk.2.a",
                "blk.2.b",
                "blk.10.a"
            ]
        );
    }

    #[test]
    fn mixes_parse_by_name() {
        assert_eq!(Mix::parse("Q4_K").unwrap().name, "Q4_K_M");
        assert_eq!(Mix::parse("iq4_nl").unwrap().ftype, 25);
        assert!(Mix::parse("Q7_X").is_none());
    }
}
