//! The `dspec` command line: `generate`, `adapters`, and `--version`.

use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use mlx_rs::Dtype;

use dspec_engine::chat_template::{ChatMessage, ChatTemplate};
use dspec_engine::generate::{generate, GenerationConfig, GenerationOutput};
use dspec_engine::loading::{builtin_registry, load_model};
use dspec_engine::runtime::{version_report, Backend};
use dspec_engine::sampling::SamplingParams;
use dspec_engine::speculative::generate_speculative;
use dspec_plugin_api::{LoadOptions, Quantization};

#[derive(Parser)]
#[command(
    name = "dspec",
    about = "Speculative decoding for LLMs on MLX",
    disable_version_flag = true
)]
struct Cli {
    /// Print dspec's version, the MLX version and the default device.
    #[arg(short = 'V', long = "version")]
    version: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Generate(GenerateArgs),
    /// List the model families dspec can load, or explain which one a model dir uses.
    Adapters(AdaptersArgs),
    /// Convert a GGUF model file into a model directory `dspec generate` loads.
    Convert(ConvertArgs),
}

#[derive(Clone, Copy, ValueEnum)]
enum StoreDtype {
    Bf16,
    F16,
    F32,
}

#[derive(Args)]
struct ConvertArgs {
    /// The .gguf file.
    gguf: PathBuf,
    /// Directory to create (config.json, *.safetensors, tokenizer files).
    out_dir: PathBuf,
    /// Dtype of the stored float weights.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: StoreDtype,
    /// Store linear and embedding weights MLX-quantized (group size 64).
    #[arg(long, value_parser = ["4", "8"])]
    quantize: Option<String>,
}

#[derive(Clone, Copy, ValueEnum)]
enum DtypeArg {
    /// f32 on the CPU backend, the checkpoint's dtype on a GPU.
    Auto,
    F32,
    Bf16,
    F16,
}

#[derive(Args)]
struct ModelArgs {
    /// Model directory (config.json, tokenizer.json, *.safetensors) or a cached hub id.
    #[arg(long)]
    target: String,
    /// Cast float weights on load.
    #[arg(long, value_enum, default_value = "auto")]
    dtype: DtypeArg,
    /// Quantize the weights on load to this many bits (MLX affine, group size 64).
    #[arg(long, value_parser = ["4", "8"])]
    quantize: Option<String>,
}

impl ModelArgs {
    fn load_options(&self, backend: Backend) -> Result<LoadOptions> {
        let dtype = match self.dtype {
            DtypeArg::Auto => backend.auto_dtype(),
            DtypeArg::F32 => Some(Dtype::Float32),
            DtypeArg::Bf16 => Some(Dtype::Bfloat16),
            DtypeArg::F16 => Some(Dtype::Float16),
        };
        let quantize = match self.quantize.as_deref() {
            None => None,
            Some(bits) => Some(Quantization {
                bits: bits.parse().context("--quantize takes 4 or 8")?,
                group_size: 64,
            }),
        };
        Ok(LoadOptions { dtype, quantize })
    }
}

