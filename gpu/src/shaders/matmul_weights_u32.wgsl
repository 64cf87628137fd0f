// The weight chunk as 16-byte vectors (every region of the device layout is 16-aligned).
@group(0) @binding(0) var<storage, read> W: array<vec4<u32>>;

// Word i of W (region B).
fn wd(i: u32) -> u32 {
    return W[i / 4u][i % 4u];
}
