//! The node's slice cache (`node --cache DIR`): model slices the coordinator sent, one GGUF
//! file each, kept for the next start.
//!
//! Layout: `DIR/<model stem>-<size>-<header hash>/layers-<start>-<end>[-head].gguf`, with
//! `.pieces` beside it (the offer it was checked against: its pieces and their hashes) and
//! `.part` while it arrives. A slice is used only after every piece has been hashed against
//! an offer: the coordinator's (every start it sends one), or with `up --no-send` the
//! `.pieces` file stored with it.
//!
//! A transfer writes each piece at its place in the `.part` file and hashes it as it
//! arrives; a piece whose hash does not match is asked for again. A transfer cut short
//! leaves the `.part` file: the next offer hashes what is there and asks only for the pieces
//! that do not match (at most the one that was arriving, usually).
//!
//! Several nodes may share one cache directory (nodes of one machine started with the same
//! `--cache`). A node receiving a slice holds an exclusive `flock` on its partial file; a node
//! offered the same slice meanwhile takes the next partial name (`layers-…-<n>.gguf.part`)
//! instead of writing into the same file, eviction passes over partial files another node
//! holds, and the `.pieces` file is written beside and renamed into place. Either node's
//! finished file is the same bytes, so the second rename replaces it harmlessly (a node that
//! mapped the first keeps its pages).

use ringllm_model::slice::{check_offer, hash_all};
use ringllm_model::sys;
use ringllm_protocol::control::{Control, Piece, SliceKey, SliceNeed, SliceOffer, SliceProgress};
use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tracing::{info, warn};

/// Room left free on the cache's disk beyond the slice itself.
pub const DISK_MARGIN: u64 = 64 << 20;
/// Partial files one slice may have at once (one per node receiving it into a shared cache).
const MAX_PARTIALS: u32 = 8;
/// How often a node tells the coordinator how far a transfer got.
pub const PROGRESS_EVERY: Duration = Duration::from_millis(250);
/// How often it logs it.
const LOG_EVERY: Duration = Duration::from_secs(5);

/// Why a slice cannot be taken.
#[derive(Debug, thiserror::Error)]
pub enum SliceError {
    #[error("node '{node}': bad slice offer: {why}")]
    BadOffer { node: String, why: String },
    #[error(
        "node '{node}': slice cache {dir}: the slice needs {need} MiB more on disk and the \
         cache keeps {margin} MiB free beside it, {free} MiB are free{evicted} (free some \
         space, or start the node with --cache on a larger disk)"
    )]
    Full {
        node: String,
        dir: PathBuf,
        need: u64,
        margin: u64,
        free: u64,
        evicted: String,
    },
    /// Every partial file of the slice is held by another node sharing the cache.
    #[error(
        "node '{node}': slice cache {dir}: {MAX_PARTIALS} other nodes sharing this cache are \
         receiving the same slice; try again once one has finished"
    )]
    Shared { node: String, dir: PathBuf },
    #[error("node '{node}': slice cache {path}: {source}")]
    Io {
        node: String,
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Where a slice lives in the cache.
#[derive(Clone, Debug)]
pub struct SlicePaths {
    pub dir: PathBuf,
    pub file: PathBuf,
    pub part: PathBuf,
    pub pieces: PathBuf,
}

/// The cache directory's name for a model: its file stem (characters safe in a file name),
/// size and header hash.
fn model_dir(key: &SliceKey) -> String {
    let stem = Path::new(&key.model.file_name)
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let stem: String = stem
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .take(64)
        .collect();
    let stem = stem.trim_start_matches('.');
    format!(
        "{}-{}-{:016x}",
        if stem.is_empty() { "model" } else { stem },
        key.model.size,
        key.model.header_hash
    )
}

pub fn paths(cache: &Path, key: &SliceKey) -> SlicePaths {
    let dir = cache.join(model_dir(key));
    let base = format!(
        "layers-{}-{}{}",
        key.layer_start,
        key.layer_end,
        if key.head { "-head" } else { "" }
    );
    SlicePaths {
        file: dir.join(format!("{base}.gguf")),
        part: dir.join(format!("{base}.gguf.part")),
        pieces: dir.join(format!("{base}.pieces")),
        dir,
    }
}

impl SlicePaths {
    /// The `n`th partial file name: `part` itself, then `layers-…-<n>.gguf.part` for the
    /// nodes sharing the cache that receive the same slice at the same time.
    fn partial(&self, n: u32) -> PathBuf {
        if n == 0 {
            return self.part.clone();
        }
        let name = self
            .file
            .file_stem()
            .map_or_else(|| "slice".into(), |s| s.to_string_lossy().into_owned());
        self.dir.join(format!("{name}-{n}.gguf.part"))
    }
}

/// Whether another process (a node sharing the cache) holds `path`'s lock: it is receiving
/// into it.
fn held_elsewhere(path: &Path) -> bool {
    let Ok(f) = File::open(path) else {
        return false;
    };
    matches!(f.try_lock(), Err(std::fs::TryLockError::WouldBlock))
}

/// Opens (creating it) the first partial file of the slice no other node holds, locked for
/// this node until the transfer ends; `None` when every one is held.
fn claim_partial(p: &SlicePaths) -> std::io::Result<Option<(PathBuf, File)>> {
    for n in 0..MAX_PARTIALS {
        let path = p.partial(n);
        let f = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)?;
        match f.try_lock() {
            Ok(()) => return Ok(Some((path, f))),
            Err(std::fs::TryLockError::WouldBlock) => continue,
            Err(std::fs::TryLockError::Error(e)) => return Err(e),
        }
    }
    Ok(None)
}

