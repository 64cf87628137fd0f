//! Properties of the three codecs (frame header, control messages, handshake messages), run on
//! bytes built in memory: round trips, rejection of every malformed input without a panic, and
//! literal pins of everything that is part of the wire format.

use proptest::prelude::*;
use ringllm_protocol::control::{
    Assignment, Capabilities, Control, ErrorCode, ErrorMsg, Holder, Input, KvType, ModelIdentity,
    NextHop, NodeStatus, Piece, Ready, SliceKey, SliceNeed, SliceOffer, SliceProgress, StageLayout,
    StageStatus, Stats,
};
use ringllm_protocol::frame::{
    FLAG_ALL_TOKENS, FRAME_MAGIC, FRAME_VERSION, KNOWN_FLAGS, MAX_CONTROL_LEN,
};
use ringllm_protocol::handshake::{Hello, HsMsg, MAX_BODY, MAX_NAME, MSG_HEADER_LEN};
use ringllm_protocol::{
    Dtype, FrameHeader, FrameKind, ProtocolError, Role, TransportKind, HEADER_LEN,
};

// ---------------------------------------------------------------------------------------------
// Strategies

const DATA_DTYPES: [Dtype; 4] = [Dtype::F32, Dtype::F16, Dtype::Bf16, Dtype::Q8];

fn data_kind() -> impl Strategy<Value = FrameKind> {
    prop_oneof![Just(FrameKind::Hidden), Just(FrameKind::Logits)]
}

fn data_dtype() -> impl Strategy<Value = Dtype> {
    prop::sample::select(DATA_DTYPES.to_vec())
}

fn any_dtype() -> impl Strategy<Value = Dtype> {
    prop_oneof![Just(Dtype::Bytes), data_dtype()]
}

fn flags() -> impl Strategy<Value = u32> {
    prop_oneof![Just(0), Just(FLAG_ALL_TOKENS), Just(KNOWN_FLAGS)]
}

/// Any header `decode` must accept (with `max_payload = u32::MAX`), with an arbitrary CRC.
fn valid_header() -> impl Strategy<Value = FrameHeader> {
    let control = (
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
        0..=MAX_CONTROL_LEN,
        flags(),
        any::<u32>(),
    )
        .prop_map(|(seq, pos, n_tokens, len, flags, crc)| FrameHeader {
            kind: FrameKind::Control,
            dtype: Dtype::Bytes,
            seq,
            pos,
            n_tokens,
            len,
            flags,
            crc,
        });
    let data = prop_oneof![1..=16u32, 1..=u32::MAX]
        .prop_flat_map(|n| (Just(n), 1..=u32::MAX / n))
        .prop_flat_map(|(n, per_token)| {
            (
                data_kind(),
                data_dtype(),
                any::<u64>(),
                any::<u32>(),
                Just(n),
                Just(n * per_token),
                flags(),
                any::<u32>(),
            )
        })
        .prop_map(
            |(kind, dtype, seq, pos, n_tokens, len, flags, crc)| FrameHeader {
                kind,
                dtype,
                seq,
                pos,
                n_tokens,
                len,
                flags,
                crc,
            },
        );
    prop_oneof![control, data]
}

/// A real frame: a header made by `FrameHeader::new` for a small payload.
fn valid_frame() -> impl Strategy<Value = (FrameHeader, Vec<u8>)> {
    let control =
        (any::<u64>(), prop::collection::vec(any::<u8>(), 0..64)).prop_map(|(seq, payload)| {
            let h = FrameHeader::new(FrameKind::Control, Dtype::Bytes, seq, 0, 0, 0, &payload)
                .expect("a small control payload fits");
            (h, payload)
        });
    let data = (
        data_kind(),
        data_dtype(),
        any::<u64>(),
        any::<u32>(),
        1..=8u32,
        1..=8usize,
        flags(),
    )
        .prop_flat_map(|(kind, dtype, seq, pos, n, per_token, flags)| {
            (
                Just((kind, dtype, seq, pos, n, flags)),
                prop::collection::vec(any::<u8>(), n as usize * per_token),
            )
        })
        .prop_map(|((kind, dtype, seq, pos, n, flags), payload)| {
            let h = FrameHeader::new(kind, dtype, seq, pos, n, flags, &payload)
                .expect("a small data payload fits");
            (h, payload)
        });
    prop_oneof![control, data]
}

fn text() -> impl Strategy<Value = String> {
    prop_oneof![Just(String::new()), "[a-z0-9._-]{1,24}", any::<String>(),]
}

fn finite_or_inf_f64() -> impl Strategy<Value = f64> {
    use prop::num::f64;
    // NaN is excluded only because it breaks `PartialEq`, not the codec.
    f64::POSITIVE | f64::NEGATIVE | f64::NORMAL | f64::SUBNORMAL | f64::ZERO | f64::INFINITE
}

fn model_identity() -> impl Strategy<Value = ModelIdentity> {
    (text(), any::<u64>(), any::<u64>()).prop_map(|(file_name, size, header_hash)| ModelIdentity {
        file_name,
        size,
        header_hash,
    })
}

fn capabilities() -> impl Strategy<Value = Capabilities> {
    (
        text(),
        text(),
        any::<u64>(),
        any::<u64>(),
        any::<u32>(),
        prop::collection::vec(text(), 0..6),
        text(),
        finite_or_inf_f64(),
        prop::collection::vec(model_identity(), 0..4),
        (transport(), finite_or_inf_f64(), text()),
    )
        .prop_map(
            |(
                node_name,
                version,
                memory_total,
                memory_available,
                threads,
                cpu_features,
                isa,
                matvec_bytes_per_s,
                models,
                (transport, disk_read_bytes_per_s, backend),
            )| Capabilities {
                node_name,
                version,
                memory_total,
                memory_available,
                threads,
                cpu_features,
                isa,
                matvec_bytes_per_s,
                models,
                transport,
                disk_read_bytes_per_s,
                backend,
            },
        )
}

