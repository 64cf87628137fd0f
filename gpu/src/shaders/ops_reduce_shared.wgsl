// Workgroup reductions through shared memory (adapters without subgroup operations).
// Prepended to every ops module built without subgroups; `WG` is defined before it.

struct Ids {
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
}

var<workgroup> red: array<f32, WG>;

// The workgroup's index in a grid folded into two dimensions (65535 groups per dimension).
fn group_index(ids: Ids) -> u32 {
    return ids.wid.y * ids.nwg.x + ids.wid.x;
}

// Sum of `v` over the workgroup; every invocation gets it. Call in uniform control flow.
fn wg_sum(v: f32, ids: Ids) -> f32 {
    red[ids.lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (ids.lid < s) {
            red[ids.lid] = red[ids.lid] + red[ids.lid + s];
        }
        workgroupBarrier();
    }
    let t = red[0];
    workgroupBarrier();
    return t;
}

// Maximum of `v` over the workgroup; every invocation gets it. Call in uniform control flow.
fn wg_max(v: f32, ids: Ids) -> f32 {
    red[ids.lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (ids.lid < s) {
            red[ids.lid] = max(red[ids.lid], red[ids.lid + s]);
        }
        workgroupBarrier();
    }
    let t = red[0];
    workgroupBarrier();
    return t;
}

var<workgroup> red4: array<vec4<f32>, WG>;

// Lane-wise sum of `v` over the workgroup (four reductions at once).
fn wg_sum4(v: vec4<f32>, ids: Ids) -> vec4<f32> {
    red4[ids.lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (ids.lid < s) {
            red4[ids.lid] = red4[ids.lid] + red4[ids.lid + s];
        }
        workgroupBarrier();
    }
    let t = red4[0];
    workgroupBarrier();
    return t;
}

// Lane-wise maximum of `v` over the workgroup.
fn wg_max4(v: vec4<f32>, ids: Ids) -> vec4<f32> {
    red4[ids.lid] = v;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s = s / 2u) {
        if (ids.lid < s) {
            red4[ids.lid] = max(red4[ids.lid], red4[ids.lid + s]);
        }
        workgroupBarrier();
    }
    let t = red4[0];
    workgroupBarrier();
    return t;
}
