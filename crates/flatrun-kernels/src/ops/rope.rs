//! Rotary position embedding, matching ggml's `ggml_rope_ext` (forward).

/// Which dimensions of a head form a rotated pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeLayout {
    /// Adjacent pairs `(2i, 2i+1)`: llama-architecture GGUFs (whose Q/K rows the converter permuted).
    Normal,
    /// Halves `(i, i + n_rot/2)`: NeoX, Qwen2/3, Gemma 3, Hugging Face llama.
    Neox,
}

/// How positions are stretched beyond the trained context.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor` (ggml `freq_scale = 1/factor`).
    Linear {
        factor: f32,
    },
    /// YaRN: interpolate low frequencies, extrapolate high ones, ramp in between.
    Yarn {
        factor: f32,
        orig_ctx: usize,
        ext_factor: f32,
        attn_factor: f32,
        beta_fast: f32,
        beta_slow: f32,
    },
    /// Llama 3.1: per-frequency divisors (see [`llama3_freq_factors`]); used when
    /// [`RopeConfig::freq_factors`] is `None` (a GGUF carries them as `rope_freqs`).
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        orig_ctx: usize,
    },
}

/// Everything RoPE needs besides the positions.
#[derive(Clone, Debug, PartialEq)]
pub struct RopeConfig {
    pub layout: RopeLayout,
    /// Rotated dimensions per head (≤ head_dim; the rest pass through).
    pub n_rot: usize,
    pub theta_base: f32,
    pub scaling: RopeScaling,
    /// Per-pair frequency divisors (`rope_freqs`), `n_rot / 2` of them.
    pub freq_factors: Option<Vec<f32>>,
}

