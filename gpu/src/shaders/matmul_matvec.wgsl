// Dequant-matvec (one activation row, decode): y[r] = Σ_c W[r][c]·x[c].
//
// A workgroup of 256 invocations computes MV_ROWS = 16 rows, 16 invocations a row. The
// activations go through workgroup memory in tiles of 1024 values, shared by the 16
// rows; within a tile, invocation i takes units (32 values) i % 16 and i % 16 + 16 of
// row i / 16, so the 16 invocations of a row read 16 consecutive units of it at a time:
// consecutive blocks, whole cache lines. The entry point (matmul_reduce_subgroup.wgsl
// or matmul_reduce_shared.wgsl) sums the 16 partials of each row.
//
// Expected roofline on a real GPU: a decode step reads every weight byte once and the
// activations from workgroup memory, so a matvec moves device_bytes (≈ rows·cols·bits/8:
// 4.5 bits for Q4_K, 8.5 for Q8_0, 16 for F16) plus 4·(rows + cols) bytes, with about
// 2 FLOP per weight: ≤ 1 FLOP/byte for every format, far below any GPU's ridge point,
// so time per call ≈ bytes ÷ memory bandwidth. A token of a model costs the sum over
// its matrices: Gemma-3 270M Q4_K_M (≈ 240 MB read per token, its 262144 × 640 Q8_0
// head alone 178 MB) ≈ 0.5 ms at 500 GB/s; a 7B Q4_K_M (≈ 4 GB) ≈ 8 ms at 500 GB/s,
// ≈ 4 ms on a 1 TB/s card. Reaching that needs enough workgroups in flight (rows / 16:
// 16384 for the head, but only 40 for a 640-row matrix, which a large GPU would run
// below its bandwidth; such small matrices are a small share of a token's bytes) and
// decode work (≤ 20 integer ops per 4 values) that stays hidden behind the loads. The
// weight layout (qmat.rs) makes every load a 16-byte vector and the 16 invocations of a
// row read 16 consecutive blocks' quants, then their consecutive scales.

const MV_ROWS: u32 = 16u;
const MV_WG: u32 = 256u;
// Invocations per row, and units per activation tile (1024 values, one vec4 per
// invocation). The tile's unit i is stored at xs[9·i ..] (stride 9 vec4, not 8, so that
// the invocations of a row, reading different units, hit different banks).
const MV_TPR: u32 = MV_WG / MV_ROWS;
const MV_TILE_UNITS: u32 = 32u;

var<workgroup> xs: array<vec4<f32>, 288>;

// This invocation's partial sum of its row, row0 + lid / MV_TPR.
fn mv_partial(lid: u32, row0: u32) -> f32 {
    var acc = 0.0;
    let lane = lid % MV_TPR;
    let row = row0 + lid / MV_TPR;
    let live = row < P.rows;
    let rb = row * P.upr;
    for (var t0 = 0u; t0 < P.upr; t0 += MV_TILE_UNITS) {
        workgroupBarrier();
        let e = t0 * 32u + 4u * lid;
        if (e < P.cols) {
            var v = vec4<f32>(0.0);
            let o = P.x_off + e;
            if (e + 4u <= P.cols) {
                v = vec4<f32>(X[o], X[o + 1u], X[o + 2u], X[o + 3u]);
            } else {
                for (var c = 0u; e + c < P.cols; c++) {
                    v[c] = X[o + c];
                }
            }
            xs[(lid / 8u) * 9u + lid % 8u] = v;
        }
        workgroupBarrier();
        if (live) {
            for (var ul = lane; ul < MV_TILE_UNITS; ul += MV_TPR) {
                let u = t0 + ul;
                if (u < P.upr) {
                    let w = unit(rb + u);
                    let x0 = ul * 9u;
                    acc += dot(w[0], xs[x0]) + dot(w[1], xs[x0 + 1u])
                        + dot(w[2], xs[x0 + 2u]) + dot(w[3], xs[x0 + 3u])
                        + dot(w[4], xs[x0 + 4u]) + dot(w[5], xs[x0 + 5u])
                        + dot(w[6], xs[x0 + 6u]) + dot(w[7], xs[x0 + 7u]);
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
