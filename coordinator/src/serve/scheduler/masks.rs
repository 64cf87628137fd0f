//! The grammar thread: constrained sequences' next-token masks, computed while the forward
//! pass runs.
//!
//! A sequence's [`Constraint`] leaves for this thread as soon as its token is sampled (and at
//! admission, for the first mask, while the prompt is prefilled), takes the token and
//! computes the mask for the next one, and comes back. The scheduler only waits for it when
//! the step's logits are ready before the mask is; that wait is the whole cost a grammar adds
//! to a step, and it is counted (`grammar_wait_seconds_total` in `/metrics`). One thread
//! serves every sequence: a mask takes well under a millisecond for the grammars requests
//! bring, and the forward pass it hides behind takes several.

use crate::text::grammar::Constraint;
use std::sync::mpsc::{channel, Receiver, Sender};

/// Where a sequence's constraint is.
pub(super) enum Grammar {
    /// Unconstrained.
    None,
    /// On the grammar thread.
    Away,
    /// Here, with the mask for the next token.
    Here(Box<Constraint>),
    /// The grammar failed (a token it refused, an internal error): the request ends with it.
    Failed(String),
}

struct Job {
    seq: u64,
    c: Box<Constraint>,
    token: Option<u32>,
}

/// A constraint back from the grammar thread.
pub(super) struct Done {
    pub(super) seq: u64,
    pub(super) c: Box<Constraint>,
    pub(super) result: Result<(), String>,
    /// Seconds this job took.
    pub(super) seconds: f64,
}

/// The grammar thread, started with the first constrained request.
#[derive(Default)]
pub(super) struct Masks {
    link: Option<(Sender<Job>, Receiver<Done>)>,
    /// Jobs sent and not yet received.
    pub(super) out: usize,
}

impl Masks {
    /// Sends `c` to take `token` (none: the first mask) and compute the next mask.
    pub(super) fn send(&mut self, seq: u64, c: Box<Constraint>, token: Option<u32>) -> Grammar {
        if self.link.is_none() {
            let (jobs, job_rx) = channel::<Job>();
            let (done_tx, done) = channel::<Done>();
            let spawned = std::thread::Builder::new()
                .name("grammar".into())
                .spawn(move || {
                    for mut j in job_rx {
                        let t0 = std::time::Instant::now();
                        let result = j.c.advance(j.token);
                        let seconds = t0.elapsed().as_secs_f64();
                        let d = Done {
                            seq: j.seq,
                            c: j.c,
                            result,
                            seconds,
                        };
                        if done_tx.send(d).is_err() {
                            return;
                        }
                    }
                });
            if let Err(e) = spawned {
                return Grammar::Failed(format!("cannot start the grammar thread: {e}"));
            }
            self.link = Some((jobs, done));
        }
        let Some((jobs, _)) = &self.link else {
            return Grammar::Failed("the grammar thread is gone".into());
        };
        match jobs.send(Job { seq, c, token }) {
            Ok(()) => {
                self.out += 1;
                Grammar::Away
            }
            Err(_) => Grammar::Failed("the grammar thread stopped".into()),
        }
    }

    /// The next constraint back, waiting for it. `None` when nothing is out (or the thread
    /// died: a panic in the grammar library, which the jobs' senders then see).
    pub(super) fn recv(&mut self) -> Option<Done> {
        if self.out == 0 {
            return None;
        }
        let d = self.link.as_ref()?.1.recv().ok()?;
        self.out -= 1;
        Some(d)
    }
}