/// Indices of the pieces of `file` whose bytes do not hash to `pieces`' (a file of the
/// wrong size fails all of them).
fn mismatches(file: &Path, size: u64, pieces: &[Piece]) -> std::io::Result<Vec<u32>> {
    let f = File::open(file)?;
    if f.metadata()?.len() != size {
        return Ok((0..pieces.len() as u32).collect());
    }
    // SAFETY: the file is this node's own cache entry, opened read-only; a concurrent
    // writer would only make a hash fail (and the piece be fetched again).
    let map = unsafe { memmap2::Mmap::map(&f)? };
    let bufs: Vec<&[u8]> = pieces
        .iter()
        .map(|p| {
            map.get(p.offset as usize..(p.offset + p.len) as usize)
                .unwrap_or(&[])
        })
        .collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let hashes = hash_all(&bufs, threads);
    Ok(pieces
        .iter()
        .zip(hashes)
        .enumerate()
        .filter(|(_, (p, h))| p.hash != *h)
        .map(|(i, _)| i as u32)
        .collect())
}

/// Every slice file in the cache (complete or partial), oldest first, but those of `keep`.
fn entries_oldest_first(cache: &Path, keep: &SlicePaths) -> Vec<(PathBuf, u64)> {
    let mut out: Vec<(PathBuf, u64, std::time::SystemTime)> = Vec::new();
    let Ok(models) = std::fs::read_dir(cache) else {
        return Vec::new();
    };
    for m in models.flatten() {
        let Ok(files) = std::fs::read_dir(m.path()) else {
            continue;
        };
        for f in files.flatten() {
            let p = f.path();
            let name = p.to_string_lossy();
            if !(name.ends_with(".gguf") || name.ends_with(".gguf.part")) {
                continue;
            }
            if p == keep.file || p == keep.part {
                continue;
            }
            // A partial file another node sharing the cache is receiving into.
            if name.ends_with(".gguf.part") && held_elsewhere(&p) {
                continue;
            }
            if let Ok(md) = f.metadata() {
                let t = md.modified().unwrap_or(std::time::UNIX_EPOCH);
                out.push((p, md.len(), t));
            }
        }
    }
    out.sort_by_key(|e| e.2);
    out.into_iter().map(|(p, n, _)| (p, n)).collect()
}