fn stage_layout() -> impl Strategy<Value = StageLayout> {
    (
        prop::collection::vec((any::<u32>(), any::<u32>()), 0..5),
        prop::collection::vec(any::<u32>(), 0..8),
        any::<u32>(),
        any::<bool>(),
    )
        .prop_map(|(windows, streamed, prefetch, stream_all)| StageLayout {
            skip_predictor: streamed.iter().map(|&x| x as u8).collect(),
            skip_confidence_ppm: prefetch.wrapping_mul(7),
            skip_max: prefetch / 3,
            windows,
            streamed,
            prefetch,
            stream_all,
        })
}

fn transport() -> impl Strategy<Value = TransportKind> {
    prop::sample::select(TransportKind::ALL.to_vec())
}

fn next_hop() -> impl Strategy<Value = NextHop> {
    prop_oneof![
        Just(NextHop::Coordinator),
        (text(), text(), transport()).prop_map(|(name, address, transport)| NextHop::Node {
            name,
            address,
            transport
        }),
    ]
}

fn assignment() -> impl Strategy<Value = Assignment> {
    (
        (any::<u64>(), model_identity(), any::<u32>(), any::<u32>()),
        (
            any::<bool>(),
            prop_oneof![Just(Input::Coordinator), Just(Input::Upstream)],
            next_hop(),
            any_dtype(),
        ),
        (
            any::<u32>(),
            prop_oneof![Just(KvType::F32), Just(KvType::F16)],
            any::<u32>(),
            any::<u32>(),
            any::<u32>(),
        ),
        stage_layout(),
    )
        .prop_map(
            |(
                (session, model, layer_start, layer_end),
                (head, input, next_hop, activations),
                (kv_ctx, kv_type, max_batch, threads, kv_slots),
                layout,
            )| Assignment {
                session,
                model,
                layer_start,
                layer_end,
                head,
                input,
                next_hop,
                activations,
                kv_ctx,
                kv_type,
                max_batch,
                threads,
                kv_slots,
                layout,
            },
        )
}

fn ready() -> impl Strategy<Value = Ready> {
    (
        any::<u64>(),
        any::<u32>(),
        any::<u32>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
        any::<u64>(),
    )
        .prop_map(
            |(session, layer_start, layer_end, weight_bytes, kv_bytes, rss_bytes, load_ms)| Ready {
                session,
                layer_start,
                layer_end,
                weight_bytes,
                kv_bytes,
                rss_bytes,
                load_ms,
            },
        )
}

fn stats() -> impl Strategy<Value = Stats> {
    prop::array::uniform::<_, 12>(any::<u64>()).prop_map(|v| Stats {
        session: v[0],
        frames_in: v[1],
        frames_out: v[2],
        bytes_in: v[3],
        bytes_out: v[4],
        tokens: v[5],
        compute_us: v[6],
        busy_us: v[7],
        rss_bytes: v[8],
        stream_bytes_read: v[9],
        stream_stall_us: v[10],
        stream_layers_skipped: v[11],
    })
}

const ERROR_CODES: [ErrorCode; 9] = [
    ErrorCode::BadRequest,
    ErrorCode::ModelMissing,
    ErrorCode::ModelMismatch,
    ErrorCode::OutOfMemory,
    ErrorCode::NextHopUnreachable,
    ErrorCode::Busy,
    ErrorCode::Compute,
    ErrorCode::Internal,
    ErrorCode::CacheFull,
];

fn error_msg() -> impl Strategy<Value = ErrorMsg> {
    (
        prop::sample::select(ERROR_CODES.to_vec()),
        any::<Option<u64>>(),
        text(),
    )
        .prop_map(|(code, seq, message)| ErrorMsg { code, seq, message })
}

fn slice_key() -> impl Strategy<Value = SliceKey> {
    (model_identity(), any::<u32>(), any::<u32>(), any::<bool>()).prop_map(
        |(model, layer_start, layer_end, head)| SliceKey {
            model,
            layer_start,
            layer_end,
            head,
        },
    )
}

fn piece() -> impl Strategy<Value = Piece> {
    (text(), any::<u64>(), any::<u64>(), any::<[u8; 32]>()).prop_map(|(name, offset, len, hash)| {
        Piece {
            name,
            offset,
            len,
            hash,
        }
    })
}

fn control() -> impl Strategy<Value = Control> {
    prop_oneof![
        (
            slice_key(),
            any::<u64>(),
            prop::collection::vec(piece(), 0..4),
            any::<bool>(),
            any::<bool>()
        )
            .prop_map(|(key, size, pieces, dry_run, discard)| Control::SliceOffer(
                SliceOffer {
                    key,
                    size,
                    pieces,
                    dry_run,
                    discard
                }
            )),
        (
            slice_key(),
            prop::collection::vec(any::<u32>(), 0..8),
            any::<u64>()
        )
            .prop_map(|(key, pieces, have_bytes)| Control::SliceNeed(SliceNeed {
                key,
                pieces,
                have_bytes
            })),
        (
            slice_key(),
            any::<u64>(),
            any::<bool>(),
            prop::collection::vec(any::<u32>(), 0..8)
        )
            .prop_map(
                |(key, received, done, bad)| Control::SliceProgress(SliceProgress {
                    key,
                    received,
                    done,
                    bad
                })
            ),
        capabilities().prop_map(Control::Capabilities),
        assignment().prop_map(Control::Assign),
        ready().prop_map(Control::Ready),
        (any::<u64>(), any::<bool>())
            .prop_map(|(nonce, reply)| Control::Heartbeat { nonce, reply }),
        stats().prop_map(Control::Stats),
        any::<u64>().prop_map(|seq| Control::ReleaseSequence { seq }),
        error_msg().prop_map(Control::Error),
        text().prop_map(|reason| Control::Shutdown { reason }),
        Just(Control::GetStats),
        Just(Control::GetStatus),
        Just(Control::Status(Box::new(node_status_example()))),
        (
            any::<u64>(),
            text(),
            any::<bool>(),
            any::<bool>(),
            transport(),
            any::<u16>()
        )
            .prop_map(|(session, from, input, output, transport, udp_port)| {
                Control::Attach {
                    session,
                    from,
                    input,
                    output,
                    transport,
                    udp_port,
                }
            }),
    ]
}

