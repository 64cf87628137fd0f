//! Which prompts a step carries (`plan_prefill`).

/// A sequence with prompt left to feed, as `plan_prefill` sees it.
#[derive(Clone, Copy, Debug)]
pub(super) struct PrefillCand {
    pub(super) slot: usize,
    /// Prompt tokens still to feed (more than one: the last is fed as a decode token).
    pub(super) pending: usize,
    /// The step that last carried some of its prompt (`None`: not started).
    pub(super) last_fed: Option<u64>,
    /// Admission order.
    pub(super) admitted: u64,
}

/// Which prompts step number `step` carries, within `budget` tokens and `room` sequences:
/// (slot, tokens), in order. Fair to prompts short and long:
/// - a prefill under way never waits two steps in a row: one the previous step left out goes
///   first (least recently fed first);
/// - otherwise prompts not started yet go first, oldest first, then the others;
/// - a prompt is taken whole when it fits what is left of the budget; a partial chunk only
///   as the step's first prefill. So a short prompt arriving while a long one prefills is fed
///   whole in the next step, without a long chunk beside it, and the long one resumes in the
///   step after.
pub(super) fn plan_prefill(
    cands: &[PrefillCand],
    budget: usize,
    room: usize,
    step: u64,
) -> Vec<(usize, usize)> {
    let previous = step.saturating_sub(1);
    // Rank: 0 = under way and left out of the previous step, 1 = not started, 2 = under way.
    let rank = |c: &PrefillCand| match c.last_fed {
        Some(f) if f < previous => (0, f, c.admitted),
        None => (1, 0, c.admitted),
        Some(f) => (2, f, c.admitted),
    };
    let mut order: Vec<&PrefillCand> = cands.iter().collect();
    order.sort_by_key(|c| rank(c));
    let mut plan = Vec::new();
    let mut left = budget;
    for c in order {
        if left == 0 || plan.len() >= room {
            break;
        }
        if c.pending <= left {
            plan.push((c.slot, c.pending));
            left -= c.pending;
        } else if plan.is_empty() {
            plan.push((c.slot, left));
            break;
        }
    }
    plan
}