/// Makes room for `need` more bytes in the cache, removing other slices (oldest first) when
/// the disk is short; with `dry_run` only checks. A slice that would not fit even with every
/// other slice removed is refused before any is.
fn make_room(
    node: &str,
    cache: &Path,
    keep: &SlicePaths,
    need: u64,
    dry_run: bool,
) -> Result<(), SliceError> {
    let want = need.saturating_add(DISK_MARGIN);
    let free = || sys::disk_free(cache).unwrap_or(u64::MAX);
    if free() >= want {
        return Ok(());
    }
    let others = entries_oldest_first(cache, keep);
    let reclaimable: u64 = others.iter().map(|(_, n)| n).sum();
    let full = |free: u64, evicted: String| SliceError::Full {
        node: node.to_string(),
        dir: cache.to_path_buf(),
        need: need.div_ceil(1 << 20),
        margin: DISK_MARGIN >> 20,
        free: free >> 20,
        evicted,
    };
    if free().saturating_add(reclaimable) < want {
        let evicted = if others.is_empty() {
            String::new()
        } else {
            format!(
                " and the {} other cached slice(s) would free only {} MiB (kept)",
                others.len(),
                reclaimable >> 20
            )
        };
        return Err(full(free(), evicted));
    }
    let mut evicted = Vec::new();
    if !dry_run {
        for (p, n) in others {
            if free() >= want {
                break;
            }
            if std::fs::remove_file(&p).is_ok() {
                let _ = std::fs::remove_file(p.with_extension("pieces"));
                warn!(
                    "slice cache: removed {} ({} MiB) to make room",
                    p.display(),
                    n >> 20
                );
                evicted.push(p);
            }
        }
    }
    let left = free();
    if left >= want || dry_run {
        return Ok(());
    }
    Err(full(
        left,
        if evicted.is_empty() {
            String::new()
        } else {
            format!(" after removing {} older slice(s)", evicted.len())
        },
    ))
}

/// What the node has of an offered slice, and (unless a dry run) the transfer that fetches
/// the rest.
pub struct Prepared {
    pub need: SliceNeed,
    pub receiving: Option<Receiving>,
    /// The complete, checked slice file (nothing to fetch).
    pub ready: Option<PathBuf>,
}

/// Looks at the cache for `offer`: hashes what is there, makes room for what is not, and
/// opens (and locks) a partial file for it.
pub fn prepare(node: &str, cache: &Path, offer: SliceOffer) -> Result<Prepared, SliceError> {
    check_offer(&offer).map_err(|why| SliceError::BadOffer {
        node: node.to_string(),
        why,
    })?;
    let p = paths(cache, &offer.key);
    let io = io_error(node);
    if offer.discard && !offer.dry_run {
        discard(&p).map_err(|(f, e)| io(&f)(e))?;
    }
    // What is already here: the finished file, else (for a dry run: a transfer hashes the
    // partial file it claims) a partial one.
    let existing = [&p.file, &p.part]
        .into_iter()
        .take(if offer.dry_run { 2 } else { 1 })
        .find(|f| f.exists());
    let need: Vec<u32> = match existing {
        Some(f) => mismatches(f, offer.size, &offer.pieces).map_err(io(f))?,
        None => (0..offer.pieces.len() as u32).collect(),
    };
    let have_bytes = offer.size.saturating_sub(need_bytes(&offer, &need));
    let ready = need.is_empty() && existing == Some(&p.file);
    if offer.dry_run || ready {
        if !ready {
            make_room(node, cache, &p, need_bytes(&offer, &need), true)?;
        }
        return Ok(Prepared {
            need: SliceNeed {
                key: offer.key.clone(),
                pieces: need,
                have_bytes,
            },
            receiving: None,
            ready: ready.then(|| p.file.clone()),
        });
    }
    std::fs::create_dir_all(&p.dir).map_err(io(&p.dir))?;
    let broken_file = existing == Some(&p.file);
    receive_into_partial(node, cache, p, offer, broken_file)
}

/// Removes what the cache holds of a slice (`bench --cold`), but partial files another node
/// sharing the cache is receiving into.
fn discard(p: &SlicePaths) -> Result<(), (PathBuf, std::io::Error)> {
    let partials = (0..MAX_PARTIALS).map(|n| p.partial(n));
    for f in [p.file.clone(), p.pieces.clone()]
        .into_iter()
        .chain(partials)
    {
        if !f.exists() || held_elsewhere(&f) {
            continue;
        }
        std::fs::remove_file(&f).map_err(|e| (f.clone(), e))?;
        info!("slice cache: discarded {} as asked", f.display());
    }
    Ok(())
}