fn role() -> impl Strategy<Value = Role> {
    prop_oneof![
        Just(Role::Coordinator),
        Just(Role::Upstream),
        Just(Role::Node),
        Just(Role::Monitor)
    ]
}

/// Hello messages whose name fits `MAX_NAME` (so they round-trip unchanged).
fn hello() -> impl Strategy<Value = Hello> {
    (
        any::<u16>(),
        any::<u16>(),
        any::<u64>(),
        role(),
        any::<[u8; 8]>(),
        any::<[u8; 32]>(),
        prop_oneof![
            Just(String::new()),
            "[a-z0-9-]{1,64}",
            any::<String>().prop_filter("fits MAX_NAME", |s| s.len() <= MAX_NAME),
        ],
    )
        .prop_map(
            |(major, minor, caps, role, cluster_id, nonce, name)| Hello {
                major,
                minor,
                caps,
                role,
                cluster_id,
                nonce,
                name,
            },
        )
}

fn hs_msg() -> impl Strategy<Value = HsMsg> {
    prop_oneof![
        hello().prop_map(HsMsg::Hello),
        any::<[u8; 32]>().prop_map(HsMsg::Proof),
        Just(HsMsg::Accept),
        any::<String>()
            .prop_filter("fits MAX_BODY", |s| s.len() <= MAX_BODY)
            .prop_map(HsMsg::Reject),
    ]
}

// ---------------------------------------------------------------------------------------------
// Helpers

/// A header laid out by hand (the CRC is left zero): field by field, as the doc of `frame`
/// describes it.
fn raw_header(kind: u8, dtype: u8, n_tokens: u32, len: u32, flags: u32, reserved: u32) -> [u8; 40] {
    let mut b = [0u8; HEADER_LEN];
    b[0..4].copy_from_slice(b"RLFR");
    b[4..6].copy_from_slice(&1u16.to_le_bytes());
    b[6] = kind;
    b[7] = dtype;
    b[8..16].copy_from_slice(&7u64.to_le_bytes());
    b[16..20].copy_from_slice(&3u32.to_le_bytes());
    b[20..24].copy_from_slice(&n_tokens.to_le_bytes());
    b[24..28].copy_from_slice(&len.to_le_bytes());
    b[28..32].copy_from_slice(&flags.to_le_bytes());
    b[32..36].copy_from_slice(&reserved.to_le_bytes());
    b
}

fn flip(bytes: &mut [u8], bit: usize) {
    bytes[bit / 8] ^= 1 << (bit % 8);
}

// ---------------------------------------------------------------------------------------------
// Frame header properties

