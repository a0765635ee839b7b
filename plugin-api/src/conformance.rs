//! One checker every `TargetModel` must pass (built-in families and plugins alike):
//! caching, rolling back (within what the cache says it can), taps and a share of the
//! weights on another thread must not change what the model computes, and a rollback
//! past that must fail.
//!
//! Tolerance: logits and hidden states are compared with |a−b| ≤ 1e-4 + 1e-4·max|b|
//! (f32 weights on MLX's CPU backend; the one-token and multi-token attention paths
//! differ only by float reassociation).

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{abs, concatenate, max, subtract};
use mlx_rs::Array;

use crate::cache::ModelCache;
use crate::target::TargetModel;

const ATOL: f32 = 1e-4;
const RTOL: f32 = 1e-4;

fn fail(what: &str, e: impl std::fmt::Display) -> String {
    format!("{what}: {e}")
}

fn tokens_array(tokens: &[u32]) -> Array {
    Array::from_slice(tokens, &[1, tokens.len() as i32])
}

/// Largest |a − b| and the bound it must stay under.
fn compare(a: &Array, b: &Array, what: &str) -> Result<(), String> {
    if a.shape() != b.shape() {
        return Err(format!(
            "{what}: shapes differ, {:?} vs {:?}",
            a.shape(),
            b.shape()
        ));
    }
    let a32 = a
        .as_dtype(mlx_rs::Dtype::Float32)
        .map_err(|e| fail(what, e))?;
    let b32 = b
        .as_dtype(mlx_rs::Dtype::Float32)
        .map_err(|e| fail(what, e))?;
    let diff = max(
        abs(subtract(&a32, &b32).map_err(|e| fail(what, e))?).map_err(|e| fail(what, e))?,
        None,
    )
    .map_err(|e| fail(what, e))?
    .try_item_cast::<f32>()
    .map_err(|e| fail(what, e))?;
    let scale = max(abs(&b32).map_err(|e| fail(what, e))?, None).map_err(|e| fail(what, e))?;
    let scale = scale.try_item_cast::<f32>().map_err(|e| fail(what, e))?;
    let bound = ATOL + RTOL * scale;
    // NaN differences must fail too, hence not `diff > bound`.
    if diff.is_nan() || diff > bound {
        return Err(format!(
            "{what}: max |difference| {diff:e} exceeds {bound:e} (values up to {scale})"
        ));
    }
    Ok(())
}

fn run(
    model: &dyn TargetModel,
    cache: &mut ModelCache,
    tokens: &[u32],
    taps: &[usize],
) -> Result<(Array, Option<Array>), String> {
    let out = model
        .forward(&tokens_array(tokens), cache, taps)
        .map_err(|e| fail("forward", e))?;
    Ok((out.logits, out.hidden))
}

/// A deterministic token sequence that uses ids across the vocabulary.
fn probe_tokens(vocab: usize, len: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 7919 + 13) % vocab.max(1)) as u32)
        .collect()
}

