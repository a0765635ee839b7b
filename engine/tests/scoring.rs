//! Scoring on tiny random models: every measure against a naive full-softmax in f64
//! over the model's own full-sequence logits, logprob against rolling, windowed
//! against one pass, BOS conditioning, the result cache, and bad requests.

mod common;

use mlx_rs::{Array, Dtype};

use dspec_engine::loading::LoadedModel;
use dspec_engine::scoring::{Scorer, Variant, Windowing};
use dspec_plugin_api::TargetModel;

use common::tiny_target;

const TEXT: &str = "The quick brown fox jumps over the lazy dog; then it naps in the sun.";

fn scorer(loaded: LoadedModel, window: Option<usize>, stride: Option<usize>) -> Scorer {
    let windowing =
        Windowing::new(window, stride, loaded.model.info().max_context).expect("valid windowing");
    Scorer::new(loaded, None, windowing)
}

/// Log-softmax rows in f64 of the model's logits for `ids` in one forward pass.
fn naive_logprobs(model: &dyn TargetModel, ids: &[u32]) -> Vec<Vec<f64>> {
    let mut cache = model.new_cache();
    let tokens = Array::from_slice(ids, &[1, ids.len() as i32]);
    let logits = model
        .forward(&tokens, &mut cache, &[])
        .expect("forward")
        .logits
        .as_dtype(Dtype::Float32)
        .expect("cast");
    logits.eval().expect("eval");
    let flat = logits.as_slice::<f32>();
    let vocab = flat.len() / ids.len();
    flat.chunks(vocab)
        .map(|row| {
            let row: Vec<f64> = row.iter().map(|&x| x as f64).collect();
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let norm = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
            row.iter().map(|x| x - norm).collect()
        })
        .collect()
}

/// `log p(ids[t] | ids[..t])` for t ≥ 1, naively.
fn naive_targets(model: &dyn TargetModel, ids: &[u32]) -> Vec<f64> {
    let rows = naive_logprobs(model, ids);
    (1..ids.len())
        .map(|t| rows[t - 1][ids[t] as usize])
        .collect()
}

fn byte_ids(text: &str) -> Vec<u32> {
    // The tiny tokenizer has one token per byte and no BOS.
    text.bytes().map(u32::from).collect()
}

fn assert_close(what: &str, got: &[f64], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol, "{what}[{i}]: {g} vs {w}");
    }
}

#[test]
fn every_measure_equals_a_naive_f64_softmax_of_the_full_sequence_logits() {
    let (_dir, loaded) = tiny_target("{}", 11);
    let mut s = scorer(loaded, None, None);

    let rolling = s.rolling(TEXT, Variant::Base).expect("rolling");
    let ids = byte_ids(TEXT);
    let want = naive_targets(s.model(), &ids);
    let got: Vec<f64> = rolling.tokens.iter().map(|t| t.logprob).collect();
    assert_close("rolling", &got, &want, 1e-4);
    assert!(!rolling.conditioned_on_bos);
    assert_eq!(
        rolling.count,
        ids.len() - 1,
        "no BOS: the first token is not scored"
    );
    assert_eq!(
        rolling.tokens.iter().map(|t| t.id).collect::<Vec<_>>(),
        ids[1..]
    );
    let total: f64 = want.iter().sum();
    assert!((rolling.total - total).abs() < 1e-3);
    let ppl = (-total / want.len() as f64).exp();
    assert!((rolling.perplexity.expect("perplexity") - ppl).abs() / ppl < 1e-4);

    let (prompt, completion) = ("The quick brown ", "fox jumps");
    let logprob = s
        .logprob(prompt, completion, Variant::Base)
        .expect("logprob");
    let ids = byte_ids(&format!("{prompt}{completion}"));
    let want = &naive_targets(s.model(), &ids)[prompt.len() - 1..];
    let got: Vec<f64> = logprob.tokens.iter().map(|t| t.logprob).collect();
    assert_close("logprob", &got, want, 1e-4);
    assert_eq!(logprob.prompt_tokens, prompt.len());
    assert!((logprob.sum - want.iter().sum::<f64>()).abs() < 1e-3);

    let next = s.next_token(prompt, 5, Variant::Base).expect("next-token");
    let ids = byte_ids(prompt);
    let row = naive_logprobs(s.model(), &ids).pop().expect("last row");
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|a, b| row[*b].total_cmp(&row[*a]));
    assert_eq!(
        next.top.iter().map(|t| t.id as usize).collect::<Vec<_>>(),
        order[..5]
    );
    for t in &next.top {
        assert!((t.logprob - row[t.id as usize]).abs() < 1e-4);
        assert!((t.prob - t.logprob.exp()).abs() < 1e-12);
    }
    let top_mass: f64 = order[..5].iter().map(|&i| row[i].exp()).sum();
    let tail = next.tail_mass.expect("k < vocab has a tail");
    assert!(
        (tail - (1.0 - top_mass)).abs() < 1e-5,
        "{tail} vs {}",
        1.0 - top_mass
    );
    assert_eq!(next.vocab_size, row.len());
    assert_eq!(next.context_tokens, ids.len());

    // k covering the vocabulary lists every token and has no tail (as the seed does).
    let all = s
        .next_token(prompt, row.len() + 10, Variant::Base)
        .expect("next-token over the whole vocabulary");
    assert_eq!(all.top.len(), row.len());
    assert_eq!(all.tail_mass, None);
    let mass: f64 = all.top.iter().map(|t| t.prob).sum();
    assert!((mass - 1.0).abs() < 1e-5, "{mass}");
}

