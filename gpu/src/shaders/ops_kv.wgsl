// Stores rows of K and V into a sequence's ring cache at slot pos % cap.

struct Params {
    // Element offset of the first row in k and v.
    src_off: u32,
    pos_off: u32,
    rows: u32,
    kvd: u32,
    cap: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> P: Params;
@group(0) @binding(1) var<storage, read> k: array<f32>;
@group(0) @binding(2) var<storage, read> v: array<f32>;
@group(0) @binding(3) var<storage, read> pos: array<u32>;
@group(0) @binding(4) var<storage, read_write> kc: array<f32>;
@group(0) @binding(5) var<storage, read_write> vc: array<f32>;
@group(0) @binding(6) var<storage, read_write> kh: array<u32>;
@group(0) @binding(7) var<storage, read_write> vh: array<u32>;

fn elem_index(ids: Ids) -> u32 {
    return group_index(ids) * WG + ids.lid;
}

// f32 → binary16 bits, rounded to nearest even (as half::f16::from_f32 on the CPU; WGSL's
// pack2x16float leaves the rounding to the driver). Overflow gives ±inf, NaN stays NaN.
fn f16_bits(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    let sign = (b >> 16u) & 0x8000u;
    let a = b & 0x7fffffffu;
    if (a >= 0x7f800000u) {
        return sign | 0x7c00u | select(0u, 0x200u, a > 0x7f800000u);
    }
    if (a >= 0x477ff000u) {
        // ≥ 65520 rounds past the largest binary16 (65504).
        return sign | 0x7c00u;
    }
    if (a >= 0x38800000u) {
        // Normal: rebias the exponent (127 → 15) and round the 13 dropped bits.
        let m = a - 0x38000000u;
        return sign | ((m + 0xfffu + ((m >> 13u) & 1u)) >> 13u);
    }
    if (a <= 0x33000000u) {
        // ≤ 2^-25: rounds to zero (2^-25 itself is a tie, to the even zero).
        return sign;
    }
    // Subnormal: the value in units of 2^-24, rounded to nearest even.
    let e = a >> 23u;
    let mant = (a & 0x7fffffu) | 0x800000u;
    let shift = 126u - e;
    let q = mant >> shift;
    let rem = mant & ((1u << shift) - 1u);
    let halfway = 1u << (shift - 1u);
    var r = q;
    if (rem > halfway || (rem == halfway && (q & 1u) == 1u)) {
        r = q + 1u;
    }
    return sign | r;
}

@compute @workgroup_size(WG)
fn kv_store_f32(ids: Ids) {
    let i = elem_index(ids);
    if (i >= P.rows * P.kvd) {
        return;
    }
    let r = i / P.kvd;
    let j = i % P.kvd;
    let slot = pos[P.pos_off + r] % P.cap;
    kc[slot * P.kvd + j] = k[P.src_off + i];
    vc[slot * P.kvd + j] = v[P.src_off + i];
}

// One invocation per pair of values (kvd is even): one u32 of the packed cache.
@compute @workgroup_size(WG)
fn kv_store_f16(ids: Ids) {
    let i = elem_index(ids);
    let hk = P.kvd / 2u;
    if (i >= P.rows * hk) {
        return;
    }
    let r = i / hk;
    let j = i % hk;
    let slot = pos[P.pos_off + r] % P.cap;
    let s = P.src_off + r * P.kvd + 2u * j;
    kh[slot * hk + j] = f16_bits(k[s]) | (f16_bits(k[s + 1u]) << 16u);
    vh[slot * hk + j] = f16_bits(v[s]) | (f16_bits(v[s + 1u]) << 16u);
}
