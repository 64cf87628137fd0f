//! Element-wise and row-wise ops of a transformer layer, on f32 rows. One implementation of
//! each (RMSNorm, RoPE, softmax, activations), shared by every architecture.

/// `out = x / rms(x) * w` over one row.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    let n = x.len();
    let ss: f32 = x.iter().map(|v| v * v).sum::<f32>() / n as f32;
    let scale = 1.0 / (ss + eps).sqrt();
    for ((o, v), g) in out.iter_mut().zip(x).zip(w) {
        *o = v * scale * g;
    }
}

/// In-place RMSNorm of one row.
pub fn rms_norm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let n = x.len();
    let ss: f32 = x.iter().map(|v| v * v).sum::<f32>() / n as f32;
    let scale = 1.0 / (ss + eps).sqrt();
    for (v, g) in x.iter_mut().zip(w) {
        *v *= scale * g;
    }
}

/// RMSNorm of every `w.len()`-wide row of `x` into `out`.
pub fn rms_norm_rows(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    for (xr, or) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
        rms_norm(xr, w, eps, or);
    }
}

/// In-place RMSNorm of every `w.len()`-wide row of `x`.
pub fn rms_norm_rows_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_exact_mut(w.len()) {
        rms_norm_inplace(row, w, eps);
    }
}

/// How RoPE pairs the dimensions of a head.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): llama.cpp's "normal" RoPE (Llama GGUFs have Q/K permuted for it).
    Interleaved,
    /// Halves (i, i + d/2): GPT-NeoX style (Gemma, Qwen2).
    Neox,
}

/// Inverse frequencies `base^(-2i/rot_dim)` for `i < rot_dim/2`.
pub fn rope_inv_freq(base: f32, rot_dim: usize) -> Vec<f32> {
    (0..rot_dim / 2)
        .map(|i| (base as f64).powf(-2.0 * i as f64 / rot_dim as f64) as f32)
        .collect()
}

/// Fills `cs` with (cos, sin) of `pos * inv_freq[i]`.
pub fn rope_cos_sin(pos: usize, inv_freq: &[f32], cs: &mut [(f32, f32)]) {
    for (c, f) in cs.iter_mut().zip(inv_freq) {
        let theta = pos as f64 * *f as f64;
        let (s, co) = theta.sin_cos();
        *c = (co as f32, s as f32);
    }
}

/// Rotates one head in place with precomputed (cos, sin) pairs (only the first
/// `2 * cs.len()` dimensions rotate).
pub fn rope_apply(head: &mut [f32], cs: &[(f32, f32)], style: RopeStyle) {
    let half = cs.len();
    match style {
        RopeStyle::Interleaved => {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = (head[2 * i], head[2 * i + 1]);
                head[2 * i] = a * c - b * s;
                head[2 * i + 1] = a * s + b * c;
            }
        }
        RopeStyle::Neox => {
            for (i, &(c, s)) in cs.iter().enumerate() {
                let (a, b) = (head[i], head[i + half]);
                head[i] = a * c - b * s;
                head[i + half] = a * s + b * c;
            }
        }
    }
}

/// In-place softmax of one row.
pub fn softmax(x: &mut [f32]) {
    let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0;
    for v in x.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU, tanh approximation (as Gemma's `gelu_pytorch_tanh`).
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// `gate[i] = act(gate[i]) * up[i]`.
pub fn glu(gate: &mut [f32], up: &[f32], act: fn(f32) -> f32) {
    for (g, u) in gate.iter_mut().zip(up) {
        *g = act(*g) * u;
    }
}

/// `x[i] += y[i]`.
pub fn add_inplace(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

/// Dot product of two f32 rows with the fastest kernel this CPU has.
pub fn dot_fast(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let bytes = |v: &[f32]| {
        // SAFETY: f32 has no padding and u8 has alignment 1: the bytes of `v` are valid u8s
        // for as long as `v` is borrowed.
        unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), n * 4) }
    };
    (crate::kernels(crate::GgmlType::F32).vec_dot)(n, bytes(a), bytes(b))
}

/// True when the kernel table is at an AVX2 level or above (so AVX2 and FMA were detected).
#[cfg(target_arch = "x86_64")]
fn avx2_level() -> bool {
    crate::isa() != crate::Isa::Scalar
}

/// True when the kernel table is at a NEON level (not forced to scalar).
#[cfg(target_arch = "aarch64")]
fn neon_level() -> bool {
    crate::isa() != crate::Isa::Scalar
}

