//! Per-frame authentication after the handshake.
//!
//! The handshake proves both ends hold the cluster key and gives them a session key no one
//! else knows. Every later frame (or datagram) carries a 24-byte seal: a 64-bit counter and a
//! 16-byte tag over the counter and the bytes it covers, keyed by a key for that direction of
//! that connection only. A frame from a machine without the key fails the tag; a replayed
//! frame fails the counter; both are refused and counted.
//!
//! ```text
//! stream frames:  seal = counter (u64 LE) ‖ BLAKE3-keyed(K_dir, "RLSL" ‖ counter ‖ bytes)[..16]
//! datagrams:      seal = counter (u64 LE) ‖ AES-128-GMAC(K_dir', nonce from counter, bytes)
//! K_c2s = HMAC-SHA256(session key, "ringllm link c2s v1"), K_s2c likewise
//! ```
//!
//! Stream transports (TCP, io_uring: `Sealer`, `Opener`) put the seal after each frame's
//! payload and require the counter to be exactly one more than the last (a stream cannot
//! reorder, so anything else is an injection). BLAKE3 rather than HMAC-SHA256 for speed (4.9
//! against 1.2 GB/s on a 16 KB frame, 7.6 against 1.2 on 1 MiB with AVX-512); like HMAC it is
//! a PRF, so a reused counter would leak nothing. Datagram transports (reliable UDP:
//! `DatagramSealer`, `DatagramOpener`) seal every datagram with GMAC, faster still on a
//! 1.4 KB datagram, which needs each counter used once per key (see `DatagramSealer`), and
//! accept counters inside a 1,024-wide sliding window, each once.
//!
//! This gives integrity and authenticity, not confidentiality: QUIC links add encryption.

use crate::key::HmacSha256;
use hmac::{KeyInit, Mac};

pub const TAG_LEN: usize = 16;
/// Bytes a seal adds: the counter and the tag.
pub const SEAL_LEN: usize = 8 + TAG_LEN;
/// Counters older than this many below the highest seen are refused on datagram links.
pub const REPLAY_WINDOW: u64 = 1024;
const DOMAIN: &[u8; 4] = b"RLSL";

/// The two MAC keys of one connection, one per direction.
#[derive(Clone)]
pub struct LinkKeys {
    pub send: [u8; 32],
    pub recv: [u8; 32],
}

impl std::fmt::Debug for LinkKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LinkKeys(..)")
    }
}

fn derive_one(session_key: &[u8; 32], label: &[u8]) -> [u8; 32] {
    let mut m = <HmacSha256 as KeyInit>::new_from_slice(session_key)
        .expect("HMAC takes keys of any length");
    m.update(label);
    m.finalize().into_bytes().into()
}

impl LinkKeys {
    /// The keys as seen from one end: the initiator sends with the client-to-server key.
    pub fn derive(session_key: &[u8; 32], initiator: bool) -> LinkKeys {
        let c2s = derive_one(session_key, b"ringllm link c2s v1");
        let s2c = derive_one(session_key, b"ringllm link s2c v1");
        if initiator {
            LinkKeys {
                send: c2s,
                recv: s2c,
            }
        } else {
            LinkKeys {
                send: s2c,
                recv: c2s,
            }
        }
    }

    /// Independent keys for one use of this connection (e.g. `b"udp"` for the datagrams of a
    /// link negotiated on it), so a frame of one kind can never pass as the other.
    pub fn sub(&self, label: &[u8]) -> LinkKeys {
        let one = |k: &[u8; 32]| {
            let mut m = keyed(k);
            m.update(b"ringllm sub key v1\0");
            m.update(label);
            let out: [u8; 32] = m.finalize().into_bytes().into();
            out
        };
        LinkKeys {
            send: one(&self.send),
            recv: one(&self.recv),
        }
    }

    /// The same keys seen from the other end.
    pub fn swapped(&self) -> LinkKeys {
        LinkKeys {
            send: self.recv,
            recv: self.send,
        }
    }
}

