//! `dspec score`: log-probabilities of a completion, rolling log-probabilities of a text,
//! or the next-token distribution, from flags or a JSONL file; optionally with a LoRA
//! adapter, fused or compared side by side with the base model.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};

use dspec_adapters::lora::LoraMode;
use dspec_engine::loading::{load_model, load_model_with_lora};
use dspec_engine::runtime::Backend;
use dspec_engine::scoring::batch::{read_requests, render_text, run_requests, ScoreRequest, Sides};
use dspec_engine::scoring::{Measure, Scorer, ScorerAdapter, Windowing};

use super::args::{count_in, ModelArgs, PluginArgs};
use super::interrupt;

#[derive(Clone, Copy, ValueEnum)]
enum MeasureArg {
    /// log p(--completion | --prompt), per token and summed.
    Logprob,
    /// log p of every token of --text given the tokens before it; total and perplexity.
    Rolling,
    /// The --top-k most likely tokens after --prompt, and the mass of the rest.
    NextToken,
}

#[derive(Args)]
pub struct ScoreArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// What to measure for --prompt/--completion/--text. Default: logprob when both
    /// --prompt and --completion are given, next-token for --prompt alone, rolling for --text.
    #[arg(long, value_enum)]
    measure: Option<MeasureArg>,
    /// Raw text (no chat template) the completion or next token follows.
    #[arg(long)]
    prompt: Option<String>,
    /// Text whose log-probability after --prompt is measured.
    #[arg(long)]
    completion: Option<String>,
    /// Text scored token by token (rolling).
    #[arg(long)]
    text: Option<String>,
    /// Score the requests in this JSONL file, one object per line:
    /// {"measure": "logprob", "prompt": ..., "completion": ...} | {"measure": "rolling", "text": ...}
    /// | {"measure": "next-token", "prompt": ..., "k": N}; any line may carry an "id".
    #[arg(long, value_name = "FILE", conflicts_with_all = ["measure", "prompt", "completion", "text"])]
    input: Option<PathBuf>,
    /// Tokens listed by next-token (and its default for JSONL lines without "k"); 1 to 1000.
    #[arg(long, default_value_t = 10, value_parser = count_in(1, 1000))]
    top_k: usize,
    /// LoRA adapter directory: PEFT (adapter_config.json + adapter_model.safetensors) or
    /// MLX-LM (adapter_config.json + adapters.safetensors). Scores the adapted model.
    #[arg(long, value_name = "DIR")]
    lora: Option<PathBuf>,
    /// Score base and adapted side by side, with deltas, from one load of the base weights.
    #[arg(long, requires = "lora", conflicts_with = "fuse")]
    compare: bool,
    /// Merge the adapter into the weights at load (faster; no base scores).
    #[arg(long, requires = "lora")]
    fuse: bool,
    /// Tokens per window for texts longer than this (default: the model's context);
    /// 2 to 16777216.
    #[arg(long, value_parser = count_in(2, 1 << 24))]
    window: Option<usize>,
    /// Tokens between window starts (default: half the window); 1 to the window.
    #[arg(long, value_parser = count_in(1, 1 << 24))]
    stride: Option<usize>,
    /// Print one JSON object with every result and the run's statistics.
    #[arg(long)]
    json: bool,
}

