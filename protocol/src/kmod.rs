//! The kernel-bypass path: `/dev/ringllm`, the device of our kernel module (`kmod/`), opened,
//! sized and mapped as one *context* (see `kmod/ringllm_kmod.h`, which this file mirrors).
//!
//! The module's netfilter hook steals the data datagrams of a reliable UDP link (prefixed with
//! a magic and the link's tag) before the socket layer and copies each into a slot of a
//! per-frame bank in memory mapped here; `Device::drain` hands them to the link's reader,
//! which checks every seal before it uses a byte. Sending writes datagrams into the mapped TX
//! area and asks the module to send them, many per system call. Acknowledgements and probes
//! carry no magic and go through the link's own UDP socket both ways.
//!
//! `UdpDataLink::with_kmod` runs a reliable UDP link over a context (`TransportKind::Kmod`).

use crate::seal::LinkKeys;
use std::fs::{File, OpenOptions};
use std::io;
use std::net::SocketAddrV4;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

pub const DEVICE: &str = "/dev/ringllm";
pub const ABI_VERSION: u32 = 2;
/// "RLK1" on the wire.
pub const MAGIC: u32 = 0x314b_4c52;
/// The magic and the tag before every data datagram.
pub const PREFIX_LEN: usize = 8;
pub const SLOT_SIZE: usize = 2048;
pub const MAX_BANKS: u32 = 64;
pub const MAX_SLOTS: u32 = 16384;
const BANK_FREE: u32 = 0;
const BANK_ACTIVE: u32 = 1;

/// How a link sizes its context: banks (frames in reassembly at once), slots per bank (a
/// frame with more chunks reuses its bank's slots in turn), and the TX area.
#[derive(Clone, Copy, Debug)]
pub struct KmodConfig {
    pub banks: u32,
    pub slots: u32,
    pub tx_bytes: u32,
}

impl Default for KmodConfig {
    /// Both directions carry data.
    fn default() -> Self {
        KmodConfig::for_link(true, true)
    }
}

impl KmodConfig {
    /// A context for a link that `receives` data frames and/or `sends` them (the other
    /// direction carries acks only, on the link's socket; a frame there still gets through,
    /// a bank at a time).
    ///
    /// Receiving: 32 banks of 512 slots (32 MiB). The sender keeps at most 256 chunks in
    /// flight, 512 between the oldest unacknowledged and the newest: up to 256 frames of one
    /// or two chunks each (a small model's hidden state) while the reader catches up, or a
    /// large frame's chunks spread over 512 slots without two sharing one.
    pub fn for_link(receives: bool, sends: bool) -> KmodConfig {
        KmodConfig {
            banks: if receives { 32 } else { 2 },
            slots: if receives { 512 } else { 64 },
            tx_bytes: if sends { 1 << 20 } else { 64 << 10 },
        }
    }
}

#[repr(C)]
#[derive(Default, Debug)]
struct Info {
    abi: u32,
    slot_size: u32,
    max_banks: u32,
    max_slots: u32,
    max_tx: u32,
    pad: u32,
    total: u64,
}

#[repr(C)]
struct Setup {
    abi: u32,
    nbanks: u32,
    slots: u32,
    tx_bytes: u32,
}

#[repr(C)]
struct Port {
    port: u16,
    pad: u16,
    tag: u32,
}

#[repr(C)]
struct Dest {
    addr: u32,
    port: u16,
    pad: u16,
}

#[repr(C)]
struct Wait {
    seen: u64,
    timeout_ns: u64,
    events: u64,
}

#[repr(C)]
struct SendArgs {
    offset: u64,
    total: u64,
    seg: u32,
    pad: u32,
}

#[repr(C)]
#[derive(Default)]
struct BankSrc {
    bank: u32,
    addr: u32,
    port: u16,
    pad: u16,
    state: u32,
    frame: u64,
}

/// The module's counters for one context (`passed` is module-wide: links share ports).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KmodStats {
    /// Datagrams stored in a bank (stolen from the stack).
    pub claimed: u64,
    /// Datagrams to a claimed port without the magic, left to the stack.
    pub passed: u64,
    /// With the magic, but a field out of bounds.
    pub dropped_malformed: u64,
    /// No bank free for a new frame.
    pub dropped_no_bank: u64,
    /// The slot still held a datagram.
    pub dropped_busy: u64,
    pub sent: u64,
    pub send_errors: u64,
    pub wakeups: u64,
    /// Banks freed by `release_bank` (a store into the bank's state is not counted).
    pub released: u64,
    /// skbs that held several datagrams (coalesced by GRO), each placed on its own.
    pub coalesced: u64,
    /// Datagrams stored in a bank that user space then freed without reading them (they
    /// landed between its last look and its store of the bank's state: late copies of a
    /// settled frame, or forgeries), dropped when the bank is next taken.
    pub dropped_stale: u64,
}

