//! Predictive layer skip: a small predictor that, from the hidden state entering a *decision
//! layer* `e`, estimates for every later layer `j ≥ e` the probability that the layer would
//! barely change a token's residual stream (`cos(h_in_j, h_out_j) ≥ τ_j`), so the forward
//! pass can leave it out for that token (`forward::Runner::set_skip`).
//!
//! The predictor is
//! * a projection to `rank` features: the hidden state is RMS-normalised (no weights), the
//!   calibration mean is subtracted and the result is projected on the leading principal
//!   directions of the calibration hidden states, each scaled to unit variance (PCA
//!   whitening, folded into the stored matrix);
//! * for every pair `e ≤ j`, a logistic regression (`rank` weights and a bias) on those
//!   features.
//!
//! One projection serves every decision layer, so a node of a ring, which sees only the state
//! entering its own window, decides with the same features as a whole model.
//!
//! [`train`] measures the labels and trains it (`ringllm calibrate`, with `train_pair` and
//! `pca`); the file format is below (`Predictor::to_bytes`).

pub mod train;

use crate::arch::Hparams;
use std::path::{Path, PathBuf};

/// First bytes of a predictor file.
pub const MAGIC: &[u8; 8] = b"RLSKIP01";
/// Format version written and read.
pub const VERSION: u32 = 1;

/// Bounds checked on every size read from a file, before anything is allocated.
const MAX_LAYERS: usize = 4096;
const MAX_D_MODEL: usize = 1 << 17;
const MAX_RANK: usize = 1024;
const MAX_ARCH_LEN: usize = 64;
/// Bytes of the trailing checksum (BLAKE3 of everything before it).
const SUM_LEN: usize = 32;

/// The model a predictor was made for: a predictor is refused for any other.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SkipModelId {
    /// `general.architecture`.
    pub arch: String,
    pub n_layer: usize,
    pub d_model: usize,
    pub vocab: usize,
    /// `GgufFile::header_hash` of the whole model file (metadata and tensor table), the hash
    /// ring assignments already name a model by.
    pub header_hash: u64,
}

impl SkipModelId {
    /// The identity a predictor for `model` carries.
    pub fn of(model: &crate::Model) -> SkipModelId {
        SkipModelId::new(&model.hp, model.file().header_hash())
    }

    pub fn new(hp: &Hparams, header_hash: u64) -> SkipModelId {
        SkipModelId {
            arch: hp.arch.name().to_string(),
            n_layer: hp.n_layer,
            d_model: hp.d_model,
            vocab: hp.vocab,
            header_hash,
        }
    }
}

impl std::fmt::Display for SkipModelId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} with {} layers, d_model {}, vocabulary {}, header hash {:016x}",
            self.arch, self.n_layer, self.d_model, self.vocab, self.header_hash
        )
    }
}

/// Why a predictor file cannot be used; the message names the file.
#[derive(Debug, thiserror::Error)]
#[error("skip predictor {}: {why}", path.display())]
pub struct SkipFileError {
    pub path: PathBuf,
    pub why: String,
}

/// A trained skip predictor (see the module).
#[derive(Clone, Debug, PartialEq)]
pub struct Predictor {
    pub model: SkipModelId,
    /// Features per token (`r`).
    pub rank: usize,
    /// The decision layer of a runner that starts at layer 0.
    pub decision_layer: usize,
    /// Per layer: the cosine above which the layer counted as skippable in calibration.
    pub taus: Vec<f32>,
    /// Mean of the normalised calibration states, `d_model`.
    pub mean: Vec<f32>,
    /// `d_model × rank`, row-major: feature `k` is `Σ_i (x̂_i − mean_i) · proj[i·rank + k]`.
    pub proj: Vec<f32>,
    /// For each pair `(e, j)`, `e ≤ j`, in the order of `pair_index`: `rank` weights, then
    /// the bias.
    pub weights: Vec<f32>,
}

