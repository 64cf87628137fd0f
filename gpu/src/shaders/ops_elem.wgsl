// Element-wise kernels: one invocation per element (or per rotated pair for RoPE), over a
// grid folded into two dimensions.

struct Params {
    off: u32,
    // Elements (or pairs) to process.
    len: u32,
    // Row width (bias), or rope: heads.
    d: u32,
    // softcap: the cap.
    f: f32,
    // rope: head width and rotated pairs per head.
    hd: u32,
    half: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read_write> x: array<f32>;

fn elem_index(ids: Ids) -> u32 {
    return group_index(ids) * WG + ids.lid;
}

// tanh with its argument clamped: tanh(±10) is ±1 in f32, and some drivers compute tanh
// through exp, which overflows to inf/inf = NaN for large arguments.
fn tanh_safe(v: f32) -> f32 {
    return tanh(clamp(v, -10.0, 10.0));
}

// x[off + i] += a[i % d] (bias of every row).
@compute @workgroup_size(WG)
fn add_bias(ids: Ids) {
    let i = elem_index(ids);
    if (i >= P.len) {
        return;
    }
    x[P.off + i] = x[P.off + i] + a[i % P.d];
}

// x[off + i] += a[i] (residual without a sandwich norm).
@compute @workgroup_size(WG)
fn add_rows(ids: Ids) {
    let i = elem_index(ids);
    if (i >= P.len) {
        return;
    }
    x[P.off + i] = x[P.off + i] + a[i];
}

// gate = silu(gate) * up, as kernels::ops::silu: g / (1 + exp(-g)).
@compute @workgroup_size(WG)
fn glu_silu(ids: Ids) {
    let i = elem_index(ids);
    if (i >= P.len) {
        return;
    }
    let g = x[i];
    x[i] = g / (1.0 + exp(-g)) * a[i];
}

// gate = gelu_tanh(gate) * up, as kernels::ops::gelu_tanh.
@compute @workgroup_size(WG)
fn glu_gelu_tanh(ids: Ids) {
    let i = elem_index(ids);
    if (i >= P.len) {
        return;
    }
    let g = x[i];
    let t = tanh_safe(0.7978846 * (g + 0.044715 * g * g * g));
    x[i] = 0.5 * g * (1.0 + t) * a[i];
}

// x = f * tanh(x / f) (final logit soft-capping).
@compute @workgroup_size(WG)
fn softcap(ids: Ids) {
    let i = elem_index(ids);
    if (i >= P.len) {
        return;
    }
    x[i] = P.f * tanh_safe(x[i] / P.f);
}

// RoPE: one invocation per rotated pair (row r, head h, j < half); `a` holds per row `half`
// (cos, sin) pairs, `d` is the heads per row. Only the first 2*half dims of a head rotate.

// Adjacent pairs (2j, 2j + 1).
@compute @workgroup_size(WG)
fn rope_interleaved(ids: Ids) {
    let i = elem_index(ids);
    if (i >= P.len) {
        return;
    }
    let per_row = P.d * P.half;
    let r = i / per_row;
    let h = (i % per_row) / P.half;
    let j = i % P.half;
    let c = a[(r * P.half + j) * 2u];
    let s = a[(r * P.half + j) * 2u + 1u];
    let b = P.off + (r * P.d + h) * P.hd + 2u * j;
    let x0 = x[b];
    let x1 = x[b + 1u];
    x[b] = x0 * c - x1 * s;
    x[b + 1u] = x0 * s + x1 * c;
}

// Halves (j, j + half).
@compute @workgroup_size(WG)
fn rope_neox(ids: Ids) {
    let i = elem_index(ids);
    if (i >= P.len) {
        return;
    }
    let per_row = P.d * P.half;
    let r = i / per_row;
    let h = (i % per_row) / P.half;
    let j = i % P.half;
    let c = a[(r * P.half + j) * 2u];
    let s = a[(r * P.half + j) * 2u + 1u];
    let b = P.off + (r * P.d + h) * P.hd + j;
    let x0 = x[b];
    let x1 = x[b + P.half];
    x[b] = x0 * c - x1 * s;
    x[b + P.half] = x0 * s + x1 * c;
}