/// The shared page's layout (`struct rlk_shared`).
#[repr(C)]
struct SharedPage {
    abi: u32,
    nbanks: u32,
    slots: u32,
    slot_size: u32,
    banks_off: u64,
    bitmaps_off: u64,
    lens_off: u64,
    data_off: u64,
    tx_off: u64,
    tx_bytes: u64,
    total: u64,
    events: AtomicU64,
    completions: AtomicU64,
    seen: AtomicU64,
    wake_every: AtomicU64,
}

#[repr(C)]
struct BankHdr {
    state: AtomicU32,
    count: u32,
    frame: u64,
    src_addr: u32,
    src_port: u16,
    pad: u16,
    stored: u32,
    gen: u32,
}

const IOC_MAGIC: u64 = b'r' as u64;
const fn ioc(dir: u64, nr: u64, size: usize) -> libc::c_ulong {
    ((dir << 30) | ((size as u64) << 16) | (IOC_MAGIC << 8) | nr) as libc::c_ulong
}
const W: u64 = 1;
const R: u64 = 2;
const IOC_INFO: libc::c_ulong = ioc(R, 1, std::mem::size_of::<Info>());
const IOC_SETUP: libc::c_ulong = ioc(W, 2, std::mem::size_of::<Setup>());
const IOC_SET_PORT: libc::c_ulong = ioc(W, 3, std::mem::size_of::<Port>());
const IOC_SET_DEST: libc::c_ulong = ioc(W, 4, std::mem::size_of::<Dest>());
const IOC_WAIT_DATA: libc::c_ulong = ioc(R | W, 5, std::mem::size_of::<Wait>());
const IOC_SEND: libc::c_ulong = ioc(W, 6, std::mem::size_of::<SendArgs>());
const IOC_GET_BANK_SRC: libc::c_ulong = ioc(R | W, 7, std::mem::size_of::<BankSrc>());
const IOC_RELEASE_BANK: libc::c_ulong = ioc(W, 8, 4);
const IOC_STATS: libc::c_ulong = ioc(R, 9, std::mem::size_of::<KmodStats>());

/// Why the device cannot be used, with what to do about it.
#[derive(Debug, thiserror::Error)]
pub enum KmodError {
    #[error(
        "{DEVICE} does not exist: the ringllm kernel module is not loaded (build it with \
         `make -C kmod KDIR=/lib/modules/$(uname -r)/build` and load it with \
         `insmod kmod/ringllm.ko`; see kmod/README.md), or choose another transport"
    )]
    NotLoaded,
    #[error(
        "cannot open {DEVICE}: {0} (it is root-only unless the module was loaded with gid=<group>)"
    )]
    Open(io::Error),
    #[error("{DEVICE} speaks ABI {found}, this build speaks {ABI_VERSION}: load the module built from the same source")]
    Abi { found: u32 },
    #[error("{DEVICE}: {what}: {error}")]
    Call {
        what: &'static str,
        error: io::Error,
    },
    #[error(
        "{DEVICE}: UDP port {port} already has a link with this tag (two links with one key?)"
    )]
    PortTaken { port: u16 },
    #[error("{DEVICE}: the mapped area's layout is inconsistent ({0})")]
    Layout(String),
}

impl From<KmodError> for io::Error {
    fn from(e: KmodError) -> io::Error {
        let kind = match &e {
            KmodError::NotLoaded => io::ErrorKind::NotFound,
            KmodError::Open(e) | KmodError::Call { error: e, .. } => e.kind(),
            KmodError::PortTaken { .. } => io::ErrorKind::AddrInUse,
            _ => io::ErrorKind::Other,
        };
        io::Error::new(kind, e.to_string())
    }
}

fn ioctl<T>(
    fd: RawFd,
    req: libc::c_ulong,
    arg: *mut T,
    what: &'static str,
) -> Result<i64, KmodError> {
    // SAFETY: `arg` points at a live value of the type the request number encodes.
    let r = unsafe { libc::ioctl(fd, req as _, arg) };
    if r < 0 {
        return Err(KmodError::Call {
            what,
            error: io::Error::last_os_error(),
        });
    }
    Ok(r as i64)
}

