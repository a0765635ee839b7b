//! The training loop: steps of anchored blocks through autograd and AdamW, a progress
//! line, acceptance measured every few steps, checkpoints to resume from.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::Instant;

use mlx_rs::optimizers::{AdamW, Optimizer};
use mlx_rs::transforms::keyed_value_and_grad;
use mlx_rs::Array;
use serde_json::json;

use super::batch::{pick_anchors, prepare, Anchored, BlockLayout};
use super::checkpoint::{load_state, save_state, state_dir, write_drafter, RunState};
use super::data::Example;
use super::eval::{acceptance, Acceptance};
use super::net::{initial_params, NetShape, Params};
use super::objective::{dflash, dspark};
use super::schedule::{anchor_rng, LearningRate, Plan};
use super::spec::DrafterKind;
use super::spec::DrafterSpec;
use crate::error::EngineError;
use crate::loading::LoadedModel;

type Result<T> = std::result::Result<T, EngineError>;

/// How long a run is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Length {
    Steps(usize),
    Epochs(usize),
}

/// A run's settings (the CLI's flags, checked).
#[derive(Debug, Clone)]
pub struct TrainOptions {
    pub out: PathBuf,
    pub length: Length,
    pub lr: f32,
    /// Steps of linear warm-up, as a share of all steps.
    pub warmup_share: f32,
    pub batch_tokens: usize,
    pub anchors: usize,
    pub gamma: f32,
    pub clip: f32,
    pub weight_decay: f32,
    pub seed: u64,
    pub resume: bool,
    pub eval_every: usize,
    pub eval_tokens: usize,
    /// The most logits (rows × vocabulary) one pass of the drafter holds:
    /// [`logits_per_pass`] unless a test splits steps differently.
    pub logits_per_pass: usize,
    /// Written with the checkpoint, for `--resume` to check.
    pub settings: serde_json::Map<String, serde_json::Value>,
}

/// What a progress display hears.
pub enum Progress<'a> {
    Started {
        total: usize,
        from: usize,
    },
    Step {
        step: usize,
        total: usize,
        loss: f32,
        accuracy: f32,
        tokens_per_second: f64,
    },
    Evaluated {
        step: usize,
        acceptance: &'a Acceptance,
    },
    Saved {
        step: usize,
    },
}

