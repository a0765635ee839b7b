//! `Drafter`: what proposes tokens for the target to verify. The engine owns the loop;
//! a drafter sees the prompt once, proposes up to k tokens per round, and is told
//! which tokens were committed (with the target's hidden states at its tap layers).

use mlx_rs::Array;

use crate::error::Result;

/// Tokens proposed for one round, with the drafter's distribution over the vocabulary
/// at each position when it has one (needed for lossless sampling; `None` = one-hot).
#[derive(Debug, Clone, Default)]
pub struct Draft {
    pub tokens: Vec<u32>,
    pub probs: Option<Vec<Vec<f32>>>,
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
    fn begin(&mut self, prompt: &[u32], hidden: Option<&Array>) -> Result<()>;

    /// Proposes up to `max_k` tokens to follow `last` (the newest committed token,
    /// not yet seen by the target). Fewer, or none, is fine.
    fn propose(&mut self, last: u32, max_k: usize) -> Result<Draft>;

    /// Reports a round's outcome: `verified` are the positions the target kept this
    /// round, `[last, accepted drafts…]` (now in its cache), and `hidden` the target's
    /// states at exactly those positions when taps are declared. The target's own next
    /// token is not among them: it arrives as `last` of the next `propose`.
    fn commit(&mut self, verified: &[u32], hidden: Option<&Array>) -> Result<()>;
}
