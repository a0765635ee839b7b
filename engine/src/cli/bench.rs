//! `dspec bench`: plain greedy and speculative decoding on the same prompts in one
//! process, as a table or JSON; a real mismatch between the two is an error.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;

use dspec_engine::bench::{read_prompts, run_bench as bench_prompts, BenchHooks, DEFAULT_PROMPTS};
use dspec_engine::loading::distributed::Distributed;
use dspec_engine::loading::drafting::{drafts_with_a_model, load_drafter};
use dspec_engine::loading::{load_model, load_model_in_group};
use dspec_engine::runtime::Backend;
use dspec_engine::text::prompt::PromptEncoder;

use super::args::{
    count_in, run_joined, DistributedArgs, DraftTuning, ModelArgs, PluginArgs, SamplingArgs,
};
use super::interrupt;

#[derive(Args)]
pub struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The drafter to measure (as for `generate --drafter`).
    #[arg(long)]
    drafter: String,
    #[command(flatten)]
    tuning: DraftTuning,
    /// Prompts to run: one per line, or JSON lines with a "prompt" field.
    /// Default: a built-in set (code, chat, a repetitive edit).
    #[arg(long)]
    prompts: Option<PathBuf>,
    /// Tokens generated per prompt and run (1 to 1000000; the context may allow fewer).
    #[arg(long, default_value_t = 128, value_parser = count_in(1, 1_000_000))]
    max_tokens: usize,
    /// Plain and speculative runs of each prompt, back to back; each row reports the
    /// median run of each, and as speedup the median of the passes' own ratios (decode
    /// speed moves between runs, on a GPU by more than a drafter's gain); 1 to 1000.
    #[arg(long, default_value_t = 3, value_parser = count_in(1, 1000))]
    passes: usize,
    /// Feed prompts as raw text instead of through the model's chat template.
    #[arg(long)]
    no_chat_template: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Warm prefills timed per prompt after its first call (reported apart); the median
    /// is reported. 0 skips prefill measurement; at most 1000.
    #[arg(long, default_value_t = 3, value_parser = count_in(0, 1000))]
    prefill_runs: usize,
    /// Also measure prefill of synthetic prompts of these lengths in tokens (the bench
    /// prompts' token ids repeated), e.g. 1024,4096,16384; each 1 to 1048576.
    #[arg(long, value_delimiter = ',', value_name = "TOKENS", value_parser = count_in(1, 1 << 20))]
    prefill_lengths: Vec<usize>,
    /// Write one JSON line per round of the timed speculative runs here (as `generate
    /// --trace`): round costs from the same process as the plain runs they compare with.
    #[arg(long)]
    trace: Option<PathBuf>,
    // Plain sampled decoding timed beside plain greedy (the command's help says how).
    #[command(flatten)]
    sampling: SamplingArgs,
    #[command(flatten)]
    distributed: DistributedArgs,
}

pub fn run(args: BenchArgs, plugins: &PluginArgs) -> Result<()> {
    dspec_engine::runtime::settings_for_a_long_lived_process();
    run_joined(args.distributed.join()?, |group| {
        run_on(args, plugins, group)
    })
}