proptest! {
    #[test]
    fn header_round_trips(h in valid_header()) {
        let b = h.encode();
        prop_assert_eq!(&b[0..4], b"RLFR");
        let d = FrameHeader::decode(&b, u32::MAX).expect("a valid header decodes");
        prop_assert_eq!(d, h);
        prop_assert_eq!(d.encode(), b);
    }

    #[test]
    fn header_cap_is_enforced_for_data(h in valid_header()) {
        // The same header under a cap one byte too small: data frames are refused, control
        // frames keep their own fixed cap.
        if h.len > 0 {
            let r = FrameHeader::decode(&h.encode(), h.len - 1);
            if h.kind == FrameKind::Control {
                prop_assert_eq!(r.expect("control ignores max_payload"), h);
            } else {
                prop_assert!(
                    matches!(r, Err(ProtocolError::TooLarge { len, max, .. })
                        if len == h.len as u64 && max == (h.len - 1) as u64),
                    "got {:?}", r
                );
            }
        }
    }

    #[test]
    fn every_single_bit_flip_is_caught((h, payload) in valid_frame()) {
        let head = h.encode();
        let d = FrameHeader::decode(&head, u32::MAX).expect("valid frame decodes");
        prop_assert!(d.verify(&payload).is_ok());
        prop_assert_eq!(d, h);

        for bit in 0..payload.len() * 8 {
            let mut p = payload.clone();
            flip(&mut p, bit);
            prop_assert!(
                matches!(d.verify(&p), Err(ProtocolError::Checksum { .. })),
                "payload bit {} flipped went unnoticed", bit
            );
        }
        for bit in 0..HEADER_LEN * 8 {
            let mut b = head;
            flip(&mut b, bit);
            if let Ok(d2) = FrameHeader::decode(&b, u32::MAX) {
                prop_assert!(
                    d2.verify(&payload).is_err(),
                    "header bit {} flipped went unnoticed", bit
                );
            }
        }
        // A payload of the wrong length is refused before any CRC is computed.
        let mut longer = payload.clone();
        longer.push(0);
        prop_assert!(matches!(d.verify(&longer), Err(ProtocolError::Inconsistent(_))));
        if !payload.is_empty() {
            prop_assert!(matches!(
                d.verify(&payload[1..]),
                Err(ProtocolError::Inconsistent(_))
            ));
        }
    }

    #[test]
    fn decode_of_random_bytes_never_panics(b in prop::array::uniform::<_, 40>(any::<u8>()),
                                           max in any::<u32>()) {
        let _ = FrameHeader::decode(&b, max);
    }

    #[test]
    fn decode_past_magic_and_version_respects_caps(
        kind in prop_oneof![0u8..=5, any::<u8>()],
        dtype in prop_oneof![0u8..=5, any::<u8>()],
        rest in prop::array::uniform::<_, 32>(any::<u8>()),
        n_tokens in prop_oneof![0u32..=4, any::<u32>()],
        len in prop_oneof![0u32..=64, any::<u32>()],
        flags in prop_oneof![0u32..=1, any::<u32>()],
        reserved in prop_oneof![Just(0u32), any::<u32>()],
        max in prop_oneof![0u32..=64, any::<u32>()],
    ) {
        let mut b = [0u8; HEADER_LEN];
        b[0..4].copy_from_slice(&FRAME_MAGIC);
        b[4..6].copy_from_slice(&FRAME_VERSION.to_le_bytes());
        b[6] = kind;
        b[7] = dtype;
        b[8..40].copy_from_slice(&rest);
        // Structured fields most of the time, so decoding reaches its later checks.
        b[20..24].copy_from_slice(&n_tokens.to_le_bytes());
        b[24..28].copy_from_slice(&len.to_le_bytes());
        b[28..32].copy_from_slice(&flags.to_le_bytes());
        b[32..36].copy_from_slice(&reserved.to_le_bytes());
        if let Ok(h) = FrameHeader::decode(&b, max) {
            prop_assert_eq!(h.flags & !KNOWN_FLAGS, 0);
            prop_assert_eq!(u32::from_le_bytes([b[32], b[33], b[34], b[35]]), 0);
            if h.kind == FrameKind::Control {
                prop_assert!(h.len <= MAX_CONTROL_LEN);
                prop_assert_eq!(h.dtype, Dtype::Bytes);
            } else if h.kind == FrameKind::Slice {
                prop_assert!(h.len <= max);
                prop_assert_eq!(h.dtype, Dtype::Bytes);
            } else {
                prop_assert!(h.len <= max);
                prop_assert!(h.dtype != Dtype::Bytes);
                prop_assert!(h.n_tokens > 0);
                prop_assert!(h.len > 0);
                prop_assert_eq!(h.len % h.n_tokens, 0);
                prop_assert_eq!(h.bytes_per_token() * h.n_tokens as usize, h.len as usize);
            }
            prop_assert_eq!(h.encode(), b);
        }
    }

    #[test]
    fn oversized_control_frames_are_too_large(len in MAX_CONTROL_LEN + 1..=u32::MAX,
                                              max in any::<u32>()) {
        // The control cap holds whatever the receiver's data cap is.
        let r = FrameHeader::decode(&raw_header(1, 0, 0, len, 0, 0), max);
        prop_assert!(
            matches!(r, Err(ProtocolError::TooLarge { len: l, max: m, .. })
                if l == len as u64 && m == MAX_CONTROL_LEN as u64),
            "got {:?}", r
        );
    }

    #[test]
    fn oversized_data_frames_are_too_large(max in 0u32..u32::MAX, extra in 1u32..=1 << 20,
                                           kind in 2u8..=3, dtype in 1u8..=4) {
        let len = max.saturating_add(extra);
        let r = FrameHeader::decode(&raw_header(kind, dtype, 1, len, 0, 0), max);
        prop_assert!(
            matches!(r, Err(ProtocolError::TooLarge { len: l, max: m, .. })
                if l == len as u64 && m == max as u64),
            "got {:?}", r
        );
    }

    #[test]
    fn data_len_must_split_into_tokens(n in 2u32..=4096, per_token in 1u32..=4096,
                                       off in 1u32..=4095, kind in 2u8..=3, dtype in 1u8..=4) {
        let off = 1 + off % (n - 1);
        let good = FrameHeader::decode(&raw_header(kind, dtype, n, n * per_token, 0, 0), u32::MAX);
        prop_assert!(good.is_ok(), "got {:?}", good);
        let bad = FrameHeader::decode(
            &raw_header(kind, dtype, n, n * per_token + off, 0, 0), u32::MAX);
        prop_assert!(matches!(bad, Err(ProtocolError::Inconsistent(_))), "got {:?}", bad);
        let zero = FrameHeader::decode(&raw_header(kind, dtype, 0, n * per_token, 0, 0), u32::MAX);
        prop_assert!(matches!(zero, Err(ProtocolError::Inconsistent(_))), "got {:?}", zero);
    }

    #[test]
    fn unknown_flags_and_reserved_bits_are_refused(
        flag_bit in prop_oneof![2u32..8, 16u32..32],
        reserved in 1u32..,
    ) {
        let f = FrameHeader::decode(&raw_header(2, 1, 1, 4, 1 << flag_bit, 0), u32::MAX);
        prop_assert!(
            matches!(f, Err(ProtocolError::BadField { field: "frame flags", .. })),
            "got {:?}", f
        );
        let r = FrameHeader::decode(&raw_header(2, 1, 1, 4, 0, reserved), u32::MAX);
        prop_assert!(
            matches!(r, Err(ProtocolError::BadField { field: "frame reserved word", .. })),
            "got {:?}", r
        );
    }
}

proptest! {
    /// Bits 8..16 carry a multi-round ring's round: any round decodes and comes back.
    #[test]
    fn a_frames_round_rides_in_its_flags(round in 0usize..256, more in any::<bool>()) {
        let base = if more { ringllm_protocol::frame::FLAG_MORE } else { 0 };
        let flags = ringllm_protocol::frame::with_round(base, round);
        let h = FrameHeader::decode(&raw_header(2, 1, 1, 4, flags, 0), u32::MAX);
        prop_assert!(h.is_ok(), "got {:?}", h);
        let h = h.unwrap();
        prop_assert_eq!(ringllm_protocol::frame::round_of(h.flags), round);
        prop_assert_eq!(h.flags & ringllm_protocol::frame::FLAG_MORE != 0, more);
    }
}

