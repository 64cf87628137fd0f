// Causal attention of one sequence over its ring cache, flash style: one workgroup per
// (row, query head), keys in tiles of WG; each invocation scores one key of a tile, the
// tile's maximum and sum are workgroup reductions, and the output accumulates with an online
// softmax (running maximum m, running sum l, accumulator rescaled by exp(m_old - m_new)).
// Nothing is sized by the context length.
//
// `KV_DECL` is replaced by the cache bindings (3: K, 4: V) and their `load_k`/`load_v`
// functions for f32 or packed f16 caches.

const MAX_HD: u32 = 512u;

struct Params {
    q_row: u32,
    rows: u32,
    n_head: u32,
    // Query heads per KV head.
    group: u32,
    hd: u32,
    qd: u32,
    kvd: u32,
    cap: u32,
    // 0: no window.
    window: u32,
    pos_off: u32,
    scale: f32,
    _p0: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> pos: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

//KV_DECL

var<workgroup> q_sh: array<f32, MAX_HD>;
var<workgroup> acc: array<f32, MAX_HD>;
var<workgroup> p_sh: array<f32, WG>;
var<workgroup> slot_sh: array<u32, WG>;
var<workgroup> pos_sh: u32;

@compute @workgroup_size(WG)
fn attention(ids: Ids) {
    let g = group_index(ids);
    if (g >= P.rows * P.n_head) {
        return;
    }
    let r = g / P.n_head;
    let h = g % P.n_head;
    let kb = (h / P.group) * P.hd;
    let qb = (P.q_row + r) * P.qd + h * P.hd;
    let lid = ids.lid;
    for (var d = lid; d < P.hd; d = d + WG) {
        q_sh[d] = q[qb + d];
        acc[d] = 0.0;
    }
    if (lid == 0u) {
        pos_sh = pos[P.pos_off + r];
    }
    let p = workgroupUniformLoad(&pos_sh);
    var lo = 0u;
    if (P.window > 0u && p + 1u > P.window) {
        lo = p + 1u - P.window;
    }
    // The ring holds the last `cap` positions only.
    if (p + 1u - lo > P.cap) {
        lo = p + 1u - P.cap;
    }
    var m = -3.0e38;
    var l = 0.0;
    for (var t0 = lo; t0 <= p; t0 = t0 + WG) {
        let j = t0 + lid;
        let valid = j <= p;
        var s = -3.0e38;
        if (valid) {
            let slot = j % P.cap;
            slot_sh[lid] = slot;
            let base = slot * P.kvd + kb;
            var dot = 0.0;
            for (var d = 0u; d < P.hd; d = d + 1u) {
                dot = dot + q_sh[d] * load_k(base + d);
            }
            s = dot * P.scale;
        }
        let mn = max(m, wg_max(s, ids));
        let alpha = exp(m - mn);
        var e = 0.0;
        if (valid) {
            e = exp(s - mn);
        }
        p_sh[lid] = e;
        l = l * alpha + wg_sum(e, ids);
        m = mn;
        let cnt = min(WG, p + 1u - t0);
        for (var d = lid; d < P.hd; d = d + WG) {
            var a = acc[d] * alpha;
            for (var jj = 0u; jj < cnt; jj = jj + 1u) {
                a = a + p_sh[jj] * load_v(slot_sh[jj] * P.kvd + kb + d);
            }
            acc[d] = a;
        }
        workgroupBarrier();
    }
    let inv = 1.0 / l;
    for (var d = lid; d < P.hd; d = d + WG) {
        out[qb + d] = acc[d] * inv;
    }
}