/// Pairs `(e, j)` with `e ≤ j < n`.
pub fn n_pairs(n_layer: usize) -> usize {
    n_layer * (n_layer + 1) / 2
}

/// Position of pair `(e, j)` (`e ≤ j < n`) among `n_pairs(n)`.
pub fn pair_index(n_layer: usize, e: usize, j: usize) -> usize {
    debug_assert!(e <= j && j < n_layer);
    // Pairs of every e' < e come first: Σ_{e'<e} (n − e').
    e * n_layer - e * (e.saturating_sub(1)) / 2 + (j - e)
}

impl Predictor {
    /// A predictor whose every pair answers `sigmoid(bias)` whatever the state (zero
    /// weights), with an identity-like projection: tests and a starting point for training.
    pub fn constant(
        model: SkipModelId,
        rank: usize,
        decision_layer: usize,
        bias: f32,
    ) -> Predictor {
        let (n, d) = (model.n_layer, model.d_model);
        let mut proj = vec![0f32; d * rank];
        for k in 0..rank.min(d) {
            proj[k * rank + k] = 1.0;
        }
        let mut weights = vec![0f32; n_pairs(n) * (rank + 1)];
        for w in weights.chunks_exact_mut(rank + 1) {
            w[rank] = bias;
        }
        Predictor {
            model,
            rank,
            decision_layer,
            taus: vec![1.0; n],
            mean: vec![0.0; d],
            proj,
            weights,
        }
    }

    /// The `rank + 1` parameters of pair `(e, j)`.
    pub fn pair(&self, e: usize, j: usize) -> &[f32] {
        let at = pair_index(self.model.n_layer, e, j) * (self.rank + 1);
        &self.weights[at..at + self.rank + 1]
    }

    pub fn pair_mut(&mut self, e: usize, j: usize) -> &mut [f32] {
        let at = pair_index(self.model.n_layer, e, j) * (self.rank + 1);
        &mut self.weights[at..at + self.rank + 1]
    }

    /// The features of one hidden state `h` (`d_model`) into `out` (`rank`).
    pub fn features(&self, h: &[f32], out: &mut [f32]) {
        features(h, &self.mean, &self.proj, self.rank, out)
    }

    /// P(skip layer `j` | features of the state entering layer `e`).
    pub fn prob(&self, feats: &[f32], e: usize, j: usize) -> f32 {
        let w = self.pair(e, j);
        let z = w[self.rank]
            + w[..self.rank]
                .iter()
                .zip(feats)
                .map(|(a, b)| a * b)
                .sum::<f32>();
        sigmoid(z)
    }

