//! The data-frame header decoder, on any 40 bytes, then the payload check on what follows:
//! every input is decoded or refused with an error, never a panic, and a header that decodes
//! encodes back to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ringllm_protocol::frame::{FrameHeader, DEFAULT_MAX_PAYLOAD, HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    let Some((head, payload)) = data.split_first_chunk::<HEADER_LEN>() else {
        return;
    };
    for cap in [0, 1 << 10, DEFAULT_MAX_PAYLOAD] {
        if let Ok(h) = FrameHeader::decode(head, cap) {
            assert_eq!(
                &h.encode(),
                head,
                "a decoded header re-encodes to its bytes"
            );
            let _ = h.verify(payload);
        }
    }
});
