//! `Drafter`: what proposes tokens for the target to verify. The engine owns the loop;
//! a drafter sees the prompt once, proposes up to k tokens per round, and is told
//! which tokens were committed (with the target's hidden states at its tap layers).
//!
//! Drafter kinds register through `inventory` like adapters do; the engine picks one
//! from `--drafter` (a kind name such as `ngram`, or a checkpoint whose config.json a
//! kind recognises) and loads it against the target's `ModelInfo`, so every mismatch
//! (vocabulary, hidden width, tap layers, mask token) is caught before decoding.

use std::path::Path;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};

use crate::error::{ModelError, Result};
use crate::target::{ModelInfo, Quantization, TargetModel};

/// Tokens proposed for one round, with the drafter's distribution over the vocabulary
/// at each position when it has one (needed for lossless sampling; `None` = one-hot).
#[derive(Debug, Clone, Default)]
pub struct Draft {
    pub tokens: Vec<u32>,
    /// Greedy drafts still on the device, in place of `tokens`: `[n]` uint32 ids, lazy.
    /// The engine builds the verify on them and reads both at once, so no host read
    /// separates drafting from verifying; [`Draft::read`] brings them to `tokens`.
    pub on_device: Option<Array>,
    /// q: `[tokens, vocab]` on the device, one row per token, each row the processed
    /// distribution the token was drawn from. Kept on the device because the engine's
    /// acceptance test runs there: only the accepted count comes back to the host.
    pub probs: Option<Array>,
}

impl Draft {
    /// Drafts left on the device (see [`Draft::on_device`]), queued now: the device
    /// computes them while the engine builds the verify on them.
    pub fn on_device(ids: Array) -> Result<Self> {
        mlx_rs::transforms::async_eval([&ids])?;
        Ok(Self {
            on_device: Some(ids),
            ..Self::default()
        })
    }