/// `gate[i] = silu(gate[i]) * up[i]` with the fastest kernel this CPU has.
pub fn glu_silu(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_level() {
            // SAFETY: the kernel table chose an AVX2 level only after detecting AVX2 and FMA.
            unsafe { crate::avx2::ops::glu::<false>(gate, up) };
            return;
        }
    }
    #[cfg(target_arch = "aarch64")]
    if neon_level() {
        crate::neon::ops::glu::<false>(gate, up);
        return;
    }
    glu(gate, up, silu);
}

/// `gate[i] = gelu_tanh(gate[i]) * up[i]` with the fastest kernel this CPU has.
pub fn glu_gelu_tanh(gate: &mut [f32], up: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_level() {
            // SAFETY: as in `glu_silu`.
            unsafe { crate::avx2::ops::glu::<true>(gate, up) };
            return;
        }
    }
    #[cfg(target_arch = "aarch64")]
    if neon_level() {
        crate::neon::ops::glu::<true>(gate, up);
        return;
    }
    glu(gate, up, gelu_tanh);
}

/// In-place softmax of one row with the fastest kernel this CPU has.
pub fn softmax_fast(x: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_level() {
            // SAFETY: as in `glu_silu`.
            unsafe { crate::avx2::ops::softmax(x) };
            return;
        }
    }
    #[cfg(target_arch = "aarch64")]
    if neon_level() {
        crate::neon::ops::softmax(x);
        return;
    }
    softmax(x);
}

