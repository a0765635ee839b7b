//! `dspec train-drafter` on tiny targets: training's forward is inference's, the loss
//! falls, a trained drafter keeps drafts with output equal to plain decoding, and a
//! resumed run equals an uninterrupted one.

mod common;

use std::path::Path;
use std::process::Command;

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use common::{load_checkpoint_drafter, max_abs_diff, read_config, tiny_target, Argmax};
use dspec_engine::training::batch::{predicted_rows, prepare, Anchored};
use dspec_engine::training::checkpoint::write_drafter;
use dspec_engine::training::data::Example;
use dspec_engine::training::net::{block_hidden, initial_params};
use dspec_engine::training::objective::dspark_logits;
use dspec_engine::training::spec::{drafter_spec, target_config, DrafterKind, DrafterSpec};
use dspec_engine::training::trainer::{fit_fc_to_taps, frozen_tensors, logits_per_pass};
use dspec_plugin_api::DrafterOptions;

/// Random tokens of the tiny byte-level vocabulary (bytes only).
fn random_tokens(rng: &mut ChaCha8Rng, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(32..127)).collect()
}

/// The drafter's logits at its anchors as training computes them (every anchor of two
/// sequences at once) equal what the drafter loaded from the written checkpoint drafts
/// there: every block
/// row for DFlash; for DSpark the first row, whose Markov input (the anchor token) is the
/// same in training and inference (later rows follow drafted tokens there).
fn training_matches_inference(kind: DrafterKind) {
    let (dir, loaded) = tiny_target(r#"{"model_type": "qwen3", "head_dim": 16}"#, 5);
    let (_, common) = target_config(dir.path()).unwrap();
    let spec = drafter_spec(kind, &common, "float32", 2, 6, vec![0, 1]).unwrap();
    let mut params = initial_params(&spec.shape.tensors(), 11);
    // Every weight away from its initial value (norms from one, the Markov head from
    // zero), so one read under the wrong name shows.
    let mut rng = ChaCha8Rng::seed_from_u64(2);
    for p in params.values_mut() {
        let shape = p.shape().to_vec();
        let n: i32 = shape.iter().product();
        let values: Vec<f32> = (0..n).map(|_| rng.random_range(-0.5..0.5)).collect();
        *p = p.add(Array::from_slice(&values, &shape)).unwrap();
    }
    let target = loaded.model.as_ref();
    let out = tempfile::tempdir().unwrap();
    let frozen = match kind {
        DrafterKind::Dflash => Vec::new(),
        DrafterKind::Dspark => frozen_tensors(target, &spec).unwrap(),
    };
    write_drafter(out.path(), &spec.config, &params, &frozen, Dtype::Float32).unwrap();

    // Two sequences in one pass: of different lengths (so the shorter one's context is
    // padded) and with different numbers of blocks (so it gets a padding block).
    let sequences = [
        (random_tokens(&mut rng, 20), vec![3, 9, 16]),
        (random_tokens(&mut rng, 13), vec![5, 11]),
    ];
    let examples: Vec<Example> = sequences
        .iter()
        .map(|(tokens, _)| Example {
            tokens: tokens.clone(),
            first_label: 1,
            soft: false,
            line: 1,
        })
        .collect();
    let anchored: Vec<Anchored> = examples
        .iter()
        .zip(&sequences)
        .map(|(example, (_, anchors))| Anchored {
            example,
            anchors: anchors.clone(),
        })
        .collect();
    let prepared = prepare(target, &spec.taps, &anchored, &spec.layout, 7.0, false).unwrap();
    let rows = predicted_rows(
        &block_hidden(&params, &spec.shape, &prepared.inputs).unwrap(),
        &spec.layout,
    )
    .unwrap();
    let (trained, compared) = match kind {
        DrafterKind::Dflash => (target.lm_head(&rows).unwrap(), spec.layout.predicted()),
        DrafterKind::Dspark => (
            dspark_logits(&params, &rows, &prepared.previous, target)
                .unwrap()
                .0,
            1,
        ),
    };
    let per_block = spec.layout.predicted();
    let blocks = prepared.inputs.anchors[0].len();

    let config = read_config(out.path());
    let options = DrafterOptions {
        bits: Some(0),
        ..DrafterOptions::default()
    };
    for (s, (tokens, anchors)) in sequences.iter().enumerate() {
        for (n, &anchor) in anchors.iter().enumerate() {
            let mut drafter =
                load_checkpoint_drafter(kind.name(), out.path(), &config, target, &options)
                    .unwrap();
            let prefix = Array::from_slice(&tokens[..anchor as usize], &[1, anchor]);
            let mut cache = target.new_cache();
            let hidden = target
                .forward(&prefix, &mut cache, &spec.taps)
                .unwrap()
                .hidden;
            drafter
                .begin(target, &tokens[..anchor as usize], hidden.as_ref())
                .unwrap();
            let mut picker = Argmax::default();
            drafter
                .propose(
                    target,
                    tokens[anchor as usize],
                    per_block as usize,
                    &mut picker,
                )
                .unwrap();
            let inferred = concatenate(&picker.logits, 0).unwrap();
            let inferred = inferred
                .reshape(&[-1, inferred.shape()[inferred.ndim() - 1]])
                .unwrap()
                .try_index(..compared)
                .unwrap();
            let start = (s * blocks + n) as i32 * per_block;
            let ours = trained.try_index(start..start + compared).unwrap();
            let diff = max_abs_diff(&ours, &inferred);
            assert!(
                diff < 1e-4,
                "sequence {s}, anchor {anchor}: logits differ by {diff}"
            );
        }
    }
    // The padding block weighs nothing; every real prediction inside its sequence weighs.
    let weights: Vec<f32> = prepared.weights.as_slice().to_vec();
    let padding = (blocks + 2) * per_block as usize;
    assert!(weights[padding..padding + per_block as usize]
        .iter()
        .all(|&w| w == 0.0));
    assert!(weights[..per_block as usize].iter().all(|&w| w > 0.0));
}

/// A fresh drafter's `fc` takes each tap channel at unit RMS over the first example.
#[test]
fn a_fresh_drafter_takes_each_tap_channel_at_unit_scale() {
    let (dir, loaded) = tiny_target("{}", 6);
    let (_, common) = target_config(dir.path()).unwrap();
    let taps = vec![0, 1];
    let spec = drafter_spec(DrafterKind::Dflash, &common, "float32", 1, 4, taps.clone()).unwrap();
    let mut params = initial_params(&spec.shape.tensors(), 1);
    let fresh_fc = params.get("fc.weight").unwrap().clone();
    let tokens = random_tokens(&mut ChaCha8Rng::seed_from_u64(3), 24);
    let example = Example {
        tokens: tokens.clone(),
        first_label: 1,
        soft: true,
        line: 1,
    };
    let target = loaded.model.as_ref();
    fit_fc_to_taps(&mut params, target, &spec, &[example]).unwrap();

    let mut cache = target.new_cache();
    let out = target
        .forward(&Array::from_slice(&tokens, &[1, 24]), &mut cache, &taps)
        .unwrap();
    let states = out.hidden.unwrap().reshape(&[24, -1]).unwrap();
    let rms = states
        .square()
        .unwrap()
        .mean_axis(0, false)
        .unwrap()
        .sqrt()
        .unwrap();
    let fitted = params.get("fc.weight").unwrap().multiply(&rms).unwrap();
    assert!(max_abs_diff(&fitted, &fresh_fc) < 1e-3);
}

#[test]
fn dflash_training_blocks_are_the_inference_drafters_blocks() {
    training_matches_inference(DrafterKind::Dflash);
}

#[test]
fn dspark_training_blocks_are_the_inference_drafters_blocks() {
    training_matches_inference(DrafterKind::Dspark);
}

fn dspec(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_dspec"))
        .args(args)
        .output()
        .expect("run dspec")
}

fn path(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

/// Prompt lines of random printable text, and the same prompts as a bench prompts file.
fn prompts(rng: &mut ChaCha8Rng, n: usize) -> (String, String) {
    let mut jsonl = String::new();
    let mut plain = String::new();
    for _ in 0..n {
        let len = rng.random_range(4..12);
        let text: String = (0..len)
            .map(|_| rng.random_range(b'a'..=b'z') as char)
            .collect();
        jsonl.push_str(&serde_json::json!({ "prompt": text }).to_string());
        jsonl.push('\n');
        plain.push_str(&text);
        plain.push('\n');
    }
    (jsonl, plain)
}

/// τ and whether every output equalled plain greedy, from `dspec bench --json`.
fn bench_tau(target: &Path, drafter: &Path, prompts: &Path) -> (f64, bool) {
    let bench = dspec(&[
        "bench",
        "--target",
        path(target),
        "--drafter",
        path(drafter),
        "--prompts",
        path(prompts),
        "--no-chat-template",
        "--max-tokens",
        "48",
        "--passes",
        "1",
        "--json",
    ]);
    assert!(
        bench.status.success(),
        "{}",
        String::from_utf8_lossy(&bench.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&bench.stdout).unwrap();
    let report = &report["report"];
    (
        report["tau"].as_f64().unwrap(),
        report["all_identical"].as_bool().unwrap(),
    )
}

/// Trained on a tiny target's own answers to prompts, a drafter keeps drafts on
/// held-out prompts where an untrained one keeps almost none, and speculative output
/// stays plain greedy's. (A random target's continuations are hard to foresee: these
/// drafters reach τ 1.1–1.2 on held-out prompts, not more; see docs/train-drafter.md.)
fn a_trained_drafter_keeps_drafts_on_held_out_prompts(kind: DrafterKind) {
    let target = tempfile::tempdir().unwrap();
    dspec_engine::tiny_model::write_tiny_model(target.path(), "{}", 3).unwrap();
    let work = tempfile::tempdir().unwrap();
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let (train, _) = prompts(&mut rng, 120);
    let (_, held_out) = prompts(&mut rng, 8);
    let data = work.path().join("train.jsonl");
    std::fs::write(&data, train).unwrap();
    let held = work.path().join("held_out.txt");
    std::fs::write(&held, held_out).unwrap();
    let run = |out: &Path, steps: &str, lr: &str| {
        let trained = dspec(&[
            "train-drafter",
            "--target",
            path(target.path()),
            "--kind",
            kind.name(),
            "--data",
            path(&data),
            "--out",
            path(out),
            "--steps",
            steps,
            "--layers",
            "1",
            "--block-size",
            "8",
            "--seed",
            "0",
            "--no-chat-template",
            "--answer-tokens",
            "48",
            "--batch-tokens",
            "256",
            "--anchors",
            "16",
            "--lr",
            lr,
        ]);
        assert!(
            trained.status.success(),
            "{}",
            String::from_utf8_lossy(&trained.stderr)
        );
    };
    let out = work.path().join("drafter");
    run(&out, "300", "3e-3");
    let log = std::fs::read_to_string(out.join("training/log.jsonl")).unwrap();
    let losses: Vec<f64> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v["loss"].as_f64())
        .collect();
    assert_eq!(losses.len(), 300);
    // Each step says where its time went: the target's forwards, and the drafter's
    // forward, backward and update.
    for line in log.lines().filter(|l| l.contains("\"loss\"")) {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        for part in ["target_seconds", "drafter_seconds"] {
            assert!(
                v[part].as_f64().is_some_and(|s| s > 0.0),
                "{part} in {line}"
            );
        }
    }
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    assert!(
        mean(&losses[280..]) < 0.75 * mean(&losses[..20]),
        "the loss did not fall: {:?} … {:?}",
        &losses[..5],
        &losses[295..]
    );
    // One step at a negligible rate: the drafter as initialised.
    let untrained = work.path().join("untrained");
    std::fs::create_dir_all(&untrained).unwrap();
    std::fs::copy(out.join("answers.jsonl"), untrained.join("answers.jsonl")).unwrap();
    run(&untrained, "1", "1e-9");

    let (tau, identical) = bench_tau(target.path(), &out, &held);
    let (tau_untrained, identical_untrained) = bench_tau(target.path(), &untrained, &held);
    assert!(identical && identical_untrained);
    assert!(
        tau_untrained < 1.03,
        "an untrained drafter kept drafts: τ {tau_untrained}"
    );
    eprintln!(
        "{}: τ {tau} on held-out prompts, untrained {tau_untrained}",
        kind.name()
    );
    assert!(
        tau > tau_untrained + 0.06,
        "τ {tau} on held-out prompts, untrained {tau_untrained}"
    );
}

#[test]
fn a_trained_dflash_drafter_keeps_drafts_on_held_out_prompts() {
    a_trained_drafter_keeps_drafts_on_held_out_prompts(DrafterKind::Dflash);
}

#[test]
fn a_trained_dspark_drafter_keeps_drafts_on_held_out_prompts() {
    a_trained_drafter_keeps_drafts_on_held_out_prompts(DrafterKind::Dspark);
}

/// The drafter the training tests train: DFlash, one layer, block 6, taps 0 and 1.
fn small_spec(loaded: &dspec_engine::loading::LoadedModel) -> DrafterSpec {
    let (_, common) = target_config(&loaded.dir).unwrap();
    drafter_spec(DrafterKind::Dflash, &common, "float32", 1, 6, vec![0, 1]).unwrap()
}

/// Trains `steps` steps of [`small_spec`] on `examples` into `out`, stopping after
/// `stop_after` when given, with the tests' options changed by `adjust`.
fn train_into(
    loaded: &dspec_engine::loading::LoadedModel,
    examples: &[Example],
    out: &Path,
    steps: usize,
    stop_after: Option<usize>,
    resume: bool,
    adjust: impl Fn(&mut dspec_engine::training::trainer::TrainOptions),
) {
    use dspec_engine::training::trainer::{train, Length, TrainOptions};
    let spec = small_spec(loaded);
    let mut options = TrainOptions {
        out: out.to_path_buf(),
        length: Length::Steps(steps),
        lr: 3e-3,
        warmup_share: 0.1,
        batch_tokens: 40,
        anchors: 4,
        gamma: 7.0,
        clip: 1.0,
        weight_decay: 0.01,
        seed: 4,
        resume,
        eval_every: 1000,
        eval_tokens: 8,
        logits_per_pass: logits_per_pass(),
        settings: serde_json::Map::new(),
    };
    adjust(&mut options);
    let stop = |step: usize| stop_after == Some(step);
    train(loaded, &spec, examples, &[], &options, &mut |_| {}, &stop).unwrap();
}

fn saved_params(out: &Path) -> std::collections::HashMap<String, Array> {
    Array::load_safetensors(out.join("training/params.safetensors")).unwrap()
}

/// A run stopped after 6 steps and resumed to 12 ends with the weights of a run of 12
/// steps at once: the data order, the anchors and the optimizer's moments all resume.
#[test]
fn a_resumed_run_equals_an_uninterrupted_one() {
    let (_dir, loaded) = tiny_target("{}", 6);
    let mut rng = ChaCha8Rng::seed_from_u64(1);
    let examples: Vec<Example> = (0..8)
        .map(|i| Example {
            tokens: random_tokens(&mut rng, 16 + i),
            first_label: 1,
            soft: i % 2 == 0,
            line: i + 1,
        })
        .collect();
    let whole = tempfile::tempdir().unwrap();
    train_into(&loaded, &examples, whole.path(), 12, None, false, |_| {});
    let parts = tempfile::tempdir().unwrap();
    train_into(&loaded, &examples, parts.path(), 12, Some(6), false, |_| {});
    let halfway = saved_params(parts.path());
    // Read now: loaded arrays are read from the file lazily, and the file is rewritten.
    mlx_rs::transforms::eval(halfway.values()).unwrap();
    // A step logged after the last save (a run killed outright) is dropped on resume:
    // it runs again.
    let log_path = parts.path().join("training/log.jsonl");
    let mut log = std::fs::read_to_string(&log_path).unwrap();
    log.push_str("{\"step\": 7, \"loss\": 1.0}\n");
    std::fs::write(&log_path, log).unwrap();
    train_into(&loaded, &examples, parts.path(), 12, None, true, |_| {});
    // The resumed run took steps 7 to 12 only: six and six lines in the log.
    let log = std::fs::read_to_string(parts.path().join("training/log.jsonl")).unwrap();
    let steps: Vec<u64> = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["step"].as_u64())
        .collect();
    assert_eq!(steps, (1..=12).collect::<Vec<u64>>());
    let (a, b) = (saved_params(whole.path()), saved_params(parts.path()));
    assert_eq!(a.len(), b.len());
    for (name, value) in &a {
        let diff = max_abs_diff(value, &b[name]);
        assert!(diff < 1e-6, "{name} differs by {diff}");
        assert!(
            max_abs_diff(value, &halfway[name]) > 0.0 || name.ends_with("norm.weight"),
            "{name} did not change after the stop"
        );
    }
}

/// A step whose sequences run one pass each ends where one pass of them all ends: the
/// passes' gradients add up to the step's.
#[test]
fn a_step_in_several_passes_equals_one_pass() {
    let (_dir, loaded) = tiny_target("{}", 6);
    let mut rng = ChaCha8Rng::seed_from_u64(8);
    let examples: Vec<Example> = (0..8)
        .map(|i| Example {
            tokens: random_tokens(&mut rng, 12 + 3 * i),
            first_label: 1 + i % 3,
            soft: i % 2 == 0,
            line: i + 1,
        })
        .collect();
    // Steps of about four sequences, of both kinds of labels.
    let passes = |logits_per_pass: usize| {
        move |o: &mut dspec_engine::training::trainer::TrainOptions| {
            o.batch_tokens = 100;
            o.logits_per_pass = logits_per_pass;
        }
    };
    let one = tempfile::tempdir().unwrap();
    train_into(
        &loaded,
        &examples,
        one.path(),
        4,
        None,
        false,
        passes(usize::MAX),
    );
    let several = tempfile::tempdir().unwrap();
    train_into(
        &loaded,
        &examples,
        several.path(),
        4,
        None,
        false,
        passes(1),
    );
    let (a, b) = (saved_params(one.path()), saved_params(several.path()));
    // Where both runs started: fresh weights, `fc` fitted to the first example's taps.
    let spec = small_spec(&loaded);
    let mut fresh = initial_params(&spec.shape.tensors(), 4);
    fit_fc_to_taps(&mut fresh, loaded.model.as_ref(), &spec, &examples).unwrap();
    for (name, value) in &a {
        let diff = max_abs_diff(value, &b[name]);
        assert!(diff < 1e-5, "{name} differs by {diff}");
        let moved = max_abs_diff(value, &fresh[name.as_str()]);
        assert!(
            moved > 1e-4 || name.ends_with("norm.weight"),
            "{name} did not train"
        );
    }
}

/// Bad flags and bad data are refused before any training, naming the flag or the
/// file and line, with what is expected.
#[test]
fn bad_flags_and_bad_data_get_clear_errors() {
    let target = tempfile::tempdir().unwrap();
    dspec_engine::tiny_model::write_tiny_model(target.path(), "{}", 3).unwrap();
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("train.jsonl");
    std::fs::write(&data, "{\"prompt\": \"abc\"}\n{\"prompt\": 42}\n").unwrap();
    let good = work.path().join("good.jsonl");
    std::fs::write(&good, "{\"text\": \"abcdefgh\"}\n").unwrap();
    let out = work.path().join("out");
    let refused = |extra: &[&str], data: &Path| -> String {
        let mut args = vec![
            "train-drafter",
            "--target",
            path(target.path()),
            "--kind",
            "dflash",
            "--data",
            path(data),
            "--out",
            path(&out),
            "--steps",
            "2",
        ];
        args.extend_from_slice(extra);
        let run = dspec(&args);
        assert!(!run.status.success(), "{extra:?} was accepted");
        String::from_utf8_lossy(&run.stderr).into_owned()
    };
    let bad_line = refused(&[], &data);
    assert!(
        bad_line.contains("train.jsonl:2") && bad_line.contains("\"prompt\""),
        "{bad_line}"
    );
    // Ranges are checked as the flags are parsed (exit 2, as for every command).
    for (flag, value, range) in [
        ("--lr", "0", "above 0 and at most 1"),
        ("--block-size", "1", "2 to 64"),
        ("--anchors", "0", "1 to 4096"),
        ("--temperature", "5", "from 0 and at most 2"),
        ("--clip", "-1", "from 0 and at most 1000000"),
    ] {
        let message = refused(&[&format!("{flag}={value}")], &good);
        assert!(
            message.contains(flag) && message.contains(range),
            "{flag} {value}: {message}"
        );
    }
    let message = refused(&["--taps", "0,99"], &good);
    assert!(
        message.contains("--taps: layer 99 is past the target's 2 layers"),
        "{message}"
    );
    let message = refused(&["--resume"], &good);
    assert!(
        message.contains("--resume") && message.contains("state.json"),
        "{message}"
    );
}

/// Ctrl-C while training ends the run after its current step, saved, with a message
/// saying how to go on; `--resume` then finishes it, every step logged once.
#[test]
fn an_interrupted_run_is_saved_and_resumes_where_it_stopped() {
    let target = tempfile::tempdir().unwrap();
    dspec_engine::tiny_model::write_tiny_model(target.path(), "{}", 3).unwrap();
    let work = tempfile::tempdir().unwrap();
    let data = work.path().join("text.jsonl");
    let mut rng = ChaCha8Rng::seed_from_u64(5);
    let lines: String = (0..16)
        .map(|_| {
            let text: String = (0..40)
                .map(|_| rng.random_range(b'a'..=b'z') as char)
                .collect();
            format!("{}\n", serde_json::json!({ "text": text }))
        })
        .collect();
    std::fs::write(&data, lines).unwrap();
    let out = work.path().join("drafter");
    let steps = 200;
    let args = |resume: bool| {
        let mut a = vec![
            "train-drafter".to_string(),
            "--target".into(),
            path(target.path()).into(),
            "--kind".into(),
            "dflash".into(),
            "--data".into(),
            path(&data).into(),
            "--out".into(),
            path(&out).into(),
            "--steps".into(),
            steps.to_string(),
            "--layers".into(),
            "1".into(),
            "--block-size".into(),
            "4".into(),
            "--batch-tokens".into(),
            "64".into(),
            "--anchors".into(),
            "4".into(),
        ];
        if resume {
            a.push("--resume".into());
        }
        a
    };
    let log = out.join("training/log.jsonl");
    let logged_steps = || -> Vec<u64> {
        std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()?["step"].as_u64())
            .collect()
    };
    let child = Command::new(env!("CARGO_BIN_EXE_dspec"))
        .args(args(false))
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while logged_steps().len() < 3 {
        assert!(started.elapsed().as_secs() < 120, "no steps logged");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY: sends SIGINT to the child this test spawned.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let stopped = child.wait_with_output().unwrap();
    let message = String::from_utf8_lossy(&stopped.stderr);
    assert!(
        !stopped.status.success(),
        "the run was not interrupted: {message}"
    );
    assert!(
        message.contains("interrupted after step") && message.contains("--resume"),
        "{message}"
    );
    let done = logged_steps();
    assert!(
        done.len() < steps,
        "{} steps ran before the interrupt",
        done.len()
    );
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("training/state.json")).unwrap())
            .unwrap();
    assert_eq!(state["step"].as_u64(), done.last().copied());

    let resumed = dspec(&args(true).iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    assert_eq!(logged_steps(), (1..=steps as u64).collect::<Vec<_>>());
}
