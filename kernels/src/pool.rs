//! A small fork–join thread pool for the per-token loop.
//!
//! `run(job)` calls `job(thread_index)` on the caller (thread 0) and on every worker that
//! joins in time, and returns when all that joined have finished. Jobs take their work from
//! shared counters (`Chunks`), never by thread index, so the caller alone can do all of it:
//! once its own call returns, the job is closed, and a worker that had not yet joined (its
//! core busy with another process, the machine never idle in a home lab) skips it instead of
//! stalling the step until the scheduler gets round to it. A thread index only selects
//! per-thread scratch. Idle workers spin briefly (a decode step follows the previous one
//! within microseconds) and then sleep on a condition variable, so a node waiting for frames
//! does not burn its cores. Nothing is allocated per `run`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before sleeping.
const SPIN: Duration = Duration::from_micros(1000);
/// A job whose workers keep the caller waiting this much longer than the caller's own share
/// took (and at least `STALL_MIN`) counts as stalled: a worker that joined was taken off its
/// core (another process wants it) in the middle of a chunk.
const STALL_MIN: Duration = Duration::from_micros(100);
/// Stalled jobs among the last 8 that send the pool solo for a while.
const STALLS_TO_GO_SOLO: u32 = 3;
/// Jobs the caller then runs alone before trying its workers again (a tenth of a second of
/// decoding a small model; more on a large one).
const SOLO_JOBS: u32 = 4096;
/// A pool that stalls again within this many jobs of trying its workers doubles its next
/// spell alone, up to `MAX_SOLO_JOBS`: under a lasting load each try costs a few stalled
/// jobs (a scheduler slice each), which at 4096 jobs a spell took ~6% of a small model's
/// decode.
const RELAPSE_JOBS: u32 = 256;
const MAX_SOLO_JOBS: u32 = 64 * SOLO_JOBS;
/// A spell alone ends after this long whatever its job count (jobs of a large model are
/// long), so the workers are back within seconds of the load going away.
const MAX_SOLO_TIME: Duration = Duration::from_secs(2);

/// Every this many jobs, the caller times one against its own CPU time.
const SAMPLE_EVERY: u32 = 8;
/// Samples per verdict on whether the machine is oversubscribed.
const SAMPLES: u32 = 32;
/// Below this share of wall time on a CPU, the caller is taken for crowded out: another
/// process wants our cores, and our spinning workers make it worse.
const MIN_CPU_SHARE: f64 = 0.8;

/// CPU time this thread has used.
fn thread_cpu_time() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill; CLOCK_THREAD_CPUTIME_ID exists
    // on every Linux this runs on (an error leaves it zero, which reads as no CPU time).
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    Duration::new(
        ts.tv_sec.max(0) as u64,
        ts.tv_nsec.clamp(0, 999_999_999) as u32,
    )
}

/// The caller's view of how its workers keep up (guarded by `ThreadPool::running`).
#[derive(Default)]
struct Adapt {
    /// Jobs since the last sample.
    since_sample: u32,
    /// Sampled jobs in this verdict's window, their wall time and the caller's CPU time.
    samples: u32,
    wall: Duration,
    cpu: Duration,
    /// One bit per recent job, 1 = stalled, newest in bit 0.
    stalls: u32,
    /// Jobs left to run on the caller alone.
    solo_left: u32,
    /// When the current spell alone began.
    solo_since: Option<Instant>,
    /// Length of the next spell (doubles on a quick relapse; `SOLO_JOBS` when 0).
    solo_len: u32,
    /// Jobs run with the workers since the last spell ended.
    since_spell: u32,
    /// Times the pool went solo (for reports and tests).
    solo_spells: u64,
}

type Job = dyn Fn(usize) + Sync;

/// `Shared::gate`: the generation it is open for (high bits), a closed bit, and the count of
/// workers inside the job (low bits).
const GATE_CLOSED: usize = 1 << 16;
const GATE_INSIDE: usize = GATE_CLOSED - 1;
const GATE_GEN_SHIFT: u32 = 17;

struct Shared {
    /// Incremented for every job; workers try to join a job when they see a new value.
    generation: AtomicUsize,
    /// Who may still join the current job, and who is inside it (see `GATE_*`).
    gate: AtomicUsize,
    /// The current job, valid while `pending > 0` for the generation it was posted with.
    job: Mutex<Option<JobPtr>>,
    /// Sleeping workers wait here for a new generation.
    wake: Condvar,
    sleepers: AtomicUsize,
    /// Set by the caller when a job panicked on a worker.
    panicked: AtomicBool,
    shutdown: AtomicBool,
}