/// Runs every check on `model`; returns the first failure with what was compared.
pub fn check_target_model(model: &dyn TargetModel) -> Result<(), String> {
    let info = model.info().clone();
    let n = 12;
    let tokens = probe_tokens(info.vocab_size, n);
    let last = info.num_layers - 1;
    let taps = [0, last];

    // Reference: one forward over the whole sequence.
    let mut cache = model.new_cache();
    let (full_logits, full_hidden) = run(model, &mut cache, &tokens, &taps)?;
    if full_logits.shape() != [1, n as i32, info.vocab_size as i32] {
        return Err(format!(
            "logits shape {:?}, expected [1, {n}, {}]",
            full_logits.shape(),
            info.vocab_size
        ));
    }
    if cache.offset() != n {
        return Err(format!(
            "cache holds {} positions after a {n}-token forward",
            cache.offset()
        ));
    }
    let full_hidden = full_hidden.ok_or("forward with taps returned no hidden states")?;
    if full_hidden.shape() != [1, n as i32, (taps.len() * info.hidden_size) as i32] {
        return Err(format!(
            "taps shape {:?}, expected [1, {n}, {}]",
            full_hidden.shape(),
            taps.len() * info.hidden_size
        ));
    }

    // The last layer's tap is the final pre-norm hidden state: norm + head reproduce the logits.
    let h = info.hidden_size as i32;
    let last_tap = full_hidden
        .try_index((.., .., h..2 * h))
        .map_err(|e| fail("slice taps", e))?;
    let normed = model
        .final_norm(&last_tap)
        .map_err(|e| fail("final_norm", e))?;
    let relogits = model.lm_head(&normed).map_err(|e| fail("lm_head", e))?;
    compare(
        &relogits,
        &full_logits,
        "lm_head(final_norm(last tap)) vs forward logits",
    )?;

    // Embedding shape.
    let emb = model
        .embed(&tokens_array(&tokens))
        .map_err(|e| fail("embed", e))?;
    if emb.shape() != [1, n as i32, h] {
        return Err(format!(
            "embed shape {:?}, expected [1, {n}, {h}]",
            emb.shape()
        ));
    }

    // Incremental decoding in uneven chunks equals the single forward, logits and taps.
    let mut cache = model.new_cache();
    let mut logits = Vec::new();
    let mut hidden = Vec::new();
    let mut start = 0;
    for chunk in [5usize, 1, 1, 3, 1, 1] {
        let (l, hd) = run(model, &mut cache, &tokens[start..start + chunk], &taps)?;
        logits.push(l);
        hidden.push(hd.ok_or("no taps in incremental forward")?);
        start += chunk;
    }
    let inc_logits = concatenate(&logits, 1).map_err(|e| fail("concat", e))?;
    let inc_hidden = concatenate(&hidden, 1).map_err(|e| fail("concat", e))?;
    compare(
        &inc_logits,
        &full_logits,
        "incremental logits vs single forward",
    )?;
    compare(
        &inc_hidden,
        &full_hidden,
        "incremental taps vs single forward",
    )?;

    // After a forward the cache can go back as far as its window reaches (everything
    // held when nothing bounds it), and a trim past that fails and forgets nothing.
    let mut cache = model.new_cache();
    run(model, &mut cache, &tokens, &[])?;
    let limit = cache.rollback_limit();
    let window = cache.rollback_window();
    if limit < n.min(window.unwrap_or(n)) {
        return Err(format!(
            "after a {n}-token forward the cache can go back {limit} positions, less than \
             its rollback window ({window:?}) promises"
        ));
    }
    if limit < n {
        if cache.trim(limit + 1).is_ok() {
            return Err(format!(
                "trim({}) succeeded past the rollback limit {limit}",
                limit + 1
            ));
        }
        if cache.offset() != n {
            return Err(format!(
                "a refused trim changed the cache: it holds {} positions, not {n}",
                cache.offset()
            ));
        }
    }
    if cache.trim(n + 1).is_ok() {
        return Err(format!(
            "trim({}) succeeded on a cache of {n} positions",
            n + 1
        ));
    }

    // Trim then replay different tokens == never having seen the trimmed ones.
    let keep = n - (n - 7).min(limit);
    let alt: Vec<u32> = tokens[keep..]
        .iter()
        .map(|t| (t + 1) % info.vocab_size as u32)
        .collect();
    cache
        .trim(n - keep)
        .map_err(|e| fail(&format!("trim({})", n - keep), e))?;
    if cache.offset() != keep {
        return Err(format!(
            "trim({}) left the cache holding {} positions, not {keep}",
            n - keep,
            cache.offset()
        ));
    }
    let (replayed, _) = run(model, &mut cache, &alt, &[])?;
    let mut fresh_seq = tokens[..keep].to_vec();
    fresh_seq.extend(&alt);
    let mut fresh_cache = model.new_cache();
    let (fresh, _) = run(model, &mut fresh_cache, &fresh_seq, &[])?;
    let fresh_tail = fresh
        .try_index((.., keep as i32..))
        .map_err(|e| fail("slice", e))?;
    compare(
        &replayed,
        &fresh_tail,
        "logits after trim+replay vs a fresh forward",
    )?;

    check_rollback_inside_blocks(model, &tokens, window)?;
    check_share(model, &tokens)
}