fn open_device(path: &Path) -> Result<File, KmodError> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .map_err(|e| match e.kind() {
            io::ErrorKind::NotFound => KmodError::NotLoaded,
            _ => KmodError::Open(e),
        })
}

/// What the loaded module offers, checked against this build (a node started with
/// `--transport kmod` calls this first and stops with its error).
pub fn probe() -> Result<(), KmodError> {
    let f = open_device(Path::new(DEVICE))?;
    let mut info = Info::default();
    ioctl(f.as_raw_fd(), IOC_INFO, &mut info, "asking the ABI version")?;
    if info.abi != ABI_VERSION {
        return Err(KmodError::Abi { found: info.abi });
    }
    Ok(())
}

/// Tags a link's two directions: ours (data the module hands us carries it) and the peer's
/// (what we put on data we send). Both ends derive them from the link's keys.
pub fn tags(keys: &LinkKeys) -> (u32, u32) {
    let k = keys.sub(b"kmod tag");
    let t = |b: &[u8; 32]| u32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    (t(&k.recv), t(&k.send))
}

/// An open, mapped context.
pub struct Device {
    file: File,
    base: *mut u8,
    len: usize,
    nbanks: u32,
    slots: u32,
    banks_off: usize,
    bitmaps_off: usize,
    lens_off: usize,
    data_off: usize,
    tx_off: usize,
    tx_bytes: usize,
    /// The peer's tag, written before every datagram we send; the TX area's lock.
    tx: Mutex<u32>,
    /// `drain` passes so far.
    drains: AtomicU64,
}

// SAFETY: the mapping lives as long as the value; everything shared with the module is
// accessed through atomics or under the protocol documented in ringllm_kmod.h (a slot's
// bytes are read only while its bit is set, and the module never writes a set slot); the TX
// area is used under `tx`.
unsafe impl Send for Device {}
// SAFETY: as for `Send`: shared state is atomics, read-only-while-set slots, or under `tx`.
unsafe impl Sync for Device {}

impl Device {
    /// Opens a context, sizes it and maps it.
    pub fn open(cfg: KmodConfig) -> Result<Device, KmodError> {
        Device::open_at(Path::new(DEVICE), cfg)
    }