/// `dspec bench` alone, or as one rank of `group` (every rank runs the same decoding;
/// rank 0 reports it, with timings that include the group's communication).
fn run_on(mut args: BenchArgs, plugins: &PluginArgs, group: Option<&Distributed>) -> Result<()> {
    let root = group.is_none_or(Distributed::is_root);
    if group.is_some() {
        args.tuning.for_group()?;
    }
    if !args.prefill_lengths.is_empty() && args.prefill_runs == 0 {
        bail!("--prefill-lengths needs --prefill-runs of at least 1");
    }
    let sampling = args.sampling.params()?;
    let ignored = args.sampling.filters_without_temperature();
    if !ignored.is_empty() {
        bail!(
            "{} apply to sampled decoding, which bench times only with --temperature > 0: add --temperature (e.g. 0.7), or drop {}",
            ignored.join(", "),
            ignored.join(", ")
        );
    }
    let prompts: Vec<String> = match &args.prompts {
        Some(path) => read_prompts(path)?,
        None => DEFAULT_PROMPTS.iter().map(|p| p.to_string()).collect(),
    };
    let backend = Backend::detect();
    let mut options = args.model.load_options(backend);
    // Passes run in one process: the kernels' one-off compile is paid once.
    options.verify_kernels = true;
    options.verifies_waited_on = drafts_with_a_model(&args.drafter)?;
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
    let drafter_options = args
        .tuning
        .options(loaded.model.info().dtype, args.max_tokens)?;
    let mut drafter = load_drafter(
        &args.drafter,
        &loaded,
        &registry,
        &options,
        &drafter_options,
    )
    .with_context(|| format!("loading --drafter {}", args.drafter))?;
    let encoder = PromptEncoder::new(&loaded.tokenizer, !args.no_chat_template, None)?;
    let ids = prompts
        .iter()
        .map(|p| encoder.encode_user(p, None))
        .collect::<Result<Vec<_>, _>>()?;
    let settings = dspec_engine::bench::BenchSettings {
        max_tokens: args.max_tokens,
        max_draft: args.tuning.max_draft.max,
        adaptive: args.tuning.max_draft.adaptive,
        verify_ahead: args.tuning.verify_ahead(),
        passes: args.passes,
        prefill: dspec_engine::bench::PrefillPlan {
            warm_runs: args.prefill_runs,
            synthetic_lengths: args.prefill_lengths.clone(),
        },
        sampled: Some(sampling),
    };
    if let Some(g) = group {
        // Every rank is done loading, which takes each its own time.
        g.rendezvous()?;
    }
    // Watched from the first exchange with the other ranks to the last.
    let _watch = group.map(Distributed::watch);
    if let Some(g) = group {
        g.check_same(
            "prompts or bench settings",
            format!("{ids:?} {settings:?}").as_bytes(),
        )?;
    }
    // One trace: the ranks' rounds are the same.
    let mut trace_file = match (&args.trace, root) {
        (Some(path), true) => Some(std::io::BufWriter::new(
            std::fs::File::create(path)
                .with_context(|| format!("creating --trace {}", path.display()))?,
        )),
        _ => None,
    };
    // Ranks must run the same passes, and a signal reaches one of them: a group keeps
    // the default (the process ends).
    if group.is_none() {
        interrupt::catch();
    }
    let report = bench_prompts(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        drafter.as_mut(),
        &ids,
        &settings,
        BenchHooks {
            trace: trace_file.as_mut().map(|f| f as &mut dyn Write),
            pass_done: &mut |pass| {
                if root {
                    eprintln!("[dspec] pass {pass} of {} done", args.passes);
                }
            },
            stop: &interrupt::interrupted,
        },
    )?;
    if let Some(mut f) = trace_file {
        f.flush().context("writing --trace")?;
    }
    if !root {
        // The same report as rank 0's: fail alike on a mismatch, print nothing.
        if report.real_mismatches > 0 {
            bail!("speculative and plain greedy outputs differ (rank 0 reports where)");
        }
        return Ok(());
    }
    if args.json {
        let info = loaded.model.info();
        let out = serde_json::json!({
            "target": loaded.dir,
            "model_type": info.model_type,
            "dtype": format!("{:?}", info.dtype),
            "device": backend.device_name(),
            "drafter_arg": args.drafter,
            "ranks": group.map_or(1, Distributed::size),
            "report": report,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "target {} on {}, drafter {} (max draft {}{}), {} greedy tokens per prompt, median of {} passes",
            loaded.dir.display(),
            backend.device_name(),
            report.drafter,
            report.max_draft,
            if report.adaptive { ", adaptive" } else { "" },
            report.max_tokens,
            report.passes
        );
        print!("{}", report.table());
    }
    if report.interrupted {
        eprintln!(
            "[dspec] interrupted (Ctrl-C): the report covers the {} of {} prompts that completed a pass, over their completed passes",
            report.rows.len(),
            ids.len()
        );
    }
    if report.real_mismatches > 0 {
        bail!("speculative and plain greedy outputs differ where rounding cannot explain it (see the table): this is a bug in dspec, please report it");
    }
    if report.near_ties > 0 {
        eprintln!(
            "note: {} prompt(s) differ only at a near-tie (two logits within rounding of each other), which a batched verify may round the other way",
            report.near_ties
        );
    }
    Ok(())
}