    /// The file's bytes:
    ///
    /// ```text
    /// magic "RLSKIP01" | version u32
    /// arch: u32 length + UTF-8 | n_layer u32 | d_model u32 | vocab u32 | header_hash u64
    /// rank u32 | decision_layer u32
    /// taus: n_layer f32 | mean: d_model f32 | proj: d_model × rank f32
    /// weights: n_layer(n_layer+1)/2 × (rank + 1) f32
    /// BLAKE3 of everything above (32 bytes)
    /// ```
    /// All little-endian.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut b = Vec::new();
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(self.model.arch.len() as u32).to_le_bytes());
        b.extend_from_slice(self.model.arch.as_bytes());
        for v in [self.model.n_layer, self.model.d_model, self.model.vocab] {
            b.extend_from_slice(&(v as u32).to_le_bytes());
        }
        b.extend_from_slice(&self.model.header_hash.to_le_bytes());
        b.extend_from_slice(&(self.rank as u32).to_le_bytes());
        b.extend_from_slice(&(self.decision_layer as u32).to_le_bytes());
        for v in self
            .taus
            .iter()
            .chain(&self.mean)
            .chain(&self.proj)
            .chain(&self.weights)
        {
            b.extend_from_slice(&v.to_le_bytes());
        }
        let sum = blake3::hash(&b);
        b.extend_from_slice(sum.as_bytes());
        b
    }

    /// Parses a predictor file's bytes; `Err` says what is wrong (without the path).
    pub fn from_bytes(bytes: &[u8]) -> Result<Predictor, String> {
        let mut r = Reader { b: bytes, at: 0 };
        let magic = r.take(8, "the magic")?;
        if magic != MAGIC {
            return Err("not a skip predictor (bad magic; `ringllm calibrate` writes them)".into());
        }
        let version = r.u32("the version")?;
        if version != VERSION {
            return Err(format!(
                "format version {version}, this build reads version {VERSION}"
            ));
        }
        let arch_len = r.u32("the architecture name length")? as usize;
        if arch_len > MAX_ARCH_LEN {
            return Err(format!(
                "architecture name of {arch_len} bytes (at most {MAX_ARCH_LEN})"
            ));
        }
        let arch = std::str::from_utf8(r.take(arch_len, "the architecture name")?)
            .map_err(|_| "the architecture name is not UTF-8".to_string())?
            .to_string();
        let n_layer = r.u32("n_layer")? as usize;
        let d_model = r.u32("d_model")? as usize;
        let vocab = r.u32("vocab")? as usize;
        let header_hash = r.u64("the model hash")?;
        let rank = r.u32("the rank")? as usize;
        let decision_layer = r.u32("the decision layer")? as usize;
        if n_layer == 0 || n_layer > MAX_LAYERS {
            return Err(format!("n_layer {n_layer} (1..={MAX_LAYERS})"));
        }
        if d_model == 0 || d_model > MAX_D_MODEL {
            return Err(format!("d_model {d_model} (1..={MAX_D_MODEL})"));
        }
        if rank == 0 || rank > MAX_RANK || rank > d_model {
            return Err(format!(
                "rank {rank} (1..={} for d_model {d_model})",
                MAX_RANK.min(d_model)
            ));
        }
        if decision_layer >= n_layer {
            return Err(format!(
                "decision layer {decision_layer} outside the {n_layer} layers"
            ));
        }
        // Every count below is bounded above, so these products cannot overflow.
        let floats = n_layer + d_model + d_model * rank + n_pairs(n_layer) * (rank + 1);
        let need = r.at + floats * 4 + SUM_LEN;
        if bytes.len() != need {
            return Err(format!(
                "{} bytes where its header asks for {need} ({})",
                bytes.len(),
                if bytes.len() < need {
                    "truncated"
                } else {
                    "trailing bytes"
                }
            ));
        }
        let body = &bytes[..need - SUM_LEN];
        if blake3::hash(body).as_bytes()[..] != bytes[need - SUM_LEN..] {
            return Err("checksum mismatch: the file is corrupt".into());
        }
        let taus = r.f32s(n_layer, "the thresholds")?;
        let mean = r.f32s(d_model, "the mean")?;
        let proj = r.f32s(d_model * rank, "the projection")?;
        let weights = r.f32s(n_pairs(n_layer) * (rank + 1), "the weights")?;
        if let Some(v) = taus
            .iter()
            .chain(&mean)
            .chain(&proj)
            .chain(&weights)
            .find(|v| !v.is_finite())
        {
            return Err(format!("a parameter is not finite ({v})"));
        }
        Ok(Predictor {
            model: SkipModelId {
                arch,
                n_layer,
                d_model,
                vocab,
                header_hash,
            },
            rank,
            decision_layer,
            taus,
            mean,
            proj,
            weights,
        })
    }

    /// Writes the predictor to `path`.
    pub fn save(&self, path: &Path) -> Result<(), SkipFileError> {
        std::fs::write(path, self.to_bytes()).map_err(|e| SkipFileError {
            path: path.to_path_buf(),
            why: format!("cannot write: {e}"),
        })
    }

    /// Reads the predictor at `path`, refusing a damaged file or one made for another model
    /// than `expect`.
    pub fn load(path: &Path, expect: &SkipModelId) -> Result<Predictor, SkipFileError> {
        let err = |why: String| SkipFileError {
            path: path.to_path_buf(),
            why,
        };
        let meta = std::fs::metadata(path).map_err(|e| err(format!("cannot read: {e}")))?;
        if !meta.is_file() {
            return Err(err("not a regular file".into()));
        }
        // The largest file the bounds above allow is far smaller than this.
        if meta.len() > 1 << 32 {
            return Err(err(format!("{} bytes: too large", meta.len())));
        }
        let bytes = std::fs::read(path).map_err(|e| err(format!("cannot read: {e}")))?;
        let p = Predictor::from_bytes(&bytes).map_err(err)?;
        if &p.model != expect {
            return Err(err(format!(
                "made for another model ({}); this model is {}: run `ringllm calibrate` on it",
                p.model, expect
            )));
        }
        Ok(p)
    }
}