    /// Drafts proposed, on the host or on the device.
    pub fn len(&self) -> usize {
        match &self.on_device {
            Some(ids) => ids.shape().first().copied().unwrap_or(0) as usize,
            None => self.tokens.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The drafts on the host, read from the device first if they are still there.
    pub fn read(&mut self) -> Result<&[u32]> {
        if let Some(ids) = self.on_device.take() {
            let ids = ids.as_dtype(Dtype::Uint32)?;
            ids.eval()?;
            self.tokens = ids.as_slice::<u32>().to_vec();
        }
        Ok(&self.tokens)
    }

    /// Appends picked tokens (and their distributions, when the picker sampled).
    pub fn extend(&mut self, picked: Picked) -> Result<()> {
        self.read()?;
        let first = self.tokens.is_empty();
        self.tokens.extend(picked.tokens);
        self.probs = match (picked.probs, self.probs.take()) {
            (Some(p), Some(mine)) => Some(mlx_rs::ops::concatenate(&[mine, p], 0)?),
            (Some(p), None) if first => Some(p),
            // Mixing picked-with and picked-without distributions cannot happen with
            // one picker; drop them rather than misalign positions.
            _ => None,
        };
        Ok(())
    }

    /// Keeps the first `n` tokens and their rows of `probs`.
    pub fn truncate(&mut self, n: usize) -> Result<()> {
        if n >= self.len() {
            return Ok(());
        }
        if let Some(ids) = self.on_device.take() {
            self.on_device = Some(ids.try_index(..n as i32)?);
            return Ok(());
        }
        self.tokens.truncate(n);
        if let Some(probs) = self.probs.take() {
            self.probs = Some(probs.try_index((..n as i32, ..))?);
        }
        Ok(())
    }
}

/// Tokens chosen from drafter logits, one per row.
#[derive(Debug, Clone, Default)]
pub struct Picked {
    pub tokens: Vec<u32>,
    /// Under sampling: each row's processed distribution, `[rows, vocab]` on the device
    /// (rows sum to 1).
    pub probs: Option<Array>,
}

/// How the engine turns a drafter's logits into tokens: argmax under greedy decoding,
/// or a sample from the same processed distribution (temperature, top-k, top-p) the
/// target is sampled with, so the drafter's `q` is known for rejection sampling.
pub trait TokenPicker {
    fn is_greedy(&self) -> bool;

    /// One token per row of `logits` (`[n, vocab]`, any float dtype), rows picked
    /// independently. Greedy picking costs one host sync for all rows.
    fn pick(&mut self, logits: &Array) -> Result<Picked>;

    /// Greedy picks left on the device: `[n]` uint32 ids, lazy, one per row of `logits`
    /// (the argmax, as [`TokenPicker::pick`] takes it), for a drafter that hands them on
    /// as [`Draft::on_device`]. `None`, the default, where the picker cannot: under
    /// sampling, or a picker that must see each pick on the host.
    fn pick_on_device(&mut self, logits: &Array) -> Result<Option<Array>> {
        let _ = logits;
        Ok(None)
    }
}

pub trait Drafter: Send {
    /// Short name for stats and errors (`ngram`, `dflash`, …).
    fn name(&self) -> &str;

    /// Target layer ids whose outputs the drafter wants (empty: none).
    fn taps(&self) -> &[usize] {
        &[]
    }

    /// Starts a sequence: the prompt ids and, when taps are declared, the target's
    /// hidden states over the prompt (`[1, L, taps × hidden]`).
    fn begin(
        &mut self,
        target: &dyn TargetModel,
        prompt: &[u32],
        hidden: Option<&Array>,
    ) -> Result<()>;

    /// Proposes up to `max_k` tokens to follow `last` (the newest committed token,
    /// not yet seen by the target). Fewer, or none, is fine. Drafters that produce
    /// logits choose their tokens through `picker`; `target` gives access to the
    /// target's embedding and lm_head for drafters that share them.
    fn propose(
        &mut self,
        target: &dyn TargetModel,
        last: u32,
        max_k: usize,
        picker: &mut dyn TokenPicker,
    ) -> Result<Draft>;

    /// Reports a round's outcome: `verified` are the positions the target kept this
    /// round, `[last, accepted drafts…]` (now in its cache), and `hidden` the target's
    /// states at exactly those positions when taps are declared. The target's own next
    /// token is not among them: it arrives as `last` of the next `propose`.
    ///
    /// A `propose` with `max_k` 0 starts rounds without drafts: the engine then decodes
    /// plainly for as long as drafts do not pay, and the positions of all those steps
    /// arrive in the `commit`s that follow, `[last, t1, t2, …]` split into consecutive
    /// pieces of at most [`Self::plain_piece`] positions (by default a few dozen, so a
    /// drafter does no work per plain step and may read each piece while decoding goes on).
    fn commit(&mut self, verified: &[u32], hidden: Option<&Array>) -> Result<()>;

    /// How often the drafter's next-token guess matched the tokens committed by rounds
    /// without drafts, counted since the last call. While drafts do not pay, the engine
    /// decodes plainly; a drafter that checks itself against those tokens (cheaply: a
    /// lookup, or the logits it computes reading them anyway) tells the engine when
    /// drafting would pay again without a verify spent to find out. `None`: the drafter
    /// does not measure it, and the engine probes with a draft now and then instead.
    /// Counts may arrive late (a drafter reading in the background) but never twice.
    fn agreement(&mut self) -> Option<Agreement> {
        None
    }

    /// The most plain steps' positions one `commit` carries; `None` leaves it to the
    /// engine (a few dozen: a drafter that reads each piece in one forward of its own
    /// wants them few). A drafter whose work per token is a host lookup asks for 1: its
    /// agreement then reaches the engine as the steps come, and drafting resumes where a
    /// copy begins rather than a piece later.
    fn plain_piece(&self) -> Option<usize> {
        None
    }

    /// Whether `propose` is a lookup in the tokens committed so far: next to free, and
    /// with no effect on the drafter, so that asking it again, or for more tokens than a
    /// round verifies, changes nothing. The engine then asks for the tokens past the
    /// round it verifies too, and queues the next round's verify before it reads this
    /// one's (greedy decoding). A drafter that runs a model answers `false`.
    fn drafts_by_lookup(&self) -> bool {
        false
    }

    /// Whether the drafter ever proposes drafts: `none` does not, and a generation with
    /// it decodes plainly throughout (no rounds, nothing kept to roll back).
    fn drafts(&self) -> bool {
        true
    }

    /// A new drafter of the same kind and settings, for another sequence decoded at the
    /// same time (a server's batch gives each sequence its own), sharing what can be
    /// shared (weights), or `None` where the drafter cannot make one (a draft model whose
    /// weights cannot be shared, or a failure making one).
    fn fork(&self) -> Option<Box<dyn Drafter>> {
        None
    }

    /// Whether [`Drafter::fork`] gives drafters. The default makes one to find out; a
    /// drafter whose forks cost something to make (a thread of their own) answers
    /// without. A fork may still fail where this says yes (`fork` then says why).
    fn forks(&self) -> bool {
        self.fork().is_some()
    }
}

/// Of `checked` committed tokens, the drafter would have proposed `agreed` (each guessed
/// from the tokens before it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Agreement {
    pub agreed: usize,
    pub checked: usize,
}

impl Agreement {
    pub fn add(&mut self, other: Agreement) {
        self.agreed += other.agreed;
        self.checked += other.checked;
    }
}

/// User choices that shape how a drafter loads.
#[derive(Debug, Clone, Default)]
pub struct DrafterOptions {
    /// `--drafter-bits`: `Some(4 | 8)` quantizes the drafter's weights on load,
    /// `Some(0)` keeps full precision, `None` takes the kind's default.
    pub bits: Option<i32>,
    /// `--confidence-threshold` for drafters with a confidence head.
    pub confidence_threshold: Option<f32>,
    /// `--ngram`: longest n-gram prompt lookup matches.
    pub ngram: usize,
    /// Activation dtype; the engine passes the target's.
    pub dtype: Option<Dtype>,
    /// `--draft-ahead`: whether a draft model keeps drafting on its own thread while
    /// the target verifies. `None`: the drafter's own default for the backend it runs on.
    pub draft_ahead: Option<DraftAhead>,
    /// `--max-tokens`: how many tokens a generation may add after its prompt, so a
    /// drafter that keeps a cache can size it once (see `KvCache::reserve`).
    pub max_new_tokens: Option<usize>,
    /// Whether the command runs the target's short continuations through dspec's CUDA
    /// kernels (`LoadOptions::verify_kernels`): a block drafter's blocks then take them
    /// too, where they serve its shapes.
    pub kernels: bool,
}

/// How far a draft model runs ahead of the target (`--draft-ahead`). Part of the
/// contract because it travels in [`DrafterOptions`], the request every drafter kind is
/// loaded with; how a kind honours it (and its default) is the kind's own business.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftAhead {
    /// Draft only when a round asks.
    Off,
    /// Keep drafting while the target verifies; a round still takes `k` drafts.
    On,
    /// As `On`, but a round whose drafts were drafted ahead takes those ready when it
    /// asks (at least one) instead of waiting for `k`.
    Eager,
}

