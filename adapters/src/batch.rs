//! What the built-in families share to run several sequences in one forward
//! ([`TargetModel::forward_batch`]): the rows' checks, and their outputs from the packed
//! hidden states: logits through the final norm and head for the wanted positions
//! only, and the tap layers' states where a drafter asked for them.

use mlx_rs::ops::concatenate;
use mlx_rs::Array;

use dspec_plugin_api::error::Result;
use dspec_plugin_api::target::{check_batch_row, check_forward_args, TapCollector};
use dspec_plugin_api::{BatchRow, RowOutput, TargetModel};
use dspec_runtime::slicing::slice_axis;

/// Checks every row as a forward of its own would be checked; returns the rows' lengths
/// and their tokens embedded one after another (`[1, T, hidden]`), which the layers then
/// run as one sequence.
pub fn embedded_rows(
    model: &dyn TargetModel,
    rows: &[BatchRow<'_>],
    taps: &[usize],
    num_layers: usize,
) -> Result<(Vec<i32>, Array)> {
    let lens = rows
        .iter()
        .map(|row| {
            check_forward_args(row.tokens, row.cache, taps, num_layers)?;
            check_batch_row(row)?;
            Ok(row.tokens.shape()[1])
        })
        .collect::<Result<Vec<_>>>()?;
    let tokens: Vec<&Array> = rows.iter().map(|r| r.tokens).collect();
    Ok((lens, model.embed(&concatenate(&tokens, 1)?)?))
}

/// Each row's output from `h`, the final layer's output over the packed rows
/// (`[1, T, hidden]`, rows of `lens` positions one after another): its wanted logits,
/// and its positions of the tapped layers' outputs, side by side in an array of its
/// own (a view of the packed states would keep every row's alive as long as any row's
/// is kept). A prompt's chunk wants no logits, so a batch that reads long prompts never
/// projects them onto the vocabulary.
pub fn rows_outputs(
    model: &dyn TargetModel,
    h: &Array,
    tapped: &TapCollector,
    rows: &[BatchRow<'_>],
    lens: &[i32],
) -> Result<Vec<RowOutput>> {
    let tapped = tapped.parts();
    let mut wanted = Vec::new();
    let mut end = 0;
    for (row, &len) in rows.iter().zip(lens) {
        end += len;
        wanted.extend((end - row.logits as i32)..end);
    }
    let logits = match wanted.is_empty() {
        true => None,
        false => {
            let picked = match wanted.len() as i32 == end {
                true => h.clone(),
                false => h.take_axis(Array::from_slice(&wanted, &[wanted.len() as i32]), 1)?,
            };
            Some(model.lm_head(&model.final_norm(&picked)?)?)
        }
    };
    let (mut at, mut start) = (0, 0);
    rows.iter()
        .zip(lens)
        .map(|(row, &len)| {
            let n = row.logits as i32;
            at += n;
            start += len;
            Ok(RowOutput {
                logits: match (n, &logits) {
                    (0, _) | (_, None) => None,
                    (_, Some(l)) => Some(slice_axis(l, 1, at - n, at)?),
                },
                hidden: match tapped.is_empty() {
                    true => None,
                    false => {
                        let parts = tapped
                            .iter()
                            .map(|t| slice_axis(t, 1, start - len, start))
                            .collect::<std::result::Result<Vec<_>, _>>()?;
                        Some(concatenate(&parts, -1)?)
                    }
                },
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use mlx_rs::{Array, Dtype};

    use dspec_plugin_api::{BatchRow, KvPool, LoadOptions, ModelCache, TargetModel};

    use crate::fixtures::{
        load_dir, tiny_experts, with, write_random_model, TINY_LLAMA, TINY_QWEN3_5_OVERRIDES,
        TINY_QWEN3_NEXT_OVERRIDES,
    };

    /// One call of a schedule for one row: `tokens` more of its sequence with the logits
    /// of the last `logits` wanted, after trimming `trim` positions (a rejected draft).
    #[derive(Clone, Copy)]
    struct Call {
        trim: usize,
        tokens: usize,
        logits: usize,
    }

    const fn call(trim: usize, tokens: usize, logits: usize) -> Call {
        Call {
            trim,
            tokens,
            logits,
        }
    }

    const STEPS: usize = 7;

    /// Three sequences as a server meets them: a prompt read in one go, one read in two
    /// chunks, decode steps, verifies of several drafts, and rejected drafts trimmed;
    /// in every call the rows are at different lengths and positions. The last calls
    /// are one new token for every row (after a trim in one), as plain batched decoding
    /// runs them.
    fn schedule() -> [[Call; STEPS]; 3] {
        [
            [
                call(0, 7, 1),
                call(0, 1, 1),
                call(0, 4, 4),
                call(2, 1, 1),
                call(0, 1, 1),
                call(1, 1, 1),
                call(0, 1, 1),
            ],
            [
                call(0, 3, 1),
                call(0, 5, 5),
                call(0, 1, 1),
                call(0, 1, 1),
                call(3, 6, 6),
                call(0, 1, 1),
                call(0, 1, 1),
            ],
            [
                call(0, 9, 0),
                call(0, 6, 1),
                call(0, 1, 1),
                call(0, 3, 3),
                call(1, 1, 1),
                call(0, 1, 1),
                call(0, 1, 1),
            ],
        ]
    }

    fn sequence(row: usize) -> Vec<u32> {
        (0..40)
            .map(|i| ((i * 31 + row * 17 + 5) % 97) as u32)
            .collect()
    }

    /// Layers whose hidden states every call asks for, as a block drafter does.
    const TAPS: [usize; 2] = [1, 0];

    /// Each call's wanted logits for every row, and every row's hidden states at
    /// [`TAPS`], the rows run together through `forward_batch` (`batched`) or each
    /// alone through `forward`, the attention layers' keys and values of the last
    /// `pooled` rows in a pool per layer, the others' in caches of their own.
    fn run(
        model: &dyn TargetModel,
        batched: bool,
        pooled: usize,
    ) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        let plan = schedule();
        let sequences: Vec<Vec<u32>> = (0..3).map(sequence).collect();
        let mut caches: Vec<ModelCache> = (0..3).map(|_| model.new_cache()).collect();
        let pools: Vec<KvPool> = (0..caches[0].num_layers()).map(|_| KvPool::new()).collect();
        for (row, cache) in caches.iter_mut().enumerate() {
            cache.set_rollback_window(8);
            if row + pooled >= 3 {
                cache.join_pools(&pools).expect("join the pools");
            }
        }
        let mut at = [0usize; 3];
        let mut out = Vec::new();
        let mut states = Vec::new();
        let steps: Vec<[Call; 3]> = (0..STEPS)
            .map(|s| [plan[0][s], plan[1][s], plan[2][s]])
            .collect();
        for (step, calls) in steps.iter().enumerate() {
            let mut tokens = Vec::new();
            for (row, cache) in caches.iter_mut().enumerate() {
                let c = calls[row];
                cache.trim(c.trim).expect("trim");
                at[row] -= c.trim;
                let ids = &sequences[row][at[row]..at[row] + c.tokens];
                tokens.push(Array::from_slice(ids, &[1, c.tokens as i32]));
                at[row] += c.tokens;
            }
            let mut rows: Vec<BatchRow> = tokens
                .iter()
                .zip(caches.iter_mut())
                .enumerate()
                .map(|(row, (tokens, cache))| BatchRow {
                    tokens,
                    cache,
                    logits: calls[row].logits,
                })
                .collect();
            let outputs = match batched {
                true => model
                    .forward_batch(&mut rows, &TAPS)
                    .expect("batched forward"),
                false => rows
                    .iter_mut()
                    .map(|row| {
                        model
                            .forward_batch(std::slice::from_mut(row), &TAPS)
                            .expect("forward")
                            .remove(0)
                    })
                    .collect(),
            };
            for (row, output) in outputs.into_iter().enumerate() {
                let hidden = output.hidden.expect("hidden states at the taps");
                let width = model.info().hidden_size * TAPS.len();
                assert_eq!(
                    hidden.shape(),
                    &[1, calls[row].tokens as i32, width as i32],
                    "row {row}, call {step}: every position's tapped states"
                );
                let hidden = hidden.as_dtype(Dtype::Float32).expect("cast");
                states.push(hidden.as_slice::<f32>().to_vec());
                let wanted = calls[row].logits;
                match output.logits {
                    None => assert_eq!(wanted, 0, "row {row}, call {step}: no logits"),
                    Some(l) => {
                        assert_eq!(l.shape()[1] as usize, wanted, "row {row}, call {step}");
                        let l = l.as_dtype(Dtype::Float32).expect("cast");
                        out.push(l.as_slice::<f32>().to_vec());
                    }
                }
            }
            for (row, cache) in caches.iter().enumerate() {
                assert_eq!(
                    cache.offset(),
                    at[row],
                    "row {row}'s cache after call {step}"
                );
            }
        }
        (out, states)
    }

    /// The largest difference between two runs' values, and the largest value.
    fn worst_of(t: &[f32], a: &[f32]) -> (f32, f32) {
        let largest = a.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let worst = t
            .iter()
            .zip(a)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max);
        (worst, largest)
    }

    /// Rows run together give what each row gives alone, within f32 rounding (a product
    /// of several rows may sum in another order than one of a single row), and the same
    /// greedy tokens, for dense families (plain, a sliding window, q/k norms, a sliding
    /// window with score softcapping), mixtures of experts and the hybrids, with the
    /// sequences' keys and values in caches of their own or in shared pools.
    #[test]
    fn rows_run_together_give_what_each_gives_alone() {
        let families = [
            ("llama", TINY_LLAMA.to_string()),
            (
                "mistral",
                with(
                    TINY_LLAMA,
                    r#"{"model_type": "mistral", "sliding_window": 5}"#,
                ),
            ),
            (
                "qwen3",
                with(TINY_LLAMA, r#"{"model_type": "qwen3", "head_dim": 16}"#),
            ),
            (
                "gemma2",
                with(
                    TINY_LLAMA,
                    r#"{"model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 24,
                        "sliding_window": 5, "attn_logit_softcapping": 50.0,
                        "final_logit_softcapping": 30.0, "hidden_activation": "gelu_pytorch_tanh"}"#,
                ),
            ),
            (
                "qwen3_moe",
                with(
                    &with(
                        TINY_LLAMA,
                        r#"{"model_type": "qwen3_moe", "head_dim": 16, "mlp_only_layers": [1]}"#,
                    ),
                    &tiny_experts(false),
                ),
            ),
            ("qwen3_5", with(TINY_LLAMA, TINY_QWEN3_5_OVERRIDES)),
            (
                "qwen3_next",
                with(
                    &with(
                        &with(TINY_LLAMA, TINY_QWEN3_5_OVERRIDES),
                        TINY_QWEN3_NEXT_OVERRIDES,
                    ),
                    &tiny_experts(true),
                ),
            ),
        ];
        for (name, config) in families {
            let dir = tempfile::tempdir().expect("temp dir");
            write_random_model(dir.path(), &config, 11, None).expect("fixture");
            let options = LoadOptions {
                dtype: Some(Dtype::Float32),
                ..LoadOptions::default()
            };
            let model = load_dir(dir.path(), &options).expect("load");
            assert!(model.batches_rows(), "{name} batches its rows");
            let (alone, alone_states) = run(model.as_ref(), false, 0);
            let runs = [
                ("together", run(model.as_ref(), true, 0)),
                ("together, pooled", run(model.as_ref(), true, 3)),
                (
                    "together, two of three pooled",
                    run(model.as_ref(), true, 2),
                ),
                ("alone, pooled", run(model.as_ref(), false, 3)),
            ];
            for (how, (_, states)) in &runs {
                assert_eq!(states.len(), alone_states.len());
                for (i, (t, a)) in states.iter().zip(&alone_states).enumerate() {
                    let (worst, largest) = worst_of(t, a);
                    assert!(
                        worst <= 1e-4 * largest.max(1.0),
                        "{name} {how}, tapped states {i}: differ by {worst} (largest {largest})"
                    );
                }
            }
            for (i, (how, t, a)) in runs
                .iter()
                .flat_map(|(how, (together, _))| {
                    assert_eq!(together.len(), alone.len());
                    together.iter().zip(&alone).map(move |(t, a)| (how, t, a))
                })
                .enumerate()
            {
                let (worst, largest) = worst_of(t, a);
                assert!(
                    worst <= 1e-4 * largest.max(1.0),
                    "{name} {how}, logits {i}: differ by {worst} (largest {largest})"
                );
                let argmax = |l: &[f32]| -> Vec<usize> {
                    l.chunks(97)
                        .map(|p| {
                            (0..p.len())
                                .max_by(|&x, &y| p[x].total_cmp(&p[y]))
                                .unwrap_or(0)
                        })
                        .collect()
                };
                assert_eq!(
                    argmax(t),
                    argmax(a),
                    "{name} {how}, logits {i}: greedy tokens"
                );
            }
        }
    }

    /// A row asking for more logits than it has positions, a cache of another model, or
    /// taps past the model's layers are refused before anything runs.
    #[test]
    fn bad_rows_are_refused() {
        let dir = tempfile::tempdir().expect("temp dir");
        write_random_model(dir.path(), TINY_LLAMA, 3, None).expect("fixture");
        let model = load_dir(dir.path(), &LoadOptions::default()).expect("load");
        let ids = Array::from_slice(&[1u32, 2, 3], &[1, 3]);
        // Two rows of `ids`, the second wanting `logits` over `second`.
        let refused =
            |first: &mut ModelCache, second: &mut ModelCache, logits: usize, taps: &[usize]| {
                let row = |cache, logits| BatchRow {
                    tokens: &ids,
                    cache,
                    logits,
                };
                let mut rows = [row(first, 1), row(second, logits)];
                match model.forward_batch(&mut rows, taps) {
                    Ok(_) => panic!("a bad batch ran"),
                    Err(e) => e,
                }
            };
        let (mut a, mut b) = (model.new_cache(), model.new_cache());
        let err = refused(&mut a, &mut b, 4, &[]);
        assert!(err.to_string().contains("last 4 positions"), "{err}");
        assert_eq!(a.offset(), 0, "nothing ran");
        let err = refused(&mut a, &mut ModelCache::new(1), 1, &[]);
        assert!(err.to_string().contains("different model"), "{err}");
        let err = refused(&mut a, &mut b, 1, &[0, 7]);
        assert!(err.to_string().contains('7'), "{err}");
        assert_eq!((a.offset(), b.offset()), (0, 0), "nothing ran");
    }
}