/// Bytes of the pieces `need` of `offer`.
fn need_bytes(offer: &SliceOffer, need: &[u32]) -> u64 {
    need.iter()
        .map(|&i| offer.pieces[i as usize].len)
        .sum::<u64>()
}

/// A `SliceError::Io` maker for `path`.
fn io_error(node: &str) -> impl Fn(&Path) -> Box<dyn FnOnce(std::io::Error) -> SliceError> + '_ {
    move |path: &Path| {
        let (path, node) = (path.to_path_buf(), node.to_string());
        Box::new(move |source| SliceError::Io { node, path, source })
    }
}

/// Claims a partial file for the slice (a finished file that failed its check becomes it),
/// hashes what it holds, makes room for the rest and starts receiving it. `broken_file`: the
/// finished file is there but some pieces do not match.
fn receive_into_partial(
    node: &str,
    cache: &Path,
    mut p: SlicePaths,
    offer: SliceOffer,
    broken_file: bool,
) -> Result<Prepared, SliceError> {
    let io = io_error(node);
    let Some((part, mut file)) = claim_partial(&p).map_err(io(&p.part))? else {
        return Err(SliceError::Shared {
            node: node.to_string(),
            dir: p.dir.clone(),
        });
    };
    if part != p.part {
        info!(
            "slice cache: another node sharing {} is receiving {}; this one receives into {}",
            cache.display(),
            p.part.display(),
            part.display()
        );
    }
    p.part = part;
    // A finished file that failed a check is worked on as the partial file (never used until
    // every piece matches).
    if broken_file {
        warn!(
            "slice cache: {} has piece(s) that do not match their hash; fetching them again",
            p.file.display()
        );
        std::fs::rename(&p.file, &p.part).map_err(io(&p.file))?;
        file = reopen_locked(&p.part).map_err(io(&p.part))?;
    }
    let len = file.metadata().map_err(io(&p.part))?.len();
    let fresh = len == 0;
    let mut need: Vec<u32> = if fresh {
        (0..offer.pieces.len() as u32).collect()
    } else {
        mismatches(&p.part, offer.size, &offer.pieces).map_err(io(&p.part))?
    };
    let have_bytes = offer.size.saturating_sub(need_bytes(&offer, &need));
    let room = make_room(
        node,
        cache,
        &p,
        if fresh {
            offer.size
        } else {
            need_bytes(&offer, &need)
        },
        false,
    );
    if let Err(e) = room {
        if fresh {
            let _ = std::fs::remove_file(&p.part);
        }
        return Err(e);
    }
    if len != offer.size {
        file.set_len(offer.size).map_err(io(&p.part))?;
        need = (0..offer.pieces.len() as u32).collect();
    }
    let need_msg = SliceNeed {
        key: offer.key.clone(),
        pieces: need.clone(),
        have_bytes,
    };
    if need.is_empty() {
        // Every piece of the partial file matched: it only lacked its rename.
        let r = Receiving::new(node, p, file, offer, Vec::new());
        let path = r.finish().map_err(|(path, source)| SliceError::Io {
            node: node.to_string(),
            path,
            source,
        })?;
        return Ok(Prepared {
            need: need_msg,
            receiving: None,
            ready: Some(path),
        });
    }
    Ok(Prepared {
        need: need_msg,
        receiving: Some(Receiving::new(node, p, file, offer, need)),
        ready: None,
    })
}

/// `path` opened for reading and writing and locked for this node.
fn reopen_locked(path: &Path) -> std::io::Result<File> {
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)?;
    f.try_lock().map_err(std::io::Error::from)?;
    Ok(f)
}