/// Why a sealed frame or datagram was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum SealError {
    /// The tag does not match the bytes: forged, corrupted, or sealed with another key.
    #[error("message authentication failed (forged, corrupted, or sent with another key)")]
    BadMac,
    /// A stream frame whose counter is not the next one: replayed, dropped or reordered.
    #[error("replayed or out-of-order frame: counter {got}, expected {expected}")]
    OutOfOrder { got: u64, expected: u64 },
    /// A datagram whose counter was already accepted.
    #[error("replayed datagram: counter {0} was already accepted")]
    Replay(u64),
    /// A datagram older than the replay window can tell apart from a replay.
    #[error(
        "stale datagram: counter {got} is more than {REPLAY_WINDOW} below the newest {newest}"
    )]
    Stale { got: u64, newest: u64 },
}

fn tag(key: &[u8; 32], counter: u64, parts: &[&[u8]]) -> [u8; TAG_LEN] {
    let mut m = blake3::Hasher::new_keyed(key);
    m.update(DOMAIN);
    m.update(&counter.to_le_bytes());
    for p in parts {
        m.update(p);
    }
    let full = m.finalize();
    let mut t = [0u8; TAG_LEN];
    t.copy_from_slice(&full.as_bytes()[..TAG_LEN]);
    t
}

fn keyed(key: &[u8; 32]) -> HmacSha256 {
    <HmacSha256 as KeyInit>::new_from_slice(key).expect("HMAC takes keys of any length")
}

/// Seals outgoing frames of one direction. Counters start at 1 and never repeat.
#[derive(Clone)]
pub struct Sealer {
    key: [u8; 32],
    next: u64,
}

impl Sealer {
    pub fn new(key: &[u8; 32]) -> Sealer {
        Sealer { key: *key, next: 1 }
    }

    /// The seal for the next frame, whose covered bytes are the concatenation of `parts`.
    pub fn seal(&mut self, parts: &[&[u8]]) -> [u8; SEAL_LEN] {
        let c = self.next;
        self.next += 1;
        self.seal_as(c, parts)
    }

    /// The next counter `seal` would use, and advances past it (datagram transports put the
    /// counter in their own header and call `tag_for`).
    pub fn next_counter(&mut self) -> u64 {
        let c = self.next;
        self.next += 1;
        c
    }

    /// The seal for an explicit counter (the caller guarantees it is never reused).
    pub fn seal_as(&self, counter: u64, parts: &[&[u8]]) -> [u8; SEAL_LEN] {
        let mut s = [0u8; SEAL_LEN];
        s[..8].copy_from_slice(&counter.to_le_bytes());
        s[8..].copy_from_slice(&tag(&self.key, counter, parts));
        s
    }

    /// Only the tag for `counter`.
    pub fn tag_for(&self, counter: u64, parts: &[&[u8]]) -> [u8; TAG_LEN] {
        tag(&self.key, counter, parts)
    }
}

/// Checks incoming frames of one direction.
#[derive(Clone)]
pub struct Opener {
    key: [u8; 32],
    window: ReplayWindow,
}

impl Opener {
    pub fn new(key: &[u8; 32]) -> Opener {
        Opener {
            key: *key,
            window: ReplayWindow::default(),
        }
    }

    /// True when `tag` is right for `counter` and `parts` (constant time), without touching
    /// the replay state.
    pub fn tag_ok(&self, counter: u64, parts: &[&[u8]], tag_in: &[u8]) -> bool {
        let want = tag(&self.key, counter, parts);
        crate::key::ct_eq(&want, tag_in)
    }

    /// Stream links: the seal must be right and its counter exactly the next one.
    pub fn open_in_order(&mut self, seal: &[u8], parts: &[&[u8]]) -> Result<u64, SealError> {
        let (counter, tag_in) = split(seal)?;
        if !self.tag_ok(counter, parts, tag_in) {
            return Err(SealError::BadMac);
        }
        let expected = self.window.newest + 1;
        if counter != expected {
            return Err(SealError::OutOfOrder {
                got: counter,
                expected,
            });
        }
        self.window.newest = counter;
        Ok(counter)
    }

    /// Datagram links: the seal must be right and its counter new and inside the window.
    pub fn open_datagram(&mut self, seal: &[u8], parts: &[&[u8]]) -> Result<u64, SealError> {
        let (counter, tag_in) = split(seal)?;
        self.window.check(counter)?;
        if !self.tag_ok(counter, parts, tag_in) {
            return Err(SealError::BadMac);
        }
        self.window.accept(counter);
        Ok(counter)
    }
}