#[test]
fn header_spot_checks() {
    // Baseline: a well-formed data header decodes.
    assert!(FrameHeader::decode(&raw_header(2, 1, 1, 4, 0, 0), 4).is_ok());
    assert!(FrameHeader::decode(&raw_header(3, 4, 1, 34, FLAG_ALL_TOKENS, 0), 34).is_ok());
    // Zero tokens, zero length.
    assert!(matches!(
        FrameHeader::decode(&raw_header(2, 1, 0, 4, 0, 0), u32::MAX),
        Err(ProtocolError::Inconsistent(_))
    ));
    assert!(matches!(
        FrameHeader::decode(&raw_header(2, 1, 1, 0, 0, 0), u32::MAX),
        Err(ProtocolError::Inconsistent(_))
    ));
    // A control frame may be empty and ignores n_tokens.
    assert!(FrameHeader::decode(&raw_header(1, 0, 0, 0, 0, 0), 0).is_ok());
    assert!(FrameHeader::decode(&raw_header(1, 0, 5, MAX_CONTROL_LEN, 0, 0), 0).is_ok());
    // Kind and dtype that do not go together.
    for (kind, dtype) in [(1u8, 1u8), (1, 4), (2, 0), (3, 0), (4, 1), (4, 2)] {
        let r = FrameHeader::decode(&raw_header(kind, dtype, 1, 4, 0, 0), u32::MAX);
        assert!(
            matches!(
                r,
                Err(ProtocolError::BadField {
                    field: "frame dtype for its kind",
                    ..
                })
            ),
            "kind {kind} dtype {dtype}: {r:?}"
        );
    }
    // Unknown kind and dtype values.
    for kind in [0u8, 5, 255] {
        let r = FrameHeader::decode(&raw_header(kind, 1, 1, 4, 0, 0), u32::MAX);
        assert!(
            matches!(
                r,
                Err(ProtocolError::BadField {
                    field: "frame kind",
                    ..
                })
            ),
            "{r:?}"
        );
    }
    for dtype in [5u8, 255] {
        let r = FrameHeader::decode(&raw_header(2, dtype, 1, 4, 0, 0), u32::MAX);
        assert!(
            matches!(
                r,
                Err(ProtocolError::BadField {
                    field: "frame dtype",
                    ..
                })
            ),
            "{r:?}"
        );
    }
    // Wrong magic and wrong version.
    let mut b = raw_header(2, 1, 1, 4, 0, 0);
    b[0..4].copy_from_slice(b"GET ");
    assert!(matches!(
        FrameHeader::decode(&b, u32::MAX),
        Err(ProtocolError::BadMagic { found, .. }) if &found == b"GET "
    ));
    let mut b = raw_header(2, 1, 1, 4, 0, 0);
    b[4..6].copy_from_slice(&2u16.to_le_bytes());
    assert!(matches!(
        FrameHeader::decode(&b, u32::MAX),
        Err(ProtocolError::Version {
            ours: 1,
            theirs: 2,
            ..
        })
    ));
}

// ---------------------------------------------------------------------------------------------
// Pinned wire values

#[test]
fn golden_frame_header() {
    // Written out by hand from the layout in `frame`'s doc comment; the CRC32C (Castagnoli)
    // of bytes 0..36 followed by the payload 00 01 .. 0b was computed independently.
    const GOLDEN: [u8; 40] = [
        0x52, 0x4c, 0x46, 0x52, // "RLFR"
        0x01, 0x00, // version 1
        0x02, // kind Hidden
        0x02, // dtype F16
        0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01, // seq 0x0102030405060708
        0x44, 0x33, 0x22, 0x11, // pos 0x11223344
        0x03, 0x00, 0x00, 0x00, // n_tokens 3
        0x0c, 0x00, 0x00, 0x00, // len 12
        0x01, 0x00, 0x00, 0x00, // flags FLAG_ALL_TOKENS
        0x00, 0x00, 0x00, 0x00, // reserved
        0x68, 0xd8, 0x71, 0x6a, // crc 0x6a71d868
    ];
    let payload: Vec<u8> = (0u8..12).collect();
    let h = FrameHeader::new(
        FrameKind::Hidden,
        Dtype::F16,
        0x0102_0304_0506_0708,
        0x1122_3344,
        3,
        FLAG_ALL_TOKENS,
        &payload,
    )
    .unwrap();
    assert_eq!(h.crc, 0x6a71_d868);
    assert_eq!(h.encode(), GOLDEN);
    let d = FrameHeader::decode(&GOLDEN, 12).unwrap();
    assert_eq!(d, h);
    d.verify(&payload).unwrap();
    assert_eq!(d.bytes_per_token(), 4);
}

#[test]
fn pinned_constants() {
    assert_eq!(HEADER_LEN, 40);
    assert_eq!(&FRAME_MAGIC, b"RLFR");
    assert_eq!(FRAME_VERSION, 1);
    assert_eq!(MAX_CONTROL_LEN, 1 << 20);
    assert_eq!(FLAG_ALL_TOKENS, 1);
    assert_eq!(MSG_HEADER_LEN, 7);
}

