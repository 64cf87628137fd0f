//! The GGUF reader on any bytes held in memory: the header, metadata and tensor table are
//! parsed or refused with an error (never a panic or an allocation the bytes do not back),
//! and every tensor it accepts lies inside the bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ringllm_model::gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    if let Ok(f) = GgufFile::from_bytes(data.to_vec()) {
        let _ = f.metadata().len();
        for t in f.tensors() {
            let _ = f.tensor_data(t).len();
        }
    }
});
