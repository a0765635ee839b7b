//! A small model of the same tokenizer drafting for a big one: k autoregressive steps
//! of its own forward pass per round, with its own KV cache trimmed back to what the
//! target accepted. Any model an adapter (built-in or plugin) loads can draft.
//!
//! The draft cache never holds a token the target rejected: after a round it keeps
//! the longest prefix of what it fed that the target verified, and the verified
//! tokens it has not seen yet wait in `pending` to be fed with the next `last`.

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::{argmax_axis, TryIndexOp};
use mlx_rs::{Array, Dtype};

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::{
    inventory, Draft, Drafter, DrafterLoadRequest, DrafterRegistration, ModelCache, Picked,
    TargetModel, TokenPicker,
};

/// Longest prompt slice fed to the draft model in one forward while starting.
const PREFILL_CHUNK: usize = 512;

/// Most verified tokens the draft model has not seen (after a round that kept every
/// draft: the last one) that go in one one-token step each rather than with `last` in
/// one forward. On a GPU a one-token step is the cheap one: an H100 trace had rounds
/// after a fully kept draft spending 4.5 ms more on drafting (2-token forward first)
/// than the 7.4 ms of rounds after a rejection (four one-token steps).
const ONE_BY_ONE: usize = 2;

pub struct DraftModelDrafter {
    model: Box<dyn TargetModel>,
    cache: ModelCache,
    /// Committed tokens the draft cache has not seen yet.
    pending: Vec<u32>,
    /// What the last `propose` fed after the committed tokens: `[last, d1..]`.
    speculative: Vec<u32>,
    /// The target's vocabulary size: logits are cut to it (a draft model may pad its
    /// vocabulary differently) and distributions are padded to it.
    target_vocab: usize,
}

impl DraftModelDrafter {
    pub fn new(model: Box<dyn TargetModel>, target_vocab: usize) -> Self {
        let cache = model.new_cache();
        Self {
            model,
            cache,
            pending: Vec::new(),
            speculative: Vec::new(),
            target_vocab,
        }
    }

    /// Runs `tokens` through the draft model and returns its last position's logits
    /// over the target's vocabulary, `[1, V]`.
    fn step(&mut self, tokens: &Array) -> Result<Array> {
        let out = self.model.forward(tokens, &mut self.cache, &[])?;
        let vocab = self.target_vocab.min(self.model.info().vocab_size) as i32;
        Ok(out.logits.try_index((0, -1.., ..vocab))?)
    }

    /// Pads a distribution over the draft vocabulary to the target's.
    fn widen(&self, mut picked: Picked) -> Picked {
        if let Some(probs) = picked.probs.as_mut() {
            for p in probs {
                p.resize(self.target_vocab, 0.0);
            }
        }
        picked
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
        self.cache = self.model.new_cache();
        self.speculative.clear();
        self.pending.clear();
        // The whole prompt now, so rounds only feed what was committed since.
        for chunk in prompt.chunks(PREFILL_CHUNK) {
            let out = self.model.forward(
                &Array::from_slice(chunk, &[1, chunk.len() as i32]),
                &mut self.cache,
                &[],
            )?;
            mlx_rs::transforms::eval(self.cache.state())?;
            drop(out);
        }
        Ok(())
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
        let mut input = std::mem::take(&mut self.pending);
        if input.len() <= ONE_BY_ONE {
            // Fed as drafting steps are, one token each (lazily: their logits are never
            // asked for, only the cache entries).
            for token in input.drain(..) {
                let one = Array::from_slice(&[token], &[1, 1]);
                self.model.forward(&one, &mut self.cache, &[])?;
            }
        }
        input.push(last);
        self.speculative = vec![last];
        let first = Array::from_slice(&input, &[1, input.len() as i32]);
        if picker.is_greedy() {
            // Chain the argmax ids lazily through the k steps: one host sync a round.
            let mut ids = Vec::with_capacity(max_k);
            let mut next = argmax_axis(&self.step(&first)?, -1, false)?.as_dtype(Dtype::Uint32)?;
            for _ in 1..max_k {
                // Start each step on the device while the host builds the next one.
                mlx_rs::transforms::async_eval([&next])?;
                ids.push(next.clone());
                let fed = next.reshape(&[1, 1])?;
                next = argmax_axis(&self.step(&fed)?, -1, false)?.as_dtype(Dtype::Uint32)?;
            }
            ids.push(next);
            let all = concatenate(&ids, 0)?;
            all.eval()?;
            draft.tokens = all
                .try_as_slice::<u32>()
                .map_err(|e| ModelError::Unsupported(format!("reading drafted ids: {e}")))?
                .to_vec();
        } else {
            let mut logits = self.step(&first)?;
            for i in 0..max_k {
                let picked = self.widen(picker.pick(&logits)?);
                let token = picked.tokens.first().copied().unwrap_or_default();
                draft.extend(picked);
                if i + 1 < max_k {
                    logits = self.step(&Array::from_slice(&[token], &[1, 1]))?;
                }
            }
        }
        // The cache now holds [pending.., last, d1..d(k-1)]; dk was never fed.
        self.speculative
            .extend_from_slice(&draft.tokens[..draft.tokens.len() - 1]);
        Ok(draft)
    }

    fn commit(&mut self, verified: &[u32], _hidden: Option<&Array>) -> Result<()> {
        let kept = self
            .speculative
            .iter()
            .zip(verified)
            .take_while(|(a, b)| a == b)
            .count();
        self.cache.trim(self.speculative.len() - kept);
        self.pending.extend_from_slice(&verified[kept..]);
        self.speculative.clear();
        Ok(())
    }
}

fn load(request: &DrafterLoadRequest) -> Result<Box<dyn Drafter>> {
    let dir = request.dir.ok_or_else(|| {
        request.mismatch("the draft-model drafter needs a model directory: --drafter model:DIR")
    })?;
    let model = (request.load_model)(dir)?;
    // The engine checks that both tokenizers are identical before this is called;
    // differently padded vocabularies are fine (logits are cut to the target's).
    Ok(Box::new(DraftModelDrafter::new(
        model,
        request.target.vocab_size,
    )))
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