/// A bounds-checked little-endian reader.
struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.b.len());
        match end {
            Some(end) => {
                let s = &self.b[self.at..end];
                self.at = end;
                Ok(s)
            }
            None => Err(format!(
                "truncated: {} bytes, ending before {what} (at byte {})",
                self.b.len(),
                self.at
            )),
        }
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        let s = self.take(4, what)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        let s = self.take(8, what)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(s);
        Ok(u64::from_le_bytes(a))
    }

    fn f32s(&mut self, n: usize, what: &str) -> Result<Vec<f32>, String> {
        let s = self.take(n * 4, what)?;
        Ok(s.chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect())
    }
}

pub fn sigmoid(z: f32) -> f32 {
    1.0 / (1.0 + (-z).exp())
}

/// RMS-normalises `h` (no weights, ε = 1e-6).
pub fn rms_normalise(h: &[f32], out: &mut [f32]) {
    let ms = h.iter().map(|v| v * v).sum::<f32>() / h.len().max(1) as f32;
    let inv = 1.0 / (ms + 1e-6).sqrt();
    for (o, v) in out.iter_mut().zip(h) {
        *o = v * inv;
    }
}

/// Features of one state: `((h / rms(h)) − mean) · proj`, `rank` of them.
pub fn features(h: &[f32], mean: &[f32], proj: &[f32], rank: usize, out: &mut [f32]) {
    let ms = h.iter().map(|v| v * v).sum::<f32>() / h.len().max(1) as f32;
    let inv = 1.0 / (ms + 1e-6).sqrt();
    out[..rank].fill(0.0);
    for (i, (&v, &m)) in h.iter().zip(mean).enumerate() {
        let c = v * inv - m;
        for (o, p) in out[..rank].iter_mut().zip(&proj[i * rank..(i + 1) * rank]) {
            *o += c * p;
        }
    }
}

/// Whitened PCA of `n` rows of `x` (`n × d`, already RMS-normalised): the mean (`d`) and a
/// `d × rank` projection onto the `rank` leading principal directions, each column divided by
/// the standard deviation along it, so features have unit variance. Subspace iteration from a
/// seeded start (deterministic).
pub fn pca(x: &[f32], d: usize, rank: usize, seed: u64) -> (Vec<f32>, Vec<f32>) {
    let n = x.len() / d.max(1);
    let mut mean = vec![0f64; d];
    for row in x.chunks_exact(d) {
        for (m, v) in mean.iter_mut().zip(row) {
            *m += *v as f64;
        }
    }
    for m in mean.iter_mut() {
        *m /= n.max(1) as f64;
    }
    // Covariance, d × d (upper triangle accumulated, then mirrored).
    let mut cov = vec![0f64; d * d];
    let mut c = vec![0f64; d];
    for row in x.chunks_exact(d) {
        for (ci, (v, m)) in c.iter_mut().zip(row.iter().zip(&mean)) {
            *ci = *v as f64 - m;
        }
        for i in 0..d {
            let ci = c[i];
            let line = &mut cov[i * d..(i + 1) * d];
            for (o, cj) in line[i..].iter_mut().zip(&c[i..]) {
                *o += ci * cj;
            }
        }
    }
    for i in 0..d {
        for j in 0..i {
            cov[i * d + j] = cov[j * d + i];
        }
    }
    let scale = 1.0 / (n.max(2) - 1) as f64;
    for v in cov.iter_mut() {
        *v *= scale;
    }
    // Subspace iteration: Q (d × rank, column-major as `rank` vectors of d).
    let mut rng = SplitMix(seed);
    let mut q: Vec<Vec<f64>> = (0..rank)
        .map(|_| (0..d).map(|_| rng.next_f64() - 0.5).collect())
        .collect();
    orthonormalise(&mut q);
    for _ in 0..60 {
        let z: Vec<Vec<f64>> = q.iter().map(|v| matvec(&cov, v, d)).collect();
        q = z;
        orthonormalise(&mut q);
    }
    // Rayleigh quotients give each direction's variance.
    let mut proj = vec![0f32; d * rank];
    for (k, v) in q.iter().enumerate() {
        let cv = matvec(&cov, v, d);
        let var: f64 = v.iter().zip(&cv).map(|(a, b)| a * b).sum();
        let inv_sd = 1.0 / var.max(1e-12).sqrt();
        for i in 0..d {
            proj[i * rank + k] = (v[i] * inv_sd) as f32;
        }
    }
    (mean.iter().map(|m| *m as f32).collect(), proj)
}

