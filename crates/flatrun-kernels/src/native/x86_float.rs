//! x86 kernels for plain-float rows (F32, F16, BF16) against f32 activations
//! (see `x86.rs` for the levels and the safety contract). `float_kernels!` is
//! expanded once per level inside `x86.rs`'s level modules.

/// One token over a group of plain-float rows: two rows per `float_gemv2` call (an odd last
/// row through `float_n::<.., 1>`); otherwise the token tiles of [`tile!`].
macro_rules! float_rows {
    ($t:expr, $es:expr; $rows:expr, $rb:expr, $acts:expr, $out:expr) => {{
        let (rows, rb, acts, out) = ($rows, $rb, $acts, $out);
        if acts.len() == 1 {
            let n = rows.len() / rb;
            // SAFETY: the caller (dispatch) checked the host supports this module's
            // features, and `checked` verified every slice the kernel indexes.
            unsafe {
                for (pair, o) in rows.chunks_exact(2 * rb).zip(out.chunks_exact_mut(2)) {
                    float_gemv2::<$t, $es>(&pair[..rb], &pair[rb..], acts[0], o);
                }
                if n % 2 == 1 {
                    float_n::<$t, $es, 1>(&rows[(n - 1) * rb..], acts, &mut out[n - 1..n]);
                }
            }
        } else {
            tile!(float_n, $t, $es; rows, rb, acts, out)
        }
    }};
}

/// The F32/F16/BF16 kernels of one x86 level and its `rows_f32` entry point, expanded by
/// `x86_level!` inside each level module (`$features`: the level's `#[target_feature]` list).
macro_rules! float_kernels {
    ($features:literal) => {
        /// Eight weights of a plain-float row as f32.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn load8<const T: u32>(p: *const u8) -> __m256 {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                const F16: u32 = GgmlType::F16 as u32;
                const BF16: u32 = GgmlType::BF16 as u32;
                match T {
                    F16 => _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)),
                    BF16 => {
                        let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
                        _mm256_castsi256_ps(_mm256_slli_epi32(h, 16))
                    }
                    _ => _mm256_loadu_ps(p as *const f32),
                }
            }
        }

        /// F32/F16/BF16 row (`ES` bytes per value) × a tile of `N` f32 token rows.
        #[target_feature(enable = $features)]
        unsafe fn float_n<const T: u32, const ES: usize, const N: usize>(
            row: &[u8],
            acts: &[&[f32]],
            out: &mut [f32],
        ) {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let n = row.len() / ES;
                let n8 = n / 8 * 8;
                let mut acc = [_mm256_setzero_ps(); N];
                let mut j = 0;
                while j < n8 {
                    let w = load8::<T>(row.as_ptr().add(j * ES));
                    for t in 0..N {
                        let x = _mm256_loadu_ps(acts.get_unchecked(t).as_ptr().add(j));
                        acc[t] = _mm256_fmadd_ps(w, x, acc[t]);
                    }
                    j += 8;
                }
                for t in 0..N {
                    // Ragged tail, one value at a time.
                    let a = acts.get_unchecked(t);
                    let mut s = hsum(acc[t]);
                    for j in n8..n {
                        s += scalar_value::<T>(row.as_ptr().add(j * ES)) * *a.get_unchecked(j);
                    }
                    out[t] = s;
                }
            }
        }

        /// One token × two adjacent plain-float rows (`ES` bytes per value): each row keeps
        /// [`float_n`]'s order (one 8-lane FMA chain, `hsum`, then the ragged tail one value at
        /// a time), so the outputs are bit for bit those of `float_n::<T, ES, 1>`; the two
        /// independent chains hide each other's FMA latency (one chain of F16 needs 4 cycles
        /// per 16 bytes, less than DRAM delivers).
        #[target_feature(enable = $features)]
        unsafe fn float_gemv2<const T: u32, const ES: usize>(r0: &[u8], r1: &[u8], a: &[f32], out: &mut [f32]) {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                let n = r0.len() / ES;
                let n8 = n / 8 * 8;
                let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                let mut j = 0;
                while j < n8 {
                    // One linear prefetch stream over the pair (see `legacy_gemv2`).
                    super::prefetch_linear(r0.as_ptr().wrapping_add(2 * j * ES), 16 * ES);
                    let x = _mm256_loadu_ps(a.as_ptr().add(j));
                    acc0 = _mm256_fmadd_ps(load8::<T>(r0.as_ptr().add(j * ES)), x, acc0);
                    acc1 = _mm256_fmadd_ps(load8::<T>(r1.as_ptr().add(j * ES)), x, acc1);
                    j += 8;
                }
                let (mut s0, mut s1) = (hsum(acc0), hsum(acc1));
                for j in n8..n {
                    s0 += scalar_value::<T>(r0.as_ptr().add(j * ES)) * *a.get_unchecked(j);
                    s1 += scalar_value::<T>(r1.as_ptr().add(j * ES)) * *a.get_unchecked(j);
                }
                out[0] = s0;
                out[1] = s1;
            }
        }

        /// One weight of a plain-float row as f32.
        #[inline]
        #[target_feature(enable = $features)]
        unsafe fn scalar_value<const T: u32>(p: *const u8) -> f32 {
            // SAFETY: the caller upholds the module's contract (see `x86.rs`): the CPU has
            // this level's features, and every pointer read below lies inside the caller's
            // rows (whole blocks), its activation rows, or this function's own buffers.
            unsafe {
                const F16: u32 = GgmlType::F16 as u32;
                const BF16: u32 = GgmlType::BF16 as u32;
                match T {
                    F16 => half::f16::from_bits(u16::from_le_bytes([*p, *p.add(1)])).to_f32(),
                    BF16 => half::bf16::from_bits(u16::from_le_bytes([*p, *p.add(1)])).to_f32(),
                    _ => f32::from_le_bytes([*p, *p.add(1), *p.add(2), *p.add(3)]),
                }
            }
        }

        /// Rows × f32 tile for F32/F16/BF16.
        pub(crate) fn rows_f32(t: GgmlType, rows: &[u8], rb: usize, acts: &[&[f32]], out: &mut [f32]) {
            if !checked(rows, rb, t.type_size(), 1, acts, out, 4) {
                return super::super::dispatch::each_row(super::super::scalar::dot_f32, t, rows, rb, acts, out);
            }
            const F32: u32 = GgmlType::F32 as u32;
            const F16: u32 = GgmlType::F16 as u32;
            const BF16: u32 = GgmlType::BF16 as u32;
            match t {
                GgmlType::F32 => float_rows!(F32, 4; rows, rb, acts, out),
                GgmlType::F16 => float_rows!(F16, 2; rows, rb, acts, out),
                GgmlType::BF16 => float_rows!(BF16, 2; rows, rb, acts, out),
                _ => super::super::dispatch::each_row(super::super::scalar::dot_f32, t, rows, rb, acts, out),
            }
        }
    };
}