/// Trains the drafter `spec` for `loaded` on `examples`; evaluates on `eval_prompts`
/// (token ids) every `eval_every` steps and at the end. `stop` is asked after every
/// step whether to end early (an interrupt): the run then saves what `--resume`
/// continues from. Returns the last acceptance.
pub fn train(
    loaded: &LoadedModel,
    spec: &DrafterSpec,
    examples: &[Example],
    eval_prompts: &[Vec<u32>],
    options: &TrainOptions,
    progress: &mut dyn FnMut(Progress<'_>),
    stop: &dyn Fn(usize) -> bool,
) -> Result<Option<Acceptance>> {
    let target = loaded.model.as_ref();
    let dtype = target.info().dtype;
    let lengths = examples.iter().map(|e| e.tokens.len()).collect();
    let mut plan = Plan::new(lengths, options.batch_tokens, options.seed);
    let total = match options.length {
        Length::Steps(n) => n,
        Length::Epochs(e) => plan.steps_in(e),
    };
    let frozen = frozen_tensors(target, spec)?;
    let mut settings = options.settings.clone();
    settings.insert("total_steps".into(), json!(total));

    let mut optimizer = AdamW::new(options.lr);
    optimizer.weight_decay = Array::from_f32(options.weight_decay);
    let (mut params, first_step) = if options.resume {
        let saved = load_state(&options.out)?;
        check_same_run(&saved.state.settings, &settings)?;
        optimizer.state = saved.moments;
        (saved.params, saved.state.step)
    } else {
        let mut params = initial_params(&spec.shape.tensors(), options.seed);
        fit_fc_to_taps(&mut params, target, spec, examples)?;
        (params, 0)
    };
    let rate = LearningRate {
        peak: options.lr,
        warmup: ((total as f32 * options.warmup_share).ceil() as usize).max(1),
        total,
    };
    let log_path = state_dir(&options.out).join("log.jsonl");
    std::fs::create_dir_all(state_dir(&options.out))
        .map_err(|e| EngineError::Invalid(format!("{}: {e}", options.out.display())))?;
    // A resumed run keeps its log up to the saved step (steps after it run again); a
    // new one starts it afresh.
    let kept = match options.resume {
        true => logged_up_to(&log_path, first_step),
        false => String::new(),
    };
    std::fs::write(&log_path, kept)
        .map_err(|e| EngineError::Invalid(format!("{}: {e}", log_path.display())))?;
    let mut log = std::fs::OpenOptions::new()
        .append(true)
        .open(&log_path)
        .map_err(|e| EngineError::Invalid(format!("{}: {e}", log_path.display())))?;
    let mut write_log = |line: serde_json::Value| -> Result<()> {
        writeln!(log, "{line}")
            .map_err(|e| EngineError::Invalid(format!("{}: {e}", log_path.display())))
    };

    progress(Progress::Started {
        total,
        from: first_step,
    });
    let mut last = None;
    let started = Instant::now();
    let mut tokens_done = 0usize;
    for step in first_step..total {
        let (batch, epoch) = plan.batch(step);
        let mut rng = anchor_rng(options.seed, step);
        let mut picked = Vec::with_capacity(batch.len());
        for &i in &batch {
            let anchors = pick_anchors(&examples[i], options.anchors, &spec.layout, &mut rng);
            if !anchors.is_empty() {
                picked.push(Anchored {
                    example: &examples[i],
                    anchors,
                });
            }
        }
        if picked.is_empty() {
            continue;
        }
        let lr = rate.at(step);
        let report = train_step(
            loaded,
            spec,
            passes(picked, &spec.shape, &spec.layout, options.logits_per_pass),
            &mut params,
            &mut optimizer,
            lr,
            options,
        )?;
        let StepReport {
            loss,
            accuracy,
            target_seconds,
            drafter_seconds,
        } = report;
        tokens_done += batch
            .iter()
            .map(|&i| examples[i].tokens.len())
            .sum::<usize>();
        let tokens_per_second = tokens_done as f64 / started.elapsed().as_secs_f64().max(1e-9);
        write_log(
            json!({"step": step + 1, "epoch": epoch, "loss": loss, "accuracy": accuracy,
                   "lr": lr, "tokens_per_second": tokens_per_second,
                   "target_seconds": target_seconds, "drafter_seconds": drafter_seconds}),
        )?;
        progress(Progress::Step {
            step: step + 1,
            total,
            loss,
            accuracy,
            tokens_per_second,
        });
        let done = step + 1 == total;
        let stopping = !done && stop(step + 1);
        let evaluate = done || (options.eval_every > 0 && (step + 1) % options.eval_every == 0);
        if evaluate || stopping {
            write_drafter(&options.out, &spec.config, &params, &frozen, dtype)?;
            save_state(
                &options.out,
                &params,
                &optimizer.state,
                &RunState {
                    step: step + 1,
                    settings: settings.clone(),
                },
            )?;
            progress(Progress::Saved { step: step + 1 });
            if stopping {
                return Ok(last);
            }
            if evaluate && !eval_prompts.is_empty() {
                let measured = acceptance(
                    loaded,
                    &options.out,
                    eval_prompts,
                    options.eval_tokens,
                    spec.layout.predicted() as usize,
                )?;
                write_log(json!({"step": step + 1, "eval": measured}))?;
                progress(Progress::Evaluated {
                    step: step + 1,
                    acceptance: &measured,
                });
                last = Some(measured);
            }
        }
    }
    if first_step >= total {
        write_drafter(&options.out, &spec.config, &params, &frozen, dtype)?;
    }
    Ok(last)
}

/// The most logits (rows × vocabulary) one pass of the drafter holds on this backend. A
/// step's sequences run in passes whose gradients add up, so that a step's memory stays
/// bounded whatever `--batch-tokens` asks. A GPU takes passes of several sequences, which
/// read the weights once for all of them (2^29 f32 logits are 2 GiB); on the CPU, where
/// arithmetic is the bound, small passes run faster, their arrays staying small.
pub fn logits_per_pass() -> usize {
    match dspec_runtime::Backend::current() {
        dspec_runtime::Backend::Cpu => 1 << 25,
        dspec_runtime::Backend::Cuda | dspec_runtime::Backend::Metal => 1 << 29,
    }
}

/// A step's sequences grouped into passes: ordered by the kind of their labels and by
/// length, so that each pass pads its sequences little, and each pass as many sequences
/// as keep its logits within `budget` (at least one).
fn passes<'a>(
    mut sequences: Vec<Anchored<'a>>,
    shape: &NetShape,
    layout: &BlockLayout,
    budget: usize,
) -> Vec<Vec<Anchored<'a>>> {
    sequences.sort_by_key(|s| (s.example.soft, s.example.tokens.len()));
    let per_block = layout.predicted().max(1) as usize * shape.vocab.max(1) as usize;
    let mut all: Vec<Vec<Anchored<'a>>> = Vec::new();
    for seq in sequences {
        let fits = |pass: &Vec<Anchored<'a>>| {
            let widest = pass.iter().chain([&seq]).map(|s| s.anchors.len()).max();
            pass[0].example.soft == seq.example.soft
                && (pass.len() + 1) * widest.unwrap_or(0) * per_block <= budget
        };
        match all.last_mut() {
            Some(pass) if fits(pass) => pass.push(seq),
            _ => all.push(vec![seq]),
        }
    }
    all
}