/// A lifetime-erased pointer to the caller's job closure.
#[derive(Clone, Copy)]
struct JobPtr(*const Job);
// SAFETY: the pointee is `Sync` and `run` keeps it alive until every worker is done with it.
unsafe impl Send for JobPtr {}

pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    n_threads: usize,
    /// Serializes `run` calls from different threads sharing one pool, and holds what the
    /// caller learned about its workers.
    running: Mutex<Adapt>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ThreadPool({} threads)", self.n_threads)
    }
}

impl ThreadPool {
    /// A pool of `n_threads` threads in all, the calling thread included (minimum 1).
    pub fn new(n_threads: usize) -> ThreadPool {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            generation: AtomicUsize::new(0),
            gate: AtomicUsize::new(GATE_CLOSED),
            job: Mutex::new(None),
            wake: Condvar::new(),
            sleepers: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
        });
        let workers = (1..n_threads)
            .map(|index| {
                let shared = Arc::clone(&shared);
                std::thread::Builder::new()
                    .name(format!("ringllm-worker-{index}"))
                    .spawn(move || worker(shared, index))
                    .unwrap_or_else(|e| panic!("cannot start worker thread {index}: {e}"))
            })
            .collect();
        ThreadPool {
            shared,
            workers,
            n_threads,
            running: Mutex::new(Adapt::default()),
        }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `job(i)` on the calling thread (`i` = 0) and on every worker that joins before
    /// the caller's own call returns (`i` its index), in parallel; returns once every call
    /// has. `job` must take its work from shared counters, so that any subset of the threads
    /// (the caller alone, at worst) does all of it.
    pub fn run(&self, job: &(dyn Fn(usize) + Sync)) {
        if self.n_threads == 1 {
            job(0);
            return;
        }
        let mut adapt = self.running.lock().unwrap_or_else(|p| p.into_inner());
        if adapt.solo_left > 0 {
            // Workers kept stalling (the machine is busy): the caller does the work alone
            // for a while; the results are the same (work is split by counters).
            adapt.solo_left -= 1;
            if adapt
                .solo_since
                .is_some_and(|t| t.elapsed() > MAX_SOLO_TIME)
            {
                adapt.solo_left = 0;
            }
            drop(adapt);
            job(0);
            return;
        }
        adapt.since_spell = adapt.since_spell.saturating_add(1);
        let s = &*self.shared;
        adapt.since_sample += 1;
        let sampled = adapt.since_sample >= SAMPLE_EVERY;
        let cpu0 = if sampled {
            adapt.since_sample = 0;
            thread_cpu_time()
        } else {
            Duration::ZERO
        };
        let started = Instant::now();
        // SAFETY: we erase the lifetime of `job`; this function does not return before the
        // gate is closed and no worker is inside, i.e. before every worker that called the
        // job has returned, and none can call it afterwards.
        let ptr =
            JobPtr(
                unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Job>(job) }
                    as *const Job,
            );
        {
            let mut slot = s.job.lock().unwrap_or_else(|p| p.into_inner());
            *slot = Some(ptr);
            let generation = s.generation.load(Ordering::SeqCst).wrapping_add(1);
            s.gate.store(gate_open(generation), Ordering::SeqCst);
            s.generation.store(generation, Ordering::SeqCst);
        }
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _slot = s.job.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        let caller = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(0)));
        let own = started.elapsed();
        // The work is all taken: latecomers skip the job from here on.
        s.gate.fetch_or(GATE_CLOSED, Ordering::SeqCst);
        let start = Instant::now();
        while s.gate.load(Ordering::Acquire) & GATE_INSIDE != 0 {
            if start.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        adapt.record(start.elapsed() > own.max(STALL_MIN));
        if sampled {
            adapt.sample(started.elapsed(), thread_cpu_time().saturating_sub(cpu0));
        }
        if let Err(p) = caller {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::SeqCst) {
            panic!("a worker thread panicked while running a kernel");
        }
    }
}

impl Adapt {
    /// Adds one timed job; after `SAMPLES`, a caller that was on a CPU less than
    /// `MIN_CPU_SHARE` of the time sends the pool solo for `SOLO_JOBS` jobs.
    fn sample(&mut self, wall: Duration, cpu: Duration) {
        self.samples += 1;
        self.wall += wall;
        self.cpu += cpu;
        if self.samples < SAMPLES {
            return;
        }
        let share = self.cpu.as_secs_f64() / self.wall.as_secs_f64().max(1e-9);
        (self.samples, self.wall, self.cpu) = (0, Duration::ZERO, Duration::ZERO);
        if share < MIN_CPU_SHARE {
            self.go_solo();
        }
    }

