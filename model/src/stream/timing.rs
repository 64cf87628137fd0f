//! The streamer's timing model: how long a token takes on one node whose reader fills
//! `depth + 1` layer buffers ahead of the compute ([`ReadAhead`], [`node_s_per_token`]), and
//! the split of a node's layers into a resident and a streamed tier ([`plan_tiers`]) at the
//! read-ahead depth the model finds fastest ([`choose_depth`]). The coordinator prices a ring
//! of such nodes with the same reader (`cluster::streaming` in the `ringllm` crate).

/// One layer as the timing model sees it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimLayer {
    /// Compute time per decoded token, seconds.
    pub compute_s: f64,
    /// Bytes read from disk per token when streamed (`None`: resident).
    pub streamed_bytes: Option<u64>,
}

/// The timing model of one node's streamer: its reader reads the streamed layers in the
/// order they run, cycling over tokens, as soon as one of its `depth + 1` buffers is free (a
/// buffer frees when its layer's compute ends); a layer runs when the token has reached it
/// and its bytes are in. Deterministic: the reads happen in the order the computes need
/// them, so running the layers in token order resolves them. A ring of such nodes is
/// modelled on the coordinator's side (`cluster::streaming`).
#[derive(Clone, Debug)]
pub struct ReadAhead {
    /// Sequential read rate, bytes per second.
    rate: f64,
    depth: usize,
    /// End times of the reads, by read index.
    read_end: Vec<f64>,
    /// When each read's buffer was freed (its layer's compute ended), by read index.
    free: Vec<f64>,
}

impl ReadAhead {
    /// A reader at `read_bytes_per_s` (1 byte/s when not a positive number), `depth` layers
    /// ahead.
    pub fn new(read_bytes_per_s: f64, depth: usize) -> ReadAhead {
        let rate = if read_bytes_per_s.is_finite() && read_bytes_per_s > 0.0 {
            read_bytes_per_s
        } else {
            1.0
        };
        ReadAhead {
            rate,
            depth,
            read_end: Vec::new(),
            free: Vec::new(),
        }
    }

    /// Runs `layer` for a token that reached it at `t`: when its compute ends.
    pub fn run(&mut self, t: f64, layer: &SimLayer) -> f64 {
        let Some(bytes) = layer.streamed_bytes else {
            return t + layer.compute_s.max(0.0);
        };
        let m = self.read_end.len();
        let prev = self.read_end.last().copied().unwrap_or(0.0);
        let slot = m.checked_sub(self.depth + 1).map_or(0.0, |j| self.free[j]);
        let end = prev.max(slot) + bytes as f64 / self.rate;
        self.read_end.push(end);
        let done = t.max(end) + layer.compute_s.max(0.0);
        self.free.push(done);
        done
    }
}

/// Seconds per decoded token in steady state, one token in flight: `token` takes the time a
/// token starts to the time the next one can (the timing model's clock); the mean over the
/// later tokens of a short run.
pub fn steady_state(mut token: impl FnMut(f64) -> f64) -> f64 {
    const TOKENS: usize = 12;
    let mut t = 0.0f64;
    let mut starts = Vec::with_capacity(TOKENS);
    for _ in 0..TOKENS {
        starts.push(t);
        t = token(t);
    }
    let half = TOKENS / 2;
    (t - starts[half]) / (TOKENS - half) as f64
}

/// Seconds per decoded token of one node running `layers` alone ([`ReadAhead`] at
/// `read_bytes_per_s`, `depth` layers ahead), with `idle_s` per token spent elsewhere
/// (sampling, other nodes), in steady state.
pub fn node_s_per_token(
    layers: &[SimLayer],
    read_bytes_per_s: f64,
    depth: usize,
    idle_s: f64,
) -> f64 {
    let mut reader = ReadAhead::new(read_bytes_per_s, depth);
    steady_state(|mut t| {
        for l in layers {
            t = reader.run(t, l);
        }
        t + idle_s
    })
}

/// Which layers of a slice stream, and how far ahead.
#[derive(Clone, Debug, PartialEq)]
pub struct TierPlan {
    /// Streamed layers (the rest are resident), in execution order.
    pub streamed: Vec<usize>,
    pub depth: usize,
    pub resident_bytes: u64,
    /// The pool of `depth + 1` layer buffers.
    pub pool_bytes: u64,
    /// Bytes read from disk per token.
    pub streamed_bytes: u64,
}

/// Splits `layers` (`(layer, bytes)` in execution order) into a resident tier and a streamed
/// tier within `budget` bytes, the first layers resident: `depth` layers are read ahead, so
/// the pool holds `depth + 1` of the largest. `None` when even the pool does not fit. With
/// everything fitting, nothing streams.
pub fn plan_tiers(layers: &[(usize, u64)], budget: u64, depth: usize) -> Option<TierPlan> {
    let total: u64 = layers.iter().map(|l| l.1).sum();
    if total <= budget {
        return Some(TierPlan {
            streamed: Vec::new(),
            depth,
            resident_bytes: total,
            pool_bytes: 0,
            streamed_bytes: 0,
        });
    }
    let largest = layers.iter().map(|l| l.1).max().unwrap_or(0);
    let pool = (largest + 2 * super::ALIGN as u64).saturating_mul(depth as u64 + 1);
    let mut left = budget.checked_sub(pool)?;
    let mut resident = 0u64;
    let mut streamed = Vec::new();
    let mut streamed_bytes = 0u64;
    let mut full = false;
    for &(il, b) in layers {
        if !full && b <= left {
            left -= b;
            resident += b;
        } else {
            // Keep the resident layers a prefix: the read order stays the run order.
            full = true;
            streamed.push(il);
            streamed_bytes += b;
        }
    }
    Some(TierPlan {
        streamed,
        depth,
        resident_bytes: resident,
        pool_bytes: pool,
        streamed_bytes,
    })
}

/// The read-ahead depth (1..=4) whose tier plan the timing model finds fastest for a node
/// running `layers` alone at `compute_bytes_per_s`, reading at `read_bytes_per_s`, with
/// `idle_s` per token spent elsewhere (sampling, other nodes): a deeper pool overlaps more of
/// the idle time but leaves fewer layers resident.
pub fn choose_depth(
    layers: &[(usize, u64)],
    budget: u64,
    compute_bytes_per_s: f64,
    read_bytes_per_s: f64,
    idle_s: f64,
) -> Option<(TierPlan, f64)> {
    let mut best: Option<(TierPlan, f64)> = None;
    for depth in 1..=4 {
        let Some(tp) = plan_tiers(layers, budget, depth) else {
            continue;
        };
        let s = predict(layers, &tp, compute_bytes_per_s, read_bytes_per_s, idle_s);
        if best.as_ref().is_none_or(|b| s < b.1 * 0.999) {
            best = Some((tp, s));
        }
    }
    best
}

/// The timing model's seconds per token for one node running `layers` with tiers `tp`.
pub fn predict(
    layers: &[(usize, u64)],
    tp: &TierPlan,
    compute_bytes_per_s: f64,
    read_bytes_per_s: f64,
    idle_s: f64,
) -> f64 {
    let speed = if compute_bytes_per_s > 0.0 {
        compute_bytes_per_s
    } else {
        1.0
    };
    let layers: Vec<SimLayer> = layers
        .iter()
        .map(|&(il, b)| SimLayer {
            compute_s: b as f64 / speed,
            streamed_bytes: tp.streamed.contains(&il).then_some(b),
        })
        .collect();
    node_s_per_token(&layers, read_bytes_per_s, tp.depth, idle_s)
}
