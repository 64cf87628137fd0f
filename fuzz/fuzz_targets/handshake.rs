//! The handshake message decoder (header, then the whole message) on any bytes: decoded or
//! refused, never a panic.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ringllm_protocol::handshake::{HsMsg, MSG_HEADER_LEN};

fuzz_target!(|data: &[u8]| {
    if let Some((head, _)) = data.split_first_chunk::<MSG_HEADER_LEN>() {
        let _ = HsMsg::decode_header(head);
    }
    let _ = HsMsg::decode(data);
});
