//! Continuous batching: many sequences decoded together, each step one forward of the
//! target over every active sequence ([`TargetModel::forward_batch`]), which reads the
//! weights once for all of them. Sequences join and leave between steps. Prompts are
//! read in chunks within a budget of positions per step, so a long prompt never holds
//! the others up for its whole prefill. The sequences' keys and values share a pool per
//! layer, a slot each ([`KvPool`]), so that a step of one new token per sequence writes
//! and attends for all of them in a few graph nodes per layer. Each sequence keeps its
//! own sampler, stop conditions and text and, with a drafter of its own, its own drafts: a step then
//! verifies every sequence's drafts in the same forward and accepts per sequence exactly
//! as a generation alone does (lossless, greedy and sampled). How many drafts each
//! sequence gets follows the load ([`budget`]).

mod budget;
mod sequence;

use std::time::Instant;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::Array;

use dspec_plugin_api::{BatchRow, Draft, KvPool, TargetModel};
use dspec_runtime::Backend;

use crate::decoding::logprobs::TokenLogprob;
use crate::decoding::sampling::{argmax_ids, host_ids};
use crate::decoding::speculative::acceptance::{accept_sampled, greedy_prefix, Accepted};
use crate::error::EngineError;
use crate::text::tokenizer::TextTokenizer;
use budget::{
    allocate, allocate_probe, CostModel, DecodeStep, Drafting, Offer, StepCosts, StepFed,
};
pub use sequence::{Finished, NewSequence, SequenceId};
use sequence::{Round, Sequence};

/// Prompt positions a step reads at most, over all sequences joining: enough that a
/// prompt is read in a few steps, few enough that the sequences decoding meanwhile are
/// held up for a fraction of a second. A GPU reads thousands of positions in the time
/// a step's fixed costs take (weights, and attention per sequence), so it takes more.
pub fn prefill_positions_per_step(backend: Backend) -> usize {
    match backend {
        Backend::Cpu => 256,
        _ => 2048,
    }
}

/// An empty key/value pool per decoder layer of `model`.
fn fresh_pools(model: &dyn TargetModel) -> Vec<KvPool> {
    (0..model.new_cache().num_layers())
        .map(|_| KvPool::new())
        .collect()
}

/// How many of the drafts offered a step verifies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DraftBudget {
    /// As many as pay for their positions at the current load ([`budget`]).
    FollowLoad,
    /// Every draft offered, up to the maximum: for tests and for measuring verifies.
    Everything,
}

/// What one step did for one sequence.
pub struct Progress {
    pub id: SequenceId,
    /// Tokens committed this step.
    pub tokens: usize,
    /// Text committed this step (often empty: held back, or part of a character).
    pub text: String,
    /// The committed tokens' log-probabilities, when the sequence asked for them.
    pub logprobs: Vec<TokenLogprob>,
    /// Set when the sequence ended this step; it has left the batch.
    pub finished: Option<Box<Finished>>,
}

/// The sequences decoding together over one target.
pub struct BatchDecoder<'m> {
    model: &'m dyn TargetModel,
    tokenizer: &'m TextTokenizer,
    sequences: Vec<Sequence>,
    next_id: u64,
    max_draft: usize,
    prefill_positions: usize,
    draft_budget: DraftBudget,
    costs: StepCosts,
    /// Per decoder layer, where the sequences' keys and values live (a slot each).
    pools: Vec<KvPool>,
    /// The layers whose states block drafters (DFlash, DSpark) read: every sequence
    /// drafting with one asks for the same, which steps then return for all rows.
    taps: Vec<usize>,
}

/// Which of the drafts offered a step verifies.
enum Grant {
    All,
    None,
    /// As many as pay under the costs measured.
    ByCost(CostModel),
    /// As many as pay, or where none do, one sequence's: a measurement.
    Probe(CostModel),
}

/// What a step feeds one sequence.
enum Row {
    /// A chunk of its prompt, for the cache only.
    Prompt(usize),
    /// Its newest token, then its drafts.
    Decode {
        drafts: Vec<u32>,
        /// The first draft offered when none was granted, to be checked against the
        /// step's token.
        guess: Option<u32>,
        /// The distributions the drafts were sampled from (`[drafts, vocab]`), where the
        /// drafter sampled them; else each is taken as certain (one-hot).
        q: Option<Array>,
    },
}

