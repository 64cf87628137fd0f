// Dequant-matvec (one activation row, decode): y[r] = Σ_c W[r][c]·x[c].
//
// A workgroup of 64 invocations computes MV_ROWS = 4 rows. The activations go through
// workgroup memory in tiles of 1024 values; within a tile, invocation i takes unit
// (32 values) i % 32 of rows i / 32 and i / 32 + 2, so the 32 invocations of a row read
// 32 consecutive units of it: consecutive blocks, whole cache lines. Partial sums are
// kept per row in a vec4 and reduced across the workgroup by the entry point
// (matmul_reduce_subgroup.wgsl or matmul_reduce_shared.wgsl).
//
// Expected roofline on a real GPU: a decode step reads every weight byte once and the
// activations from workgroup memory, so a matvec moves device_bytes (≈ rows·cols·bits/8:
// 4.5 bits for Q4_K, 8.5 for Q8_0, 16 for F16) plus 4·(rows + cols) bytes, with about
// 2 FLOP per weight: ≤ 1 FLOP/byte for every format, far below any GPU's ridge point,
// so time per call ≈ bytes ÷ memory bandwidth. A token of a model costs the sum over
// its matrices: Gemma-3 270M Q4_K_M (≈ 240 MB read per token, its 262144 × 640 Q8_0
// head alone 178 MB) ≈ 0.5 ms at 500 GB/s; a 7B Q4_K_M (≈ 4 GB) ≈ 8 ms at 500 GB/s,
// ≈ 4 ms on a 1 TB/s card. The kernel needs enough workgroups in flight to reach that:
// rows / 4 workgroups (≥ 160 for a 640-row matrix), and decode work per unit (≤ 20
// integer ops per 4 values) that stays hidden behind the loads.

const MV_ROWS: u32 = 4u;
const MV_WG: u32 = 64u;
// Units per activation tile (1024 values); the tile's unit i is stored at xs[9·i ..]
// (stride 9 vec4, not 8, so that neighbouring invocations hit different banks).
const MV_TILE_UNITS: u32 = 32u;

var<workgroup> xs: array<vec4<f32>, 288>;

fn mv_partial(lid: u32, row0: u32) -> vec4<f32> {
    var acc = vec4<f32>(0.0);
    let ul = lid % MV_TILE_UNITS;
    let rsel = lid / MV_TILE_UNITS;
    for (var t0 = 0u; t0 < P.upr; t0 += MV_TILE_UNITS) {
        workgroupBarrier();
        let e0 = t0 * 32u;
        for (var i = 0u; i < 4u; i++) {
            let q = lid + MV_WG * i;
            let e = e0 + 4u * q;
            var v = vec4<f32>(0.0);
            for (var c = 0u; c < 4u; c++) {
                if (e + c < P.cols) {
                    v[c] = X[P.x_off + e + c];
                }
            }
            xs[(q / 8u) * 9u + q % 8u] = v;
        }
        workgroupBarrier();
        let u = t0 + ul;
        if (u < P.upr) {
            for (var h = 0u; h < 2u; h++) {
                let r = rsel + 2u * h;
                if (row0 + r < P.rows) {
                    var w = unit((row0 + r) * P.rw, u);
                    var s = 0.0;
                    for (var k = 0u; k < 8u; k++) {
                        s += dot(w[k], xs[ul * 9u + k]);
                    }
                    acc[r] += s;
                }
            }
        }
    }
    return acc;
}

fn mv_store(row0: u32, r: u32, v: f32) {
    if (row0 + r < P.rows) {
        Y[P.y_off + P.row_base + row0 + r] = v;
    }
}
