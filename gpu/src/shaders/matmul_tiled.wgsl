// Tiled matmul (prefill, n > 1 activation rows): Y[m][r] = Σ_c X[m][c]·W[r][c].
//
// A workgroup of 64 computes a tile of MT_R = 32 weight rows × MT_M = 16 activation rows.
// Per step of MT_K = 64 columns, each invocation dequantizes one unit (row i / 2, unit
// i % 2) into workgroup memory and loads 16 activations; the dequantized weight tile is
// then used by all 16 activation rows. Invocation i accumulates weight rows 4·(i % 8) ..
// +4 for activation rows 2·(i / 8), +1: 8 outputs, one vec4 and two vec2 reads per 8 FMAs.

const MT_R: u32 = 32u;
const MT_M: u32 = 16u;
const MT_K: u32 = 64u;

// ws[k·8 + r/4][r%4] = W[r0 + r][k0 + k]; xt[k·8 + m/2][m%2] = X[m0 + m][k0 + k].
var<workgroup> ws: array<vec4<f32>, 512>;
var<workgroup> xt: array<vec2<f32>, 512>;

@compute @workgroup_size(64)
fn matmul(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
) {
    let r0 = (wid.y * P.grid_x + wid.x) * MT_R;
    let m0 = wid.z * MT_M;
    let tx = lid % 8u;
    let ty = lid / 8u;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    let wr = lid / 2u;
    let wh = lid % 2u;
    let kend = P.upr * 32u;
    for (var k0 = 0u; k0 < kend; k0 += MT_K) {
        let wu = k0 / 32u + wh;
        var w: array<vec4<f32>, 8>;
        if (r0 + wr < P.rows && wu < P.upr) {
            w = unit((r0 + wr) * P.upr + wu);
        }
        for (var k = 0u; k < 8u; k++) {
            for (var c = 0u; c < 4u; c++) {
                let kk = 32u * wh + 4u * k + c;
                ws[kk * 8u + wr / 4u][wr % 4u] = w[k][c];
            }
        }
        for (var i = 0u; i < 16u; i++) {
            let idx = lid + 64u * i;
            let m = idx / MT_K;
            let kk = idx % MT_K;
            var v = 0.0;
            if (m0 + m < P.n && k0 + kk < P.cols) {
                v = X[P.x_off + (m0 + m) * P.x_stride + k0 + kk];
            }
            xt[kk * 8u + m / 2u][m % 2u] = v;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < MT_K; kk++) {
            let w4 = ws[kk * 8u + tx];
            let x2 = xt[kk * 8u + ty];
            acc0 += w4 * x2.x;
            acc1 += w4 * x2.y;
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i++) {
        let r = r0 + 4u * tx + i;
        if (r < P.rows) {
            let m = m0 + 2u * ty;
            if (m < P.n) {
                Y[P.y_off + m * P.y_stride + P.row_base + r] = acc0[i];
            }
            if (m + 1u < P.n) {
                Y[P.y_off + (m + 1u) * P.y_stride + P.row_base + r] = acc1[i];
            }
        }
    }
}
