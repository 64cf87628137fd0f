// Matvec entry point, subgroup variant. The 16 rows' partials are spread over four vec4
// (an invocation's value in its row's component, zeros elsewhere) and summed with
// subgroupAdd within each subgroup, whatever its size (4 to 128: at most 64 subgroups);
// the subgroups' sums meet in workgroup memory.
var<workgroup> red: array<array<vec4<f32>, 4>, 64>;

@compute @workgroup_size(256)
fn matvec(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(subgroup_invocation_id) sgi: u32,
    @builtin(subgroup_id) sgid: u32,
    @builtin(num_subgroups) nsg: u32,
) {
    let row0 = (wid.y * P.grid_x + wid.x) * MV_ROWS;
    let p = mv_partial(lid, row0);
    let r = lid / MV_TPR;
    let lanes = vec4<u32>(0u, 1u, 2u, 3u);
    var s: array<vec4<f32>, 4>;
    for (var g = 0u; g < 4u; g++) {
        let v = select(vec4<f32>(0.0), vec4<f32>(p), lanes + vec4<u32>(4u * g) == vec4<u32>(r));
        s[g] = subgroupAdd(v);
    }
    if (sgi == 0u && sgid < 64u) {
        red[sgid] = s;
    }
    workgroupBarrier();
    if (lid < MV_ROWS) {
        var t = 0.0;
        for (var i = 0u; i < min(nsg, 64u); i++) {
            t += red[i][lid / 4u][lid % 4u];
        }
        mv_store(row0, lid, t);
    }
}