    fn go_solo(&mut self) {
        self.stalls = 0;
        self.solo_len = if self.solo_spells > 0 && self.since_spell <= RELAPSE_JOBS {
            self.solo_len
                .max(SOLO_JOBS)
                .saturating_mul(2)
                .min(MAX_SOLO_JOBS)
        } else {
            SOLO_JOBS
        };
        self.solo_left = self.solo_len;
        self.solo_since = Some(Instant::now());
        self.since_spell = 0;
        self.solo_spells += 1;
    }

    /// Notes whether the last job stalled; after `STALLS_TO_GO_SOLO` of the last 8, the
    /// next `SOLO_JOBS` jobs run on the caller alone.
    fn record(&mut self, stalled: bool) {
        self.stalls = (self.stalls << 1) | u32::from(stalled);
        if (self.stalls & 0xff).count_ones() >= STALLS_TO_GO_SOLO {
            self.go_solo();
        }
    }
}

impl ThreadPool {
    /// `f` over `0..n` in ranges of at most `chunk`, handed to the threads by a shared counter;
    /// on the calling thread alone, as one range, when `n <= chunk` or the pool has one thread.
    pub fn for_ranges(&self, n: usize, chunk: usize, f: &(dyn Fn(std::ops::Range<usize>) + Sync)) {
        if n <= chunk || self.n_threads == 1 {
            f(0..n);
            return;
        }
        let chunks = Chunks::new(n, chunk);
        self.run(&|_| {
            while let Some(r) = chunks.next_range() {
                f(r);
            }
        });
    }

    /// How many times this pool has run jobs on the caller alone because its workers kept
    /// stalling.
    pub fn solo_spells(&self) -> u64 {
        self.running
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .solo_spells
    }
}

/// The gate of a job just posted as `generation`: open, nobody inside.
fn gate_open(generation: usize) -> usize {
    generation << GATE_GEN_SHIFT
}

/// Joins the job of `generation` if it is still open: counts this worker inside.
fn try_join(gate: &AtomicUsize, generation: usize) -> bool {
    let mut v = gate.load(Ordering::SeqCst);
    loop {
        if v >> GATE_GEN_SHIFT != generation & (usize::MAX >> GATE_GEN_SHIFT)
            || v & GATE_CLOSED != 0
        {
            return false;
        }
        match gate.compare_exchange_weak(v, v + 1, Ordering::SeqCst, Ordering::SeqCst) {
            Ok(_) => return true,
            Err(now) => v = now,
        }
    }
}