impl ScoreArgs {
    /// The requests to score, from --input or from the single-item flags.
    fn requests(&self) -> Result<Vec<ScoreRequest>> {
        if let Some(path) = &self.input {
            return Ok(read_requests(path, self.top_k)?);
        }
        let measure = match (
            self.measure,
            &self.prompt,
            &self.completion,
            &self.text,
        ) {
            (Some(MeasureArg::Logprob) | None, Some(prompt), Some(completion), None) => {
                Measure::Logprob {
                    prompt: prompt.clone(),
                    completion: completion.clone(),
                }
            }
            (Some(MeasureArg::NextToken) | None, Some(prompt), None, None) => Measure::NextToken {
                prompt: prompt.clone(),
                k: self.top_k,
            },
            (Some(MeasureArg::Rolling) | None, None, None, Some(text)) => Measure::Rolling {
                text: text.clone(),
            },
            (Some(MeasureArg::Logprob), ..) => bail!("--measure logprob takes --prompt and --completion"),
            (Some(MeasureArg::NextToken), ..) => bail!("--measure next-token takes --prompt (and --top-k)"),
            (Some(MeasureArg::Rolling), ..) => bail!("--measure rolling takes --text"),
            (None, ..) => bail!(
                "give --prompt and --completion (logprob), --prompt (next-token), --text (rolling), or --input FILE.jsonl"
            ),
        };
        Ok(vec![ScoreRequest {
            line: None,
            id: None,
            measure,
        }])
    }
}

pub fn run(args: ScoreArgs, plugins: &PluginArgs) -> Result<()> {
    // Bad requests fail before the weights load.
    let requests = args.requests()?;
    let backend = Backend::detect();
    let options = args.model.load_options(backend);
    let registry = plugins.registry()?;
    let show_progress = std::io::stderr().is_terminal() && !args.json;
    let (loaded, lora) = match &args.lora {
        None => (
            load_model(&args.model.target, &registry, &options, show_progress)?,
            None,
        ),
        Some(dir) => {
            let mode = if args.fuse {
                LoraMode::Fused
            } else {
                LoraMode::Switchable
            };
            let (loaded, lora) = load_model_with_lora(
                &args.model.target,
                &registry,
                &options,
                dir,
                mode,
                show_progress,
            )
            .with_context(|| format!("loading --lora {}", dir.display()))?;
            for warning in &lora.warnings {
                eprintln!("warning: {warning}");
            }
            (loaded, Some(lora))
        }
    };
    let info = loaded.model.info().clone();
    let windowing = Windowing::new(args.window, args.stride, info.max_context)?;
    let dir = loaded.dir.clone();
    let mut scorer = Scorer::new(loaded, lora.as_ref().map(ScorerAdapter::from), windowing);
    let sides = if args.compare {
        Sides::Compare
    } else {
        Sides::One(scorer.default_variant())
    };
    interrupt::catch();
    let results = run_requests(&mut scorer, &requests, sides, &interrupt::interrupted)?;
    let stats = scorer.stats();
    let interrupted = (results.len() < requests.len()).then(|| {
        format!(
            "interrupted (Ctrl-C) after {} of {} requests: their results are above",
            results.len(),
            requests.len()
        )
    });
    if args.json {
        let report = serde_json::json!({
            "model": {
                "dir": dir,
                "model_type": info.model_type,
                "dtype": format!("{:?}", info.dtype),
                "quantized_bits": info.quantized_bits,
                "device": backend.device_name(),
            },
            "adapter": lora.as_ref().map(|l| serde_json::json!({
                "dir": l.dir,
                "summary": l.summary,
                "fused": l.switch.is_none(),
                "warnings": l.warnings,
            })),
            "window": windowing.window,
            "stride": windowing.stride,
            "results": results,
            "requests": requests.len(),
            "interrupted": interrupted.is_some(),
            "stats": stats,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
        if let Some(message) = interrupted {
            eprintln!("[dspec] {message}");
        }
        return Ok(());
    }
    if let Some(lora) = &lora {
        eprintln!(
            "[dspec] {}{}",
            lora.summary,
            if lora.switch.is_none() {
                " (fused)"
            } else {
                ""
            }
        );
    }
    print!("{}", render_text(&results));
    eprintln!(
        "[dspec] {} request(s): {} computed, {} from cache, {} forward passes (window {}, stride {})",
        results.len(),
        stats.computed,
        stats.cache_hits,
        stats.forward_passes,
        windowing.window,
        windowing.stride,
    );
    if let Some(message) = interrupted {
        eprintln!("[dspec] {message}");
    }
    Ok(())
}