impl DrafterOptions {
    /// `--drafter-bits` as a weight quantization: `None` takes the kind's
    /// `default_bits`, 0 means full precision, 4 and 8 quantize (group size 64; layers
    /// too narrow for it fall back to 32 on load). Any other value is an error message
    /// naming the flag.
    pub fn quantization(
        &self,
        default_bits: i32,
    ) -> std::result::Result<Option<Quantization>, String> {
        match self.bits.unwrap_or(default_bits) {
            0 => Ok(None),
            bits @ (4 | 8) => Ok(Some(Quantization {
                bits,
                group_size: 64,
            })),
            other => Err(format!(
                "--drafter-bits {other} is not supported; use 4 or 8, or 0 for full precision"
            )),
        }
    }
}

/// Loads a model directory through the engine's adapter registry (built-ins and
/// plugins): how the draft-model drafter gets its model.
pub type ModelLoader<'a> = &'a dyn Fn(&Path) -> Result<Box<dyn TargetModel>>;

/// Everything a drafter constructor gets.
pub struct DrafterLoadRequest<'a> {
    /// The drafter's checkpoint directory (`None` for kinds chosen by name only).
    pub dir: Option<&'a Path>,
    /// Its parsed config.json (`Null` without a checkpoint).
    pub config: &'a serde_json::Value,
    /// The target the drafter must fit.
    pub target: &'a ModelInfo,
    pub options: &'a DrafterOptions,
    pub load_model: ModelLoader<'a>,
}

impl DrafterLoadRequest<'_> {
    /// The error for a drafter that does not fit the target: names the drafter's
    /// config file and what differs.
    pub fn mismatch(&self, message: impl Into<String>) -> ModelError {
        let path = match self.dir {
            Some(dir) => dir.join("config.json"),
            None => "--drafter".into(),
        };
        ModelError::DrafterMismatch {
            path,
            message: message.into(),
        }
    }
}

/// Constructor of a drafter kind.
pub type DrafterLoadFn = fn(&DrafterLoadRequest) -> Result<Box<dyn Drafter>>;