/// The slice `key` from the cache, checked against the offer stored with it (`up
/// --no-send`); `None` when it is not there or fails a check (said in the log).
pub fn cached(cache: &Path, key: &SliceKey) -> Option<PathBuf> {
    let p = paths(cache, key);
    if !p.file.exists() {
        return None;
    }
    let stored = std::fs::read(&p.pieces).ok()?;
    let offer = match Control::decode(&stored) {
        Ok(Control::SliceOffer(o)) if o.key == *key && check_offer(&o).is_ok() => o,
        _ => {
            warn!("slice cache: {} is unreadable", p.pieces.display());
            return None;
        }
    };
    match mismatches(&p.file, offer.size, &offer.pieces) {
        Ok(bad) if bad.is_empty() => Some(p.file),
        Ok(bad) => {
            warn!(
                "slice cache: {}: {} piece(s) do not match their hash (first: {}); not using it",
                p.file.display(),
                bad.len(),
                offer.pieces[bad[0] as usize].name
            );
            None
        }
        Err(e) => {
            warn!("slice cache: {}: {e}", p.file.display());
            None
        }
    }
}

/// A slice arriving: the pieces still to come, in the order the coordinator sends them.
pub struct Receiving {
    node: String,
    paths: SlicePaths,
    file: File,
    offer: SliceOffer,
    queue: VecDeque<u32>,
    /// The piece arriving: bytes written, hash so far.
    cur: Option<(u32, u64, blake3::Hasher)>,
    received: u64,
    total: u64,
    bad: Vec<u32>,
    started: Instant,
    last_progress: Instant,
    last_log: Instant,
}

/// What a frame did to a transfer.
pub enum Step {
    /// More to come; a progress message to send when it is time.
    More(Option<SliceProgress>),
    /// Every needed piece arrived: `bad` lists the ones to ask for again (then the transfer
    /// goes on); empty, the slice is in place at `path`.
    Done {
        progress: SliceProgress,
        path: Option<PathBuf>,
    },
}

impl Receiving {
    fn new(node: &str, paths: SlicePaths, file: File, offer: SliceOffer, need: Vec<u32>) -> Self {
        let total = need.iter().map(|&i| offer.pieces[i as usize].len).sum();
        let now = Instant::now();
        info!(
            "slice layers {}-{}{}: receiving {} piece(s), {:.1} MiB, into {}",
            offer.key.layer_start,
            offer.key.layer_end,
            if offer.key.head { " and head" } else { "" },
            need.len(),
            total as f64 / 1048576.0,
            paths.part.display()
        );
        Receiving {
            node: node.to_string(),
            paths,
            file,
            offer,
            queue: need.into(),
            cur: None,
            received: 0,
            total,
            bad: Vec::new(),
            started: now,
            last_progress: now,
            last_log: now,
        }
    }

    /// Says (in the log) that the transfer ended before its last piece; what arrived stays
    /// in the `.part` file for the next offer.
    pub fn log_cut(&self) {
        warn!(
            "slice layers {}-{}: transfer cut after {} of {} bytes; {} kept for resuming",
            self.offer.key.layer_start,
            self.offer.key.layer_end,
            self.received,
            self.total,
            self.paths.part.display()
        );
    }

    pub fn key(&self) -> &SliceKey {
        &self.offer.key
    }

    /// Whether pieces are still expected (the coordinator should be sending).
    pub fn expecting(&self) -> bool {
        !self.queue.is_empty()
    }

    fn progress(&self, done: bool) -> SliceProgress {
        SliceProgress {
            key: self.offer.key.clone(),
            received: self.received,
            done,
            bad: if done { self.bad.clone() } else { Vec::new() },
        }
    }