/// A share of the model ([`TargetModel::share`]), moved to a thread of its own once the
/// model's forward was evaluated here, computes there what the model computes, and the
/// model computes the same afterwards.
fn check_share(model: &dyn TargetModel, tokens: &[u32]) -> Result<(), String> {
    let (expected, _) = run(model, &mut model.new_cache(), tokens, &[])?;
    expected
        .eval()
        .map_err(|e| fail("evaluate the logits", e))?;
    let Some(share) = model.share() else {
        return Ok(());
    };
    let shape = expected.shape().to_vec();
    let owned = tokens.to_vec();
    let elsewhere = std::thread::spawn(move || -> Result<Vec<f32>, String> {
        let (logits, _) = run(share.as_ref(), &mut share.new_cache(), &owned, &[])?;
        // Only host values leave the thread: its arrays belong to its stream.
        let logits = logits
            .as_dtype(mlx_rs::Dtype::Float32)
            .map_err(|e| fail("a share's logits", e))?;
        logits.eval().map_err(|e| fail("a share's logits", e))?;
        Ok(logits.as_slice::<f32>().to_vec())
    })
    .join()
    .map_err(|_| "a share's forward panicked on its thread".to_string())??;
    compare(
        &Array::from_slice(&elsewhere, &shape),
        &expected,
        "a share's logits on another thread vs the model's",
    )?;
    let (again, _) = run(model, &mut model.new_cache(), tokens, &[])?;
    compare(
        &again,
        &expected,
        "the model's logits after a share ran vs before",
    )
}

/// Rolling back inside a block of positions, whether it came one token per forward (a
/// draft model drafting) or in one forward (a verify), to each of its positions, then
/// feeding a token other than the one that was there, equals never having gone past
/// that position.
fn check_rollback_inside_blocks(
    model: &dyn TargetModel,
    tokens: &[u32],
    window: Option<usize>,
) -> Result<(), String> {
    let vocab = model.info().vocab_size as u32;
    let prefix = 5;
    let block = window.unwrap_or(4).min(4);
    // Logits after `tokens[..p]` and then a different token, for each p of the block.
    let mut expected = Vec::new();
    for p in prefix..=prefix + block {
        let mut seq = tokens[..p].to_vec();
        seq.push((tokens[p] + 1) % vocab);
        let (logits, _) = run(model, &mut model.new_cache(), &seq, &[])?;
        let last = logits
            .try_index((.., p as i32..))
            .map_err(|e| fail("slice", e))?;
        expected.push(last);
    }
    for one_at_a_time in [true, false] {
        let how = if one_at_a_time {
            "one token per forward"
        } else {
            "one forward"
        };
        for back in 0..=block {
            let mut cache = model.new_cache();
            run(model, &mut cache, &tokens[..prefix], &[])?;
            let drafted = &tokens[prefix..prefix + block];
            if one_at_a_time {
                for &t in drafted {
                    run(model, &mut cache, &[t], &[])?;
                }
            } else {
                run(model, &mut cache, drafted, &[])?;
            }
            cache
                .trim(back)
                .map_err(|e| fail(&format!("a block of {block} in {how}, trim({back})"), e))?;
            let p = prefix + block - back;
            if cache.offset() != p {
                return Err(format!(
                    "a block of {block} in {how}, trim({back}): the cache holds {} positions, not {p}",
                    cache.offset()
                ));
            }
            let (logits, _) = run(model, &mut cache, &[(tokens[p] + 1) % vocab], &[])?;
            compare(
                &logits,
                &expected[p - prefix],
                &format!(
                    "a block of {block} in {how}, rolled back {back}: logits vs a fresh forward"
                ),
            )?;
        }
    }
    Ok(())
}
