//! A small model of the same tokenizer drafting for a big one: k autoregressive steps
//! of its own forward pass per round. Any model an adapter (built-in or plugin) loads
//! can draft. The model runs on its own thread ([`crate::draft_thread`]), which keeps
//! its cache to what the target committed plus its own greedy continuation, and on a
//! GPU drafts the next round while the target verifies this one. Where the model shares
//! its weights ([`TargetModel::share`]), the drafter forks: each fork drafts for its own
//! sequence on a thread of its own, over the same weights.

use std::sync::Once;

use mlx_rs::ops::concatenate;
use mlx_rs::Array;

use dspec_adapters::attention::WHOLE_BUFFER_MAX_TOKENS;
use dspec_plugin_api::error::Result;
use dspec_plugin_api::{
    inventory, Agreement, Draft, DraftAhead, Drafter, DrafterLoadRequest, DrafterRegistration,
    Picked, TargetModel, TokenPicker,
};
use dspec_runtime::Backend;

use crate::draft_thread::{warm_up, DraftThread};

/// Committed tokens worth sending to the thread before drafting resumes: a whole
/// continuation's width, the longest forward the thread reads them in.
const FEED_AT: usize = WHOLE_BUFFER_MAX_TOKENS as usize;

pub struct DraftModelDrafter {
    /// The model and its cache, on their own thread.
    thread: DraftThread,
    /// A share of the model's weights kept on this thread, taken once they were
    /// evaluated, which forks share in turn; `None` where the model cannot share them.
    weights: Option<Box<dyn TargetModel>>,
    /// Committed tokens the thread has not been told about yet.
    unsent: Vec<u32>,
    /// How many tokens at the head of `unsent`, and of the `last` after them, a drafting
    /// round already accounted for (its kept drafts and the target's token after them):
    /// the thread checks its guesses only on the rest, plain decoding's tokens.
    accounted: usize,
    /// Whether the last `propose` sent its `last` to the thread: then it opens the next
    /// `commit`, already sent. A propose of no drafts sends nothing, and the commit after
    /// it (plain steps, maybe many) is all unsent.
    sent_last: bool,
    /// The target's vocabulary size: logits are cut to it (a draft model may pad its
    /// vocabulary differently) and distributions are padded to it.
    target_vocab: usize,
    /// Whether the thread works while the target does: then it also reads runs of
    /// plain steps as they come ([`FEED_AT`]).
    overlaps: bool,
    /// Whether the prompt waits for the first `propose` that asks for drafts, rather
    /// than being read as the sequence begins: a fork that does not overlap the target.
    /// A fork serves one of a batch's sequences, which the load may never grant drafts,
    /// and a thread that does not overlap the target takes the cores it decodes with
    /// (the CPU's default). A drafter alone is asked at once, and reads the prompt
    /// while the target prefills it.
    prompt_when_asked: bool,
    /// The prompt not yet sent to the thread, while it waits.
    prompt: Option<Vec<u32>>,
    /// Settings a fork takes: whether to draft ahead, and what a generation may add.
    ahead: DraftAhead,
    max_new_tokens: Option<usize>,
}

impl DraftModelDrafter {
    /// `ahead`: whether to keep drafting while the target verifies (see
    /// [`crate::draft_thread`]); `max_new_tokens`: what a generation may add after its
    /// prompt, when known.
    pub fn new(
        model: Box<dyn TargetModel>,
        target_vocab: usize,
        ahead: DraftAhead,
        max_new_tokens: Option<usize>,
    ) -> Result<Self> {
        warm_up(model.as_ref())?;
        // Shared once evaluated: forks move shares of it to threads of their own.
        let weights = model.share();
        let thread = DraftThread::spawn_warm(model, target_vocab, ahead, max_new_tokens)?;
        let mut drafter = Self::on(thread, weights, target_vocab, ahead, max_new_tokens);
        drafter.prompt_when_asked = false;
        Ok(drafter)
    }

    /// A fork for a fresh sequence on `thread`.
    fn on(
        thread: DraftThread,
        weights: Option<Box<dyn TargetModel>>,
        target_vocab: usize,
        ahead: DraftAhead,
        max_new_tokens: Option<usize>,
    ) -> Self {
        Self {
            thread,
            weights,
            unsent: Vec::new(),
            accounted: 0,
            sent_last: false,
            target_vocab,
            overlaps: ahead != DraftAhead::Off,
            prompt_when_asked: ahead == DraftAhead::Off,
            prompt: None,
            ahead,
            max_new_tokens,
        }
    }