#[test]
fn pinned_frame_kind_and_dtype_values() {
    let kinds = [
        (FrameKind::Control, 1u8),
        (FrameKind::Hidden, 2),
        (FrameKind::Logits, 3),
        (FrameKind::Slice, 4),
    ];
    for (k, v) in kinds {
        assert_eq!(k as u8, v, "{k:?}");
        assert_eq!(FrameKind::from_u8(v), Some(k));
    }
    assert_eq!(FrameKind::from_u8(0), None);
    assert_eq!(FrameKind::from_u8(5), None);

    let dtypes = [
        (Dtype::Bytes, 0u8),
        (Dtype::F32, 1),
        (Dtype::F16, 2),
        (Dtype::Bf16, 3),
        (Dtype::Q8, 4),
    ];
    for (d, v) in dtypes {
        assert_eq!(d as u8, v, "{d:?}");
        assert_eq!(Dtype::from_u8(v), Some(d));
    }
    assert_eq!(Dtype::from_u8(5), None);
    // Names are used in configuration; `bytes` is not a tensor type.
    for d in DATA_DTYPES {
        assert_eq!(Dtype::from_name(d.name()), Some(d));
    }
    assert_eq!(Dtype::from_name("bytes"), None);
    assert_eq!(Dtype::Q8.bytes_for(64), Some(68));
    assert_eq!(Dtype::Q8.bytes_for(33), None);
    assert_eq!(Dtype::F32.bytes_for(3), Some(12));
    assert_eq!(Dtype::Bf16.bytes_for(3), Some(6));
    assert_eq!(Dtype::Bytes.bytes_for(3), None);
}

fn one_of_each_control() -> Vec<(Control, u8)> {
    let model = ModelIdentity {
        file_name: "m.gguf".into(),
        size: 1,
        header_hash: 2,
    };
    vec![
        (
            Control::Capabilities(Capabilities {
                node_name: "n".into(),
                version: "0.1".into(),
                memory_total: 1,
                memory_available: 1,
                threads: 1,
                cpu_features: vec!["avx2".into()],
                isa: "scalar".into(),
                matvec_bytes_per_s: 1.5,
                models: vec![model.clone()],
                transport: TransportKind::Quic,
                disk_read_bytes_per_s: 1e9,
                backend: "cpu".into(),
            }),
            0,
        ),
        (
            Control::Assign(Assignment {
                session: 1,
                model,
                layer_start: 0,
                layer_end: 4,
                head: true,
                input: Input::Upstream,
                next_hop: NextHop::Node {
                    name: "b".into(),
                    address: "10.0.0.2:7000".into(),
                    transport: TransportKind::Udp,
                },
                activations: Dtype::F16,
                kv_ctx: 4096,
                kv_type: KvType::F16,
                max_batch: 32,
                threads: 0,
                kv_slots: 8,
                layout: StageLayout {
                    windows: vec![(0, 2), (4, 6)],
                    streamed: vec![5],
                    prefetch: 2,
                    stream_all: false,
                    skip_predictor: vec![1, 2, 3],
                    skip_confidence_ppm: 990_000,
                    skip_max: 5,
                },
            }),
            1,
        ),
        (
            Control::Ready(Ready {
                session: 1,
                layer_start: 0,
                layer_end: 4,
                weight_bytes: 5,
                kv_bytes: 6,
                rss_bytes: 7,
                load_ms: 8,
            }),
            2,
        ),
        (
            Control::Heartbeat {
                nonce: 9,
                reply: true,
            },
            3,
        ),
        (Control::Stats(Stats::default()), 4),
        (Control::ReleaseSequence { seq: 3 }, 5),
        (
            Control::Error(ErrorMsg {
                code: ErrorCode::Busy,
                seq: Some(4),
                message: "busy".into(),
            }),
            6,
        ),
        (
            Control::Shutdown {
                reason: "bye".into(),
            },
            7,
        ),
        (Control::GetStats, 8),
        (
            Control::Attach {
                session: 1,
                from: "a".into(),
                input: true,
                output: false,
                transport: TransportKind::Udp,
                udp_port: 40000,
            },
            9,
        ),
        (Control::SliceOffer(slice_offer_example()), 10),
        (
            Control::SliceNeed(SliceNeed {
                key: slice_offer_example().key,
                pieces: vec![1, 3],
                have_bytes: 7,
            }),
            11,
        ),
        (
            Control::SliceProgress(SliceProgress {
                key: slice_offer_example().key,
                received: 5,
                done: true,
                bad: vec![2],
            }),
            12,
        ),
        (Control::GetStatus, 13),
        (Control::Status(Box::new(node_status_example())), 14),
    ]
}

fn node_status_example() -> NodeStatus {
    NodeStatus {
        node_name: "n".into(),
        version: "0.1".into(),
        listen: "0.0.0.0:7701".into(),
        transport: TransportKind::Udp,
        threads: 2,
        isa: "avx2".into(),
        memory_total: 8 << 30,
        memory_budget: 2 << 30,
        matvec_bytes_per_s: 1e10,
        disk_read_bytes_per_s: 2e9,
        uptime_ms: 1234,
        coordinator: Some(Holder {
            name: "master".into(),
            address: "10.0.0.1:50000".into(),
            held_ms: 99,
        }),
        stage: Some(StageStatus {
            session: 7,
            model: "m.gguf".into(),
            layer_start: 0,
            layer_end: 15,
            head: false,
            windows: vec![(0, 5), (10, 15)],
            streamed_layers: 3,
            weight_bytes: 1 << 20,
            kv_bytes: 1 << 10,
        }),
        stats: Stats {
            bytes_in: 5,
            ..Stats::default()
        },
        bytes_in_per_s: 1.5,
        bytes_out_per_s: 2.5,
        tokens_per_s: 3.5,
    }
}

fn slice_offer_example() -> SliceOffer {
    SliceOffer {
        key: SliceKey {
            model: ModelIdentity {
                file_name: "m.gguf".into(),
                size: 10,
                header_hash: 11,
            },
            layer_start: 0,
            layer_end: 4,
            head: true,
        },
        size: 96,
        pieces: vec![Piece {
            name: "header".into(),
            offset: 0,
            len: 96,
            hash: [7; 32],
        }],
        dry_run: false,
        discard: false,
    }
}

