// RMSNorm kernels: one workgroup per vector, the sum of squares reduced over the workgroup.
// Same arithmetic order as the CPU (kernels::ops::rms_norm): scale = 1 / sqrt(mean(x²) + eps),
// out = x * scale * w.

struct Params {
    src_off: u32,
    dst_off: u32,
    // Vectors to norm (rows, or rows × heads for the per-head norm).
    count: u32,
    // Width of one vector.
    d: u32,
    eps: f32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;

fn sum_sq_src(base: u32, ids: Ids) -> f32 {
    var ss = 0.0;
    for (var i = ids.lid; i < P.d; i = i + WG) {
        let v = src[base + i];
        ss = ss + v * v;
    }
    return wg_sum(ss, ids);
}

// dst[dst_off + r*d ..] = rms_norm(src[src_off + r*d ..]) * w.
@compute @workgroup_size(WG)
fn rms_norm(ids: Ids) {
    let r = group_index(ids);
    if (r >= P.count) {
        return;
    }
    let xb = P.src_off + r * P.d;
    let ob = P.dst_off + r * P.d;
    let ss = sum_sq_src(xb, ids);
    let scale = 1.0 / sqrt(ss / f32(P.d) + P.eps);
    for (var i = ids.lid; i < P.d; i = i + WG) {
        dst[ob + i] = src[xb + i] * scale * w[i];
    }
}

// In place: dst[dst_off + v*d ..] normed with w[0..d] (per-head QK-norm).
@compute @workgroup_size(WG)
fn rms_norm_inplace(ids: Ids) {
    let r = group_index(ids);
    if (r >= P.count) {
        return;
    }
    let xb = P.dst_off + r * P.d;
    var ss = 0.0;
    for (var i = ids.lid; i < P.d; i = i + WG) {
        let v = dst[xb + i];
        ss = ss + v * v;
    }
    let tot = wg_sum(ss, ids);
    let scale = 1.0 / sqrt(tot / f32(P.d) + P.eps);
    for (var i = ids.lid; i < P.d; i = i + WG) {
        dst[xb + i] = dst[xb + i] * scale * w[i];
    }
}

// Residual with a sandwich norm: dst[r] += rms_norm(src[r]) * w.
@compute @workgroup_size(WG)
fn residual_norm(ids: Ids) {
    let r = group_index(ids);
    if (r >= P.count) {
        return;
    }
    let ob = P.src_off + r * P.d;
    let xb = P.dst_off + r * P.d;
    let ss = sum_sq_src(ob, ids);
    let scale = 1.0 / sqrt(ss / f32(P.d) + P.eps);
    for (var i = ids.lid; i < P.d; i = i + WG) {
        dst[xb + i] = dst[xb + i] + src[ob + i] * scale * w[i];
    }
}