    /// A drafter of the same settings over a share of the same weights, drafting on a
    /// thread of its own; `None` where the weights are not shared.
    fn fork_on_thread(&self) -> Option<Result<Self>> {
        let weights = self.weights.as_ref()?;
        let (model, kept) = (weights.share()?, weights.share());
        // The shares hold the weights `new` evaluated: nothing to warm up.
        let thread =
            DraftThread::spawn_warm(model, self.target_vocab, self.ahead, self.max_new_tokens);
        Some(thread.map(|t| Self::on(t, kept, self.target_vocab, self.ahead, self.max_new_tokens)))
    }

    /// Pads distributions over the draft vocabulary to the target's (with zeros: the
    /// draft model never proposes tokens past its own vocabulary).
    fn widen(&self, mut picked: Picked) -> Result<Picked> {
        if let Some(probs) = picked.probs.take() {
            let shape = probs.shape();
            let (rows, width) = (shape[0], shape[shape.len() - 1]);
            let missing = self.target_vocab as i32 - width;
            picked.probs = Some(if missing > 0 {
                let pad = Array::zeros::<f32>(&[rows, missing])?;
                concatenate(&[probs, pad], 1)?
            } else {
                probs
            });
        }
        Ok(picked)
    }
}

impl Drafter for DraftModelDrafter {
    fn name(&self) -> &str {
        "draft-model"
    }

    fn begin(
        &mut self,
        _target: &dyn TargetModel,
        prompt: &[u32],
        _hidden: Option<&Array>,
    ) -> Result<()> {
        self.unsent.clear();
        self.accounted = 0;
        self.sent_last = false;
        // The draft model reads the prompt on its thread; the first `propose` waits.
        if self.prompt_when_asked {
            self.prompt = Some(prompt.to_vec());
            Ok(())
        } else {
            self.thread.begin(prompt)
        }
    }

    fn propose(
        &mut self,
        _target: &dyn TargetModel,
        last: u32,
        max_k: usize,
        picker: &mut dyn TokenPicker,
    ) -> Result<Draft> {
        let mut draft = Draft::default();
        if max_k == 0 {
            return Ok(draft);
        }
        if let Some(prompt) = self.prompt.take() {
            self.thread.begin(&prompt)?;
        }
        let mut committed = std::mem::take(&mut self.unsent);
        committed.push(last);
        self.sent_last = true;
        let check_from = std::mem::take(&mut self.accounted);
        if picker.is_greedy() {
            draft.tokens = self.thread.draft(committed, check_from, max_k)?.tokens;
            return Ok(draft);
        }
        // Sampled: the engine picks each token from the draft model's logits.
        for i in 0..max_k {
            let extra = draft.tokens.clone();
            let committed = if i == 0 {
                std::mem::take(&mut committed)
            } else {
                Vec::new()
            };
            let logits = self.thread.logits(committed, check_from, extra)?;
            let vocab = logits.len() as i32;
            let picked = picker.pick(&Array::from_slice(&logits, &[1, vocab]))?;
            draft.extend(self.widen(picked)?)?;
        }
        Ok(draft)
    }

    fn commit(&mut self, verified: &[u32], _hidden: Option<&Array>) -> Result<()> {
        // After a propose, `verified[0]` is the `last` it sent.
        let sent = usize::from(std::mem::take(&mut self.sent_last));
        self.unsent
            .extend_from_slice(verified.get(sent..).unwrap_or_default());
        if sent == 1 {
            self.accounted = self.unsent.len() + 1;
        }
        // A run of plain steps arrives in pieces: where the thread's work overlaps the
        // target's (as drafting ahead does), it reads each piece while the target decodes
        // on, instead of all of them at the next round's drafting, on its clock.
        if self.overlaps && self.unsent.len() >= FEED_AT {
            let check_from = self.accounted.min(self.unsent.len());
            self.accounted -= check_from;
            self.thread
                .feed(std::mem::take(&mut self.unsent), check_from)?;
        }
        Ok(())
    }

    fn agreement(&mut self) -> Option<Agreement> {
        Some(self.thread.agreement())
    }

    fn fork(&self) -> Option<Box<dyn Drafter>> {
        match self.fork_on_thread()? {
            Ok(fork) => Some(Box::new(fork)),
            Err(e) => {
                // The sequence decodes without drafts. A server forks for every request it
                // takes: once is enough to say why.
                static SAID: Once = Once::new();
                SAID.call_once(|| {
                    eprintln!(
                        "[dspec] warning: a sequence decodes without drafts: {e} (said once; \
                         later sequences may too)"
                    )
                });
                None
            }
        }
    }

    fn forks(&self) -> bool {
        self.weights.is_some()
    }
}