    /// Takes the bytes of a `Slice` frame for piece `seq`.
    pub fn on_frame(&mut self, seq: u64, bytes: &[u8]) -> Result<Step, SliceError> {
        let Some(&want) = self.queue.front() else {
            return Err(self.bad_frame(format!(
                "{} bytes of piece {seq} after the last needed piece",
                bytes.len()
            )));
        };
        if seq != want as u64 {
            return Err(self.bad_frame(format!("piece {seq} arrived, {want} was expected")));
        }
        let piece = &self.offer.pieces[want as usize];
        let (idx, written, mut hasher) = self
            .cur
            .take()
            .unwrap_or_else(|| (want, 0, blake3::Hasher::new()));
        debug_assert_eq!(idx, want);
        let end = written + bytes.len() as u64;
        if end > piece.len {
            return Err(self.bad_frame(format!(
                "piece {want} ({}) is {} bytes; {end} arrived",
                piece.name, piece.len
            )));
        }
        let at = piece.offset + written;
        self.file
            .write_all_at(bytes, at)
            .map_err(|source| SliceError::Io {
                node: self.node.clone(),
                path: self.paths.part.clone(),
                source,
            })?;
        hasher.update(bytes);
        self.received += bytes.len() as u64;
        if end < piece.len {
            self.cur = Some((want, end, hasher));
        } else {
            self.queue.pop_front();
            if *hasher.finalize().as_bytes() != piece.hash {
                warn!(
                    "slice layers {}-{}: piece {want} ({}, {} bytes) does not match its hash; \
                     asking for it again",
                    self.offer.key.layer_start, self.offer.key.layer_end, piece.name, piece.len
                );
                self.bad.push(want);
            }
        }
        self.log_now_and_then();
        if !self.queue.is_empty() {
            let now = Instant::now();
            if now - self.last_progress >= PROGRESS_EVERY {
                self.last_progress = now;
                return Ok(Step::More(Some(self.progress(false))));
            }
            return Ok(Step::More(None));
        }
        let progress = self.progress(true);
        if !self.bad.is_empty() {
            // The coordinator sends the bad pieces again, in this order.
            self.queue = std::mem::take(&mut self.bad).into();
            self.total += self
                .queue
                .iter()
                .map(|&i| self.offer.pieces[i as usize].len)
                .sum::<u64>();
            return Ok(Step::Done {
                progress,
                path: None,
            });
        }
        let secs = self.started.elapsed().as_secs_f64();
        info!(
            "slice layers {}-{}: {:.1} MiB received in {secs:.1} s ({:.1} MB/s), every piece checked",
            self.offer.key.layer_start,
            self.offer.key.layer_end,
            self.received as f64 / 1048576.0,
            self.received as f64 / secs.max(1e-9) / 1e6
        );
        let path = self.finish_ref().map_err(|(path, source)| SliceError::Io {
            node: self.node.clone(),
            path,
            source,
        })?;
        Ok(Step::Done {
            progress,
            path: Some(path),
        })
    }

    fn bad_frame(&self, why: String) -> SliceError {
        SliceError::BadOffer {
            node: self.node.clone(),
            why: format!("slice transfer: {why}"),
        }
    }

    fn log_now_and_then(&mut self) {
        let now = Instant::now();
        if now - self.last_log < LOG_EVERY {
            return;
        }
        self.last_log = now;
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        let rate = self.received as f64 / secs;
        let left = self.total.saturating_sub(self.received) as f64;
        info!(
            "slice layers {}-{}: {:.1} of {:.1} MiB ({:.0}%), {:.1} MB/s, ETA {:.0} s",
            self.offer.key.layer_start,
            self.offer.key.layer_end,
            self.received as f64 / 1048576.0,
            self.total as f64 / 1048576.0,
            100.0 * self.received as f64 / self.total.max(1) as f64,
            rate / 1e6,
            left / rate.max(1.0)
        );
    }

    fn finish(self) -> Result<PathBuf, (PathBuf, std::io::Error)> {
        self.finish_ref()
    }

    /// Flushes the `.part` file, stores the offer beside it and renames it into place.
    fn finish_ref(&self) -> Result<PathBuf, (PathBuf, std::io::Error)> {
        let p = &self.paths;
        self.file.sync_all().map_err(|e| (p.part.clone(), e))?;
        let stored = Control::SliceOffer(SliceOffer {
            dry_run: false,
            discard: false,
            ..self.offer.clone()
        })
        .encode()
        .map_err(|e| (p.pieces.clone(), std::io::Error::other(e.to_string())))?;
        // Beside, then renamed: a node sharing the cache never reads a half-written one.
        let tmp = p.part.with_extension("pieces");
        std::fs::write(&tmp, stored).map_err(|e| (tmp.clone(), e))?;
        std::fs::rename(&tmp, &p.pieces).map_err(|e| (p.pieces.clone(), e))?;
        std::fs::rename(&p.part, &p.file).map_err(|e| (p.part.clone(), e))?;
        Ok(p.file.clone())
    }
}
