//! `dspec train-drafter`: trains a DFlash or DSpark drafter for a target on the target's own
//! answers, and writes it where `dspec generate --drafter DIR` loads it.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

use dspec_engine::loading::load_model;
use dspec_engine::runtime::Backend;
use dspec_engine::text::prompt::PromptEncoder;
use dspec_engine::training::data::{load_examples, read_lines, DataLine, DataOptions};
use dspec_engine::training::spec::{
    default_layers, default_taps, drafter_spec, target_config, DrafterKind,
};
use dspec_engine::training::trainer::{logits_per_pass, train, Length, Progress, TrainOptions};

use super::args::{count_in, number_in, ModelArgs, PluginArgs};
use super::interrupt;

#[derive(Args)]
pub struct TrainDrafterArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Which drafter to train.
    #[arg(long, value_enum)]
    kind: DrafterKind,
    /// Training data, JSONL: `{"prompt": …}` or `{"messages": […]}` lines (the target
    /// writes the answers, cached in OUT/answers.jsonl), or `{"text": …}` lines (learnt as
    /// they are, against the target's own distributions).
    #[arg(long, value_name = "FILE")]
    data: PathBuf,
    /// Where the drafter is written (config.json, model.safetensors; training/ holds
    /// what --resume needs and the log).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// Optimizer steps (1 to 10,000,000).
    #[arg(long, conflicts_with = "epochs", value_parser = count_in(1, 10_000_000))]
    steps: Option<usize>,
    /// Passes over the data (1 to 1,000; default 3 when --steps is not given).
    #[arg(long, value_parser = count_in(1, 1_000))]
    epochs: Option<usize>,
    /// Draft layers (1 to 64); default 1 for targets under 3B parameters, else 5.
    #[arg(long, value_parser = count_in(1, 64))]
    layers: Option<usize>,
    /// Positions per block, the anchor included (2 to 64); default 16 for DFlash, 7 for DSpark.
    #[arg(long, value_parser = count_in(2, 64))]
    block_size: Option<usize>,
    /// Target layers the drafter reads, comma-separated, each from 0 to the target's layers
    /// less one (default: five spread evenly, as
    /// the published drafters choose them; every layer of a target with five or fewer).
    #[arg(long, value_delimiter = ',')]
    taps: Option<Vec<usize>>,
    /// Peak learning rate of AdamW (above 0, at most 1), reached after a linear warm-up
    /// and decayed to zero on a cosine.
    #[arg(long, default_value_t = 6e-4, value_parser = number_in(0.0, 1.0, true))]
    lr: f32,
    /// Tokens of data per step (64 to 10,000,000): whole sequences are packed up to it.
    #[arg(long, default_value_t = 8192, value_parser = count_in(64, 10_000_000))]
    batch_tokens: usize,
    /// Blocks per sequence and step, at random anchor positions (1 to 4,096).
    #[arg(long, default_value_t = 64, value_parser = count_in(1, 4_096))]
    anchors: usize,
    /// Seed of the initial weights, the data order, the anchors and sampled answers
    /// (0 to 2^64 − 1).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Feed prompts as raw text instead of through the target's chat template.
    #[arg(long)]
    no_chat_template: bool,
    /// Continue the run saved in --out (the same flags, more steps done).
    #[arg(long)]
    resume: bool,
    /// Prompts (the --data format) to measure acceptance on by real speculative decoding.
    #[arg(long, value_name = "FILE")]
    eval: Option<PathBuf>,
    /// Save, and measure acceptance on --eval, every this many steps (1 to 10,000,000;
    /// and at the end).
    #[arg(long, default_value_t = 200, value_parser = count_in(1, 10_000_000))]
    eval_every: usize,
    /// Tokens generated per --eval prompt (1 to 4,096).
    #[arg(long, default_value_t = 128, value_parser = count_in(1, 4_096))]
    eval_tokens: usize,
    /// Sampling temperature of the target's answers (0 to 2; 0 is greedy).
    #[arg(long, default_value_t = 0.0, value_parser = number_in(0.0, 2.0, false))]
    temperature: f32,
    /// Most tokens of one answer the target writes (1 to 32,768).
    #[arg(long, default_value_t = 512, value_parser = count_in(1, 32_768))]
    answer_tokens: usize,
    /// Longest training sequence, prompt and answer together (8 to 131,072); longer ones are cut.
    #[arg(long, default_value_t = 2048, value_parser = count_in(8, 131_072))]
    max_seq_tokens: usize,
    /// γ of the loss's weighting of block position k by exp(−(k−1)/γ) (above 0, at most
    /// 1000; default 7 for DFlash, 4 for DSpark, as published).
    #[arg(long, value_parser = number_in(0.0, 1000.0, true))]
    gamma: Option<f32>,
    /// Largest global gradient norm, 0 to 1,000,000; larger gradients are scaled down
    /// (0 turns it off).
    #[arg(long, default_value_t = 1.0, value_parser = number_in(0.0, 1e6, false))]
    clip: f32,
}