    pub fn open_at(path: &Path, cfg: KmodConfig) -> Result<Device, KmodError> {
        let file = open_device(path)?;
        let fd = file.as_raw_fd();
        let mut info = Info::default();
        ioctl(fd, IOC_INFO, &mut info, "asking the ABI version")?;
        if info.abi != ABI_VERSION {
            return Err(KmodError::Abi { found: info.abi });
        }
        let mut setup = Setup {
            abi: ABI_VERSION,
            nbanks: cfg.banks,
            slots: cfg.slots,
            tx_bytes: cfg.tx_bytes,
        };
        ioctl(fd, IOC_SETUP, &mut setup, "sizing the context")?;
        ioctl(fd, IOC_INFO, &mut info, "asking the mapped size")?;
        let len = usize::try_from(info.total).map_err(|_| KmodError::Layout("size".into()))?;
        // SAFETY: maps the context's area (the module checks offset and length); the result
        // is checked before use.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return Err(KmodError::Call {
                what: "mapping the context",
                error: io::Error::last_os_error(),
            });
        }
        let mut d = Device {
            file,
            base: base.cast(),
            len,
            nbanks: 0,
            slots: 0,
            banks_off: 0,
            bitmaps_off: 0,
            lens_off: 0,
            data_off: 0,
            tx_off: 0,
            tx_bytes: 0,
            tx: Mutex::new(0),
            drains: AtomicU64::new(0),
        };
        let sh = d.shared();
        let layout = (
            sh.abi,
            sh.nbanks,
            sh.slots,
            sh.slot_size as usize,
            sh.total as usize,
        );
        if layout != (ABI_VERSION, cfg.banks, cfg.slots, SLOT_SIZE, len) {
            return Err(KmodError::Layout(format!("{layout:?}")));
        }
        let (banks_off, bitmaps_off, lens_off, data_off, tx_off, tx_bytes) = (
            sh.banks_off as usize,
            sh.bitmaps_off as usize,
            sh.lens_off as usize,
            sh.data_off as usize,
            sh.tx_off as usize,
            sh.tx_bytes as usize,
        );
        let slots = cfg.slots as usize * cfg.banks as usize;
        let fits = banks_off + cfg.banks as usize * std::mem::size_of::<BankHdr>() <= bitmaps_off
            && bitmaps_off + slots / 8 <= lens_off
            && lens_off + slots * 2 <= data_off
            && data_off + slots * SLOT_SIZE <= tx_off
            && tx_off + tx_bytes <= len
            && bitmaps_off % 8 == 0
            && banks_off % 8 == 0;
        if !fits {
            return Err(KmodError::Layout("offsets".into()));
        }
        d.nbanks = cfg.banks;
        d.slots = cfg.slots;
        d.banks_off = banks_off;
        d.bitmaps_off = bitmaps_off;
        d.lens_off = lens_off;
        d.data_off = data_off;
        d.tx_off = tx_off;
        d.tx_bytes = tx_bytes;
        Ok(d)
    }

    /// A context for the reliable UDP link on `socket` (bound, and connected to the peer's
    /// socket): claims the socket's port for data carrying our tag, and sends to the peer
    /// with its tag. Open it before the peer may send.
    pub fn for_link(
        socket: &std::net::UdpSocket,
        keys: &LinkKeys,
        cfg: KmodConfig,
    ) -> Result<Device, io::Error> {
        let local = socket.local_addr()?;
        let peer = socket.peer_addr()?;
        let (std::net::SocketAddr::V4(_), std::net::SocketAddr::V4(peer4)) = (local, peer) else {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                format!("the kmod transport is IPv4 only ({local} to {peer})"),
            ));
        };
        let dev = Device::open(cfg)?;
        let (ours, theirs) = tags(keys);
        dev.set_port(local.port(), ours)?;
        dev.set_dest(peer4, theirs)?;
        Ok(dev)
    }

    fn shared(&self) -> &SharedPage {
        // SAFETY: page 0 of the mapping is the module's `rlk_shared`, alive with the mapping.
        unsafe { &*(self.base as *const SharedPage) }
    }

    fn bank(&self, b: u32) -> &BankHdr {
        // SAFETY: `b < nbanks` (callers); the bank headers are inside the mapping (checked
        // in `open_at`).
        unsafe {
            &*(self
                .base
                .add(self.banks_off)
                .cast::<BankHdr>()
                .add(b as usize))
        }
    }

    fn word(&self, b: u32, w: usize) -> &AtomicU64 {
        // SAFETY: word `w < slots / 64` of bank `b < nbanks`'s bitmap, 8-byte aligned, inside
        // the mapping; the module updates these words with atomic bit operations only.
        unsafe {
            &*(self
                .base
                .add(self.bitmaps_off)
                .cast::<AtomicU64>()
                .add(b as usize * (self.slots as usize / 64) + w))
        }
    }

    pub fn raw_fd(&self) -> RawFd {
        self.file.as_raw_fd()
    }

    pub fn banks(&self) -> u32 {
        self.nbanks
    }

    /// Claims data datagrams to UDP `port` carrying `tag`.
    pub fn set_port(&self, port: u16, tag: u32) -> Result<(), KmodError> {
        let mut p = Port { port, pad: 0, tag };
        ioctl(self.raw_fd(), IOC_SET_PORT, &mut p, "claiming a port").map_err(|e| match e {
            KmodError::Call { error, .. } if error.raw_os_error() == Some(libc::EADDRINUSE) => {
                KmodError::PortTaken { port }
            }
            e => e,
        })?;
        Ok(())
    }

    /// Where `send` sends, and the tag the peer claims its data with.
    pub fn set_dest(&self, to: SocketAddrV4, peer_tag: u32) -> Result<(), KmodError> {
        let mut d = Dest {
            addr: u32::from_ne_bytes(to.ip().octets()),
            port: to.port().to_be(),
            pad: 0,
        };
        ioctl(
            self.raw_fd(),
            IOC_SET_DEST,
            &mut d,
            "setting the destination",
        )?;
        *self.tx.lock().unwrap_or_else(|e| e.into_inner()) = peer_tag;
        Ok(())
    }

    /// How many wake a sleeper in `poll` (the module always wakes it when a bank completes).
    pub fn set_wake_every(&self, n: u64) {
        self.shared().wake_every.store(n, Ordering::Relaxed);
    }

    pub fn stats(&self) -> Result<KmodStats, KmodError> {
        let mut s = KmodStats::default();
        ioctl(self.raw_fd(), IOC_STATS, &mut s, "reading the counters")?;
        Ok(s)
    }

    /// Sleeps until the module stored a datagram since `seen` (or `timeout`); the count now.
    pub fn wait_data(&self, seen: u64, timeout: std::time::Duration) -> Result<u64, KmodError> {
        let mut w = Wait {
            seen,
            timeout_ns: timeout.as_nanos().min(u64::MAX as u128) as u64,
            events: 0,
        };
        match ioctl(self.raw_fd(), IOC_WAIT_DATA, &mut w, "waiting for data") {
            Ok(_) => Ok(w.events),
            Err(KmodError::Call { error, .. }) if error.kind() == io::ErrorKind::Interrupted => {
                Ok(self.shared().events.load(Ordering::Acquire))
            }
            Err(e) => Err(e),
        }
    }

    /// The source, frame and state of bank `b`, as the module reports them.
    pub fn bank_src(&self, b: u32) -> Result<(SocketAddrV4, u64, bool), KmodError> {
        let mut s = BankSrc {
            bank: b,
            ..Default::default()
        };
        ioctl(
            self.raw_fd(),
            IOC_GET_BANK_SRC,
            &mut s,
            "reading a bank's source",
        )?;
        let ip = std::net::Ipv4Addr::from(s.addr.to_ne_bytes());
        Ok((
            SocketAddrV4::new(ip, u16::from_be(s.port)),
            s.frame,
            s.state == BANK_ACTIVE,
        ))
    }

    pub fn release_bank(&self, b: u32) -> Result<(), KmodError> {
        let mut b = b;
        ioctl(self.raw_fd(), IOC_RELEASE_BANK, &mut b, "releasing a bank")?;
        Ok(())
    }

    /// Hands every datagram the module stored to `take` (its bytes without the prefix; they
    /// stay put while `take` runs), frees its slot, then frees each bank `done` says is
    /// finished (given the bank's frame; by a store into the bank's state, which the module
    /// reads when a new frame needs a bank). Returns the datagrams taken.
    pub fn drain(
        &self,
        mut take: impl FnMut(&[u8]),
        mut done: impl FnMut(u64) -> bool,
    ) -> Result<usize, KmodError> {
        let sh = self.shared();
        // Everything up to here is being looked at: poll reports new datagrams only.
        let ev = sh.events.load(Ordering::Acquire);
        sh.seen.store(ev, Ordering::Release);
        let words = self.slots as usize / 64;
        let mut n = 0;
        // Every 64th pass looks at every bank, not only those that gave something (a bank a
        // forgery claimed for a frame then in progress is freed once that frame is done).
        let sweep = self
            .drains
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(64);
        for b in 0..self.nbanks {
            let bank = self.bank(b);
            if bank.state.load(Ordering::Acquire) != BANK_ACTIVE {
                continue;
            }
            let before = n;
            let mut left = false;
            for w in 0..words {
                let word = self.word(b, w);
                let mut bits = word.load(Ordering::Acquire);
                while bits != 0 {
                    let bit = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    let slot = b as usize * self.slots as usize + w * 64 + bit;
                    // SAFETY: the slot's bit is set, so the module wrote its length and bytes
                    // before (release order) and will not touch them until the bit is clear.
                    let len = unsafe {
                        std::ptr::read_volatile(
                            self.base.add(self.lens_off).cast::<u16>().add(slot),
                        )
                    } as usize;
                    if len <= SLOT_SIZE {
                        // SAFETY: as above; `len <= SLOT_SIZE` keeps the slice inside the slot.
                        let d = unsafe {
                            std::slice::from_raw_parts(
                                self.base.add(self.data_off + slot * SLOT_SIZE),
                                len,
                            )
                        };
                        take(d);
                    }
                    word.fetch_and(!(1u64 << bit), Ordering::Release);
                    n += 1;
                }
                if word.load(Ordering::Relaxed) != 0 {
                    left = true;
                }
            }
            // SAFETY: the frame was written before the bank turned active (read after the
            // acquire load of `state` above).
            let frame = unsafe { std::ptr::read_volatile(&bank.frame) };
            if !left && (n > before || sweep) && done(frame) {
                // Freed by a store, not a system call per frame: the module clears the
                // bitmap when the next frame claims the bank.
                bank.state.store(BANK_FREE, Ordering::Release);
            }
        }
        Ok(n)
    }

    /// Datagrams the module stored that nobody has looked at yet.
    pub fn pending(&self) -> bool {
        let sh = self.shared();
        sh.events.load(Ordering::Acquire) != sh.seen.load(Ordering::Acquire)
    }

    /// Sends the datagrams laid end to end in `buf`, each `seg` bytes but the last: copies
    /// them into the TX area behind the magic and the peer's tag, and has the module send
    /// them (one system call per TX area's worth).
    pub fn send(&self, buf: &[u8], seg: usize) -> Result<(), KmodError> {
        if seg == 0 || seg + PREFIX_LEN > SLOT_SIZE {
            return Err(KmodError::Call {
                what: "sending",
                error: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("datagram of {seg} bytes"),
                ),
            });
        }
        let tag = self.tx.lock().unwrap_or_else(|e| e.into_inner());
        let stride = seg + PREFIX_LEN;
        let per_call = (self.tx_bytes / stride).max(1);
        let mut prefix = [0u8; PREFIX_LEN];
        prefix[..4].copy_from_slice(&MAGIC.to_le_bytes());
        prefix[4..].copy_from_slice(&tag.to_le_bytes());
        for batch in buf.chunks(per_call * seg) {
            let mut at = 0usize;
            for d in batch.chunks(seg) {
                // SAFETY: `at + PREFIX_LEN + d.len() <= per_call * stride <= tx_bytes`; the
                // TX area is ours while `tx` is held.
                unsafe {
                    let dst = self.base.add(self.tx_off + at);
                    std::ptr::copy_nonoverlapping(prefix.as_ptr(), dst, PREFIX_LEN);
                    std::ptr::copy_nonoverlapping(d.as_ptr(), dst.add(PREFIX_LEN), d.len());
                }
                at += PREFIX_LEN + d.len();
            }
            let mut s = SendArgs {
                offset: 0,
                total: at as u64,
                seg: stride as u32,
                pad: 0,
            };
            let mut sent = 0u64;
            let want = batch.len().div_ceil(seg) as u64;
            while sent < want {
                s.offset = sent * stride as u64;
                s.total = at as u64 - s.offset;
                match ioctl(self.raw_fd(), IOC_SEND, &mut s, "sending datagrams") {
                    Ok(n) => sent += n.max(1) as u64,
                    Err(KmodError::Call { error, .. })
                        if matches!(
                            error.raw_os_error(),
                            Some(libc::ENOBUFS | libc::EAGAIN | libc::ECONNREFUSED | libc::EINTR)
                        ) =>
                    {
                        // A datagram lost on the way out is one lost on the wire: the link
                        // retransmits it. (A refused port is the peer restarting.)
                        sent += 1;
                    }
                    Err(e) => return Err(e),
                }
            }
        }
        drop(tag);
        Ok(())
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: unmaps what `open_at` mapped; nothing borrows it past `self`.
        unsafe {
            libc::munmap(self.base.cast(), self.len);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The request numbers of `kmod/ringllm_kmod.h`, as its `_IOR`/`_IOW` macros give them
    /// (printed by a C program including the header, compiled with gcc on x86_64), and its
    /// layouts (`sizeof`, `offsetof` from the same program).
    const EXPECTED_IOCTLS: [u64; 9] = [
        0x8020_7201,
        0x4010_7202,
        0x4008_7203,
        0x4008_7204,
        0xc018_7205,
        0x4018_7206,
        0xc018_7207,
        0x4004_7208,
        0x8058_7209,
    ];

    #[test]
    fn the_abi_matches_the_module_header() {
        assert_eq!(
            [
                IOC_INFO,
                IOC_SETUP,
                IOC_SET_PORT,
                IOC_SET_DEST,
                IOC_WAIT_DATA,
                IOC_SEND,
                IOC_GET_BANK_SRC,
                IOC_RELEASE_BANK,
                IOC_STATS
            ]
            .map(u64::from),
            EXPECTED_IOCTLS
        );
        assert_eq!(std::mem::size_of::<SharedPage>(), 104);
        assert_eq!(std::mem::offset_of!(SharedPage, events), 72);
        assert_eq!(std::mem::offset_of!(SharedPage, seen), 88);
        assert_eq!(std::mem::size_of::<BankHdr>(), 32);
    }
}
