//! `dspec generate`: a prompt (flag, file or stdin) through the chat template, plain or
//! speculative decoding, streamed text and a statistics line (or one JSON object).

use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use dspec_engine::decoding::generate::{generate_until, GenerationConfig, GenerationOutput};
use dspec_engine::decoding::speculative::{generate_speculative, ServingOptions, Speculation};
use dspec_engine::loading::distributed::Distributed;
use dspec_engine::loading::drafting::load_drafter;
use dspec_engine::loading::{load_model, load_model_in_group};
use dspec_engine::runtime::Backend;
use dspec_engine::text::prompt::encode_prompt;

use super::args::{
    count_in, run_joined, DistributedArgs, DraftTuning, ModelArgs, PluginArgs, SamplingArgs,
};
use super::interrupt;

#[derive(Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text; `-` reads it from standard input.
    #[arg(long, short = 'p', conflicts_with = "prompt_file")]
    prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// System message for the chat template.
    #[arg(long)]
    system: Option<String>,
    /// Feed the prompt as raw text instead of through the model's chat template.
    #[arg(long)]
    no_chat_template: bool,
    /// Passed to chat templates that support it (e.g. Qwen3's thinking switch).
    #[arg(long)]
    enable_thinking: Option<bool>,
    /// Most tokens to generate (1 to 1000000; the context may allow fewer).
    #[arg(long, default_value_t = 256, value_parser = count_in(1, 1_000_000))]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Stop when this text is generated (repeatable); it is not printed.
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Print the text only when generation is done.
    #[arg(long)]
    no_stream: bool,
    /// Print one JSON object with the text and statistics.
    #[arg(long)]
    json: bool,
    /// Speculative decoding with this drafter: `ngram` (prompt lookup), a DFlash or
    /// DSpark checkpoint (directory or cached hub id; its config.json says which), or
    /// `model:DIR` (a smaller model with the target's tokenizer), or `replay:FILE` (the
    /// answer of an earlier `--json` run drafted back: the best case of speculation).
    #[arg(long)]
    drafter: Option<String>,
    #[command(flatten)]
    tuning: DraftTuning,
    /// Write one JSON line per speculative round (drafted tokens, accepted count) here.
    #[arg(long, requires = "drafter")]
    trace: Option<PathBuf>,
    #[command(flatten)]
    distributed: DistributedArgs,
}

fn read_prompt(args: &GenerateArgs) -> Result<String> {
    match (&args.prompt, &args.prompt_file) {
        (Some(p), _) if p == "-" => {
            let mut s = String::new();
            std::io::stdin()
                .read_to_string(&mut s)
                .context("reading the prompt from standard input")?;
            Ok(s)
        }
        (Some(p), _) => Ok(p.clone()),
        (None, Some(file)) => std::fs::read_to_string(file)
            .with_context(|| format!("reading --prompt-file {}", file.display())),
        (None, None) => {
            bail!("give a prompt with --prompt TEXT, --prompt - (stdin) or --prompt-file FILE")
        }
    }
}

pub fn run(args: GenerateArgs, plugins: &PluginArgs) -> Result<()> {
    run_joined(args.distributed.join()?, |group| {
        run_on(args, plugins, group)
    })
}

