//! Continuous batching against each sequence decoded alone: many sequences in one
//! batch, joining while others decode, prompts read in chunks, with and without drafts,
//! must give each sequence exactly what plain decoding gives it alone (greedy, and
//! sampled with its own seed), and speculative sampling in a batch must keep the
//! target's distribution.

mod common;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use mlx_rs::Array;

use dspec_adapters::fixtures::{tiny_experts, with, TINY_QWEN3_5_OVERRIDES};
use dspec_drafters::dflash::TINY_DFLASH;
use dspec_drafters::dspark::TINY_DSPARK_QWEN3;
use dspec_drafters::ngram::NgramDrafter;
use dspec_engine::decoding::batch::{BatchDecoder, DraftBudget, Finished, NewSequence, SequenceId};
use dspec_engine::decoding::generate::{generate, GenerationConfig};
use dspec_engine::decoding::sampling::SamplingParams;
use dspec_engine::loading::LoadedModel;
use dspec_engine::tiny_model::write_tiny_model;
use dspec_plugin_api::error::Result as ModelResult;
use dspec_plugin_api::{Draft, DraftAhead, Drafter, DrafterOptions, TargetModel, TokenPicker};

use common::lossless::{chi_square, exact_joint, greedy_path, params, FixedDrafter, SAMPLES};
use common::{max_abs_diff, tiny_target};

/// The ids of the tiny models' end-of-text token.
const EOS: u32 = 256;

/// Prompts of different lengths, some repeating themselves (so lookups find drafts), one
/// longer than a step's prompt budget in the tests below.
fn prompts() -> Vec<Vec<u32>> {
    let text = |s: &str| s.bytes().map(u32::from).collect::<Vec<u32>>();
    vec![
        text("Hi"),
        text("the cat sat on the mat; the cat sat on the"),
        text("fn add(a: i32, b: i32) -> i32 { a + b }\nfn add(a: i32, b: i32) -> i32 {"),
        text("abcabcabcabcabcabcabcabcabcabcabcabc"),
        text(&"lorem ipsum dolor sit amet, ".repeat(5)),
        text("Q: 2+2? A:"),
    ]
}

fn config(max_tokens: usize, sampling: SamplingParams) -> GenerationConfig {
    GenerationConfig {
        max_tokens,
        sampling,
        stop_strings: Vec::new(),
        eos_ids: vec![EOS],
    }
}

/// Each sequence decoded alone by plain decoding: its tokens and text.
fn alone(loaded: &LoadedModel, prompt: &[u32], config: &GenerationConfig) -> (Vec<u32>, String) {
    let out = generate(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        prompt,
        config,
        &mut |_| {},
    )
    .expect("plain decoding");
    (out.tokens, out.text)
}

/// The sequences run as one batch, sequence i joining at step `i * join_every`; returns
/// each one's tokens and text (checked to be the pieces streamed), in the order given,
/// and the drafts verified and kept in all.
fn batched(
    loaded: &LoadedModel,
    sequences: Vec<(Vec<u32>, GenerationConfig)>,
    drafters: &dyn Fn(usize) -> Option<Box<dyn Drafter>>,
    budget: DraftBudget,
    join_every: usize,
) -> (Vec<(Vec<u32>, String)>, Drafts) {
    let mut batch = BatchDecoder::new(loaded.model.as_ref(), &loaded.tokenizer, 5)
        .with_prefill_positions(40)
        .with_draft_budget(budget);
    let total = sequences.len();
    let mut waiting = sequences.into_iter().enumerate().peekable();
    let mut ids: HashMap<SequenceId, usize> = HashMap::new();
    let mut streamed = vec![String::new(); total];
    let mut finished: Vec<Option<Finished>> = (0..total).map(|_| None).collect();
    let mut step = 0;
    while waiting.peek().is_some() || !batch.is_empty() {
        while let Some((i, _)) = waiting.peek() {
            if *i * join_every > step && !batch.is_empty() {
                break;
            }
            let Some((i, (prompt, config))) = waiting.next() else {
                break;
            };
            let id = batch
                .add(NewSequence {
                    prompt,
                    config,
                    drafter: drafters(i),
                    logprobs: None,
                    reused: None,
                })
                .expect("joins");
            ids.insert(id, i);
        }
        for p in batch.step().expect("a batched step") {
            let i = ids[&p.id];
            streamed[i].push_str(&p.text);
            if let Some(done) = p.finished {
                finished[i] = Some(*done);
            }
        }
        step += 1;
        assert!(step < 10_000, "the batch never finished");
    }
    let mut drafts = Drafts::default();
    let outputs = finished
        .into_iter()
        .zip(streamed)
        .map(|(f, streamed)| {
            let f = f.expect("every sequence finishes");
            assert_eq!(f.text, streamed, "the streamed pieces make the text");
            drafts.verified += f.speculative.drafted_tokens;
            drafts.kept += f.speculative.accepted_tokens;
            (f.tokens, f.text)
        })
        .collect();
    (outputs, drafts)
}