#[test]
fn logprob_of_a_completion_is_the_sum_of_the_matching_rolling_logprobs() {
    let (_dir, loaded) = tiny_target("{}", 12);
    // A small window makes both measures go through several windows.
    let mut s = scorer(loaded, Some(24), Some(8));
    let (prompt, completion) = (
        "The quick brown fox jumps over ",
        "the lazy dog; then it naps.",
    );
    let logprob = s
        .logprob(prompt, completion, Variant::Base)
        .expect("logprob");
    let rolling = s
        .rolling(&format!("{prompt}{completion}"), Variant::Base)
        .expect("rolling");
    // Rolling scores tokens 1.. (no BOS); the completion starts at token len(prompt).
    let matching = &rolling.tokens[prompt.len() - 1..];
    assert_eq!(matching.len(), logprob.tokens.len());
    for (r, l) in matching.iter().zip(&logprob.tokens) {
        assert_eq!(
            (r.id, r.logprob),
            (l.id, l.logprob),
            "same token, same window"
        );
    }
    let sum: f64 = matching.iter().map(|t| t.logprob).sum();
    assert!((logprob.sum - sum).abs() < 1e-9, "{} vs {sum}", logprob.sum);
}

#[test]
fn windowed_scoring_is_one_pass_when_it_fits_and_each_token_sees_its_window_otherwise() {
    // 700 tokens: longer than one 512-token forward chunk, within the context.
    let (_dir, loaded) = tiny_target(r#"{"max_position_embeddings": 1024}"#, 13);
    let text: String = TEXT.repeat(11)[..700].to_string();
    let ids = byte_ids(&text);
    let mut s = scorer(loaded, None, None);
    assert_eq!(s.windowing().window, 1024);
    let one_pass = s.rolling(&text, Variant::Base).expect("rolling");
    let want = naive_targets(s.model(), &ids);
    let got: Vec<f64> = one_pass.tokens.iter().map(|t| t.logprob).collect();
    assert_close("chunked single window", &got, &want, 1e-4);

    // Forced windows of 64 every 16 tokens: each token scored once, in the first window
    // reaching it, i.e. window k ≥ 1 starts at 16k and scores tokens 48+16k..64+16k.
    let model = s.model();
    let (w, stride) = (64usize, 16usize);
    let mut expected = Vec::new();
    let mut begin = 0;
    let mut scored_to = 1;
    while scored_to < ids.len() {
        let end = (begin + w).min(ids.len());
        let window = naive_targets(model, &ids[begin..end]);
        expected.extend_from_slice(&window[scored_to - begin - 1..]);
        scored_to = end;
        begin += stride;
    }
    let (_dir2, loaded2) = tiny_target(r#"{"max_position_embeddings": 1024}"#, 13);
    let mut windowed = scorer(loaded2, Some(w), Some(stride));
    let forced = windowed.rolling(&text, Variant::Base).expect("windowed");
    assert_eq!(
        forced.count,
        ids.len() - 1,
        "every token scored exactly once"
    );
    let got: Vec<f64> = forced.tokens.iter().map(|t| t.logprob).collect();
    assert_close("forced windows", &got, &expected, 1e-4);
    // The first window is the one-pass computation itself; later tokens lost context,
    // which a random model notices.
    assert_close("first window", &got[..w - 1], &want[..w - 1], 1e-4);
    let moved = got[w..]
        .iter()
        .zip(&want[w..])
        .filter(|(g, o)| (*g - *o).abs() > 1e-3);
    assert!(
        moved.count() > 0,
        "windows of {w} should change later tokens"
    );
    // The text needs one window per stride after the first.
    let windows = 1 + (ids.len() - w).div_ceil(stride);
    assert_eq!(windowed.stats().forward_passes, windows);
}

#[test]
fn a_tokenizer_with_bos_conditions_the_first_token_on_it() {
    let (dir, _) = tiny_target("{}", 14);
    let config = serde_json::json!({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>",
                                    "add_bos_token": true});
    std::fs::write(dir.path().join("tokenizer_config.json"), config.to_string())
        .expect("write tokenizer_config.json");
    let loaded = common::load_dir(dir.path());
    let bos = loaded.tokenizer.bos_token_id().expect("bos id");
    let mut s = scorer(loaded, None, None);
    let rolling = s.rolling("Hello", Variant::Base).expect("rolling");
    assert!(rolling.conditioned_on_bos);
    assert_eq!(rolling.count, 5, "every text token is scored after BOS");
    let mut ids = vec![bos];
    ids.extend(byte_ids("Hello"));
    let want = naive_targets(s.model(), &ids);
    let got: Vec<f64> = rolling.tokens.iter().map(|t| t.logprob).collect();
    assert_close("after BOS", &got, &want, 1e-4);
    // An empty prompt is fine when BOS gives the completion something to follow.
    let l = s
        .logprob("", "Hello", Variant::Base)
        .expect("logprob after BOS");
    assert_eq!(l.prompt_tokens, 1);
    assert!((l.sum - rolling.total).abs() < 1e-9);
}

#[test]
fn a_repeated_request_is_computed_once_per_run() {
    let (_dir, loaded) = tiny_target("{}", 15);
    let mut s = scorer(loaded, None, None);
    let first = s.rolling(TEXT, Variant::Base).expect("rolling");
    let after_first = s.stats();
    let again = s.rolling(TEXT, Variant::Base).expect("rolling again");
    assert_eq!(first, again);
    let stats = s.stats();
    assert_eq!(stats.computed, 1);
    assert_eq!(stats.cache_hits, 1);
    assert_eq!(stats.forward_passes, after_first.forward_passes);
    // Different parameters are a different result.
    s.next_token(TEXT, 3, Variant::Base).expect("k=3");
    s.next_token(TEXT, 4, Variant::Base).expect("k=4");
    assert_eq!(s.stats().computed, 3);
}

#[test]
fn bad_requests_are_errors_that_say_what_to_change() {
    let (_dir, loaded) = tiny_target("{}", 16);
    let max_context = loaded.model.info().max_context;
    let mut s = scorer(loaded, None, None);
    let err = |r: Result<_, dspec_engine::EngineError>| {
        r.err().map(|e| e.to_string()).unwrap_or_default()
    };
    assert!(err(s.logprob("abc", "", Variant::Base).map(|_| ())).contains("adds no tokens"));
    assert!(err(s.logprob("", "abc", Variant::Base).map(|_| ())).contains("nothing conditions"));
    assert!(err(s.next_token("abc", 0, Variant::Base).map(|_| ())).contains("at least 1"));
    assert!(err(s.rolling("abc", Variant::Adapted).map(|_| ())).contains("--lora"));
    let empty = s
        .rolling("", Variant::Base)
        .expect("an empty text scores nothing");
    assert_eq!((empty.count, empty.perplexity), (0, None));
    for (window, stride, says) in [
        (Some(1), None, "at least 2"),
        (Some(10_000), None, "exceeds the model's context"),
        (Some(16), Some(16), "--stride"),
    ] {
        let e = Windowing::new(window, stride, max_context)
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{window:?}/{stride:?}: {e}");
    }
}