/// MLX settings for a training process, unless the user set them. Every step builds
/// graphs of new shapes, and MLX's CUDA backend caches a CUDA graph per kernel sequence and
/// a cuDNN attention graph per shape, and stops the process once a cache has missed twice
/// its size: launching a step's large kernels directly costs nothing worth a graph, and the
/// target's attention meets a few dozen shapes.
fn mlx_settings_for_training() {
    for (name, value) in [
        ("MLX_USE_CUDA_GRAPHS", "0"),
        ("MLX_CUDA_SDPA_CACHE_SIZE", "4096"),
    ] {
        if std::env::var_os(name).is_none() {
            std::env::set_var(name, value);
        }
    }
}

pub fn run(args: TrainDrafterArgs, plugins: &PluginArgs) -> Result<()> {
    mlx_settings_for_training();
    // Flags are range-checked as they are parsed; the defaults lie in their ranges.
    let length = match (args.steps, args.epochs) {
        (Some(s), _) => Length::Steps(s),
        (None, Some(e)) => Length::Epochs(e),
        (None, None) => Length::Epochs(3),
    };
    let gamma = args.gamma.unwrap_or(args.kind.default_gamma());
    let block_size = args.block_size.unwrap_or(args.kind.default_block_size());

    let backend = Backend::detect();
    let options = args.model.load_options(backend);
    let registry = plugins.registry()?;
    let loaded = load_model(
        &args.model.target,
        &registry,
        &options,
        std::io::stderr().is_terminal(),
    )?;
    let (config, common) = target_config(&loaded.dir)?;
    if args.kind == DrafterKind::Dspark && config["final_logit_softcapping"].is_number() {
        bail!(
            "--kind dspark: the target caps its logits (final_logit_softcapping), and a DSpark \
             checkpoint holds the target's head as a plain product; train --kind dflash, which \
             drafts through the target's own head"
        );
    }
    let layers = args.layers.unwrap_or_else(|| default_layers(&common));
    let taps = match args.taps.clone() {
        Some(t) if t.is_empty() => bail!("--taps: give at least one target layer"),
        Some(t) => t,
        None => default_taps(common.num_hidden_layers as usize, 5),
    };
    let dtype = format!("{:?}", loaded.model.info().dtype).to_lowercase();
    let spec = drafter_spec(args.kind, &common, &dtype, layers, block_size, taps)?;

    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating --out {}", args.out.display()))?;
    let data_options = DataOptions {
        chat_template: !args.no_chat_template,
        temperature: args.temperature,
        seed: args.seed,
        answer_tokens: args.answer_tokens,
        max_tokens: args.max_seq_tokens,
    };
    let eval_prompts = match &args.eval {
        Some(file) => eval_prompts(file, &loaded.tokenizer, !args.no_chat_template)?,
        None => Vec::new(),
    };
    let bar = progress_bar();
    let (examples, summary) = load_examples(
        &args.data,
        &loaded,
        &data_options,
        &args.out.join("answers.jsonl"),
        &mut |done, all| {
            bar.set_length(all as u64);
            bar.set_position(done as u64);
            bar.set_message("answers written by the target");
        },
    )?;
    bar.finish_and_clear();
    for warning in &summary.warnings {
        eprintln!("warning: {warning}");
    }
    if examples.is_empty() {
        bail!(
            "--data {}: no line gave a sequence to learn from ({} skipped for fewer than two \
             tokens to learn)",
            args.data.display(),
            summary.skipped
        );
    }
    eprintln!(
        "{} sequences ({} answers written, {} reused, {} cut to --max-seq-tokens, {} skipped); \
         drafter: {} layer(s), block {}, taps {:?}",
        summary.examples,
        summary.generated,
        summary.reused,
        summary.truncated,
        summary.skipped,
        layers,
        block_size,
        spec.taps
    );

    let settings = json!({
        "target": loaded.dir, "kind": args.kind, "data": args.data, "layers": layers,
        "block_size": block_size, "taps": spec.taps, "lr": args.lr,
        "batch_tokens": args.batch_tokens, "anchors": args.anchors, "seed": args.seed,
        "chat_template": !args.no_chat_template, "temperature": args.temperature,
        "answer_tokens": args.answer_tokens, "max_seq_tokens": args.max_seq_tokens,
        "gamma": gamma, "clip": args.clip,
    });
    let train_options = TrainOptions {
        out: args.out.clone(),
        length,
        lr: args.lr,
        warmup_share: 0.04,
        batch_tokens: args.batch_tokens,
        anchors: args.anchors,
        gamma,
        clip: args.clip,
        weight_decay: 0.01,
        seed: args.seed,
        resume: args.resume,
        eval_every: args.eval_every,
        eval_tokens: args.eval_tokens,
        logits_per_pass: logits_per_pass(),
        settings: settings.as_object().cloned().unwrap_or_default(),
    };
    let bar = progress_bar();
    let interactive = std::io::stderr().is_terminal();
    let mut report_every = 1;
    let (mut saved_at, mut total_steps) = (0, 0);
    interrupt::catch();
    let last = train(
        &loaded,
        &spec,
        &examples,
        &eval_prompts,
        &train_options,
        &mut |p| match p {
            Progress::Started { total, from } => {
                total_steps = total;
                bar.set_length(total as u64);
                bar.set_position(from as u64);
                report_every = (total / 20).max(1);
            }
            Progress::Step {
                step,
                total,
                loss,
                accuracy,
                tokens_per_second,
            } => {
                bar.set_position(step as u64);
                let line = format!(
                    "loss {loss:.4}  accuracy {:.1}%  {tokens_per_second:.0} tok/s",
                    accuracy * 100.0
                );
                if interactive {
                    bar.set_message(line);
                } else if step % report_every == 0 || step == total {
                    eprintln!("step {step}/{total}: {line}");
                }
            }
            Progress::Evaluated { step, acceptance } => {
                bar.suspend(|| {
                    eprintln!(
                        "step {step}: τ {:.2} on {} --eval prompts ({} tokens in {} verifies)",
                        acceptance.tau,
                        acceptance.prompts,
                        acceptance.generated_tokens,
                        acceptance.verify_forwards
                    )
                });
            }
            Progress::Saved { step } => saved_at = step,
        },
        &|_| interrupt::interrupted(),
    )?;
    bar.finish_and_clear();
    if interrupt::interrupted() && saved_at < total_steps {
        bail!(
            "interrupted after step {saved_at} of {total_steps}, which is saved in {}: run the \
             same command with --resume to go on",
            args.out.display()
        );
    }
    match last {
        Some(a) => println!(
            "wrote {}: τ {:.2} on the --eval prompts; use it with --drafter {}",
            args.out.display(),
            a.tau,
            args.out.display()
        ),
        None => println!(
            "wrote {}; use it with --drafter {}",
            args.out.display(),
            args.out.display()
        ),
    }
    Ok(())
}