fn matvec(m: &[f64], v: &[f64], d: usize) -> Vec<f64> {
    m.chunks_exact(d)
        .map(|row| row.iter().zip(v).map(|(a, b)| a * b).sum())
        .collect()
}

/// Modified Gram-Schmidt; a vector that collapses is replaced by a unit axis.
fn orthonormalise(q: &mut [Vec<f64>]) {
    for k in 0..q.len() {
        for p in 0..k {
            let (a, b) = q.split_at_mut(k);
            let dot: f64 = a[p].iter().zip(&b[0]).map(|(x, y)| x * y).sum();
            for (y, x) in b[0].iter_mut().zip(&a[p]) {
                *y -= dot * x;
            }
        }
        let norm = q[k].iter().map(|v| v * v).sum::<f64>().sqrt();
        if norm > 1e-30 {
            for v in q[k].iter_mut() {
                *v /= norm;
            }
        } else {
            let d = q[k].len();
            q[k] = (0..d).map(|i| if i == k % d { 1.0 } else { 0.0 }).collect();
        }
    }
}

/// A small deterministic generator (SplitMix64) for the PCA start.
struct SplitMix(u64);

impl SplitMix {
    fn next_f64(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// L2-regularised logistic regression by Newton's method: `x` is `n × rank` features, `y`
/// the labels; returns `rank` weights and the bias. `l2` penalises the weights and (a
/// hundredth of it) the bias, so a label that never or always holds gives a large but finite
/// bias rather than diverging.
pub fn train_pair(x: &[f32], y: &[bool], rank: usize, l2: f64) -> Vec<f32> {
    let m = rank + 1;
    let mut w = vec![0f64; m];
    let n = y.len();
    let mut grad = vec![0f64; m];
    let mut hess = vec![0f64; m * m];
    let mut xi = vec![0f64; m];
    for _ in 0..30 {
        grad.fill(0.0);
        hess.fill(0.0);
        for (i, &label) in y.iter().enumerate().take(n) {
            for (a, b) in xi.iter_mut().zip(&x[i * rank..(i + 1) * rank]) {
                *a = *b as f64;
            }
            xi[rank] = 1.0;
            let z: f64 = w.iter().zip(&xi).map(|(a, b)| a * b).sum();
            let p = 1.0 / (1.0 + (-z).exp());
            let g = p - if label { 1.0 } else { 0.0 };
            let h = (p * (1.0 - p)).max(1e-9);
            for a in 0..m {
                grad[a] += g * xi[a];
                let hx = h * xi[a];
                let row = &mut hess[a * m..(a + 1) * m];
                for (o, b) in row[a..].iter_mut().zip(&xi[a..]) {
                    *o += hx * b;
                }
            }
        }
        for a in 0..m {
            for b in 0..a {
                hess[a * m + b] = hess[b * m + a];
            }
            let lam = if a == rank { l2 * 0.01 } else { l2 };
            grad[a] += lam * w[a];
            hess[a * m + a] += lam;
        }
        let Some(step) = cholesky_solve(&hess, &grad, m) else {
            break;
        };
        let mut biggest = 0f64;
        for (wi, s) in w.iter_mut().zip(&step) {
            *wi -= s;
            biggest = biggest.max(s.abs());
        }
        if biggest < 1e-5 {
            break;
        }
    }
    w.iter().map(|v| *v as f32).collect()
}

/// Solves `a · s = b` for symmetric positive definite `a` (`m × m`); `None` if it is not.
fn cholesky_solve(a: &[f64], b: &[f64], m: usize) -> Option<Vec<f64>> {
    let mut l = vec![0f64; m * m];
    for i in 0..m {
        for j in 0..=i {
            let mut s = a[i * m + j];
            for k in 0..j {
                s -= l[i * m + k] * l[j * m + k];
            }
            if i == j {
                if s <= 0.0 {
                    return None;
                }
                l[i * m + i] = s.sqrt();
            } else {
                l[i * m + j] = s / l[j * m + j];
            }
        }
    }
    let mut y = vec![0f64; m];
    for i in 0..m {
        let mut s = b[i];
        for k in 0..i {
            s -= l[i * m + k] * y[k];
        }
        y[i] = s / l[i * m + i];
    }
    let mut x = vec![0f64; m];
    for i in (0..m).rev() {
        let mut s = y[i];
        for k in i + 1..m {
            s -= l[k * m + i] * x[k];
        }
        x[i] = s / l[i * m + i];
    }
    Some(x)
}

/// Cosine similarity of two vectors (0 when either is zero).
pub fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (*x as f64, *y as f64);
        ab += x * y;
        aa += x * x;
        bb += y * y;
    }
    if aa == 0.0 || bb == 0.0 {
        0.0
    } else {
        (ab / (aa.sqrt() * bb.sqrt())) as f32
    }
}