fn load(request: &DrafterLoadRequest) -> Result<Box<dyn Drafter>> {
    let dir = request.dir.ok_or_else(|| {
        request.mismatch("the draft-model drafter needs a model directory: --drafter model:DIR")
    })?;
    let model = (request.load_model)(dir)?;
    // The engine checks that both tokenizers are identical before this is called;
    // differently padded vocabularies are fine (logits are cut to the target's).
    // Unset, drafting ahead is on for GPU backends, where decoding waits on the host and
    // the two threads' host work overlaps; off on the CPU, whose cores the target's
    // arithmetic already uses.
    let ahead = request
        .options
        .draft_ahead
        .unwrap_or(match Backend::current() {
            Backend::Cpu => DraftAhead::Off,
            Backend::Cuda | Backend::Metal => DraftAhead::On,
        });
    Ok(Box::new(DraftModelDrafter::new(
        model,
        request.target.vocab_size,
        ahead,
        request.options.max_new_tokens,
    )?))
}

inventory::submit! {
    DrafterRegistration {
        kind: "draft-model",
        summary: "a smaller model with the target's tokenizer drafting autoregressively (--drafter model:DIR)",
        detect: |_| false,
        by_name: false,
        load,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dspec_adapters::fixtures::{load_dir, write_random_model, TINY_LLAMA};
    use dspec_plugin_api::{ForwardOutput, LoadOptions, ModelCache, ModelError, ModelInfo};

    /// Greedy drafting never asks the picker: the draft thread takes the argmax.
    struct Greedy;
    impl TokenPicker for Greedy {
        fn is_greedy(&self) -> bool {
            true
        }
        fn pick(&mut self, _logits: &Array) -> Result<Picked> {
            Err(ModelError::Unsupported(
                "greedy drafts take no picks".into(),
            ))
        }
    }

    /// A random tiny model written from `seed` (kept on disk in the returned directory,
    /// for drafters loaded from it) and loaded as the target.
    fn tiny(seed: u64) -> (tempfile::TempDir, Box<dyn TargetModel>) {
        let dir = tempfile::tempdir().expect("temp dir");
        write_random_model(dir.path(), TINY_LLAMA, seed, None).expect("fixture");
        let target = load_dir(dir.path(), &LoadOptions::default()).expect("load");
        (dir, target)
    }

    /// A drafter of the model in `dir`, loaded apart from every other.
    fn drafter(dir: &tempfile::TempDir, ahead: DraftAhead) -> DraftModelDrafter {
        let model = load_dir(dir.path(), &LoadOptions::default()).expect("load");
        DraftModelDrafter::new(model, 97, ahead, None).expect("spawn")
    }

    /// Rounds without drafts reach the drafter as a propose of none and one commit of
    /// every plain step's position: its first position must reach the model too, so the
    /// drafts after it are those of a drafter that saw the whole sequence from the start.
    #[test]
    fn a_commit_after_a_propose_of_no_drafts_keeps_its_first_position() {
        let (dir, target) = tiny(4);
        let t = target.as_ref();
        let (mut batched, mut fresh) = (
            drafter(&dir, DraftAhead::Off),
            drafter(&dir, DraftAhead::Off),
        );
        batched.begin(t, &[3, 14, 15], None).unwrap();
        assert!(batched
            .propose(t, 92, 0, &mut Greedy)
            .unwrap()
            .tokens
            .is_empty());
        batched.commit(&[92, 65, 35], None).unwrap();
        fresh.begin(t, &[3, 14, 15, 92, 65, 35], None).unwrap();
        let drafts = batched.propose(t, 89, 4, &mut Greedy).unwrap().tokens;
        assert_eq!(drafts, fresh.propose(t, 89, 4, &mut Greedy).unwrap().tokens);
        // After a propose, a commit opens with the `last` it sent.
        for d in [&mut batched, &mut fresh] {
            d.commit(&[89, drafts[0]], None).unwrap();
        }
        let next = (drafts[1] + 1) % 97;
        assert_eq!(
            batched.propose(t, next, 3, &mut Greedy).unwrap().tokens,
            fresh.propose(t, next, 3, &mut Greedy).unwrap().tokens
        );
    }

    /// Forks of a drafter draft on threads of their own over the same weights: each one,
    /// and the drafter it was forked from, drafts for its own sequence what a drafter
    /// loaded fresh for that sequence alone does, while the others draft for theirs in
    /// between (drafting ahead, as forks of a drafter that drafts ahead do).
    #[test]
    fn forks_draft_what_fresh_drafters_do_each_for_its_own_sequence() {
        let (dir, target) = tiny(6);
        let t = target.as_ref();
        let original = drafter(&dir, DraftAhead::On);
        assert!(original.forks());
        let forks = [original.fork(), original.fork()].map(|f| f.expect("a fork"));
        let mut drafters: Vec<Box<dyn Drafter>> = vec![Box::new(original)];
        drafters.extend(forks);
        let mut alone: Vec<DraftModelDrafter> =
            (0..3).map(|_| drafter(&dir, DraftAhead::Off)).collect();
        let prompts: [&[u32]; 3] = [&[3, 14, 15], &[92, 65, 35, 89], &[79]];
        for ((d, a), prompt) in drafters.iter_mut().zip(&mut alone).zip(prompts) {
            d.begin(t, prompt, None).unwrap();
            a.begin(t, prompt, None).unwrap();
        }
        let mut last = [26, 53, 58];
        for round in 0..4 {
            for (i, (d, a)) in drafters.iter_mut().zip(&mut alone).enumerate() {
                let drafts = d.propose(t, last[i], 4, &mut Greedy).unwrap().tokens;
                let expected = a.propose(t, last[i], 4, &mut Greedy).unwrap().tokens;
                assert_eq!(drafts, expected, "drafter {i}, round {round}");
                // Keeps `round % 3` drafts, then a token the model did not draft.
                let kept = round % 3;
                let mut verified = vec![last[i]];
                verified.extend_from_slice(&drafts[..kept]);
                d.commit(&verified, None).unwrap();
                a.commit(&verified, None).unwrap();
                last[i] = (drafts[kept] + 1) % 97;
            }
        }
    }

    /// A fork that does not draft ahead reads its prompt only once drafts are asked of
    /// it, after plain steps: it drafts what a drafter alone, which read the prompt as
    /// the sequence began, drafts after the same steps.
    #[test]
    fn a_fork_reading_its_prompt_when_asked_drafts_what_a_drafter_alone_does() {
        let (dir, target) = tiny(7);
        let t = target.as_ref();
        let mut fork = drafter(&dir, DraftAhead::Off).fork().expect("a fork");
        let mut alone = drafter(&dir, DraftAhead::Off);
        let prompt = [5, 61, 17, 40, 2];
        fork.begin(t, &prompt, None).unwrap();
        alone.begin(t, &prompt, None).unwrap();
        // Plain steps first: rounds asked for no drafts, their tokens committed in pieces,
        // each opening with the `last` its propose was given.
        let mut last = 33;
        for piece in [[33, 8, 71].as_slice(), &[78, 12]] {
            assert!(fork
                .propose(t, last, 0, &mut Greedy)
                .unwrap()
                .tokens
                .is_empty());
            assert!(alone
                .propose(t, last, 0, &mut Greedy)
                .unwrap()
                .tokens
                .is_empty());
            fork.commit(piece, None).unwrap();
            alone.commit(piece, None).unwrap();
            last = (piece[piece.len() - 1] + 7) % 97;
        }
        for round in 0..3 {
            let drafts = fork.propose(t, last, 4, &mut Greedy).unwrap().tokens;
            let expected = alone.propose(t, last, 4, &mut Greedy).unwrap().tokens;
            assert_eq!(drafts.len(), 4, "round {round}");
            assert_eq!(drafts, expected, "round {round}");
            let verified = [last, drafts[0]];
            fork.commit(&verified, None).unwrap();
            alone.commit(&verified, None).unwrap();
            last = (drafts[1] + 1) % 97;
        }
    }

    /// A model that does not share its weights, as a plugin's.
    struct Unshared(Box<dyn TargetModel>);

    impl TargetModel for Unshared {
        fn info(&self) -> &ModelInfo {
            self.0.info()
        }
        fn new_cache(&self) -> ModelCache {
            self.0.new_cache()
        }
        fn forward(
            &self,
            tokens: &Array,
            cache: &mut ModelCache,
            taps: &[usize],
        ) -> Result<ForwardOutput> {
            self.0.forward(tokens, cache, taps)
        }
        fn embed(&self, tokens: &Array) -> Result<Array> {
            self.0.embed(tokens)
        }
        fn lm_head(&self, hidden: &Array) -> Result<Array> {
            self.0.lm_head(hidden)
        }
        fn final_norm(&self, hidden: &Array) -> Result<Array> {
            self.0.final_norm(hidden)
        }
    }

    /// Over a model that does not share its weights, the drafter does not fork, and says
    /// so when asked.
    #[test]
    fn a_model_that_does_not_share_gives_no_forks() {
        let (_dir, model) = tiny(4);
        let drafter = DraftModelDrafter::new(Box::new(Unshared(model)), 97, DraftAhead::Off, None)
            .expect("spawn");
        assert!(!drafter.forks());
        assert!(drafter.fork().is_none());
    }
}