impl<'m> BatchDecoder<'m> {
    /// A batch over `model`; sequences with a drafter verify at most `max_draft` drafts a
    /// round.
    pub fn new(model: &'m dyn TargetModel, tokenizer: &'m TextTokenizer, max_draft: usize) -> Self {
        Self {
            model,
            tokenizer,
            sequences: Vec::new(),
            next_id: 0,
            max_draft,
            prefill_positions: prefill_positions_per_step(Backend::current()),
            draft_budget: DraftBudget::FollowLoad,
            costs: StepCosts::default(),
            pools: fresh_pools(model),
            taps: Vec::new(),
        }
    }

    /// Prompt positions a step may read (at least 1).
    pub fn with_prefill_positions(mut self, positions: usize) -> Self {
        self.prefill_positions = positions.max(1);
        self
    }

    pub fn with_draft_budget(mut self, budget: DraftBudget) -> Self {
        self.draft_budget = budget;
        self
    }

    pub fn len(&self) -> usize {
        self.sequences.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sequences.is_empty()
    }

    /// Adds a sequence, which takes part from the next step on. A prompt the model
    /// cannot take (empty, ids past its vocabulary, longer than its context) is refused
    /// here, leaving the others untouched.
    pub fn add(&mut self, new: NewSequence) -> Result<SequenceId, EngineError> {
        let taps = new
            .drafter
            .as_ref()
            .filter(|d| d.drafts())
            .map_or(&[][..], |d| d.taps());
        let reading = self.sequences.iter().any(Sequence::reads_states);
        if !taps.is_empty() && reading && taps != self.taps.as_slice() {
            return Err(EngineError::Invalid(format!(
                "a sequence whose drafter reads the target's layers {taps:?} cannot join a \
                 batch whose drafters read layers {:?}: give every sequence the same drafter",
                self.taps
            )));
        }
        let taps = taps.to_vec();
        let id = SequenceId(self.next_id);
        let sequence = Sequence::new(id, self.model, new, self.max_draft, &self.pools)?;
        if sequence.reads_states() {
            self.taps = taps;
        }
        self.next_id += 1;
        self.sequences.push(sequence);
        Ok(id)
    }

    /// Drops a sequence (its client went away); false when it is not in the batch.
    pub fn cancel(&mut self, id: SequenceId) -> bool {
        let before = self.sequences.len();
        self.sequences.retain(|s| s.id != id);
        self.release_pools_when_idle();
        self.sequences.len() < before
    }

    /// With no sequence left, the pools' buffers (as long as the longest sequence they
    /// held, for every slot) are given back.
    fn release_pools_when_idle(&mut self) {
        if self.sequences.is_empty() {
            self.pools = fresh_pools(self.model);
            self.taps.clear();
        }
    }

    /// The most slots and positions per slot any pool has room for.
    fn pool_extent(&self) -> (usize, usize) {
        self.pools
            .iter()
            .map(|p| (p.slots(), p.capacity()))
            .max()
            .unwrap_or_default()
    }