/// Drafts over a batch's sequences.
#[derive(Default)]
struct Drafts {
    verified: usize,
    kept: usize,
}

/// A dense target, the hybrid (whose recurrent states roll back rejected drafts) and a
/// mixture of experts.
fn targets() -> Vec<(&'static str, String)> {
    vec![
        ("llama", "{}".to_string()),
        ("qwen3_5", TINY_QWEN3_5_OVERRIDES.to_string()),
        (
            "qwen3_moe",
            with(
                r#"{"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "head_dim": 16, "mlp_only_layers": [1]}"#,
                &tiny_experts(false),
            ),
        ),
    ]
}

/// Greedy sequences of every prompt, the i-th generating up to `first + step · i`
/// tokens, and what each gets decoded alone.
#[allow(clippy::type_complexity)]
fn greedy_sequences(
    loaded: &LoadedModel,
    first: usize,
    step: usize,
) -> (Vec<(Vec<u32>, GenerationConfig)>, Vec<(Vec<u32>, String)>) {
    let sequences: Vec<(Vec<u32>, GenerationConfig)> = prompts()
        .into_iter()
        .enumerate()
        .map(|(i, p)| (p, config(first + step * i, SamplingParams::default())))
        .collect();
    let want = sequences.iter().map(|(p, c)| alone(loaded, p, c)).collect();
    (sequences, want)
}

/// A sequence's own greedy continuation with one token changed: drafts from it are
/// kept and rejected for sure.
fn changed_path(want: &(Vec<u32>, String)) -> FixedDrafter {
    let mut path = want.0.clone();
    if let Some(t) = path.get_mut(4) {
        *t = (*t + 1) % EOS;
    }
    FixedDrafter { path, seen: 0 }
}

/// No drafter; n-gram lookup for even sequences and, for odd ones, [`changed_path`].
fn drafters(kind: &str, want: &[(Vec<u32>, String)], i: usize) -> Option<Box<dyn Drafter>> {
    match kind {
        "none" => None,
        _ if i.is_multiple_of(2) => Some(Box::new(NgramDrafter::new(3))),
        _ => Some(Box::new(changed_path(&want[i]))),
    }
}

#[test]
fn greedy_batches_give_each_sequence_what_it_gets_alone() {
    for (name, overrides) in targets() {
        let (_dir, loaded) = tiny_target(&overrides, 5);
        let (sequences, want) = greedy_sequences(&loaded, 12, 5);
        for (kind, budget, join_every) in [
            ("none", DraftBudget::FollowLoad, 0),
            ("none", DraftBudget::FollowLoad, 3),
            ("drafts", DraftBudget::Everything, 2),
            ("drafts", DraftBudget::FollowLoad, 1),
        ] {
            let (got, drafts) = batched(
                &loaded,
                sequences.clone(),
                &|i| drafters(kind, &want, i),
                budget,
                join_every,
            );
            if budget == DraftBudget::Everything {
                assert!(drafts.kept > 0, "{name}: no draft was ever kept");
            }
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(
                    g, w,
                    "{name}, {kind} {budget:?}, joining every {join_every} steps: sequence {i}"
                );
            }
        }
    }
}

