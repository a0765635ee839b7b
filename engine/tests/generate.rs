//! Plain generation against a reference without any cache: each step re-runs the whole
//! sequence and takes the argmax. The cached, pipelined loop must pick the same tokens.
//! Sampled generation (on the device, pipelined the same way) is reproducible by seed.

use mlx_rs::ops::indexing::{argmax_axis, TryIndexOp};
use mlx_rs::Array;

use dspec_engine::decoding::generate::{generate, GenerationConfig, GenerationOutput, StopReason};
use dspec_engine::decoding::sampling::SamplingParams;
use dspec_engine::error::EngineError;
use dspec_engine::loading::{builtin_registry, load_model, LoadedModel};
use dspec_engine::tiny_model::write_tiny_model;
use dspec_plugin_api::{LoadOptions, TargetModel};

fn reference_greedy(model: &dyn TargetModel, prompt: &[u32], steps: usize) -> Vec<u32> {
    let mut seq = prompt.to_vec();
    for _ in 0..steps {
        let mut cache = model.new_cache();
        let tokens = Array::from_slice(&seq, &[1, seq.len() as i32]);
        let logits = model.forward(&tokens, &mut cache, &[]).unwrap().logits;
        let last = logits.try_index((.., -1, ..)).unwrap();
        seq.push(argmax_axis(&last, -1, None).unwrap().item_cast::<u32>());
    }
    seq[prompt.len()..].to_vec()
}

/// A tiny model written with `overrides` and `seed`, loaded with the default options.
fn load_tiny(overrides: &str, seed: u64) -> (tempfile::TempDir, LoadedModel) {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), overrides, seed).unwrap();
    let loaded = load_model(
        dir.path().to_str().unwrap(),
        &builtin_registry().unwrap(),
        &LoadOptions::default(),
        false,
    )
    .unwrap();
    (dir, loaded)
}

/// Plain decoding of `prompt` under `config`, streamed pieces dropped.
fn run(
    loaded: &LoadedModel,
    prompt: &[u32],
    config: &GenerationConfig,
) -> Result<GenerationOutput, EngineError> {
    generate(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        prompt,
        config,
        &mut |_| {},
    )
}

#[test]
fn greedy_generation_equals_uncached_argmax_decoding() {
    for overrides in [
        "{}",
        r#"{"model_type": "gemma2", "head_dim": 16, "sliding_window": 6, "attn_logit_softcapping": 50.0}"#,
    ] {
        let (_dir, loaded) = load_tiny(overrides, 5);
        let prompt = loaded
            .tokenizer
            .encode_prompt("A prompt of some length", false)
            .unwrap();
        let config = GenerationConfig {
            max_tokens: 20,
            sampling: SamplingParams::default(),
            stop_strings: vec![],
            eos_ids: vec![], // never stop early: compare all 20 steps
        };
        let mut streamed = String::new();
        let out = generate(
            loaded.model.as_ref(),
            &loaded.tokenizer,
            &prompt,
            &config,
            &mut |s| streamed.push_str(s),
        )
        .unwrap();
        assert_eq!(out.stats.stop_reason, StopReason::MaxTokens);
        assert_eq!(
            out.tokens,
            reference_greedy(loaded.model.as_ref(), &prompt, 20),
            "{overrides}"
        );
        assert_eq!(streamed, out.text);
        assert_eq!(
            out.text,
            loaded.tokenizer.decode(&out.tokens, true).unwrap(),
            "streamed text is the decoded tokens"
        );
    }
}

#[test]
fn generation_stops_on_an_eos_id_without_emitting_it() {
    let (_dir, loaded) = load_tiny("{}", 5);
    let prompt = loaded.tokenizer.encode_prompt("Stop here", false).unwrap();
    let expected = reference_greedy(loaded.model.as_ref(), &prompt, 6);
    // Declare the 4th greedy token an EOS: generation must end right there.
    let config = GenerationConfig {
        max_tokens: 50,
        sampling: SamplingParams::default(),
        stop_strings: vec![],
        eos_ids: vec![expected[3]],
    };
    let out = run(&loaded, &prompt, &config).unwrap();
    let first_eos = expected.iter().position(|&t| t == expected[3]).unwrap();
    assert_eq!(out.stats.stop_reason, StopReason::Eos);
    assert_eq!(out.tokens, expected[..=first_eos].to_vec());
    assert_eq!(
        out.text,
        loaded
            .tokenizer
            .decode(&expected[..first_eos], true)
            .unwrap()
    );
}

