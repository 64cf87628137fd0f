// Matvec entry point, subgroup variant: subgroupAdd within each subgroup, then one
// partial per subgroup through workgroup memory (any subgroup size from 1 to 64).
var<workgroup> red: array<vec4<f32>, 64>;

@compute @workgroup_size(64)
fn matvec(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(subgroup_invocation_id) sgi: u32,
    @builtin(subgroup_id) sgid: u32,
    @builtin(num_subgroups) nsg: u32,
) {
    let row0 = (wid.y * P.grid_x + wid.x) * MV_ROWS;
    let acc = mv_partial(lid, row0);
    let s = subgroupAdd(acc);
    if (sgi == 0u) {
        red[sgid] = s;
    }
    workgroupBarrier();
    if (lid < MV_ROWS) {
        var t = 0.0;
        for (var i = 0u; i < nsg; i++) {
            t += red[i][lid];
        }
        mv_store(row0, lid, t);
    }
}