fn worker(shared: Arc<Shared>, index: usize) {
    let s = &*shared;
    let mut seen = 0usize;
    loop {
        // Wait for a new generation: spin, then sleep.
        let start = Instant::now();
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            if s.generation.load(Ordering::Acquire) != seen {
                break;
            }
            if start.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            let slot = s.job.lock().unwrap_or_else(|p| p.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            let slot = s
                .wake
                .wait_while(slot, |_| {
                    s.generation.load(Ordering::SeqCst) == seen
                        && !s.shutdown.load(Ordering::SeqCst)
                })
                .unwrap_or_else(|p| p.into_inner());
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            drop(slot);
        }
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        seen = s.generation.load(Ordering::Acquire);
        if !try_join(&s.gate, seen) {
            continue; // too late: the caller did the work
        }
        let job = *s.job.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(JobPtr(ptr)) = job {
            // SAFETY: `run` keeps the closure alive until no worker is inside the gate, which
            // happens only after this call returns.
            let f = unsafe { &*ptr };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(index))).is_err() {
                s.panicked.store(true, Ordering::SeqCst);
            }
        }
        s.gate.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        {
            let _slot = self.shared.job.lock().unwrap_or_else(|p| p.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// Hands out chunks of `0..total` to the threads of one `run` (dynamic scheduling).
pub struct Chunks {
    next: AtomicUsize,
    total: usize,
    chunk: usize,
}

impl Chunks {
    pub fn new(total: usize, chunk: usize) -> Chunks {
        Chunks {
            next: AtomicUsize::new(0),
            total,
            chunk: chunk.max(1),
        }
    }

    /// The next range to work on, or `None` when all are taken.
    pub fn next_range(&self) -> Option<std::ops::Range<usize>> {
        let start = self.next.fetch_add(self.chunk, Ordering::Relaxed);
        (start < self.total).then(|| start..(start + self.chunk).min(self.total))
    }
}

/// A raw pointer that threads of one `run` use to write disjoint parts of one buffer.
#[derive(Clone, Copy)]
pub struct SharedMut<T>(*mut T, usize);
// SAFETY: users write disjoint indices only (stated at each use).
unsafe impl<T: Send> Send for SharedMut<T> {}
// SAFETY: as above.
unsafe impl<T: Send> Sync for SharedMut<T> {}

impl<T> SharedMut<T> {
    pub fn new(slice: &mut [T]) -> SharedMut<T> {
        SharedMut(slice.as_mut_ptr(), slice.len())
    }

    pub fn len(&self) -> usize {
        self.1
    }

    pub fn is_empty(&self) -> bool {
        self.1 == 0
    }

    /// # Safety
    /// No other thread may access `range` while the returned slice lives, and the buffer
    /// must outlive it.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn slice(&self, range: std::ops::Range<usize>) -> &mut [T] {
        assert!(
            range.start <= range.end && range.end <= self.1,
            "range out of bounds"
        );
        // SAFETY: in bounds (checked above); exclusivity is the caller's promise.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(range.start), range.end - range.start) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU64;

    #[test]
    fn every_job_is_done_once_by_the_threads_that_join() {
        let pool = ThreadPool::new(3);
        let (hits, callers) = (AtomicU64::new(0), AtomicU64::new(0));
        for _ in 0..1000 {
            let chunks = Chunks::new(64, 1);
            pool.run(&|i| {
                assert!(i < 3);
                if i == 0 {
                    callers.fetch_add(1, Ordering::Relaxed);
                }
                while chunks.next_range().is_some() {
                    hits.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        assert_eq!(hits.load(Ordering::Relaxed), 64 * 1000);
        assert_eq!(callers.load(Ordering::Relaxed), 1000);
    }

    /// The gate: a worker joins only the open job of its own generation; once the caller
    /// closes it (its own share done), a worker that comes late skips it.
    #[test]
    fn late_workers_skip_a_closed_job() {
        let gate = AtomicUsize::new(GATE_CLOSED);
        assert!(!try_join(&gate, 0));
        for g in [
            1usize,
            2,
            usize::MAX >> GATE_GEN_SHIFT,
            (usize::MAX >> GATE_GEN_SHIFT) + 3,
        ] {
            gate.store(gate_open(g), Ordering::SeqCst);
            assert!(!try_join(&gate, g.wrapping_add(1)), "another generation");
            assert!(try_join(&gate, g) && try_join(&gate, g));
            assert_eq!(gate.load(Ordering::SeqCst) & GATE_INSIDE, 2);
            gate.fetch_or(GATE_CLOSED, Ordering::SeqCst);
            assert!(!try_join(&gate, g), "closed");
            gate.fetch_sub(2, Ordering::SeqCst);
            assert_eq!(gate.load(Ordering::SeqCst) & GATE_INSIDE, 0);
        }
    }

    /// Three stalled jobs among eight send the pool solo for `SOLO_JOBS` jobs, which still
    /// do all their work; then the workers are tried again.
    #[test]
    fn stalls_send_the_pool_solo_for_a_while() {
        let mut a = Adapt::default();
        for stalled in [
            true, false, false, false, false, false, false, false, true, false,
        ] {
            a.record(stalled);
        }
        assert_eq!(a.solo_left, 0, "two stalls in eight are tolerated");
        a.record(true);
        a.record(true);
        assert_eq!((a.solo_left, a.solo_spells), (SOLO_JOBS, 1));
        // A caller on a CPU only half the time it waits for jobs goes solo too.
        let mut b = Adapt::default();
        let ms = Duration::from_millis(1);
        for _ in 0..SAMPLES {
            b.sample(ms, ms);
        }
        assert_eq!(
            b.solo_left, 0,
            "a caller on its CPU all the time keeps its workers"
        );
        for _ in 0..SAMPLES {
            b.sample(ms, ms / 2);
        }
        assert_eq!((b.solo_left, b.solo_spells), (SOLO_JOBS, 1));
        let pool = ThreadPool::new(2);
        pool.running.lock().unwrap().solo_left = 3;
        let done = AtomicU64::new(0);
        let threads = AtomicU64::new(0);
        for _ in 0..5 {
            let chunks = Chunks::new(10, 1);
            pool.run(&|i| {
                threads.fetch_or(1 << i, Ordering::Relaxed);
                while chunks.next_range().is_some() {
                    done.fetch_add(1, Ordering::Relaxed);
                }
            });
        }
        assert_eq!(done.load(Ordering::Relaxed), 50);
        assert_eq!(pool.running.lock().unwrap().solo_left, 0);
    }

    /// A pool that stalls again right after a spell alone makes the next spell twice as long
    /// (up to `MAX_SOLO_JOBS`); one that kept its workers for a while starts over.
    #[test]
    fn quick_relapses_lengthen_the_spells_alone() {
        let mut a = Adapt::default();
        let stall = |a: &mut Adapt| (0..STALLS_TO_GO_SOLO).for_each(|_| a.record(true));
        stall(&mut a);
        assert_eq!(a.solo_left, SOLO_JOBS);
        let mut want = SOLO_JOBS;
        for _ in 0..10 {
            a.solo_left = 0;
            a.since_spell = 10;
            stall(&mut a);
            want = (want * 2).min(MAX_SOLO_JOBS);
            assert_eq!(a.solo_left, want);
        }
        assert_eq!(want, MAX_SOLO_JOBS);
        a.solo_left = 0;
        a.since_spell = RELAPSE_JOBS + 1;
        stall(&mut a);
        assert_eq!(
            a.solo_left, SOLO_JOBS,
            "a long run with the workers resets the spell"
        );
    }

    /// Jobs complete, every chunk once, while another thread keeps every core busy.
    #[test]
    fn jobs_complete_beside_a_busy_loop() {
        let stop = AtomicBool::new(false);
        std::thread::scope(|sc| {
            for _ in 0..std::thread::available_parallelism().map_or(1, |n| n.get()) {
                sc.spawn(|| {
                    while !stop.load(Ordering::Relaxed) {
                        std::hint::spin_loop();
                    }
                });
            }
            let pool = ThreadPool::new(2);
            let done = AtomicU64::new(0);
            for _ in 0..200 {
                let chunks = Chunks::new(16, 1);
                pool.run(&|_| {
                    while chunks.next_range().is_some() {
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                });
            }
            stop.store(true, Ordering::Relaxed);
            assert_eq!(done.load(Ordering::Relaxed), 16 * 200);
        });
    }

    #[test]
    fn workers_sleep_and_wake() {
        let pool = ThreadPool::new(2);
        // Thread 0 keeps the job open until the worker has joined (a hang guard of 10 s).
        let both = |hits: &AtomicU64| {
            pool.run(&|i| {
                hits.fetch_add(1, Ordering::SeqCst);
                if i == 0 {
                    let t = Instant::now();
                    while hits.load(Ordering::SeqCst) < 2 && t.elapsed() < Duration::from_secs(10) {
                        std::hint::spin_loop();
                    }
                }
            });
            hits.load(Ordering::SeqCst)
        };
        assert_eq!(both(&AtomicU64::new(0)), 2);
        std::thread::sleep(Duration::from_millis(20)); // past the spin: the worker sleeps
        assert_eq!(
            both(&AtomicU64::new(0)),
            2,
            "the sleeping worker woke and joined"
        );
    }

    #[test]
    fn chunks_cover_the_range_once() {
        let pool = ThreadPool::new(2);
        let chunks = Chunks::new(1001, 7);
        let mut seen = vec![0u8; 1001];
        let out = SharedMut::new(&mut seen);
        pool.run(&|_| {
            while let Some(r) = chunks.next_range() {
                // SAFETY: chunks are disjoint.
                for v in unsafe { out.slice(r) } {
                    *v += 1;
                }
            }
        });
        assert!(seen.iter().all(|&v| v == 1));
    }

    #[test]
    fn worker_panic_reaches_the_caller() {
        let pool = ThreadPool::new(2);
        let joined = AtomicBool::new(false);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|i| {
                if i == 0 {
                    // Keep the job open until the worker is in (a hang guard of 10 s).
                    let t = Instant::now();
                    while !joined.load(Ordering::SeqCst) && t.elapsed() < Duration::from_secs(10) {
                        std::hint::spin_loop();
                    }
                } else {
                    joined.store(true, Ordering::SeqCst);
                    panic!("boom");
                }
            });
        }));
        assert!(joined.load(Ordering::SeqCst), "the worker never joined");
        assert!(r.is_err());
        // The pool still works afterwards.
        let chunks = Chunks::new(5, 1);
        let hits = AtomicU64::new(0);
        pool.run(&|_| {
            while chunks.next_range().is_some() {
                hits.fetch_add(1, Ordering::Relaxed);
            }
        });
        assert_eq!(hits.load(Ordering::Relaxed), 5);
    }
}
