//! The control-message decoder on any payload: decoded or refused, never a panic, and what
//! decodes re-encodes to bytes that decode and encode to the same bytes again.
#![no_main]

use libfuzzer_sys::fuzz_target;
use ringllm_protocol::control::Control;

fuzz_target!(|data: &[u8]| {
    if let Ok(c) = Control::decode(data) {
        if let Ok((_, bytes)) = c.to_frame() {
            let again = Control::decode(&bytes).expect("an encoded message decodes");
            let (_, bytes2) = again.to_frame().expect("it encodes again");
            assert_eq!(bytes, bytes2);
        }
    }
});
