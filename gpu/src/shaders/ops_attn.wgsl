// Causal attention of one sequence over its ring cache, flash style: a workgroup takes one
// (row, query head) and a range of its visible keys, in tiles of WG keys; each invocation
// scores one key of a tile, the tile's maximum and sum are workgroup reductions, and the
// output accumulates with an online softmax (running maximum m, running sum l, accumulator
// rescaled by exp(m_old - m_new)). Nothing is sized by the context length.
//
// `attention` takes all visible keys of its (row, head) and writes the output. When there are
// few (row, head) pairs and many keys (decoding at a long context), `attention_part` splits
// the keys over `splits` workgroups per pair, each writing its (acc[hd], m, l) to `part`, and
// `attention_combine` merges them (flash decoding): a GPU then has enough workgroups to fill
// its cores.
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
    // Workgroups per (row, head) and visible keys each takes (attention_part, _combine).
    splits: u32,
    chunk: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> pos: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;
// Per (row, head, split): acc[hd], then m, then l.
@group(0) @binding(6) var<storage, read_write> part: array<f32>;

//KV_DECL

var<workgroup> q_sh: array<f32, MAX_HD>;
var<workgroup> acc: array<f32, MAX_HD>;
var<workgroup> p_sh: array<f32, WG>;
var<workgroup> slot_sh: array<u32, WG>;
var<workgroup> pos_sh: u32;

// Attends row r, head h over split s of its visible keys (the whole range when
// P.splits == 1): leaves the unnormalized output in acc[0..hd] and returns (m, l).
fn attend(ids: Ids, r: u32, h: u32, s: u32) -> vec2<f32> {
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
    // This split's keys: begin..end (end exclusive, at most p + 1).
    var begin = lo;
    var end = p + 1u;
    if (P.splits > 1u) {
        begin = min(lo + s * P.chunk, end);
        end = min(begin + P.chunk, end);
    }
    var m = -3.0e38;
    var l = 0.0;
    for (var t0 = begin; t0 < end; t0 = t0 + WG) {
        let j = t0 + lid;
        let valid = j < end;
        var sc = -3.0e38;
        if (valid) {
            let slot = j % P.cap;
            slot_sh[lid] = slot;
            let base = slot * P.kvd + kb;
            var dot = 0.0;
            for (var d = 0u; d < P.hd; d = d + 1u) {
                dot = dot + q_sh[d] * load_k(base + d);
            }
            sc = dot * P.scale;
        }
        let mn = max(m, wg_max(sc, ids));
        let alpha = exp(m - mn);
        var e = 0.0;
        if (valid) {
            e = exp(sc - mn);
        }
        p_sh[lid] = e;
        l = l * alpha + wg_sum(e, ids);
        m = mn;
        let cnt = min(WG, end - t0);
        for (var d = lid; d < P.hd; d = d + WG) {
            var a = acc[d] * alpha;
            for (var jj = 0u; jj < cnt; jj = jj + 1u) {
                a = a + p_sh[jj] * load_v(slot_sh[jj] * P.kvd + kb + d);
            }
            acc[d] = a;
        }
        workgroupBarrier();
    }
    return vec2<f32>(m, l);
}

// One workgroup per (row, head), all its keys, output normalized into `out`.
@compute @workgroup_size(WG)
fn attention(ids: Ids) {
    let g = group_index(ids);
    if (g >= P.rows * P.n_head) {
        return;
    }
    let r = g / P.n_head;
    let h = g % P.n_head;
    let ml = attend(ids, r, h, 0u);
    let ob = (P.q_row + r) * P.qd + h * P.hd;
    let inv = 1.0 / ml.y;
    for (var d = ids.lid; d < P.hd; d = d + WG) {
        out[ob + d] = acc[d] * inv;
    }
}

// One workgroup per (row, head, split): the split's partial output, maximum and sum.
@compute @workgroup_size(WG)
fn attention_part(ids: Ids) {
    let g = group_index(ids);
    if (g >= P.rows * P.n_head * P.splits) {
        return;
    }
    let rh = g / P.splits;
    let ml = attend(ids, rh / P.n_head, rh % P.n_head, g % P.splits);
    let base = g * (P.hd + 2u);
    for (var d = ids.lid; d < P.hd; d = d + WG) {
        part[base + d] = acc[d];
    }
    if (ids.lid == 0u) {
        part[base + P.hd] = ml.x;
        part[base + P.hd + 1u] = ml.y;
    }
}

// One workgroup per (row, head): merges its splits (an empty split has l = 0 and m = -3e38,
// so its weight exp(m - M) is 0).
@compute @workgroup_size(WG)
fn attention_combine(ids: Ids) {
    let g = group_index(ids);
    if (g >= P.rows * P.n_head) {
        return;
    }
    let r = g / P.n_head;
    let h = g % P.n_head;
    let stride = P.hd + 2u;
    let first = g * P.splits;
    var mx = -3.0e38;
    for (var s = 0u; s < P.splits; s = s + 1u) {
        mx = max(mx, part[(first + s) * stride + P.hd]);
    }
    var l = 0.0;
    for (var s = 0u; s < P.splits; s = s + 1u) {
        let b = (first + s) * stride;
        l = l + part[b + P.hd + 1u] * exp(part[b + P.hd] - mx);
    }
    let inv = 1.0 / l;
    let ob = (P.q_row + r) * P.qd + h * P.hd;
    for (var d = ids.lid; d < P.hd; d = d + WG) {
        var a = 0.0;
        for (var s = 0u; s < P.splits; s = s + 1u) {
            let b = (first + s) * stride;
            a = a + part[b + d] * exp(part[b + P.hd] - mx);
        }
        out[ob + d] = a * inv;
    }
}