/// How the forward pass skips layers: the predictor, the probability a skip needs, and the
/// longest run of consecutive layers one token may skip.
#[derive(Clone)]
pub struct SkipPolicy {
    pub predictor: std::sync::Arc<Predictor>,
    /// Skip layer `j` for a token when P(skip) ≥ this.
    pub confidence: f32,
    /// Never more than this many layers skipped in a row by one token.
    pub max_skip: usize,
    /// Replaces the predictor's probability by 1 (skip) or 0 (run) as
    /// `force(position, layer)` says: tests and experiments with a known plan. The
    /// `max_skip` rule still applies.
    pub force: Option<std::sync::Arc<dyn Fn(usize, usize) -> bool + Send + Sync>>,
}

impl std::fmt::Debug for SkipPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SkipPolicy")
            .field("confidence", &self.confidence)
            .field("max_skip", &self.max_skip)
            .field("forced", &self.force.is_some())
            .finish()
    }
}

/// Default probability a skip needs.
pub const DEFAULT_CONFIDENCE: f32 = 0.99;
/// Default longest run of skipped layers.
pub const DEFAULT_MAX_SKIP: usize = 5;

impl SkipPolicy {
    pub fn new(predictor: std::sync::Arc<Predictor>) -> SkipPolicy {
        SkipPolicy {
            predictor,
            confidence: DEFAULT_CONFIDENCE,
            max_skip: DEFAULT_MAX_SKIP,
            force: None,
        }
    }
}

/// Counters of the forward pass's skipping (`Runner::skip_stats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SkipStats {
    /// (token, layer) pairs the runner went through, skipped or not.
    pub evaluations: u64,
    /// Of those, skipped.
    pub skipped: u64,
    /// Computed although the predictor leaned to skip (0.5 ≤ p < confidence).
    pub doubted: u64,
    /// Whole layers not run because every token of the batch skipped them.
    pub layers_not_run: u64,
    /// Weight bytes of those layers (not read at all).
    pub bytes_not_read: u64,
    /// Σ over skipped (token, layer) of the layer's weight bytes: what decoding one token at
    /// a time would not read.
    pub skipped_weight_bytes: u64,
}