/// `dspec generate` alone, or as one rank of `group` (every rank generates the same
/// tokens; rank 0 prints them).
fn run_on(mut args: GenerateArgs, plugins: &PluginArgs, group: Option<&Distributed>) -> Result<()> {
    let prompt_text = read_prompt(&args)?;
    let mut sampling = args.sampling.params()?;
    let root = group.is_none_or(Distributed::is_root);
    if group.is_some() {
        args.tuning.for_group()?;
        if args.trace.is_some() && !root {
            // One trace: the ranks' rounds are the same.
            args.trace = None;
        }
    }
    let backend = Backend::detect();
    let options = args.model.load_options(backend);
    let registry = plugins.registry()?;
    let show_progress = std::io::stderr().is_terminal() && !args.json && root;
    let loaded = match group {
        None => load_model(&args.model.target, &registry, &options, show_progress)?,
        Some(g) => load_model_in_group(
            &args.model.target,
            &registry,
            &options,
            g.group(),
            show_progress,
        )?,
    };
    let tokenizer = &loaded.tokenizer;

    let prompt_ids = encode_prompt(
        tokenizer,
        &prompt_text,
        args.system.as_deref(),
        !args.no_chat_template,
        args.enable_thinking,
    )?;

    // Loaded before the ranks meet: loading takes each rank its own time.
    let mut drafter = match args.drafter.as_deref() {
        Some(spec) => {
            let drafter_options = args
                .tuning
                .options(loaded.model.info().dtype, args.max_tokens)?;
            Some(
                load_drafter(spec, &loaded, &registry, &options, &drafter_options)
                    .with_context(|| format!("loading --drafter {spec}"))?,
            )
        }
        None => None,
    };
    if let Some(g) = group {
        g.rendezvous()?;
    }
    // Watched from the first exchange with the other ranks to the last.
    let _watch = group.map(Distributed::watch);
    if let Some(g) = group {
        if !sampling.is_greedy() {
            sampling.seed = Some(g.shared_seed(sampling.seed)?);
        }
        g.check_same(
            "prompts or decoding settings",
            // Paths may differ between machines; what is generated may not.
            format!(
                "{prompt_ids:?} {} {:?} {:?} {} {} {:?}",
                args.max_tokens,
                sampling,
                args.stop,
                args.drafter.is_some(),
                args.tuning.max_draft.max,
                options.dtype
            )
            .as_bytes(),
        )?;
    }
    let config = GenerationConfig {
        max_tokens: args.max_tokens,
        sampling,
        stop_strings: args.stop.clone(),
        eos_ids: tokenizer.eos_token_ids().to_vec(),
    };
    let stream = !args.no_stream && !args.json && root;
    let mut stdout = std::io::stdout();
    let mut on_text = |piece: &str| {
        if stream {
            // A closed pipe (e.g. `| head`) is not an error worth a panic.
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
    };
    // Ctrl-C ends the generation after its current token, with the text and the
    // numbers so far (alone only: the ranks of a group must stop at the same token).
    if group.is_none() {
        interrupt::catch();
    }
    let cancelled = || Ok(interrupt::interrupted());
    let (output, speculative) = match drafter.as_mut() {
        None => (
            generate_until(
                loaded.model.as_ref(),
                tokenizer,
                &prompt_ids,
                &config,
                &mut on_text,
                &cancelled,
            )?,
            None,
        ),
        Some(drafter) => {
            let mut trace_file = match &args.trace {
                Some(path) => Some(std::io::BufWriter::new(
                    std::fs::File::create(path)
                        .with_context(|| format!("creating --trace {}", path.display()))?,
                )),
                None => None,
            };
            let out = generate_speculative(
                loaded.model.as_ref(),
                tokenizer,
                &prompt_ids,
                &config,
                Speculation {
                    drafter: drafter.as_mut(),
                    max_draft: args.tuning.max_draft.max,
                    adaptive: args.tuning.max_draft.adaptive,
                    trace: trace_file.as_mut().map(|f| f as &mut dyn Write),
                    verify_ahead: args.tuning.verify_ahead(),
                },
                &mut on_text,
                ServingOptions {
                    cancelled: Some(&cancelled),
                    ..ServingOptions::default()
                },
            )?;
            if let Some(mut f) = trace_file {
                f.flush().context("writing --trace")?;
            }
            let generation = GenerationOutput {
                text: out.text,
                tokens: out.tokens,
                stats: out.stats,
            };
            (generation, Some(out.speculative))
        }
    };
    let s = &output.stats;
    if !root {
        return Ok(());
    }
    if args.json {
        let info = loaded.model.info();
        let report = serde_json::json!({
            "text": output.text,
            "tokens": output.tokens,
            "model": {
                "dir": loaded.dir,
                "adapter": loaded.adapter,
                "model_type": info.model_type,
                "dtype": format!("{:?}", info.dtype),
                "quantized_bits": info.quantized_bits,
                "device": backend.device_name(),
                "ranks": group.map_or(1, Distributed::size),
            },
            "stats": s,
            "speculative": speculative,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    if !stream {
        print!("{}", output.text);
    }
    println!();
    if interrupt::interrupted() {
        eprintln!("[dspec] interrupted (Ctrl-C): what was generated until then is above");
    }
    eprintln!(
        "[dspec] prompt {} tokens, prefill {:.1} tok/s | generated {} tokens, decode {:.1} tok/s | stop: {}",
        s.prompt_tokens,
        s.prefill_tokens_per_second,
        s.generated_tokens,
        s.decode_tokens_per_second,
        serde_json::to_value(s.stop_reason)?.as_str().unwrap_or("?"),
    );
    if let Some(sp) = speculative {
        eprintln!(
            "[dspec] drafter {}: tau {:.2} tokens/forward over {} target forwards, {}/{} drafts accepted, acceptance histogram {:?}, {:.0}% of decode time drafting",
            sp.drafter,
            sp.tau,
            sp.target_forwards,
            sp.accepted_tokens,
            sp.drafted_tokens,
            sp.acceptance_histogram,
            100.0 * sp.draft_time_share,
        );
        if let Some(cost) = &sp.round_cost {
            eprintln!("[dspec] {}", cost.describe(sp.tau));
        }
    }
    Ok(())
}
