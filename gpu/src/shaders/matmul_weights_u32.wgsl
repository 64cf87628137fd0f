// The weight chunk as u32 words (every format's device layout is whole words).
@group(0) @binding(0) var<storage, read> W: array<u32>;