/// The Llama 3.1 frequency divisors for `n_rot` rotated dims (what the GGUF converter
/// stores as `rope_freqs`): 1 for short wavelengths, `factor` for long ones, a smooth
/// blend in between.
pub fn llama3_freq_factors(
    n_rot: usize,
    theta_base: f32,
    factor: f32,
    low_freq_factor: f32,
    high_freq_factor: f32,
    orig_ctx: usize,
) -> Vec<f32> {
    let low_freq_wavelen = orig_ctx as f32 / low_freq_factor;
    let high_freq_wavelen = orig_ctx as f32 / high_freq_factor;
    (0..n_rot / 2)
        .map(|i| {
            let freq = 1.0 / theta_base.powf((2 * i) as f32 / n_rot as f32);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_freq_wavelen {
                1.0
            } else if wavelen > low_freq_wavelen {
                factor
            } else {
                let smooth = (orig_ctx as f32 / wavelen - low_freq_factor)
                    / (high_freq_factor - low_freq_factor);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// YaRN's correction dimension: the rotated dim whose wavelength spans `n_rot_turns` turns of the original context.
fn yarn_corr_dim(n_dims: usize, orig_ctx: usize, n_rot_turns: f32, base: f32) -> f32 {
    n_dims as f32 * (orig_ctx as f32 / (n_rot_turns * 2.0 * std::f32::consts::PI)).ln()
        / (2.0 * base.ln())
}

/// Parameters of ggml's `rope_yarn` derived from the config once per call.
struct ThetaParams {
    freq_scale: f32,
    ext_factor: f32,
    mscale: f32,
    corr_dims: [f32; 2],
    theta_scale: f32,
}

impl ThetaParams {
    fn new(cfg: &RopeConfig) -> Self {
        let n_dims = cfg.n_rot;
        let theta_scale = cfg.theta_base.powf(-2.0 / n_dims as f32);
        let (freq_scale, ext_factor, mscale, corr_dims) = match cfg.scaling {
            RopeScaling::None | RopeScaling::Llama3 { .. } => (1.0, 0.0, 1.0, [0.0, 0.0]),
            RopeScaling::Linear { factor } => (1.0 / factor, 0.0, 1.0, [0.0, 0.0]),
            RopeScaling::Yarn {
                factor,
                orig_ctx,
                ext_factor,
                attn_factor,
                beta_fast,
                beta_slow,
            } => {
                let start = yarn_corr_dim(n_dims, orig_ctx, beta_fast, cfg.theta_base).floor();
                let end = yarn_corr_dim(n_dims, orig_ctx, beta_slow, cfg.theta_base).ceil();
                let corr = [start.max(0.0), end.min(n_dims as f32 - 1.0)];
                (1.0 / factor, ext_factor, attn_factor, corr)
            }
        };
        ThetaParams {
            freq_scale,
            ext_factor,
            mscale,
            corr_dims,
            theta_scale,
        }
    }

    /// cos/sin of pair `i0/2` at extrapolated angle `theta_extrap` (ggml `rope_yarn`).
    fn cos_sin(&self, theta_extrap: f32, i0: usize) -> (f32, f32) {
        let (theta, mscale) = self.angle(theta_extrap, i0);
        (theta.cos() * mscale, theta.sin() * mscale)
    }

    /// The angle of pair `i0/2` at extrapolated angle `theta_extrap`, and
    /// the magnitude ggml's `rope_yarn` multiplies cos and sin by (YaRN's
    /// attention factor; 1 otherwise). The angle is linear in the position.
    fn angle(&self, theta_extrap: f32, i0: usize) -> (f32, f32) {
        let theta_interp = self.freq_scale * theta_extrap;
        let mut theta = theta_interp;
        let mut mscale = self.mscale;
        if self.ext_factor != 0.0 {
            // Ramp from extrapolation (high frequencies) to interpolation (low ones).
            let [low, high] = self.corr_dims;
            let y = ((i0 / 2) as f32 - low) / (high - low).max(0.001);
            let ramp_mix = (1.0 - y.clamp(0.0, 1.0)) * self.ext_factor;
            theta = theta_interp * (1.0 - ramp_mix) + theta_extrap * ramp_mix;
            mscale *= 1.0 + 0.1 * (1.0 / self.freq_scale).ln();
        }
        (theta, mscale)
    }
}

/// What [`rope`] and [`rope_shift`] derive from a config once per call:
/// the rotated dims, ggml's `rope_yarn` parameters and the per-pair
/// frequency divisors.
struct Angles<'c> {
    n_rot: usize,
    params: ThetaParams,
    freq_factors: Option<std::borrow::Cow<'c, [f32]>>,
}

impl<'c> Angles<'c> {
    /// `None` when nothing is rotated.
    fn new(cfg: &'c RopeConfig, head_dim: usize) -> Option<Angles<'c>> {
        let n_rot = cfg.n_rot.min(head_dim) & !1;
        if n_rot == 0 || head_dim == 0 {
            return None;
        }
        let params = ThetaParams::new(&RopeConfig {
            n_rot,
            ..cfg.clone()
        });
        let freq_factors = match (&cfg.freq_factors, cfg.scaling) {
            (Some(f), _) => Some(std::borrow::Cow::Borrowed(&f[..])),
            (
                None,
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    orig_ctx,
                },
            ) => Some(std::borrow::Cow::Owned(llama3_freq_factors(
                n_rot,
                cfg.theta_base,
                factor,
                low_freq_factor,
                high_freq_factor,
                orig_ctx,
            ))),
            (None, _) => None,
        };
        Some(Angles {
            n_rot,
            params,
            freq_factors,
        })
    }

    /// Fills `table` (`n_rot / 2` pairs) with the (cos, sin) of every pair
    /// at position `pos`; `scaled`: times YaRN's magnitude, as ggml's rope.
    fn table(&self, pos: f32, scaled: bool, table: &mut [(f32, f32)]) {
        // Angles: theta_i = pos * base^(-2i/n_rot) / freq_factor_i.
        let mut theta = pos;
        for (i, c) in table.iter_mut().enumerate() {
            let ff = self
                .freq_factors
                .as_deref()
                .and_then(|f| f.get(i).copied())
                .unwrap_or(1.0);
            *c = if scaled {
                self.params.cos_sin(theta / ff, 2 * i)
            } else {
                let (angle, _) = self.params.angle(theta / ff, 2 * i);
                (angle.cos(), angle.sin())
            };
            theta *= self.params.theta_scale;
        }
    }
}

/// Rotates each `head_dim`-wide head of `token` by the pairs of `table`.
fn rotate_heads(token: &mut [f32], head_dim: usize, layout: RopeLayout, table: &[(f32, f32)]) {
    let (stride, pair_gap) = match layout {
        RopeLayout::Normal => (2, 1),
        RopeLayout::Neox => (1, table.len()),
    };
    for head in token.chunks_exact_mut(head_dim) {
        for (i, &(cos, sin)) in table.iter().enumerate() {
            let a = i * stride;
            let b = a + pair_gap;
            let (x0, x1) = (head[a], head[b]);
            // As ggml's compiled rotation (GCC contracts it to fused multiply-adds):
            // x0·cos − x1·sin and x0·sin + x1·cos, each with one product fused.
            head[a] = x0.mul_add(cos, -(x1 * sin));
            head[b] = x0.mul_add(sin, x1 * cos);
        }
    }
}

/// Rotate `x` (n_tokens × n_heads × head_dim) in place; token `t` sits at `positions[t]`.
pub fn rope(x: &mut [f32], n_heads: usize, head_dim: usize, positions: &[usize], cfg: &RopeConfig) {
    // Tokens are independent: split them over the pool when there are many.
    let token_len = n_heads * head_dim;
    let n = positions
        .len()
        .min(x.len().checked_div(token_len).unwrap_or(0));
    super::rows::par_rows_mut(&mut x[..n * token_len], token_len, |tokens, rows| {
        rope_serial(rows, n_heads, head_dim, &positions[tokens], cfg)
    });
}

/// [`rope`] on the calling thread.
fn rope_serial(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    positions: &[usize],
    cfg: &RopeConfig,
) {
    let Some(angles) = Angles::new(cfg, head_dim) else {
        return;
    };
    // One (cos, sin) table per token, shared by its heads.
    let mut table = vec![(0f32, 0f32); angles.n_rot / 2];
    let token_len = n_heads * head_dim;
    for (t, &pos) in positions.iter().enumerate() {
        let Some(token) = x.get_mut(t * token_len..(t + 1) * token_len) else {
            break;
        };
        angles.table(pos as f32, true, &mut table);
        rotate_heads(token, head_dim, cfg.layout, &table);
    }
}

/// Moves rows that [`rope`] rotated at position `p` to position `p + delta`
/// (`delta` may be negative): every whole token of `x` (n_tokens × n_heads ×
/// head_dim) is rotated by the angles of position `delta`, which is the
/// angle difference because every angle is linear in the position. A pure
/// rotation: YaRN's magnitude, which [`rope`] applied once, is not applied
/// again (a shifted key keeps its norm).
pub fn rope_shift(x: &mut [f32], n_heads: usize, head_dim: usize, delta: i64, cfg: &RopeConfig) {
    let Some(angles) = Angles::new(cfg, head_dim) else {
        return;
    };
    let token_len = n_heads * head_dim;
    if token_len == 0 {
        return;
    }
    // One table for every token: they all move by the same delta.
    let mut table = vec![(0f32, 0f32); angles.n_rot / 2];
    angles.table(delta as f32, false, &mut table);
    let whole = x.len() / token_len * token_len;
    super::rows::par_rows_mut(&mut x[..whole], token_len, |_, rows| {
        for token in rows.chunks_exact_mut(token_len) {
            rotate_heads(token, head_dim, cfg.layout, &table);
        }
    });
}