/// Sampled sequences draw from their own seeds: a batch gives each what it gets alone.
#[test]
fn sampled_batches_give_each_sequence_what_its_seed_gives_alone() {
    let (_dir, loaded) = tiny_target("{}", 9);
    let sequences: Vec<(Vec<u32>, GenerationConfig)> = prompts()
        .into_iter()
        .enumerate()
        .map(|(i, p)| {
            let sampling = SamplingParams {
                temperature: 0.9,
                top_p: 0.95,
                seed: Some(100 + i as u64),
                ..SamplingParams::default()
            };
            (p, config(16, sampling))
        })
        .collect();
    let (got, _) = batched(
        &loaded,
        sequences.clone(),
        &|_| None,
        DraftBudget::FollowLoad,
        2,
    );
    for (i, ((prompt, config), g)) in sequences.iter().zip(&got).enumerate() {
        assert_eq!(g, &alone(&loaded, prompt, config), "sequence {i}");
    }
}

/// Speculative sampling in batches keeps the target's distribution: the first three
/// tokens of many sequences (drafts from the target's greedy path, so some are kept and
/// some rejected) against the exact joint distribution, by chi-square.
#[test]
fn sampled_drafts_in_batches_keep_the_target_distribution() {
    let (_dir, loaded) = tiny_target("{}", 3);
    let prompt = prompts()[1].clone();
    let model = loaded.model.as_ref();
    let expected = exact_joint(model, &prompt, &params(0));
    let path = greedy_path(model, &prompt, 4);
    let mut seen: HashMap<[u32; 3], usize> = HashMap::new();
    let (mut drafted, mut kept) = (0, 0);
    for chunk in 0..SAMPLES / 50 {
        let mut batch = BatchDecoder::new(model, &loaded.tokenizer, 2)
            .with_draft_budget(DraftBudget::Everything);
        for i in 0..50 {
            let cfg = GenerationConfig {
                eos_ids: Vec::new(),
                ..config(3, params((chunk * 50 + i) as u64 * 7_919 + 1))
            };
            batch
                .add(NewSequence {
                    prompt: prompt.clone(),
                    config: cfg,
                    drafter: Some(Box::new(FixedDrafter {
                        path: path.clone(),
                        seen: 0,
                    })),
                    logprobs: None,
                    reused: None,
                })
                .expect("joins");
        }
        while !batch.is_empty() {
            for p in batch.step().expect("a step") {
                if let Some(done) = p.finished {
                    let t = &done.tokens;
                    *seen.entry([t[0], t[1], t[2]]).or_insert(0) += 1;
                    drafted += done.speculative.drafted_tokens;
                    kept += done.speculative.accepted_tokens;
                }
            }
        }
    }
    assert!(
        kept > 0 && kept < drafted,
        "{kept} of {drafted} drafts kept"
    );
    let (stat, critical) = chi_square(&expected, &seen);
    assert!(stat < critical, "chi-square {stat:.1} ≥ {critical:.1}");
}

