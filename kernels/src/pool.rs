//! A small fork–join thread pool for the per-token loop.
//!
//! `run(job)` executes `job(thread_index)` once on every thread of the pool (the caller is
//! thread 0) and returns when all have finished. Idle workers spin briefly (a decode step
//! follows the previous one within microseconds) and then sleep on a condition variable, so
//! a node waiting for frames does not burn its cores. Nothing is allocated per `run`.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long an idle worker spins before sleeping.
const SPIN: Duration = Duration::from_micros(1000);

type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// Incremented for every job; workers run a job when they see a new value.
    generation: AtomicUsize,
    /// Workers still running the current job.
    pending: AtomicUsize,
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
    /// Serializes `run` calls from different threads sharing one pool.
    running: Mutex<()>,
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
            pending: AtomicUsize::new(0),
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
            running: Mutex::new(()),
        }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `job(i)` for every thread index `i` in `0..n_threads()`, in parallel.
    pub fn run(&self, job: &(dyn Fn(usize) + Sync)) {
        if self.n_threads == 1 {
            job(0);
            return;
        }
        let _guard = self.running.lock().unwrap_or_else(|p| p.into_inner());
        let s = &*self.shared;
        // SAFETY: we erase the lifetime of `job`; this function does not return before
        // `pending` is back to 0, i.e. before every worker finished calling it.
        let ptr =
            JobPtr(
                unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync + '_), &'static Job>(job) }
                    as *const Job,
            );
        {
            let mut slot = s.job.lock().unwrap_or_else(|p| p.into_inner());
            *slot = Some(ptr);
            s.pending.store(self.n_threads - 1, Ordering::SeqCst);
            s.generation.fetch_add(1, Ordering::SeqCst);
        }
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _slot = s.job.lock().unwrap_or_else(|p| p.into_inner());
            s.wake.notify_all();
        }
        let caller = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(0)));
        let start = Instant::now();
        while s.pending.load(Ordering::Acquire) != 0 {
            if start.elapsed() < SPIN {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        if let Err(p) = caller {
            std::panic::resume_unwind(p);
        }
        if s.panicked.swap(false, Ordering::SeqCst) {
            panic!("a worker thread panicked while running a kernel");
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
        let job = *s.job.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(JobPtr(ptr)) = job {
            // SAFETY: `run` keeps the closure alive until `pending` reaches 0, which happens
            // only after this call returns.
            let f = unsafe { &*ptr };
            if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(index))).is_err() {
                s.panicked.store(true, Ordering::SeqCst);
            }
        }
        s.pending.fetch_sub(1, Ordering::Release);
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
    fn every_thread_runs_every_job() {
        let pool = ThreadPool::new(3);
        let hits = AtomicU64::new(0);
        for _ in 0..1000 {
            pool.run(&|i| {
                hits.fetch_add(1 << (i * 16), Ordering::Relaxed);
            });
        }
        let h = hits.load(Ordering::Relaxed);
        assert_eq!(h & 0xffff, 1000);
        assert_eq!((h >> 16) & 0xffff, 1000);
        assert_eq!((h >> 32) & 0xffff, 1000);
    }

    #[test]
    fn workers_sleep_and_wake() {
        let pool = ThreadPool::new(2);
        let hits = AtomicU64::new(0);
        pool.run(&|_| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        std::thread::sleep(Duration::from_millis(20)); // past the spin: the worker sleeps
        pool.run(&|_| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 4);
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
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            pool.run(&|i| assert!(i == 0, "boom"));
        }));
        assert!(r.is_err());
        // The pool still works afterwards.
        let hits = AtomicU64::new(0);
        pool.run(&|_| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 2);
    }
}