#[test]
fn sharded_checkpoint_loads_like_a_single_file() {
    let dir = tempfile::tempdir().unwrap();
    write_tiny_model(dir.path(), "{}", 8).unwrap();
    let registry = builtin_registry().unwrap();
    let logits = |d: &std::path::Path| -> Vec<f32> {
        let loaded = load_model(
            d.to_str().unwrap(),
            &registry,
            &LoadOptions::default(),
            false,
        )
        .unwrap();
        let ids = loaded.tokenizer.encode("shards", false).unwrap();
        let mut cache = loaded.model.new_cache();
        let out = loaded
            .model
            .forward(
                &Array::from_slice(&ids, &[1, ids.len() as i32]),
                &mut cache,
                &[],
            )
            .unwrap();
        out.logits.as_slice::<f32>().to_vec()
    };
    let single = logits(dir.path());

    // Split the weights over two shards named by an index, as HF sharded checkpoints are.
    let path = dir.path().join("model.safetensors");
    let all = Array::load_safetensors(&path).unwrap();
    let mut names: Vec<&String> = all.keys().collect();
    names.sort();
    let (first, second) = names.split_at(names.len() / 2);
    let mut weight_map = serde_json::Map::new();
    for (file, part) in [
        ("model-00001-of-00002.safetensors", first),
        ("model-00002-of-00002.safetensors", second),
    ] {
        Array::save_safetensors(
            part.iter().map(|n| (n.as_str(), &all[*n])),
            None,
            dir.path().join(file),
        )
        .unwrap();
        part.iter().for_each(|n| {
            weight_map.insert(n.to_string(), file.into());
        });
    }
    std::fs::remove_file(&path).unwrap();
    let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
    std::fs::write(
        dir.path().join("model.safetensors.index.json"),
        index.to_string(),
    )
    .unwrap();
    assert_eq!(logits(dir.path()), single);

    // An index naming a shard that is not there is an error that names it.
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let err = load_model(
        dir.path().to_str().unwrap(),
        &registry,
        &LoadOptions::default(),
        false,
    )
    .err()
    .expect("missing shard");
    assert!(
        err.to_string().contains("model-00002-of-00002.safetensors"),
        "{err}"
    );
}

/// A seed fixes a sampled generation; another seed gives another one. (Its distribution
/// is checked in speculative_sampling.rs.)
#[test]
fn sampled_generation_is_reproducible_by_seed() {
    let (_dir, loaded) = load_tiny("{}", 5);
    let prompt = loaded.tokenizer.encode_prompt("Sample me", false).unwrap();
    let sample = |seed: Option<u64>, top_p: f32| {
        let config = GenerationConfig {
            max_tokens: 30,
            sampling: SamplingParams {
                temperature: 1.0,
                top_p,
                seed,
                ..SamplingParams::default()
            },
            stop_strings: vec![],
            eos_ids: vec![],
        };
        let out = run(&loaded, &prompt, &config).unwrap();
        assert_eq!(out.tokens.len(), 30);
        assert_eq!(out.stats.stop_reason, StopReason::MaxTokens);
        out.tokens
    };
    for top_p in [1.0, 0.9] {
        let first = sample(Some(1), top_p);
        assert_eq!(first, sample(Some(1), top_p), "top-p {top_p}: same seed");
        assert_ne!(first, sample(Some(2), top_p), "top-p {top_p}: another seed");
        assert_ne!(
            sample(None, top_p),
            sample(None, top_p),
            "top-p {top_p}: OS seeds"
        );
        assert_ne!(
            first,
            reference_greedy(loaded.model.as_ref(), &prompt, 30),
            "top-p {top_p}: sampling is not greedy"
        );
    }
}

/// A prompt id past the model's embedding rows (a tokenizer that knows more tokens than
/// its model) is refused with an error naming it, before anything is looked up; ids
/// within the rows generate.
#[test]
fn prompt_ids_past_the_embedding_are_refused() {
    // The tokenizer keeps its 267 tokens; the model gets 200 embedding rows.
    let (_dir, loaded) = load_tiny(r#"{"vocab_size": 200}"#, 5);
    let config = GenerationConfig {
        max_tokens: 4,
        sampling: SamplingParams::default(),
        stop_strings: vec![],
        eos_ids: vec![],
    };
    let err = run(&loaded, &[5, 250, 7], &config).unwrap_err();
    assert!(
        matches!(err, EngineError::TokenPastVocabulary { id: 250, rows: 200 }),
        "{err}"
    );
    assert!(err.to_string().contains("tokenizer"), "{err}");
    let out = run(&loaded, &[5, 199, 7], &config).unwrap();
    assert_eq!(out.tokens.len(), 4);
}
