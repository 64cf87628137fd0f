//! The data plane on io_uring: the same frames as `TcpDataLink` (header ‖ payload ‖ seal, see
//! `tcp` and `seal`), written and read through one io_uring instance per link.
//!
//! * Frames that fit the registered send buffer (`UringConfig::buffer`, 64 KiB) are
//!   assembled there and written with one `IORING_OP_WRITE_FIXED`. Every read lands in a
//!   registered receive buffer through `IORING_OP_READ_FIXED`, which then serves headers,
//!   small payloads and seals like a `BufReader`.
//! * Larger frames go out as a linked chain `header → payload → seal` (one `io_uring_enter`):
//!   the payload straight from the caller's slice, by `IORING_OP_SEND` (the kernel copies)
//!   or, from `UringConfig::zc_threshold` bytes on, by `IORING_OP_SEND_ZC` in pieces. `send`
//!   returns only after the kernel's notifications say it no longer references the slice.
//!   Large payloads are received with `IORING_OP_RECV` (`MSG_WAITALL`) straight into the
//!   caller's buffer, linked to a `READ_FIXED` that picks up the seal and what follows it.
//! * `recv_timeout` links the first read to an `IORING_OP_LINK_TIMEOUT`.
//!
//! Zero-copy is not free, which is why the default threshold is high:
//! * A zero-copy `send` returns when the peer has acknowledged the data, not when it is
//!   queued: the sender waits for the wire (and buffers only what the receiver's window
//!   holds), where a copying send returns as soon as the socket buffer takes the bytes.
//! * The kernel pins the pages until then; for a user without `CAP_IPC_LOCK` the pinned bytes
//!   (and the registered buffers) count against `RLIMIT_MEMLOCK`, shared by every process of
//!   that user. A link keeps at most `zc_inflight` bytes pinned; when the kernel still
//!   refuses (`ENOMEM`) the piece is sent by copying and a warning says how to raise the
//!   limit.
//! * On loopback, and on NICs without scatter-gather, the kernel copies anyway
//!   (`LinkCounters::zc_copied`), and zero-copy is then slower than copying.
//!
//! Memory safety rests on one rule: no method returns while the kernel may still write into,
//! or read from, memory it was given, except for the read-only pages of a zero-copy send
//! whose link was shut down while the kernel still queued them (see `Engine::wait_notifs`).
//! Every operation goes through `Engine::run`, which waits for all completions of the chain
//! it submitted, on every path.
//!
//! # Layout
//!
//! * `support`: what the kernel offers (`probe`), the link's tuning (`UringConfig`), and
//!   set-up errors in words.
//! * `engine`: the ring of one link, its operations and their completions (`Engine::run`).
//! * `link`: `UringDataLink`: the registered buffers, and `DataLink` on top of the two paths.
//! * `send`: the send path (WRITE_FIXED, or linked SEND / SEND_ZC chains).
//! * `recv`: the receive path (READ_FIXED into the receive buffer, RECV into the caller's).

mod engine;
mod link;
mod recv;
mod send;
mod support;

pub use link::UringDataLink;
pub use support::{probe, UringConfig, UringSupport};

use std::time::Duration;

/// `IORING_SEND_ZC_REPORT_USAGE`: the notification says whether the kernel copied after all.
const SEND_ZC_REPORT_USAGE: u16 = 8;
/// `IORING_NOTIF_USAGE_ZC_COPIED`, in a notification's result.
const NOTIF_USAGE_ZC_COPIED: u32 = 1 << 31;
/// Registered buffer indices.
const SEND_BUF: u16 = 0;
const RECV_BUF: u16 = 1;
/// Longest chain of linked operations submitted at once.
const MAX_CHAIN: usize = 16;
/// Largest length given to one operation.
const MAX_OP_LEN: usize = 1 << 30;
/// Where a large frame's seal is staged in the send buffer (its header is at 0).
const SEAL_OFF: usize = 64;
/// How often a wait for zero-copy notifications checks whether the link was shut down.
const NOTIF_POLL: Duration = Duration::from_millis(50);
/// Consecutive failed `io_uring_enter` calls (10 ms apart) before the process is aborted
/// rather than letting the kernel write into memory that was handed back.
const MAX_ENTER_FAILURES: u32 = 1000;