/// A sequence the model cannot take is refused as it joins; the others go on.
#[test]
fn a_bad_sequence_is_refused_alone() {
    let (_dir, loaded) = tiny_target("{}", 4);
    let mut batch = BatchDecoder::new(loaded.model.as_ref(), &loaded.tokenizer, 4);
    let good = prompts()[1].clone();
    let want = alone(&loaded, &good, &config(8, SamplingParams::default()));
    let id = batch
        .add(NewSequence {
            prompt: good,
            config: config(8, SamplingParams::default()),
            drafter: None,
            logprobs: None,
            reused: None,
        })
        .expect("joins");
    batch.step().expect("a step");
    for bad in [vec![], vec![1, 2, 100_000]] {
        let err = batch
            .add(NewSequence {
                prompt: bad,
                config: config(8, SamplingParams::default()),
                drafter: None,
                logprobs: None,
                reused: None,
            })
            .expect_err("refused");
        assert!(!err.to_string().is_empty());
    }
    assert_eq!(batch.len(), 1);
    let mut tokens = None;
    while !batch.is_empty() {
        for p in batch.step().expect("a step") {
            if let Some(done) = p.finished {
                assert_eq!(p.id, id);
                tokens = Some(done.tokens);
            }
        }
    }
    assert_eq!(tokens, Some(want.0));
}

/// Drafts a fixed path, as [`FixedDrafter`] does, while reading the target's states at
/// two layers as a block drafter does, recording every piece the batch hands it.
struct StatesRecorder {
    fixed: FixedDrafter,
    taps: Vec<usize>,
    states: Arc<Mutex<Vec<Array>>>,
}

impl StatesRecorder {
    fn record(&self, hidden: Option<&Array>, what: &str) -> ModelResult<()> {
        let hidden = hidden.unwrap_or_else(|| panic!("{what} came without states"));
        self.states.lock().expect("lock").push(hidden.clone());
        Ok(())
    }
}

impl Drafter for StatesRecorder {
    fn name(&self) -> &str {
        "states"
    }
    fn taps(&self) -> &[usize] {
        &self.taps
    }
    fn begin(
        &mut self,
        target: &dyn TargetModel,
        prompt: &[u32],
        hidden: Option<&Array>,
    ) -> ModelResult<()> {
        self.states.lock().expect("lock").clear();
        self.record(hidden, "the prompt")?;
        self.fixed.begin(target, prompt, hidden)
    }
    fn propose(
        &mut self,
        target: &dyn TargetModel,
        last: u32,
        max_k: usize,
        picker: &mut dyn TokenPicker,
    ) -> ModelResult<Draft> {
        self.fixed.propose(target, last, max_k, picker)
    }
    fn commit(&mut self, verified: &[u32], hidden: Option<&Array>) -> ModelResult<()> {
        self.record(hidden, "a round")?;
        self.fixed.commit(verified, hidden)
    }
}

/// A drafter that reads the target's states (DFlash, DSpark) gets, in a batch, exactly
/// the states of every position its sequence keeps, in order: the prompt's when it
/// begins, then each round's fed and kept positions. They equal, within f32 rounding,
/// the states one forward of the target over the sequence gives at the same layers;
/// with drafts kept and rejected, sequences joining mid-stream, prompts read in chunks,
/// for the dense, hybrid and mixture-of-experts targets.
#[test]
fn drafters_reading_target_states_get_every_kept_positions_states() {
    let taps = vec![1, 0];
    for (name, overrides) in targets() {
        let (_dir, loaded) = tiny_target(&overrides, 5);
        let (sequences, want) = greedy_sequences(&loaded, 12, 5);
        for (budget, join_every) in [(DraftBudget::Everything, 2), (DraftBudget::FollowLoad, 1)] {
            let recorded: Vec<Arc<Mutex<Vec<Array>>>> =
                want.iter().map(|_| Arc::default()).collect();
            let drafter = |i: usize| -> Option<Box<dyn Drafter>> {
                Some(Box::new(StatesRecorder {
                    fixed: changed_path(&want[i]),
                    taps: taps.clone(),
                    states: recorded[i].clone(),
                }))
            };
            let (got, drafts) = batched(&loaded, sequences.clone(), &drafter, budget, join_every);
            if budget == DraftBudget::Everything {
                assert!(drafts.kept > 0, "{name}: no draft was ever kept");
            }
            for (i, ((g, w), (prompt, _))) in got.iter().zip(&want).zip(&sequences).enumerate() {
                let what = format!("{name}, {budget:?}: sequence {i}");
                assert_eq!(g, w, "{what}");
                let pieces = recorded[i].lock().expect("lock");
                let states = mlx_rs::ops::concatenate(&pieces, 1).expect("concatenate");
                let held = states.shape()[1] as usize;
                let sequence: Vec<u32> = prompt.iter().chain(&w.0).copied().collect();
                assert!(
                    held + 1 >= sequence.len() && held <= sequence.len(),
                    "{what}: states of {held} positions for a sequence of {}",
                    sequence.len()
                );
                let ids = Array::from_slice(&sequence[..held], &[1, held as i32]);
                let mut cache = loaded.model.new_cache();
                let expected = loaded
                    .model
                    .forward(&ids, &mut cache, &taps)
                    .expect("forward")
                    .hidden
                    .expect("states");
                assert_eq!(states.shape(), expected.shape(), "{what}");
                let worst = max_abs_diff(&states, &expected);
                let zeros = mlx_rs::ops::zeros_like(&expected).expect("zeros");
                let largest = max_abs_diff(&expected, &zeros);
                assert!(
                    worst <= 1e-4 * largest.max(1.0),
                    "{what}: states differ by {worst} (largest {largest})"
                );
            }
        }
    }
}