fn split(seal: &[u8]) -> Result<(u64, &[u8]), SealError> {
    if seal.len() != SEAL_LEN {
        return Err(SealError::BadMac);
    }
    let mut c = [0u8; 8];
    c.copy_from_slice(&seal[..8]);
    Ok((u64::from_le_bytes(c), &seal[8..]))
}

/// Which counters were seen, for the newest `REPLAY_WINDOW` counters. Counter 0 is never
/// valid (senders start at 1).
#[derive(Clone, Debug)]
pub struct ReplayWindow {
    newest: u64,
    /// Bit `i` of the window: counter `newest - i` was accepted.
    bits: [u64; (REPLAY_WINDOW / 64) as usize],
}

impl Default for ReplayWindow {
    fn default() -> Self {
        ReplayWindow {
            newest: 0,
            bits: [0; (REPLAY_WINDOW / 64) as usize],
        }
    }
}

impl ReplayWindow {
    pub fn newest(&self) -> u64 {
        self.newest
    }

    fn bit(&self, back: u64) -> bool {
        let (w, b) = ((back / 64) as usize, back % 64);
        self.bits[w] >> b & 1 == 1
    }

    /// Whether `counter` could be accepted (without recording it).
    pub fn check(&self, counter: u64) -> Result<(), SealError> {
        if counter == 0 {
            return Err(SealError::Replay(0));
        }
        if counter > self.newest {
            return Ok(());
        }
        let back = self.newest - counter;
        if back >= REPLAY_WINDOW {
            return Err(SealError::Stale {
                got: counter,
                newest: self.newest,
            });
        }
        if self.bit(back) {
            return Err(SealError::Replay(counter));
        }
        Ok(())
    }

    /// Records `counter` (call after `check` and the tag passed).
    pub fn accept(&mut self, counter: u64) {
        if counter > self.newest {
            self.shift(counter - self.newest);
            self.newest = counter;
        }
        let back = self.newest - counter;
        if back < REPLAY_WINDOW {
            let (w, b) = ((back / 64) as usize, back % 64);
            self.bits[w] |= 1 << b;
        }
    }