/// A drafter kind, submitted with `inventory::submit!`.
pub struct DrafterRegistration {
    /// The kind's name: what `--drafter NAME` selects and what stats show.
    pub kind: &'static str,
    /// One line for `dspec adapters` and error messages.
    pub summary: &'static str,
    /// Whether a checkpoint's config.json is of this kind (`false` for kinds that
    /// have no checkpoint, such as `ngram`).
    pub detect: fn(&serde_json::Value) -> bool,
    /// Whether `--drafter NAME` alone (no checkpoint) selects this kind.
    pub by_name: bool,
    pub load: DrafterLoadFn,
}

inventory::collect!(DrafterRegistration);

/// Every registered drafter kind, sorted by name; a kind registered twice is an error.
pub fn drafter_kinds() -> Result<Vec<&'static DrafterRegistration>> {
    let mut kinds: Vec<&'static DrafterRegistration> =
        inventory::iter::<DrafterRegistration>.into_iter().collect();
    kinds.sort_by_key(|k| k.kind);
    for pair in kinds.windows(2) {
        if pair[0].kind == pair[1].kind {
            return Err(ModelError::DuplicateRegistration {
                key: pair[0].kind.to_string(),
                first: "a drafter registration".into(),
                second: "another drafter registration".into(),
            });
        }
    }
    Ok(kinds)
}

/// The first kind, in name order, whose `detect` accepts `config` (the built-in kinds
/// tell their configs apart by `architectures`, so at most one of them accepts).
pub fn detect_drafter_kind(
    config: &serde_json::Value,
) -> Result<Option<&'static DrafterRegistration>> {
    Ok(drafter_kinds()?.into_iter().find(|k| (k.detect)(config)))
}

/// The kind selected by name (`ngram`, …) when it may be chosen without a checkpoint.
pub fn drafter_kind_by_name(name: &str) -> Result<Option<&'static DrafterRegistration>> {
    Ok(drafter_kinds()?
        .into_iter()
        .find(|k| k.by_name && k.kind == name))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn picked(tokens: &[u32], probs: Option<&[f32]>) -> Picked {
        Picked {
            tokens: tokens.to_vec(),
            probs: probs.map(|p| Array::from_slice(p, &[tokens.len() as i32, 2])),
        }
    }

    /// Drafts left on the device count and cut like host drafts, without being read,
    /// and come to the host as the ids they are; appending host picks reads them first.
    #[test]
    fn drafts_on_the_device_count_cut_and_read_like_host_drafts() {
        let ids = Array::from_slice(&[7u32, 3, 9, 4], &[4]);
        let mut draft = Draft::on_device(ids).unwrap();
        assert_eq!((draft.len(), draft.tokens.len()), (4, 0));
        draft.truncate(3).unwrap();
        assert_eq!(draft.len(), 3);
        assert!(draft.on_device.is_some(), "cutting does not read");
        assert_eq!(draft.read().unwrap(), &[7, 3, 9]);
        assert!(draft.on_device.is_none());
        assert_eq!(draft.len(), 3);

        let mut draft = Draft::on_device(Array::from_slice(&[5i32, 6], &[2])).unwrap();
        draft.extend(picked(&[8], None)).unwrap();
        assert_eq!(draft.tokens, vec![5, 6, 8]);
        assert!(Draft::default().is_empty());
    }

    fn rows(draft: &Draft) -> Vec<f32> {
        let probs = draft.probs.as_ref().expect("probabilities");
        assert_eq!(probs.shape(), [draft.tokens.len() as i32, 2]);
        probs.as_slice::<f32>().to_vec()
    }

    #[test]
    fn distributions_stay_aligned_with_their_tokens() {
        let mut draft = Draft::default();
        draft.extend(picked(&[1], Some(&[0.25, 0.75]))).unwrap();
        draft
            .extend(picked(&[0, 1], Some(&[0.5, 0.5, 0.0, 1.0])))
            .unwrap();
        assert_eq!(draft.tokens, [1, 0, 1]);
        assert_eq!(rows(&draft), [0.25, 0.75, 0.5, 0.5, 0.0, 1.0]);
        draft.truncate(2).unwrap();
        assert_eq!(draft.tokens, [1, 0]);
        assert_eq!(rows(&draft), [0.25, 0.75, 0.5, 0.5]);
        draft.truncate(5).unwrap();
        assert_eq!(draft.tokens.len(), 2);
        // Tokens without a distribution make the whole draft one-hot.
        draft.extend(picked(&[1], None)).unwrap();
        assert_eq!(draft.tokens, [1, 0, 1]);
        assert!(draft.probs.is_none());
    }
}