/// What a step measured.
struct StepReport {
    loss: f32,
    /// The weighted share of predictions equal to their labels.
    accuracy: f32,
    /// Seconds in the target's forwards, and in the drafter's passes and update.
    target_seconds: f64,
    drafter_seconds: f64,
}

/// One step over `passes`: each pass's sequences through the target, then loss and
/// gradients through autograd, summed over the passes and divided by the step's total
/// weight; clipped, and AdamW at rate `lr`.
fn train_step(
    loaded: &LoadedModel,
    spec: &DrafterSpec,
    passes: Vec<Vec<Anchored<'_>>>,
    params: &mut Params,
    optimizer: &mut AdamW,
    lr: f32,
    options: &TrainOptions,
) -> Result<StepReport> {
    let target = loaded.model.as_ref();
    let (mut target_seconds, mut drafter_seconds) = (0.0, 0.0);
    let mut summed: Option<(HashMap<Rc<str>, Array>, Array, Array)> = None;
    let mut weight = 0.0f32;
    for pass in passes {
        let preparing = Instant::now();
        let batch = prepare(
            target,
            &spec.taps,
            &pass,
            &spec.layout,
            options.gamma,
            spec.kind == DrafterKind::Dspark,
        )?;
        target_seconds += preparing.elapsed().as_secs_f64();
        let stepping = Instant::now();
        weight += batch.weight;
        let objective = |p: HashMap<Rc<str>, Array>,
                         _: ()|
         -> std::result::Result<Vec<Array>, mlx_rs::error::Exception> {
            let loss = match spec.kind {
                DrafterKind::Dflash => dflash,
                DrafterKind::Dspark => dspark,
            };
            let values = loss(&p, &spec.shape, &spec.layout, target, &batch)
                .map_err(|e| mlx_rs::error::Exception::custom(e.to_string()))?;
            Ok(vec![values.loss, values.correct])
        };
        let mut value_and_grad = keyed_value_and_grad(objective);
        let (values, grads) = value_and_grad(params.clone(), ())?;
        let (loss, correct) = (values[0].clone(), values[1].clone());
        summed = Some(match summed.take() {
            None => (grads, loss, correct),
            Some((mut total, l, c)) => {
                for (name, grad) in grads {
                    let sum = match total.remove(&name) {
                        Some(before) => before.add(&grad)?,
                        None => grad,
                    };
                    total.insert(name, sum);
                }
                (total, l.add(&loss)?, c.add(&correct)?)
            }
        });
        if let Some((grads, loss, correct)) = &summed {
            let mut pending: Vec<&Array> = grads.values().collect();
            pending.extend([loss, correct]);
            mlx_rs::transforms::eval(pending)?;
        }
        drafter_seconds += stepping.elapsed().as_secs_f64();
    }
    let stepping = Instant::now();
    let (grads, loss, correct) =
        summed.ok_or_else(|| EngineError::Invalid("a training step had no sequences".into()))?;
    let scale = Array::from_f32(1.0 / weight.max(1e-9));
    let grads: HashMap<Rc<str>, Array> = grads
        .into_iter()
        .map(|(name, g)| Ok((name, g.multiply(&scale)?)))
        .collect::<Result<_>>()?;
    let grads = if options.clip > 0.0 {
        clipped(grads, options.clip)?
    } else {
        grads
    };
    optimizer.lr = Array::from_f32(lr);
    for (name, grad) in &grads {
        if let Some(param) = params.get_mut(name) {
            optimizer.update_single(name, grad, param)?;
        }
    }
    let mut pending: Vec<&Array> = params.values().collect();
    pending.extend(optimizer.state.values().flat_map(|(m, v)| [m, v]));
    mlx_rs::transforms::eval(pending)?;
    let scalar = |a: &Array| {
        a.try_item_cast::<f32>()
            .map_err(|e| EngineError::Mlx(e.to_string()))
    };
    let (loss, correct) = (
        scalar(&loss)? / weight.max(1e-9),
        scalar(&correct)? / weight.max(1e-9),
    );
    if !loss.is_finite() {
        return Err(EngineError::Invalid(format!(
            "the loss became {loss}; lower --lr (or --clip) and start again"
        )));
    }
    drafter_seconds += stepping.elapsed().as_secs_f64();
    Ok(StepReport {
        loss,
        accuracy: correct,
        target_seconds,
        drafter_seconds,
    })
}