/// Asks the CPU to bring every 64-byte line of `s` into cache (a hint: no effect on results,
/// nothing on other architectures). For data read soon in a pattern the hardware prefetcher
/// does not follow, such as a sequence's KV rows, which the weights stream out of cache
/// between decode steps.
pub fn prefetch<T>(s: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let p = s.as_ptr().cast::<i8>();
        let bytes = std::mem::size_of_val(s);
        let mut off = 0;
        while off < bytes {
            // SAFETY: a prefetch never faults; the address is inside `s`.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.add(off)) };
            off += 64;
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        let p = s.as_ptr().cast::<u8>();
        let bytes = std::mem::size_of_val(s);
        let mut off = 0;
        while off < bytes {
            // SAFETY: `prfm` is a hint: it never faults and changes no architectural state; the
            // address is inside `s`.
            unsafe {
                core::arch::asm!(
                    "prfm pldl1keep, [{0}]",
                    in(reg) p.add(off),
                    options(nostack, preserves_flags, readonly)
                )
            };
            off += 64;
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = s;
}

/// `y += alpha * x` with the fastest kernel this CPU has.
pub fn axpy_fast(alpha: f32, x: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        // Every AVX2 level (avx2, vnni, avx512): before, only the plain avx2 level took this.
        if avx2_level() {
            // SAFETY: the kernel table chose AVX2 only after detecting AVX2 and FMA.
            unsafe { crate::avx2::ops::axpy(alpha, x, y) };
            return;
        }
    }
    #[cfg(target_arch = "aarch64")]
    if neon_level() {
        crate::neon::ops::axpy(alpha, x, y);
        return;
    }
    axpy(alpha, x, y);
}

/// Dot product of two f32 rows.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    // Eight partial sums let the compiler vectorize without reassociation flags.
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for j in 0..8 {
            acc[j] += a[c * 8 + j] * b[c * 8 + j];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// `y += alpha * x`.
pub fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (b, a) in y.iter_mut().zip(x) {
        *b += alpha * a;
    }
}

/// Attention scores of `n_q` queries (rows of `hd` floats, back to back in `q`) against `n_k`
/// keys (key j at `k[j * k_stride..][..hd]`): `scores[g * s_stride + j] = scale · q_g·k_j`.
/// Several queries of one KV head (grouped-query attention) share every key load.
#[allow(clippy::too_many_arguments)]
pub fn qk_scores(
    q: &[f32],
    n_q: usize,
    hd: usize,
    k: &[f32],
    k_stride: usize,
    n_k: usize,
    scale: f32,
    scores: &mut [f32],
    s_stride: usize,
) {
    if n_q == 0 || n_k == 0 {
        return;
    }
    assert!(q.len() >= n_q * hd, "qk_scores: {n_q} queries of {hd}");
    assert!(
        k_stride >= hd && k.len() >= (n_k - 1) * k_stride + hd,
        "qk_scores: {n_k} keys"
    );
    assert!(
        s_stride >= n_k && scores.len() >= (n_q - 1) * s_stride + n_k,
        "qk_scores: scores"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_level() {
            // SAFETY: shapes checked above; AVX2 and FMA detected (the table's level).
            unsafe {
                crate::avx2::ops::qk_scores(q, n_q, hd, k, k_stride, n_k, scale, scores, s_stride)
            };
            return;
        }
    }
    for g in 0..n_q {
        let qg = &q[g * hd..(g + 1) * hd];
        for j in 0..n_k {
            scores[g * s_stride + j] = dot(qg, &k[j * k_stride..j * k_stride + hd]) * scale;
        }
    }
}

/// Adds the attention-weighted values to `n_q` output rows (back to back in `out`, `hd` each):
/// `out[g * hd + d] += Σ_j p[g * p_stride + j] · v[j * v_stride + d]`.
#[allow(clippy::too_many_arguments)]
pub fn pv_accumulate(
    p: &[f32],
    p_stride: usize,
    n_q: usize,
    v: &[f32],
    v_stride: usize,
    n_k: usize,
    hd: usize,
    out: &mut [f32],
) {
    if n_q == 0 || n_k == 0 {
        return;
    }
    assert!(
        p_stride >= n_k && p.len() >= (n_q - 1) * p_stride + n_k,
        "pv_accumulate: weights"
    );
    assert!(
        v_stride >= hd && v.len() >= (n_k - 1) * v_stride + hd,
        "pv_accumulate: {n_k} values"
    );
    assert!(
        out.len() >= n_q * hd,
        "pv_accumulate: {n_q} outputs of {hd}"
    );
    #[cfg(target_arch = "x86_64")]
    {
        if avx2_level() {
            // SAFETY: shapes checked above; AVX2 and FMA detected (the table's level).
            unsafe { crate::avx2::ops::pv_accumulate(p, p_stride, n_q, v, v_stride, n_k, hd, out) };
            return;
        }
    }
    for g in 0..n_q {
        let o = &mut out[g * hd..(g + 1) * hd];
        for j in 0..n_k {
            axpy(p[g * p_stride + j], &v[j * v_stride..j * v_stride + hd], o);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rms_norm_unit_rms() {
        let x = [3.0f32, -4.0, 0.0, 5.0];
        let mut out = [0f32; 4];
        rms_norm(&x, &[1.0; 4], 0.0, &mut out);
        let rms = (out.iter().map(|v| v * v).sum::<f32>() / 4.0).sqrt();
        assert!((rms - 1.0).abs() < 1e-6);
    }

    #[test]
    fn rope_preserves_norm_and_rotates_position_zero_not_at_all() {
        let inv = rope_inv_freq(10000.0, 8);
        let mut cs = vec![(0.0, 0.0); 4];
        for style in [RopeStyle::Interleaved, RopeStyle::Neox] {
            let orig: Vec<f32> = (0..8).map(|i| i as f32 - 3.5).collect();
            let mut h = orig.clone();
            rope_cos_sin(0, &inv, &mut cs);
            rope_apply(&mut h, &cs, style);
            assert_eq!(h, orig);
            rope_cos_sin(17, &inv, &mut cs);
            rope_apply(&mut h, &cs, style);
            let n0: f32 = orig.iter().map(|v| v * v).sum();
            let n1: f32 = h.iter().map(|v| v * v).sum();
            assert!((n0 - n1).abs() < 1e-3);
            assert_ne!(h, orig);
        }
    }

    #[test]
    fn rope_neox_rotates_halves() {
        // One frequency pair (rot_dim 2 of a 4-dim head): theta = pos.
        let cs = [(0.0f32, 1.0f32)]; // 90 degrees
        let mut h = [1.0f32, 2.0, 3.0, 4.0];
        rope_apply(&mut h, &cs, RopeStyle::Neox);
        // Pair (0, 1): (1, 2) -> (-2, 1); dims 2.. untouched.
        assert_eq!(h, [-2.0, 1.0, 3.0, 4.0]);
        let mut h = [1.0f32, 2.0, 3.0, 4.0];
        rope_apply(&mut h, &cs, RopeStyle::Interleaved);
        assert_eq!(h, [-2.0, 1.0, 3.0, 4.0]);
    }

    #[test]
    fn softmax_sums_to_one() {
        let mut x = [1.0f32, 2.0, 3.0, -1e9];
        softmax(&mut x);
        assert!((x.iter().sum::<f32>() - 1.0).abs() < 1e-6);
        assert!(x[3] == 0.0);
        assert!(x[2] > x[1] && x[1] > x[0]);
    }

    #[test]
    fn activations_match_known_values() {
        assert!((silu(1.0) - 0.731_058_6).abs() < 1e-6);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-5);
        assert_eq!(gelu_tanh(0.0), 0.0);
    }
}