/// A progress bar on a terminal, hidden elsewhere.
fn progress_bar() -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(0);
    if let Ok(style) =
        ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed} < {eta}] {msg}")
    {
        bar.set_style(style);
    }
    bar
}

/// The --eval file's prompts as the target reads them.
fn eval_prompts(
    file: &Path,
    tokenizer: &dspec_engine::text::tokenizer::TextTokenizer,
    chat_template: bool,
) -> Result<Vec<Vec<u32>>> {
    let encoder = PromptEncoder::new(tokenizer, chat_template, None)?;
    let mut prompts = Vec::new();
    for (line, entry) in read_lines(file).context("--eval")? {
        let tokens = match entry {
            DataLine::Prompt(text) => encoder.encode_user(&text, None)?,
            DataLine::Text(text) => tokenizer.encode_prompt(&text, false)?,
            DataLine::Messages(mut messages) => {
                while messages.last().is_some_and(|m| m.role == "assistant") {
                    messages.pop();
                }
                encoder
                    .encode_conversation(&messages)
                    .with_context(|| format!("--eval {}:{line}", file.display()))?
            }
        };
        if tokens.is_empty() {
            bail!("--eval {}:{line}: the prompt is empty", file.display());
        }
        prompts.push(tokens);
    }
    Ok(prompts)
}