/// DFlash and DSpark drafters forked for each sequence, as the server gives them: every
/// sequence gets what plain decoding gives it alone, and a taught DSpark's drafts are
/// kept.
#[test]
fn block_drafters_forked_per_sequence_keep_each_sequence_exact() {
    let (_dir, loaded) = tiny_target(r#"{"model_type": "qwen3", "head_dim": 16}"#, 7);
    let (sequences, want) = greedy_sequences(&loaded, 10, 4);
    let dflash_dir = tempfile::tempdir().expect("temp dir");
    dspec_drafters::dflash::write_random_checkpoint(dflash_dir.path(), TINY_DFLASH, 3)
        .expect("a DFlash checkpoint");
    let dspark_dir = tempfile::tempdir().expect("temp dir");
    dspec_drafters::dspark::write_random_checkpoint(dspark_dir.path(), TINY_DSPARK_QWEN3, 3)
        .expect("a DSpark checkpoint");
    // After each token of the sequences' answers, the DSpark drafter proposes the next.
    let pairs: Vec<(u32, u32)> = want[1].0.windows(2).map(|p| (p[0], p[1])).collect();
    common::teach_markov_head(dspark_dir.path(), &pairs);
    let full_precision = DrafterOptions {
        bits: Some(0),
        ..DrafterOptions::default()
    };
    for (kind, dir) in [("dflash", dflash_dir.path()), ("dspark", dspark_dir.path())] {
        let server = common::load_checkpoint_drafter(
            kind,
            dir,
            &common::read_config(dir),
            loaded.model.as_ref(),
            &full_precision,
        )
        .expect("load the drafter");
        assert!(server.forks(), "{kind}: forks");
        let drafts = forks_keep_each_sequence_exact(&loaded, &sequences, &want, &*server, kind);
        assert!(drafts.verified > 0, "{kind}: no draft was verified");
        if kind == "dspark" {
            assert!(drafts.kept > 0, "the taught DSpark drafter kept nothing");
        }
    }
}

/// Batches of `sequences`, each drafted for by a fork of `server`, joining two a step with
/// every draft verified and one a step with the budget following the load: every
/// sequence gets `want`, what plain decoding gives it alone. Returns the drafts of the
/// batch that verified every one.
fn forks_keep_each_sequence_exact(
    loaded: &LoadedModel,
    sequences: &[(Vec<u32>, GenerationConfig)],
    want: &[(Vec<u32>, String)],
    server: &dyn Drafter,
    what: &str,
) -> Drafts {
    let mut everything = None;
    for (budget, join_every) in [(DraftBudget::Everything, 2), (DraftBudget::FollowLoad, 1)] {
        let (got, drafts) = batched(
            loaded,
            sequences.to_vec(),
            &|_| server.fork(),
            budget,
            join_every,
        );
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert_eq!(g, w, "{what}, {budget:?}: sequence {i}");
        }
        everything.get_or_insert(drafts);
    }
    everything.expect("a batch with every draft verified")
}