#[derive(Args)]
struct GenerateArgs {
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
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 means greedy decoding.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Nucleus sampling mass (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Drop tokens less likely than min_p × the most likely one (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this text is generated (repeatable); it is not printed.
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Print the text only when generation is done.
    #[arg(long)]
    no_stream: bool,
    /// Print one JSON object with the text and statistics.
    #[arg(long)]
    json: bool,
    /// Speculative decoding with this drafter: `ngram` (prompt lookup).
    #[arg(long)]
    drafter: Option<String>,
    /// Longest n-gram the `ngram` drafter matches.
    #[arg(long, default_value_t = 3)]
    ngram: usize,
    /// Most tokens drafted per round.
    #[arg(long, default_value_t = 5)]
    max_draft: usize,
}

#[derive(Args)]
struct AdaptersArgs {
    /// Report which adapter this model directory resolves to, and why.
    #[arg(long)]
    detect: Option<PathBuf>,
}

fn main() {
    let cli = Cli::parse();
    let result = match (cli.version, cli.command) {
        (true, _) => {
            println!("{}", version_report());
            Ok(())
        }
        (false, Some(Command::Generate(args))) => run_generate(args),
        (false, Some(Command::Adapters(args))) => run_adapters(args),
        (false, Some(Command::Convert(args))) => run_convert(args),
        (false, None) => {
            eprintln!("dspec: give a command (generate, adapters) or --help");
            std::process::exit(2);
        }
    };
    if let Err(err) = result {
        eprintln!("error: {err:#}");
        std::process::exit(1);
    }
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

fn sampling_params(args: &GenerateArgs) -> Result<SamplingParams> {
    if args.temperature < 0.0 || !args.temperature.is_finite() {
        bail!(
            "--temperature must be ≥ 0 (0 = greedy), got {}",
            args.temperature
        );
    }
    if !(args.top_p > 0.0 && args.top_p <= 1.0) {
        bail!("--top-p must be in (0, 1], got {}", args.top_p);
    }
    if !(0.0..1.0).contains(&args.min_p) {
        bail!("--min-p must be in [0, 1), got {}", args.min_p);
    }
    Ok(SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        seed: args.seed,
    })
}

fn run_generate(args: GenerateArgs) -> Result<()> {
    let prompt_text = read_prompt(&args)?;
    let sampling = sampling_params(&args)?;
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let backend = Backend::detect();
    let options = args.model.load_options(backend)?;
    let registry = builtin_registry()?;
    let show_progress = std::io::stderr().is_terminal() && !args.json;
    let loaded = load_model(&args.model.target, &registry, &options, show_progress)?;
    let tokenizer = &loaded.tokenizer;

    let prompt_ids = match tokenizer.chat_template().filter(|_| !args.no_chat_template) {
        Some(source) => {
            let template = ChatTemplate::new(source, tokenizer.bos_token(), tokenizer.eos_token())?;
            let mut messages = Vec::new();
            if let Some(system) = &args.system {
                messages.push(ChatMessage {
                    role: "system".into(),
                    content: system.clone(),
                });
            }
            messages.push(ChatMessage {
                role: "user".into(),
                content: prompt_text.clone(),
            });
            let mut extra = serde_json::Map::new();
            if let Some(thinking) = args.enable_thinking {
                extra.insert("enable_thinking".into(), thinking.into());
            }
            let rendered = template.render(&messages, true, &extra)?;
            tokenizer.encode_prompt(&rendered, true)?
        }
        None => tokenizer.encode_prompt(&prompt_text, false)?,
    };

    let config = GenerationConfig {
        max_tokens: args.max_tokens,
        sampling,
        stop_strings: args.stop.clone(),
        eos_ids: tokenizer.eos_token_ids().to_vec(),
    };
    let stream = !args.no_stream && !args.json;
    let mut stdout = std::io::stdout();
    let mut on_text = |piece: &str| {
        if stream {
            // A closed pipe (e.g. `| head`) is not an error worth a panic.
            let _ = stdout.write_all(piece.as_bytes());
            let _ = stdout.flush();
        }
    };
    let (output, speculative) = match args.drafter.as_deref() {
        None => (
            generate(
                loaded.model.as_ref(),
                tokenizer,
                &prompt_ids,
                &config,
                &mut on_text,
            )?,
            None,
        ),
        Some("ngram") => {
            if args.ngram == 0 || args.max_draft == 0 {
                bail!("--ngram and --max-draft must be at least 1");
            }
            let mut drafter = dspec_drafters::ngram::NgramDrafter::new(args.ngram);
            let out = generate_speculative(
                loaded.model.as_ref(),
                tokenizer,
                &prompt_ids,
                &config,
                dspec_engine::speculative::Speculation {
                    drafter: &mut drafter,
                    max_draft: args.max_draft,
                    trace: None,
                },
                &mut on_text,
            )?;
            let generation = GenerationOutput {
                text: out.text,
                tokens: out.tokens,
                stats: out.stats,
            };
            (generation, Some(out.speculative))
        }
        Some(other) => {
            bail!("--drafter `{other}` is not available in this build (available: ngram)")
        }
    };
    let s = &output.stats;
    if args.json {
        let info = loaded.model.info();
        let report = serde_json::json!({
            "text": output.text,
            "model": {
                "dir": loaded.dir,
                "adapter": loaded.adapter,
                "model_type": info.model_type,
                "dtype": format!("{:?}", info.dtype),
                "quantized_bits": info.quantized_bits,
                "device": backend.device_name(),
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
    }
    Ok(())
}

fn run_convert(args: ConvertArgs) -> Result<()> {
    use dspec_engine::convert::{convert_gguf, ConvertOptions};
    let options = ConvertOptions {
        dtype: match args.dtype {
            StoreDtype::Bf16 => Dtype::Bfloat16,
            StoreDtype::F16 => Dtype::Float16,
            StoreDtype::F32 => Dtype::Float32,
        },
        quantize_bits: match args.quantize.as_deref() {
            Some(bits) => Some(bits.parse().context("--quantize takes 4 or 8")?),
            None => None,
        },
    };
    let bar = if std::io::stderr().is_terminal() {
        indicatif::ProgressBar::new(0)
    } else {
        indicatif::ProgressBar::hidden()
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "converting [{bar:30}] {pos}/{len} tensors {elapsed}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    let progress = |done: usize, total: usize| {
        bar.set_length(total as u64);
        bar.set_position(done as u64);
    };
    let report = convert_gguf(&args.gguf, &args.out_dir, options, &progress)
        .with_context(|| format!("converting {}", args.gguf.display()))?;
    bar.finish_and_clear();
    eprintln!(
        "wrote {} ({}, {} tensors in {} file(s))",
        args.out_dir.display(),
        report.model_type,
        report.tensors,
        report.shards
    );
    Ok(())
}

fn run_adapters(args: AdaptersArgs) -> Result<()> {
    let registry = builtin_registry()?;
    if let Some(dir) = args.detect {
        let found = registry.detect(&dir)?;
        println!(
            "{}: adapter {} — {}",
            dir.display(),
            found.adapter.name,
            found.reason
        );
        return Ok(());
    }
    let rows: Vec<(String, String, String)> = registry
        .entries()
        .iter()
        .flat_map(|e| {
            let keys = e
                .model_types
                .iter()
                .cloned()
                .chain(e.aliases.iter().map(|a| format!("{a} (alias)")));
            keys.map(move |k| (k, e.name.clone(), e.source.to_string()))
        })
        .collect();
    let width = rows.iter().map(|r| r.0.len()).max().unwrap_or(10).max(10);
    let name_width = rows.iter().map(|r| r.1.len()).max().unwrap_or(7).max(7);
    println!(
        "{:<width$}  {:<name_width$}  SOURCE",
        "MODEL_TYPE", "ADAPTER"
    );
    for (key, name, source) in rows {
        println!("{key:<width$}  {name:<name_width$}  {source}");
    }
    Ok(())
}