#[test]
fn pinned_control_discriminants() {
    let all = one_of_each_control();
    assert_eq!(all.len(), 15);
    for (msg, index) in all {
        let b = msg.encode().unwrap();
        assert_eq!(
            b[0],
            index,
            "{} encodes with variant index {}",
            msg.name(),
            b[0]
        );
        assert_eq!(Control::decode(&b).unwrap(), msg);
    }
    // Small fixed encodings.
    assert_eq!(Control::GetStats.encode().unwrap(), [8]);
    assert_eq!(Control::GetStatus.encode().unwrap(), [13]);
    assert_eq!(
        Control::ReleaseSequence { seq: 3 }.encode().unwrap(),
        [5, 3]
    );
    assert_eq!(
        Control::Heartbeat {
            nonce: 9,
            reply: true
        }
        .encode()
        .unwrap(),
        [3, 9, 1]
    );
}

#[test]
fn pinned_kv_types() {
    // serde writes a unit variant as its index in declaration order.
    assert_eq!(KvType::F32 as u8, 0);
    assert_eq!(KvType::F16 as u8, 1);
    for k in KvType::ALL {
        assert_eq!(k.name().parse::<KvType>(), Ok(k));
        assert_eq!(k.name().to_uppercase().parse::<KvType>(), Ok(k));
    }
    assert!("q8".parse::<KvType>().is_err());
}

#[test]
fn pinned_error_codes() {
    let expected = [
        (ErrorCode::BadRequest, 0u8),
        (ErrorCode::ModelMissing, 1),
        (ErrorCode::ModelMismatch, 2),
        (ErrorCode::OutOfMemory, 3),
        (ErrorCode::NextHopUnreachable, 4),
        (ErrorCode::Busy, 5),
        (ErrorCode::Compute, 6),
        (ErrorCode::Internal, 7),
        (ErrorCode::CacheFull, 8),
    ];
    for (code, v) in expected {
        let b = Control::Error(ErrorMsg {
            code,
            seq: None,
            message: String::new(),
        })
        .encode()
        .unwrap();
        // Variant Error (6), the code, `None` (0), an empty message (0).
        assert_eq!(b, [6, v, 0, 0], "{code:?}");
    }
}

#[test]
fn control_to_frame_is_a_valid_control_frame() {
    for (msg, _) in one_of_each_control() {
        let (h, payload) = msg.to_frame().unwrap();
        assert_eq!(h.kind, FrameKind::Control);
        assert_eq!(h.dtype, Dtype::Bytes);
        let d = FrameHeader::decode(&h.encode(), 0).unwrap();
        d.verify(&payload).unwrap();
        assert_eq!(Control::decode(&payload).unwrap(), msg);
    }
}

// ---------------------------------------------------------------------------------------------
// Control message properties

proptest! {
    #[test]
    fn control_round_trips(msg in control()) {
        let b = msg.encode().expect("small messages encode");
        prop_assert!(b.len() <= MAX_CONTROL_LEN as usize);
        prop_assert_eq!(Control::decode(&b).expect("own encoding decodes"), msg);
    }

    #[test]
    fn control_truncations_and_trailers_are_refused(msg in control(),
                                                    tail in prop::collection::vec(any::<u8>(), 1..8)) {
        let b = msg.encode().unwrap();
        for cut in 0..b.len() {
            let r = Control::decode(&b[..cut]);
            prop_assert!(r.is_err(), "{}-byte prefix of {} decoded: {:?}", cut, msg.name(), r);
        }
        let mut longer = b.clone();
        longer.extend_from_slice(&tail);
        let r = Control::decode(&longer);
        prop_assert!(matches!(r, Err(ProtocolError::Control(_))), "got {:?}", r);
    }

    #[test]
    fn control_decode_of_random_bytes_never_panics(b in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = Control::decode(&b);
    }

    #[test]
    fn control_decode_of_mutated_encodings_never_panics(msg in control(),
                                                        at in any::<prop::sample::Index>(),
                                                        byte in any::<u8>()) {
        let mut b = msg.encode().unwrap();
        let i = at.index(b.len());
        b[i] = byte;
        let _ = Control::decode(&b);
    }
}

#[test]
fn control_huge_claimed_lengths_are_refused() {
    // bincode varints: a byte up to 250 is the value; 0xFB, 0xFC, 0xFD announce a u16, u32,
    // u64 that follows.
    let huge = (u64::MAX / 2).to_le_bytes();
    for marker in [0xFBu8, 0xFD] {
        // Capabilities (0), node_name claiming a huge length.
        let mut b = vec![0u8, marker];
        b.extend_from_slice(&huge);
        assert!(Control::decode(&b).is_err(), "marker {marker:#x}");
        b.extend_from_slice(&[b'x'; 64]);
        assert!(Control::decode(&b).is_err(), "marker {marker:#x}");

        // Capabilities with empty strings and zero numbers up to cpu_features, then a Vec
        // claiming a huge number of elements.
        let mut b = vec![0u8, 0, 0, 0, 0, 0, marker];
        b.extend_from_slice(&huge);
        assert!(Control::decode(&b).is_err(), "marker {marker:#x}");
    }
    // Capabilities.models: a Vec<ModelIdentity> claiming u64::MAX / 2 elements.
    let mut b = vec![0u8, 0, 0, 0, 0, 0, 0, 0];
    b.extend_from_slice(&1.0f64.to_le_bytes());
    b.push(0xFD);
    b.extend_from_slice(&huge);
    assert!(Control::decode(&b).is_err());

    // Shutdown: a u32 claim just over the cap, and one under the cap with no bytes behind it.
    let mut b = vec![7u8, 0xFC];
    b.extend_from_slice(&(MAX_CONTROL_LEN + 1).to_le_bytes());
    assert!(Control::decode(&b).is_err());
    let mut b = vec![7u8, 0xFC];
    b.extend_from_slice(&(MAX_CONTROL_LEN / 2).to_le_bytes());
    assert!(Control::decode(&b).is_err());

    // Unknown variant indexes.
    assert!(Control::decode(&[15]).is_err());
    // Status (14) with nothing behind it, and with a name claiming a huge length.
    assert!(Control::decode(&[14]).is_err());
    let mut b = vec![14u8, 0xFD];
    b.extend_from_slice(&huge);
    assert!(Control::decode(&b).is_err());
    assert!(Control::decode(&[250]).is_err());
    assert!(Control::decode(&[]).is_err());
}