impl SkipStats {
    /// Skipped fraction of the evaluations.
    pub fn skip_fraction(&self) -> f64 {
        if self.evaluations == 0 {
            0.0
        } else {
            self.skipped as f64 / self.evaluations as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> SkipModelId {
        SkipModelId {
            arch: "llama".into(),
            n_layer: 5,
            d_model: 16,
            vocab: 100,
            header_hash: 0x1234_5678_9abc_def0,
        }
    }

    fn sample() -> Predictor {
        let mut p = Predictor::constant(id(), 4, 2, -3.0);
        for (i, w) in p.weights.iter_mut().enumerate() {
            *w = (i as f32 * 0.37).sin();
        }
        for (i, v) in p.proj.iter_mut().enumerate() {
            *v = (i as f32 * 0.11).cos();
        }
        p.taus = vec![0.9, 0.95, 0.97, 0.98, 0.99];
        p.mean[3] = 0.5;
        p
    }

    /// A path in the temporary directory, its file removed when dropped.
    struct TmpPath(PathBuf);

    impl std::ops::Deref for TmpPath {
        type Target = Path;
        fn deref(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TmpPath {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    fn tmp(name: &str) -> TmpPath {
        let name = format!("ringllm-skip-{}-{name}", std::process::id());
        TmpPath(std::env::temp_dir().join(name))
    }

    #[test]
    fn pair_index_enumerates_every_pair_once() {
        for n in [1, 2, 5, 18, 30] {
            let mut seen = vec![false; n_pairs(n)];
            let mut expect = 0;
            for e in 0..n {
                for j in e..n {
                    let i = pair_index(n, e, j);
                    assert_eq!(i, expect, "n {n} pair ({e},{j})");
                    assert!(!seen[i]);
                    seen[i] = true;
                    expect += 1;
                }
            }
            assert!(seen.iter().all(|s| *s));
        }
    }

    #[test]
    fn file_round_trip() {
        let p = sample();
        let path = tmp("round.skip");
        p.save(&path).expect("save");
        let q = Predictor::load(&path, &id()).expect("load");
        assert_eq!(p, q);
        let mut f = vec![0f32; 4];
        let h: Vec<f32> = (0..16).map(|i| i as f32 - 7.0).collect();
        q.features(&h, &mut f);
        // By hand: normalise, subtract the mean, project.
        let rms = (h.iter().map(|v| v * v).sum::<f32>() / 16.0 + 1e-6).sqrt();
        for (k, fk) in f.iter().enumerate() {
            let want: f32 = (0..16)
                .map(|i| (h[i] / rms - q.mean[i]) * q.proj[i * 4 + k])
                .sum();
            assert!((fk - want).abs() < 1e-4, "feature {k}: {fk} vs {want}");
        }
        let w = q.pair(2, 4);
        let z: f32 = w[4] + (0..4).map(|k| w[k] * f[k]).sum::<f32>();
        assert!((q.prob(&f, 2, 4) - 1.0 / (1.0 + (-z).exp())).abs() < 1e-6);
    }

    #[test]
    fn truncated_file_is_refused() {
        let bytes = sample().to_bytes();
        let path = tmp("trunc.skip");
        for cut in [4, 30, bytes.len() - 1, bytes.len() / 2] {
            std::fs::write(&*path, &bytes[..cut]).expect("write");
            let e = Predictor::load(&path, &id())
                .expect_err("truncated")
                .to_string();
            assert!(e.contains(&path.display().to_string()), "{e}");
            assert!(e.contains("truncated"), "cut {cut}: {e}");
        }
    }

    #[test]
    fn flipped_byte_is_refused() {
        let bytes = sample().to_bytes();
        let path = tmp("flip.skip");
        // A byte inside the weights, and one inside the checksum.
        for at in [bytes.len() - 100, bytes.len() - 5] {
            let mut b = bytes.clone();
            b[at] ^= 0x10;
            std::fs::write(&*path, &b).expect("write");
            let e = Predictor::load(&path, &id())
                .expect_err("corrupt")
                .to_string();
            assert!(e.contains("checksum mismatch"), "byte {at}: {e}");
            assert!(e.contains("flip.skip"), "{e}");
        }
        // A flipped byte in the magic is named as such.
        let mut b = bytes.clone();
        b[0] ^= 1;
        std::fs::write(&*path, &b).expect("write");
        let e = Predictor::load(&path, &id())
            .expect_err("magic")
            .to_string();
        assert!(e.contains("bad magic"), "{e}");
    }

    #[test]
    fn absurd_sizes_are_refused_before_allocating() {
        let mut b = sample().to_bytes();
        // n_layer sits after magic (8), version (4), arch length (4) and "llama" (5).
        b[21..25].copy_from_slice(&u32::MAX.to_le_bytes());
        let e = Predictor::from_bytes(&b).expect_err("huge n_layer");
        assert!(e.contains("n_layer"), "{e}");
    }

    #[test]
    fn predictor_for_another_model_is_refused() {
        let path = tmp("other.skip");
        sample().save(&path).expect("save");
        for other in [
            SkipModelId {
                header_hash: 1,
                ..id()
            },
            SkipModelId {
                arch: "gemma3".into(),
                ..id()
            },
            SkipModelId {
                d_model: 32,
                ..id()
            },
        ] {
            let e = Predictor::load(&path, &other)
                .expect_err("other model")
                .to_string();
            assert!(e.contains("made for another model"), "{e}");
            assert!(e.contains("other.skip"), "{e}");
        }
    }

    #[test]
    fn logistic_regression_learns_a_separable_rule() {
        // Label: x0 + 0.5·x1 > 0.2, on a deterministic spread of points.
        let mut rng = SplitMix(7);
        let n = 2000;
        let x: Vec<f32> = (0..n * 3)
            .map(|_| (rng.next_f64() * 2.0 - 1.0) as f32)
            .collect();
        let y: Vec<bool> = (0..n)
            .map(|i| x[i * 3] + 0.5 * x[i * 3 + 1] > 0.2)
            .collect();
        let w = train_pair(&x, &y, 3, 1e-3);
        let correct = (0..n)
            .filter(|&i| {
                let z = w[3] + (0..3).map(|k| w[k] * x[i * 3 + k]).sum::<f32>();
                (z > 0.0) == y[i]
            })
            .count();
        assert!(correct as f64 / n as f64 > 0.98, "accuracy {correct}/{n}");
        // The third feature is noise: its weight is small next to the first.
        assert!(w[2].abs() < 0.1 * w[0].abs(), "{w:?}");
    }

    #[test]
    fn pca_finds_the_dominant_direction() {
        // Points along (1, 1, 0, 0)/√2 with small noise elsewhere.
        let mut rng = SplitMix(3);
        let d = 4;
        let mut x = Vec::new();
        for _ in 0..500 {
            let t = (rng.next_f64() * 2.0 - 1.0) as f32 * 3.0;
            let noise = |r: &mut SplitMix| (r.next_f64() as f32 - 0.5) * 0.1;
            x.extend_from_slice(&[
                t + noise(&mut rng),
                t + noise(&mut rng),
                noise(&mut rng),
                noise(&mut rng),
            ]);
        }
        let (_, proj) = pca(&x, d, 1, 1);
        let dir: Vec<f32> = (0..d).map(|i| proj[i]).collect();
        let norm = dir.iter().map(|v| v * v).sum::<f32>().sqrt();
        let c = (dir[0] + dir[1]).abs() / (norm * 2f32.sqrt());
        assert!(c > 0.999, "direction {dir:?}");
    }
}