/// A draft model (`--drafter model:DIR`) loaded once and forked for each sequence, as the
/// server does: each fork drafts on a thread of its own over the same weights, and every
/// sequence gets what plain decoding gives it alone, joining mid-stream, on the dense,
/// hybrid and mixture-of-experts targets. The target drafting for itself has every draft
/// kept; a smaller model drafting ahead has drafts rejected too.
#[test]
fn a_draft_model_forked_per_sequence_keeps_each_sequence_exact() {
    let smaller = tempfile::tempdir().expect("temp dir");
    write_tiny_model(smaller.path(), r#"{"num_hidden_layers": 1}"#, 8).expect("a draft model");
    for (name, overrides) in targets() {
        let (target_dir, loaded) = tiny_target(&overrides, 5);
        let (sequences, want) = greedy_sequences(&loaded, 12, 5);
        for (draft_dir, ahead) in [
            (target_dir.path(), DraftAhead::Off),
            (smaller.path(), DraftAhead::On),
        ] {
            let twin = draft_dir == target_dir.path();
            let options = DrafterOptions {
                draft_ahead: Some(ahead),
                ..DrafterOptions::default()
            };
            let server = common::load_draft_model(&loaded, draft_dir, &options);
            assert!(server.forks(), "{name}: a draft model forks");
            let what = format!("{name}, twin {twin}");
            let drafts =
                forks_keep_each_sequence_exact(&loaded, &sequences, &want, &*server, &what);
            assert!(drafts.verified > 0, "{what}: no draft was verified");
            if twin {
                assert_eq!(
                    drafts.kept, drafts.verified,
                    "{what}: the twin is always right"
                );
            } else {
                assert!(drafts.kept < drafts.verified, "{what}: nothing rejected");
            }
        }
    }
}

/// Sampled sequences drafted for by forks of the target's own model as draft model: each
/// fork draws its drafts from the target's distribution with its sequence's sampler, so
/// a batched round weighing them by it keeps every one.
#[test]
fn sampled_drafts_of_forked_draft_models_are_weighed_by_their_distribution() {
    let (dir, loaded) = tiny_target("{}", 3);
    let server = common::load_draft_model(&loaded, dir.path(), &DrafterOptions::default());
    let (drafted, kept) = sampled_drafts_kept(&loaded, 6, &|_| server.fork());
    assert!(drafted > 0, "nothing was drafted");
    assert_eq!(
        kept, drafted,
        "every draft the target's own model drew is kept"
    );
}

/// Sequences whose drafters read different layers cannot share a batch (its steps
/// return one set of states for every row).
#[test]
fn drafters_reading_other_layers_are_refused() {
    let (_dir, loaded) = tiny_target("{}", 4);
    let mut batch = BatchDecoder::new(loaded.model.as_ref(), &loaded.tokenizer, 4);
    let recorder = |taps: Vec<usize>| -> Option<Box<dyn Drafter>> {
        Some(Box::new(StatesRecorder {
            fixed: FixedDrafter {
                path: Vec::new(),
                seen: 0,
            },
            taps,
            states: Arc::default(),
        }))
    };
    let join = |batch: &mut BatchDecoder, drafter| {
        batch.add(NewSequence {
            prompt: prompts()[1].clone(),
            config: config(8, SamplingParams::default()),
            drafter,
            logprobs: None,
            reused: None,
        })
    };
    join(&mut batch, recorder(vec![0, 1])).expect("joins");
    join(&mut batch, recorder(vec![0, 1])).expect("the same layers join");
    join(&mut batch, None).expect("no drafter joins");
    let err = join(&mut batch, recorder(vec![1])).expect_err("refused");
    assert!(err.to_string().contains("same drafter"), "{err}");
    assert_eq!(batch.len(), 3);
}

/// `count` sampled sequences (each its own seed, the prompts in turn) decoded together
/// with every draft verified, each with `drafter(i)`: the drafts proposed and kept.
fn sampled_drafts_kept(
    loaded: &LoadedModel,
    count: u64,
    drafter: &dyn Fn(u64) -> Option<Box<dyn Drafter>>,
) -> (usize, usize) {
    let mut batch = BatchDecoder::new(loaded.model.as_ref(), &loaded.tokenizer, 3)
        .with_draft_budget(DraftBudget::Everything);
    for i in 0..count {
        batch
            .add(NewSequence {
                prompt: prompts()[(i % 6) as usize].clone(),
                config: config(10, params(i * 31 + 7)),
                drafter: drafter(i),
                logprobs: None,
                reused: None,
            })
            .expect("joins");
    }
    let (mut drafted, mut kept) = (0, 0);
    while !batch.is_empty() {
        for p in batch.step().expect("a step") {
            if let Some(done) = p.finished {
                drafted += done.speculative.drafted_tokens;
                kept += done.speculative.accepted_tokens;
            }
        }
    }
    (drafted, kept)
}

/// Drafts by sampling from the target itself, with the request's own sampler: its
/// drafts' distributions are the target's, so a round that weighs each draft by the
/// distribution it was drawn from keeps every one.
struct SampledTwin {
    sequence: Vec<u32>,
}

impl Drafter for SampledTwin {
    fn name(&self) -> &str {
        "sampled twin"
    }
    fn begin(&mut self, _: &dyn TargetModel, prompt: &[u32], _: Option<&Array>) -> ModelResult<()> {
        self.sequence = prompt.to_vec();
        Ok(())
    }
    fn propose(
        &mut self,
        target: &dyn TargetModel,
        last: u32,
        max_k: usize,
        picker: &mut dyn TokenPicker,
    ) -> ModelResult<Draft> {
        let mut cache = target.new_cache();
        let ids: Vec<u32> = self.sequence.iter().copied().chain([last]).collect();
        let mut logits = target
            .forward(
                &Array::from_slice(&ids, &[1, ids.len() as i32]),
                &mut cache,
                &[],
            )?
            .logits;
        let mut draft = Draft::default();
        for _ in 0..max_k {
            let n = logits.shape()[1];
            let row = mlx_rs::ops::indexing::TryIndexOp::try_index(&logits, (0, n - 1..n, ..))?;
            let picked = picker.pick(&row)?;
            let token = picked.tokens[0];
            draft.extend(picked)?;
            logits = target
                .forward(&Array::from_slice(&[token], &[1, 1]), &mut cache, &[])?
                .logits;
        }
        Ok(draft)
    }
    fn commit(&mut self, verified: &[u32], _: Option<&Array>) -> ModelResult<()> {
        self.sequence.extend_from_slice(verified);
        Ok(())
    }
}

/// A batched round weighs each sampled draft by the distribution the drafter drew it
/// from (the drafter's q), not as a certain proposal: a drafter whose q is the target's
/// own has every draft kept.
#[test]
fn sampled_drafts_are_weighed_by_the_distribution_they_came_from() {
    let (_dir, loaded) = tiny_target("{}", 3);
    let twin = |_| -> Option<Box<dyn Drafter>> {
        Some(Box::new(SampledTwin {
            sequence: Vec::new(),
        }))
    };
    let (drafted, kept) = sampled_drafts_kept(&loaded, 8, &twin);
    assert!(drafted > 0, "nothing was drafted");
    assert_eq!(
        kept, drafted,
        "every draft the target's own sampler drew is kept"
    );
}
