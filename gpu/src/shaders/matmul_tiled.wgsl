// Tiled matmul (prefill, n > 1 activation rows): Y[m][r] = Σ_c X[m][c]·W[r][c].
//
// A workgroup of 64 computes a tile of MT_R = 32 weight rows × MT_M = 32 activation rows,
// stepping through the columns one unit (32 values) at a time. Per step, invocations
// 0..32 each dequantize one unit (row i) into workgroup memory, and invocations 32..64
// each load one column of the 32 activation rows (consecutive invocations, consecutive
// columns); every dequantized weight is then used by all 32 activation rows. Invocation
// i accumulates a 4 × 4 block, weight rows 4·(i % 8) .. +4 for activation rows
// 4·(i / 8) .. +4: two vec4 reads per 16 multiply-adds.

const MT_R: u32 = 32u;
const MT_M: u32 = 32u;

// ws[k·8 + r/4][r%4] = W[r0 + r][k0 + k]; xt[k·8 + m/4][m%4] = X[m0 + m][k0 + k].
var<workgroup> ws: array<vec4<f32>, 256>;
var<workgroup> xt: array<vec4<f32>, 256>;

fn mt_x(m: u32, c: u32) -> f32 {
    if (m < P.n && c < P.cols) {
        return X[P.x_off + m * P.x_stride + c];
    }
    return 0.0;
}

@compute @workgroup_size(64)
fn matmul(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let r0 = (wid.y * P.grid_x + wid.x) * MT_R;
    let m0 = wid.z * MT_M;
    let tx = lid % 8u;
    let ty = lid / 8u;
    var acc: array<vec4<f32>, 4>;
    for (var u = 0u; u < P.upr; u++) {
        if (lid < 32u) {
            var w: array<vec4<f32>, 8>;
            if (r0 + lid < P.rows) {
                w = unit((r0 + lid) * P.upr + u);
            }
            for (var k = 0u; k < 8u; k++) {
                let v = w[k];
                ws[(4u * k) * 8u + lid / 4u][lid % 4u] = v.x;
                ws[(4u * k + 1u) * 8u + lid / 4u][lid % 4u] = v.y;
                ws[(4u * k + 2u) * 8u + lid / 4u][lid % 4u] = v.z;
                ws[(4u * k + 3u) * 8u + lid / 4u][lid % 4u] = v.w;
            }
        } else {
            let kk = lid - 32u;
            let c = 32u * u + kk;
            for (var q = 0u; q < 8u; q++) {
                let m = m0 + 4u * q;
                xt[kk * 8u + q] = vec4<f32>(mt_x(m, c), mt_x(m + 1u, c), mt_x(m + 2u, c), mt_x(m + 3u, c));
            }
        }
        workgroupBarrier();
        for (var kk = 0u; kk < 32u; kk++) {
            let w4 = ws[kk * 8u + tx];
            let x4 = xt[kk * 8u + ty];
            acc[0] += w4 * x4.x;
            acc[1] += w4 * x4.y;
            acc[2] += w4 * x4.z;
            acc[3] += w4 * x4.w;
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let m = m0 + 4u * ty + i;
        if (m < P.n) {
            let a = acc[i];
            let o = P.y_off + m * P.y_stride + P.row_base + r0 + 4u * tx;
            let r = r0 + 4u * tx;
            if (r < P.rows) {
                Y[o] = a.x;
            }
            if (r + 1u < P.rows) {
                Y[o + 1u] = a.y;
            }
            if (r + 2u < P.rows) {
                Y[o + 2u] = a.z;
            }
            if (r + 3u < P.rows) {
                Y[o + 3u] = a.w;
            }
        }
    }
}