    /// Moves the window forward by `n` counters.
    fn shift(&mut self, n: u64) {
        if n >= REPLAY_WINDOW {
            self.bits = [0; (REPLAY_WINDOW / 64) as usize];
            return;
        }
        let words = (n / 64) as usize;
        let bits = (n % 64) as u32;
        let len = self.bits.len();
        for i in (0..len).rev() {
            let src = i.checked_sub(words);
            let hi = src.map_or(0, |s| self.bits[s]);
            let lo = src
                .and_then(|s| s.checked_sub(1))
                .map_or(0, |s| self.bits[s]);
            self.bits[i] = if bits == 0 {
                hi
            } else {
                hi << bits | lo >> (64 - bits)
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair() -> (Sealer, Opener) {
        let k = LinkKeys::derive(&[7u8; 32], true);
        let other = LinkKeys::derive(&[7u8; 32], false);
        assert_eq!(k.send, other.recv);
        assert_eq!(k.recv, other.send);
        assert_ne!(k.send, k.recv);
        (Sealer::new(&k.send), Opener::new(&other.recv))
    }

    #[test]
    fn stream_seals_open_in_order_and_refuse_tampering_and_replay() {
        let (mut s, mut o) = pair();
        let a = s.seal(&[b"head", b"payload"]);
        let b = s.seal(&[b"head", b"second"]);
        assert_eq!(o.open_in_order(&a, &[b"head", b"payload"]), Ok(1));
        // Replaying the first frame is out of order even with a valid tag.
        assert_eq!(
            o.open_in_order(&a, &[b"head", b"payload"]),
            Err(SealError::OutOfOrder {
                got: 1,
                expected: 2
            })
        );
        // A flipped payload bit fails the tag.
        assert_eq!(
            o.open_in_order(&b, &[b"head", b"secone"]),
            Err(SealError::BadMac)
        );
        // The split between parts does not matter, only the bytes.
        assert_eq!(o.open_in_order(&b, &[b"heads", b"econd"]), Ok(2));
    }

    #[test]
    fn a_seal_made_with_another_session_key_fails() {
        let mut s = Sealer::new(&LinkKeys::derive(&[1u8; 32], true).send);
        let mut o = Opener::new(&LinkKeys::derive(&[2u8; 32], false).recv);
        let a = s.seal(&[b"x"]);
        assert_eq!(o.open_in_order(&a, &[b"x"]), Err(SealError::BadMac));
        // Our own direction's key is not the peer's.
        let k = LinkKeys::derive(&[1u8; 32], true);
        let mut o = Opener::new(&k.send.map(|b| b ^ 1));
        assert_eq!(o.open_datagram(&a, &[b"x"]), Err(SealError::BadMac));
    }

    #[test]
    fn datagram_window_accepts_reordering_once_and_refuses_stale() {
        let (s, mut o) = pair();
        let seal = |c: u64| s.seal_as(c, &[b"d"]);
        for c in [3u64, 1, 2, 10, 5] {
            assert_eq!(o.open_datagram(&seal(c), &[b"d"]), Ok(c));
        }
        for c in [3u64, 1, 10] {
            assert_eq!(
                o.open_datagram(&seal(c), &[b"d"]),
                Err(SealError::Replay(c))
            );
        }
        assert_eq!(o.open_datagram(&seal(2000), &[b"d"]), Ok(2000));
        assert_eq!(
            o.open_datagram(&seal(500), &[b"d"]),
            Err(SealError::Stale {
                got: 500,
                newest: 2000
            })
        );
        assert_eq!(o.open_datagram(&seal(1000), &[b"d"]), Ok(1000));
        assert_eq!(
            o.open_datagram(&seal(1000), &[b"d"]),
            Err(SealError::Replay(1000))
        );
        // A forged datagram with a fresh counter is refused and does not use the counter up.
        let mut forged = seal(1500);
        forged[10] ^= 1;
        assert_eq!(o.open_datagram(&forged, &[b"d"]), Err(SealError::BadMac));
        assert_eq!(o.open_datagram(&seal(1500), &[b"d"]), Ok(1500));
        assert_eq!(
            o.open_datagram(&seal(0), &[b"d"]),
            Err(SealError::Replay(0))
        );
    }

    #[test]
    fn window_matches_a_set_model() {
        // Pseudo-random counters against a plain set of everything accepted.
        let mut w = ReplayWindow::default();
        let mut seen = std::collections::HashSet::new();
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for _ in 0..20_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let newest = w.newest();
            let c = (newest + 40).saturating_sub(x % 1500).max(1);
            let model = if c + REPLAY_WINDOW <= newest {
                Err(SealError::Stale { got: c, newest })
            } else if seen.contains(&c) {
                Err(SealError::Replay(c))
            } else {
                Ok(())
            };
            assert_eq!(w.check(c), model, "counter {c}, newest {newest}");
            if model.is_ok() {
                w.accept(c);
                seen.insert(c);
            }
        }
    }
}

/// Datagram seals: AES-128-GMAC (GCM with the datagram as associated data and no plaintext,
/// ring's AES-NI/CLMUL code) under a key derived from the direction's key, the nonce being the
/// datagram's counter. About 3× keyed BLAKE3 on a 1.4 KB datagram, where BLAKE3 cannot use its
/// SIMD width. GMAC needs every counter used once per key: datagram links draw each one from a
/// single atomic counter, and a counter is never sealed twice.
pub struct DatagramSealer {
    key: ring::aead::LessSafeKey,
}

/// Checks datagram seals (see `DatagramSealer`) and the replay window.
pub struct DatagramOpener {
    key: ring::aead::LessSafeKey,
    window: ReplayWindow,
}

fn gmac_key(key: &[u8; 32]) -> ring::aead::LessSafeKey {
    let k = blake3::keyed_hash(key, b"ringllm datagram gmac key v1");
    let unbound = ring::aead::UnboundKey::new(&ring::aead::AES_128_GCM, &k.as_bytes()[..16])
        .expect("a 16-byte key is valid for AES-128-GCM");
    ring::aead::LessSafeKey::new(unbound)
}

fn gmac_nonce(counter: u64) -> ring::aead::Nonce {
    let mut n = [0u8; 12];
    n[4..].copy_from_slice(&counter.to_le_bytes());
    ring::aead::Nonce::assume_unique_for_key(n)
}

impl DatagramSealer {
    pub fn new(key: &[u8; 32]) -> DatagramSealer {
        DatagramSealer { key: gmac_key(key) }
    }

    /// The seal of the datagram bytes `covered` under `counter` (used for this datagram only).
    pub fn seal(&self, counter: u64, covered: &[u8]) -> [u8; SEAL_LEN] {
        let mut s = [0u8; SEAL_LEN];
        s[..8].copy_from_slice(&counter.to_le_bytes());
        let tag = self
            .key
            .seal_in_place_separate_tag(
                gmac_nonce(counter),
                ring::aead::Aad::from(covered),
                &mut [],
            )
            .expect("sealing an empty plaintext cannot overflow");
        s[8..].copy_from_slice(tag.as_ref());
        s
    }
}

impl DatagramOpener {
    pub fn new(key: &[u8; 32]) -> DatagramOpener {
        DatagramOpener {
            key: gmac_key(key),
            window: ReplayWindow::default(),
        }
    }

    /// The seal must be right and its counter new and inside the window.
    pub fn open(&mut self, seal: &[u8], covered: &[u8]) -> Result<u64, SealError> {
        let (counter, tag_in) = split(seal)?;
        self.window.check(counter)?;
        let mut tag = [0u8; TAG_LEN];
        tag.copy_from_slice(tag_in);
        self.key
            .open_in_place(
                gmac_nonce(counter),
                ring::aead::Aad::from(covered),
                &mut tag,
            )
            .map_err(|_| SealError::BadMac)?;
        self.window.accept(counter);
        Ok(counter)
    }
}

#[cfg(test)]
mod datagram_tests {
    use super::*;

    #[test]
    fn gmac_datagrams_open_once_and_refuse_forgery() {
        let k = LinkKeys::derive(&[9u8; 32], true);
        let s = DatagramSealer::new(&k.send);
        let mut o = DatagramOpener::new(&k.send);
        let a = s.seal(1, b"datagram one");
        assert_eq!(o.open(&a, b"datagram one"), Ok(1));
        assert_eq!(o.open(&a, b"datagram one"), Err(SealError::Replay(1)));
        let b = s.seal(2, b"datagram two");
        assert_eq!(o.open(&b, b"datagram twO"), Err(SealError::BadMac));
        // A refused forgery does not use the counter up.
        assert_eq!(o.open(&b, b"datagram two"), Ok(2));
        let mut c = s.seal(3, b"x");
        c[20] ^= 4;
        assert_eq!(o.open(&c, b"x"), Err(SealError::BadMac));
        // Another direction's key fails.
        let mut other = DatagramOpener::new(&k.recv);
        assert_eq!(other.open(&s.seal(4, b"y"), b"y"), Err(SealError::BadMac));
    }
}

#[cfg(test)]
mod speed {
    #[test]
    #[ignore]
    fn mac_speeds() {
        use crate::key::HmacSha256;
        use hmac::{KeyInit, Mac};
        for size in [1432usize, 2560, 16 << 10, 1 << 20] {
            let data = vec![7u8; size];
            let n = (64 << 20) / size;
            let t = std::time::Instant::now();
            for _ in 0..n {
                let mut m = <HmacSha256 as KeyInit>::new_from_slice(&[1u8; 32]).unwrap();
                m.update(&data);
                std::hint::black_box(m.finalize());
            }
            let hmac = t.elapsed().as_secs_f64() / n as f64;
            let t = std::time::Instant::now();
            for _ in 0..n {
                let mut h = blake3::Hasher::new_keyed(&[1u8; 32]);
                h.update(&data);
                std::hint::black_box(h.finalize());
            }
            let b3 = t.elapsed().as_secs_f64() / n as f64;
            let g = super::DatagramSealer::new(&[1u8; 32]);
            let t = std::time::Instant::now();
            for i in 0..n {
                std::hint::black_box(g.seal(i as u64, &data));
            }
            let gm = t.elapsed().as_secs_f64() / n as f64;
            eprintln!(
                "{size}: gmac {:.2} µs ({:.2} GB/s)",
                gm * 1e6,
                size as f64 / gm / 1e9
            );
            eprintln!(
                "{size}: hmac-sha256 {:.2} µs ({:.2} GB/s), blake3 {:.2} µs ({:.2} GB/s)",
                hmac * 1e6,
                size as f64 / hmac / 1e9,
                b3 * 1e6,
                size as f64 / b3 / 1e9
            );
        }
    }
}
