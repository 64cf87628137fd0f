//! The reliable-UDP datagram parser on any bytes a seal could cover (data, ack, probe), and
//! the consistency check of a data chunk's numbers: parsed or refused, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ringllm_protocol::udp::wire::Datagram;

fuzz_target!(|data: &[u8]| {
    if let Ok(Datagram::Data { hdr, data: chunk }) = Datagram::parse(data) {
        if let Ok(n) = hdr.check() {
            assert!(n as u64 <= hdr.chunk_size as u64);
            let _ = chunk.len() == n;
        }
    }
});