#[test]
fn control_size_cap_applies_both_ways() {
    let big = Control::Shutdown {
        reason: "x".repeat(MAX_CONTROL_LEN as usize + 1),
    };
    assert!(big.encode().is_err());
    assert!(big.to_frame().is_err());
    let bytes = vec![8u8; MAX_CONTROL_LEN as usize + 1];
    assert!(matches!(
        Control::decode(&bytes),
        Err(ProtocolError::TooLarge { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// Handshake message properties

fn truncate(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}

proptest! {
    #[test]
    fn hs_round_trips(msg in hs_msg()) {
        let b = msg.encode();
        prop_assert_eq!(&b[0..4], b"RLHS");
        prop_assert_eq!(b.len(), MSG_HEADER_LEN + u16::from_le_bytes([b[5], b[6]]) as usize);
        prop_assert_eq!(HsMsg::decode(&b).expect("own encoding decodes"), msg);
    }

    #[test]
    fn hs_long_names_are_truncated_on_a_char_boundary(mut h in hello(), name in "\\PC{60,80}") {
        h.name = name.clone();
        let d = HsMsg::decode(&HsMsg::Hello(h.clone()).encode()).expect("decodes");
        h.name = truncate(&name, MAX_NAME).to_string();
        prop_assert_eq!(d, HsMsg::Hello(h));
    }

    #[test]
    fn hs_truncations_and_trailers_are_refused(msg in hs_msg(), extra in any::<u8>()) {
        let b = msg.encode();
        for cut in 0..b.len() {
            let r = HsMsg::decode(&b[..cut]);
            prop_assert!(r.is_err(), "{}-byte prefix decoded: {:?}", cut, r);
        }
        let mut longer = b;
        longer.push(extra);
        prop_assert!(HsMsg::decode(&longer).is_err());
    }

    #[test]
    fn hs_decode_of_random_bytes_never_panics(b in prop::collection::vec(any::<u8>(), 0..128)) {
        let _ = HsMsg::decode(&b);
        if b.len() >= MSG_HEADER_LEN {
            let head: [u8; MSG_HEADER_LEN] = b[..MSG_HEADER_LEN].try_into().unwrap();
            let _ = HsMsg::decode_header(&head);
        }
    }

    #[test]
    fn hs_random_bodies_never_panic(t in 0u8..=6, body in prop::collection::vec(any::<u8>(), 0..100)) {
        // A correct header in front of a random body, so the body parser is reached.
        let mut b = b"RLHS".to_vec();
        b.push(t);
        b.extend_from_slice(&(body.len() as u16).to_le_bytes());
        b.extend_from_slice(&body);
        let r = HsMsg::decode(&b);
        // Types 1-4 since protocol 3.0; 5, `Ident`, since 3.2.
        if !(1..=5).contains(&t) {
            prop_assert!(
                matches!(r, Err(ProtocolError::BadField { field: "handshake message type", .. })),
                "got {:?}", r
            );
        }
        let _ = HsMsg::decode_body(t, &body);
    }

    #[test]
    fn hs_mutated_hellos_never_panic(h in hello(), at in any::<prop::sample::Index>(), byte in any::<u8>()) {
        let mut b = HsMsg::Hello(h).encode();
        let i = at.index(b.len());
        b[i] = byte;
        let _ = HsMsg::decode(&b);
    }
}

#[test]
fn hs_header_checks() {
    assert!(matches!(
        HsMsg::decode(b"GET / HTTP/1.1\r\n"),
        Err(ProtocolError::BadMagic { what: "handshake", found }) if &found == b"GET "
    ));
    let mut b = *b"RLHS\x01\x00\x00";
    b[5..7].copy_from_slice(&(MAX_BODY as u16 + 1).to_le_bytes());
    assert!(matches!(
        HsMsg::decode_header(&b),
        Err(ProtocolError::TooLarge { .. })
    ));
    b[5..7].copy_from_slice(&(MAX_BODY as u16).to_le_bytes());
    assert_eq!(HsMsg::decode_header(&b).unwrap(), (1, MAX_BODY));
    // Accept with a body, a proof of the wrong size, an unknown role.
    assert!(HsMsg::decode(b"RLHS\x03\x01\x00x").is_err());
    assert!(HsMsg::decode(b"RLHS\x02\x01\x00x").is_err());
    let mut hello = HsMsg::Hello(Hello {
        major: 1,
        minor: 0,
        caps: 1,
        role: Role::Node,
        cluster_id: [1; 8],
        nonce: [2; 32],
        name: "n".into(),
    })
    .encode();
    assert_eq!(hello[MSG_HEADER_LEN + 12], 3, "role Node is 3 on the wire");
    hello[MSG_HEADER_LEN + 12] = 9;
    assert!(matches!(
        HsMsg::decode(&hello),
        Err(ProtocolError::BadField {
            field: "handshake role",
            value: 9
        })
    ));
}