    /// One forward over every sequence that has something to feed: prompt chunks within
    /// the step's budget, and each decoding sequence's newest token with the drafts
    /// granted to it. Returns what each sequence committed; finished sequences leave.
    pub fn step(&mut self) -> Result<Vec<Progress>, EngineError> {
        let start = Instant::now();
        let extent = self.pool_extent();
        let rows = self.plan()?;
        let arrays: Vec<Option<Array>> = self
            .sequences
            .iter()
            .zip(&rows)
            .map(|(s, row)| {
                row.as_ref().map(|row| match row {
                    Row::Prompt(n) => {
                        let ids = &s.prompt[s.read..s.read + n];
                        Array::from_slice(ids, &[1, *n as i32])
                    }
                    Row::Decode { drafts, .. } => {
                        let ids: Vec<u32> = [s.last].iter().chain(drafts).copied().collect();
                        Array::from_slice(&ids, &[1, ids.len() as i32])
                    }
                })
            })
            .collect();
        let positions: usize = arrays.iter().flatten().map(|a| a.shape()[1] as usize).sum();
        let decoding: Vec<usize> = rows
            .iter()
            .filter_map(|r| match r {
                Some(Row::Decode { drafts, .. }) => Some(drafts.len()),
                _ => None,
            })
            .collect();
        // Whether a drafter that runs a model drafted any of the drafts verified: probing
        // such drafts costs that drafter's forward too.
        let from_models = self.sequences.iter().zip(&rows).any(|(s, row)| {
            matches!(row, Some(Row::Decode { drafts, .. }) if !drafts.is_empty())
                && s.drafter.as_ref().is_some_and(|d| !d.drafts_by_lookup())
        });
        let read_prompts = rows.iter().any(|r| matches!(r, Some(Row::Prompt(_))));
        if positions == 0 {
            return Ok(Vec::new());
        }
        let taps: &[usize] = match self.sequences.iter().any(Sequence::reads_states) {
            true => &self.taps,
            false => &[],
        };
        let mut batch: Vec<BatchRow> = self
            .sequences
            .iter_mut()
            .zip(&arrays)
            .zip(&rows)
            .filter_map(|((s, tokens), row)| {
                let (tokens, row) = (tokens.as_ref()?, row.as_ref()?);
                Some(BatchRow {
                    tokens,
                    logits: match row {
                        Row::Prompt(_) => 0,
                        Row::Decode { drafts, .. } => drafts.len() + 1,
                    },
                    cache: &mut s.cache,
                })
            })
            .collect();
        let mut outputs = self.model.forward_batch(&mut batch, taps)?.into_iter();
        drop(batch);
        // Each decoding row's logits `[n, vocab]`, and under greedy decoding its argmax,
        // all evaluated with every cache in one wait; each fed row's states at the taps.
        let mut logits: Vec<Option<Array>> = Vec::with_capacity(rows.len());
        let mut states: Vec<Option<Array>> = Vec::with_capacity(rows.len());
        for row in &rows {
            let output = row.as_ref().and_then(|_| outputs.next());
            let (row_logits, row_states) = output.map_or((None, None), |o| (o.logits, o.hidden));
            logits.push(row_logits.map(|l| l.try_index(0)).transpose()?);
            states.push(row_states);
        }
        let greedy: Vec<Option<Array>> = self
            .sequences
            .iter()
            .zip(&logits)
            .map(|(s, l)| match (l, &s.sampler) {
                (Some(l), None) => argmax_ids(l).map(Some),
                _ => Ok(None),
            })
            .collect::<Result<_, _>>()?;
        let pooled: Vec<Array> = self.pools.iter().flat_map(KvPool::arrays).collect();
        // The rows' states too: each is an array of its own, and evaluated now it no
        // longer holds the step's layer outputs.
        mlx_rs::transforms::eval(
            greedy
                .iter()
                .flatten()
                .chain(states.iter().flatten())
                .chain(&pooled)
                .chain(self.sequences.iter().flat_map(|s| s.cache.state())),
        )?;
        drop(pooled);
        let mut progress = Vec::new();
        let mut ended = Vec::new();
        let rows_out = rows.into_iter().zip(logits).zip(greedy).zip(states);
        for (i, (((row, logits), greedy), states)) in rows_out.enumerate() {
            let s = &mut self.sequences[i];
            let (drafts, guess, q) = match row {
                None => continue,
                Some(Row::Prompt(n)) => {
                    s.read += n;
                    s.keep_states(states);
                    continue;
                }
                Some(Row::Decode { drafts, guess, q }) => (drafts, guess, q),
            };
            let logits = logits.ok_or_else(|| {
                EngineError::Mlx("a decoding row of a batched step got no logits".into())
            })?;
            let Accepted {
                drafts: accepted,
                token,
            } = match s.sampler.as_mut() {
                Some(sampler) => accept_sampled(&logits, &drafts, q.as_ref(), sampler)?,
                None => {
                    let argmax = greedy.as_ref().ok_or_else(|| {
                        EngineError::Mlx("a greedy row of a batched step got no argmax".into())
                    })?;
                    greedy_prefix(&host_ids(argmax)?, &drafts)?
                }
            };
            s.cache.trim(drafts.len() - accepted)?;
            if let Some(guess) = guess {
                s.observe_guess(guess, token);
            }
            let before = s.generated();
            let round = Round {
                drafts: &drafts,
                accepted,
                token,
                logits: Some(&logits),
                states: states.as_ref(),
            };
            let (text, entries, stop) = s.end_round(self.model, self.tokenizer, round)?;
            progress.push(Progress {
                id: s.id,
                tokens: s.generated() - before,
                text,
                logprobs: entries,
                finished: None,
            });
            if let Some(stop) = stop {
                ended.push((s.id, stop));
            }
        }
        let committed: usize = progress.iter().map(|p| p.tokens).sum();
        let fed = match read_prompts || self.pool_extent() != extent {
            true => StepFed::Untypical,
            false => StepFed::Decode(DecodeStep {
                rows: decoding.len(),
                drafts: decoding.iter().sum(),
                verifying: decoding.iter().filter(|&&d| d > 0).count(),
                committed,
                from_models,
            }),
        };
        self.costs.observe(start.elapsed().as_secs_f64(), fed);
        for (id, stop) in ended {
            let Some(at) = self.sequences.iter().position(|s| s.id == id) else {
                continue;
            };
            let (rest, finished) = self
                .sequences
                .swap_remove(at)
                .finish(self.tokenizer, stop)?;
            if let Some(p) = progress.iter_mut().find(|p| p.id == id) {
                p.text.push_str(&rest);
                p.finished = Some(Box::new(finished));
            }
        }
        self.release_pools_when_idle();
        Ok(progress)
    }