/// Scales each input column of the fresh `fc` by the inverse of its channel's RMS in the
/// target's tap states (measured on the first example), so that every channel starts on
/// the same footing. Real targets' residual streams carry a few channels thousands of
/// times larger than the rest; a fan-in initialisation would let those drown out every
/// other channel of the context, which the drafter would then have to unlearn.
pub fn fit_fc_to_taps(
    params: &mut Params,
    target: &dyn dspec_plugin_api::TargetModel,
    spec: &DrafterSpec,
    examples: &[Example],
) -> Result<()> {
    let Some(first) = examples.first() else {
        return Ok(());
    };
    let t = first.tokens.len() as i32;
    let mut cache = target.new_cache();
    let out = target.forward(
        &Array::from_slice(&first.tokens, &[1, t]),
        &mut cache,
        &spec.taps,
    )?;
    let Some(hidden) = out.hidden else {
        return Ok(());
    };
    let taps = hidden.reshape(&[t, -1])?.as_dtype(mlx_rs::Dtype::Float32)?;
    let rms = taps
        .square()?
        .mean_axis(0, false)?
        .sqrt()?
        .add(Array::from_f32(1e-6))?;
    let name: Rc<str> = Rc::from("fc.weight");
    if let Some(fc) = params.get_mut(&name) {
        *fc = fc.divide(rms.reshape(&[1, -1])?)?;
        fc.eval()?;
    }
    Ok(())
}

/// What a DSpark checkpoint holds of the target's, frozen: its embedding table and its
/// head (`[vocab, hidden]` each), read through the target's own `embed` and `lm_head`
/// so that any family and quantization gives them as the target computes them.
pub fn frozen_tensors(
    target: &dyn dspec_plugin_api::TargetModel,
    spec: &DrafterSpec,
) -> Result<Vec<(String, Array)>> {
    if spec.kind != DrafterKind::Dspark {
        return Ok(Vec::new());
    }
    let (vocab, hidden) = (spec.shape.vocab, spec.shape.hidden);
    let ids: Vec<u32> = (0..vocab as u32).collect();
    let table = target
        .embed(&Array::from_slice(&ids, &[1, vocab]))?
        .reshape(&[vocab, hidden])?;
    let dtype = target.info().dtype;
    let identity = mlx_rs::ops::eye::<f32>(hidden, None, None)?.as_dtype(dtype)?;
    let head = target.lm_head(&identity)?.t().as_dtype(dtype)?;
    mlx_rs::transforms::eval([&table, &head])?;
    Ok(vec![
        ("embed_tokens.weight".into(), table),
        ("lm_head.weight".into(), head),
    ])
}

/// `grads` scaled by `clip / ‖grads‖` where their global norm is above `clip`; computed
/// on the device, so the step reads nothing back before the update.
fn clipped(grads: HashMap<Rc<str>, Array>, clip: f32) -> Result<HashMap<Rc<str>, Array>> {
    let mut squares = Array::from_f32(0.0);
    for g in grads.values() {
        squares = squares.add(g.square()?.sum(None)?)?;
    }
    let norm = squares.sqrt()?;
    let scale = mlx_rs::ops::minimum(
        Array::from_f32(1.0),
        Array::from_f32(clip).divide(norm.add(Array::from_f32(1e-6))?)?,
    )?;
    grads
        .into_iter()
        .map(|(k, g)| Ok((k, g.multiply(&scale)?)))
        .collect()
}

/// The lines of the log at `path` that belong to steps up to `step`.
fn logged_up_to(path: &std::path::Path, step: usize) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines()
        .filter(|line| {
            serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v["step"].as_u64())
                .is_some_and(|s| s as usize <= step)
        })
        .map(|line| format!("{line}\n"))
        .collect()
}

/// A resumed run must repeat the flags that decide what its steps compute.
fn check_same_run(
    saved: &serde_json::Map<String, serde_json::Value>,
    now: &serde_json::Map<String, serde_json::Value>,
) -> Result<()> {
    for (key, value) in now {
        let before = saved.get(key).unwrap_or(&serde_json::Value::Null);
        if before != value {
            return Err(EngineError::Invalid(format!(
                "--resume: this run has {key} = {value} but the saved one had {before}; \
                 resume with the same flags, or start anew without --resume"
            )));
        }
    }
    Ok(())
}
