// Causal attention of one sequence over its ring cache, flash style. A workgroup takes one
// row, up to four query heads that share a KV head (one per lane of a vec4, so each key and
// value is loaded once for all of them), and a range of the row's visible keys, in tiles of
// WG keys: each invocation scores one key of a tile for every head, the tile's maxima and
// sums are workgroup reductions, and the output accumulates with an online softmax (running
// maximum m, running sum l, accumulator rescaled by exp(m_old - m_new)). Nothing is sized by
// the context length.
//
// `attention` takes all visible keys of its (row, heads) and writes the output. When there
// are few such units and many keys (decoding at a long context), `attention_part` splits the
// keys over `splits` workgroups per unit, each writing per head its (acc[hd], m, l) to `part`,
// and `attention_combine` merges them (flash decoding): a GPU then has enough workgroups to
// fill its cores.
//
// `KV_DECL` is replaced by the cache bindings (3: K, 4: V) and their `load_k`/`load_v`
// functions for f32 or packed f16 caches.

const MAX_HD: u32 = 512u;
// Head dims an invocation accumulates: MAX_HD / WG.
const DPT: u32 = MAX_HD / WG;

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
    // Workgroups per unit and visible keys each takes (attention_part, _combine).
    splits: u32,
    chunk: u32,
    // Query heads per workgroup (≤ 4), and such blocks per KV head.
    ng: u32,
    blocks: u32,
    // Attention logit soft-cap (0: none): scores become softcap * tanh(score / softcap).
    softcap: f32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> pos: array<u32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;
// Per (row, head, split): acc[hd], then m, then l.
@group(0) @binding(6) var<storage, read_write> part: array<f32>;

//KV_DECL

// The unit's queries, dim-major: q4_sh[d][g] is head g's dim d.
var<workgroup> q4_sh: array<vec4<f32>, MAX_HD>;
var<workgroup> p4_sh: array<vec4<f32>, WG>;
var<workgroup> slot_sh: array<u32, WG>;
var<workgroup> pos_sh: u32;

// What a workgroup's `attend` leaves: its invocation's accumulators (dims lid + k*WG), the
// running maximum and sum per head.
var<private> acc4: array<vec4<f32>, DPT>;

struct Unit {
    r: u32,
    // First query head and how many (≤ 4).
    h0: u32,
    nq: u32,
}

// Unit u (< rows * n_kv * blocks): row, KV head, block of query heads.
fn unit(u: u32) -> Unit {
    let n_kv = P.n_head / P.group;
    let per_row = n_kv * P.blocks;
    let r = u / per_row;
    let kvh = (u % per_row) / P.blocks;
    let b = u % P.blocks;
    let h0 = kvh * P.group + b * P.ng;
    return Unit(r, h0, min(P.ng, P.group - b * P.ng));
}

// Attends the unit over split s of its row's visible keys (all of them when P.splits == 1):
// leaves the unnormalized outputs in acc4 and returns (m, l) per head lane.
fn attend(ids: Ids, un: Unit, s: u32) -> array<vec4<f32>, 2> {
    let kb = (un.h0 / P.group) * P.hd;
    let qb = (P.q_row + un.r) * P.qd + un.h0 * P.hd;
    let lid = ids.lid;
    for (var d = lid; d < P.hd; d = d + WG) {
        var v = vec4<f32>(0.0);
        for (var g = 0u; g < un.nq; g = g + 1u) {
            v[g] = q[qb + g * P.hd + d];
        }
        q4_sh[d] = v;
    }
    for (var k = 0u; k < DPT; k = k + 1u) {
        acc4[k] = vec4<f32>(0.0);
    }
    if (lid == 0u) {
        pos_sh = pos[P.pos_off + un.r];
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
    var m = vec4<f32>(-3.0e38);
    var l = vec4<f32>(0.0);
    for (var t0 = begin; t0 < end; t0 = t0 + WG) {
        let j = t0 + lid;
        let valid = j < end;
        var sc = vec4<f32>(-3.0e38);
        if (valid) {
            let slot = j % P.cap;
            slot_sh[lid] = slot;
            let base = slot * P.kvd + kb;
            var dot = vec4<f32>(0.0);
            for (var d = 0u; d < P.hd; d = d + 1u) {
                dot = dot + q4_sh[d] * load_k(base + d);
            }
            sc = dot * P.scale;
            if (P.softcap > 0.0) {
                sc = P.softcap * tanh(sc / P.softcap);
            }
        }
        let mn = max(m, wg_max4(sc, ids));
        let alpha = exp(m - mn);
        var e = vec4<f32>(0.0);
        if (valid) {
            e = exp(sc - mn);
        }
        p4_sh[lid] = e;
        l = l * alpha + wg_sum4(e, ids);
        m = mn;
        let cnt = min(WG, end - t0);
        for (var k = 0u; k < DPT; k = k + 1u) {
            let d = lid + k * WG;
            if (d < P.hd) {
                var a = acc4[k] * alpha;
                for (var jj = 0u; jj < cnt; jj = jj + 1u) {
                    a = a + p4_sh[jj] * load_v(slot_sh[jj] * P.kvd + kb + d);
                }
                acc4[k] = a;
            }
        }
        workgroupBarrier();
    }
    return array<vec4<f32>, 2>(m, l);
}

// One workgroup per unit, all its keys, outputs normalized into `out`.
@compute @workgroup_size(WG)
fn attention(ids: Ids) {
    let u = group_index(ids);
    if (u >= P.rows * (P.n_head / P.group) * P.blocks) {
        return;
    }
    let un = unit(u);
    let ml = attend(ids, un, 0u);
    let inv = 1.0 / ml[1];
    let ob = (P.q_row + un.r) * P.qd + un.h0 * P.hd;
    for (var k = 0u; k < DPT; k = k + 1u) {
        let d = ids.lid + k * WG;
        if (d < P.hd) {
            let o = acc4[k] * inv;
            for (var g = 0u; g < un.nq; g = g + 1u) {
                out[ob + g * P.hd + d] = o[g];
            }
        }
    }
}

// One workgroup per (unit, split): per head the split's partial output, maximum and sum.
@compute @workgroup_size(WG)
fn attention_part(ids: Ids) {
    let w = group_index(ids);
    if (w >= P.rows * (P.n_head / P.group) * P.blocks * P.splits) {
        return;
    }
    let un = unit(w / P.splits);
    let s = w % P.splits;
    let ml = attend(ids, un, s);
    let stride = P.hd + 2u;
    for (var g = 0u; g < un.nq; g = g + 1u) {
        let base = ((un.r * P.n_head + un.h0 + g) * P.splits + s) * stride;
        for (var k = 0u; k < DPT; k = k + 1u) {
            let d = ids.lid + k * WG;
            if (d < P.hd) {
                part[base + d] = acc4[k][g];
            }
        }
        if (ids.lid == 0u) {
            part[base + P.hd] = ml[0][g];
            part[base + P.hd + 1u] = ml[1][g];
        }
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