    /// What each sequence feeds this step: prompt chunks first come, first served within
    /// the budget; every decoding sequence its newest token, with the drafts granted from
    /// what its drafter offers.
    fn plan(&mut self) -> Result<Vec<Option<Row>>, EngineError> {
        let mut budget = self.prefill_positions;
        let mut rows = Vec::with_capacity(self.sequences.len());
        let mut offered: Vec<(usize, Offered, f64)> = Vec::new();
        // Drafts are weighed against the step's decoding rows alone, without the prompt
        // chunks it also reads (their time would make any draft look cheap next to the
        // step's rate).
        let mut rows_decoding = 0;
        // Where this step verifies no drafts, a drafter is asked for one only: its guess,
        // checked against the step's token.
        let grant = match (self.draft_budget, self.costs.model()) {
            (DraftBudget::Everything, _) => Grant::All,
            // Before any step is timed, a plain step is timed first.
            (DraftBudget::FollowLoad, None) => Grant::None,
            (DraftBudget::FollowLoad, Some(costs)) => match self.costs.drafting() {
                Drafting::ByCost => Grant::ByCost(costs),
                Drafting::Off => Grant::None,
                Drafting::Probe => Grant::Probe(costs),
            },
        };
        let drafting = !matches!(grant, Grant::None);
        for (i, s) in self.sequences.iter_mut().enumerate() {
            let left = s.prompt_left();
            if left > 0 {
                let n = left.min(budget);
                budget -= n;
                rows.push((n > 0).then_some(Row::Prompt(n)));
                continue;
            }
            rows_decoding += 1;
            // The first decode row feeds the prompt's last token: drafts follow committed
            // tokens only, as in a generation alone.
            let cap = match (s.has_committed(), drafting) {
                (true, true) => s.draft_cap(self.max_draft),
                (true, false) => s.draft_cap(self.max_draft).min(1),
                (false, _) => 0,
            };
            let lookup = s
                .drafter
                .as_ref()
                .filter(|d| d.drafts())
                .map(|d| d.drafts_by_lookup());
            match (lookup, cap > 0) {
                (Some(true), true) => {
                    let draft = s.propose(self.model, cap)?;
                    if !draft.tokens.is_empty() {
                        offered.push((i, Offered::Drafts(draft), s.alpha()));
                    }
                }
                // A drafter that runs a model drafts only what a step grants: its
                // forward costs whether or not its drafts are verified.
                (Some(false), true) if drafting => offered.push((i, Offered::Up(cap), s.alpha())),
                _ => {}
            }
            rows.push(Some(Row::Decode {
                drafts: Vec::new(),
                guess: None,
                q: None,
            }));
        }
        let offers: Vec<Offer> = offered
            .iter()
            .map(|(_, offer, alpha)| Offer {
                available: match offer {
                    Offered::Drafts(draft) => draft.tokens.len(),
                    Offered::Up(cap) => *cap,
                },
                alpha: *alpha,
            })
            .collect();
        let granted = match grant {
            Grant::All => offers.iter().map(|o| o.available).collect(),
            Grant::None => vec![0; offers.len()],
            Grant::ByCost(costs) => allocate(&offers, rows_decoding, &costs),
            Grant::Probe(costs) => allocate_probe(&offers, rows_decoding, &costs),
        };
        for ((i, offer, _), k) in offered.into_iter().zip(granted) {
            rows[i] = Some(match offer {
                Offered::Drafts(mut draft) => {
                    let guess = (k == 0).then(|| draft.tokens.first().copied()).flatten();
                    draft.truncate(k)?;
                    Row::Decode {
                        drafts: draft.tokens,
                        guess,
                        q: draft.probs,
                    }
                }
                Offered::Up(_) if k == 0 => continue,
                Offered::Up(_) => {
                    let draft = self.sequences[i].propose(self.model, k)?;
                    Row::Decode {
                        drafts: draft.tokens,
                        guess: None,
                        q: draft.probs,
                    }
                }
            });
        }
        Ok(rows)
    }
}

/// What a sequence's drafter offers a step.
enum Offered {
    /// Drafts looked up already (free to make, whether verified or not), read.
    Drafts(Draft),
    /// Up to this many, drafted once granted.
    Up(usize),
}
