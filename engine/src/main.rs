//! The `dspec` command line: `generate`, `bench`, `score`, `adapters`, `convert`, and `--version`.

use std::io::{IsTerminal, Read, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use mlx_rs::Dtype;

use dspec_adapters::lora::LoraMode;
use dspec_engine::bench::{read_prompts, run_bench as bench_prompts, DEFAULT_PROMPTS};
use dspec_engine::decoding::drafting::{available_drafters, load_drafter};
use dspec_engine::decoding::generate::{generate, GenerationConfig, GenerationOutput};
use dspec_engine::decoding::sampling::SamplingParams;
use dspec_engine::decoding::speculative::{generate_speculative, Speculation};
use dspec_engine::loading::plugins::{registry_with_plugins, PluginOptions, PluginSearch};
use dspec_engine::loading::{load_model, load_model_with_lora};
use dspec_engine::runtime::{exit_process, version_report, Backend};
use dspec_engine::scoring::batch::{read_requests, render_text, run_requests, ScoreRequest, Sides};
use dspec_engine::scoring::{Measure, Scorer, ScorerAdapter, Windowing};
use dspec_engine::text::chat_template::{ChatMessage, ChatTemplate};
use dspec_engine::text::tokenizer::TextTokenizer;
use dspec_plugin_api::{AdapterRegistry, DraftAhead, DrafterOptions, LoadOptions, Quantization};

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
    #[command(flatten)]
    plugins: PluginArgs,
    #[command(subcommand)]
    command: Option<Command>,
}

/// Adapter plugins: shared libraries adding model families (see examples/adapter-plugin).
#[derive(Args)]
struct PluginArgs {
    /// Load the adapter plugin in FILE (repeatable). Plugins are also loaded from the
    /// directories in $DSPEC_PLUGIN_PATH and from $XDG_DATA_HOME/dspec/plugins
    /// (default ~/.local/share/dspec/plugins), in that order.
    #[arg(long = "plugin", value_name = "FILE", global = true)]
    plugin: Vec<PathBuf>,
    /// Let plugins load model types that a built-in adapter also handles (otherwise
    /// such a clash is an error).
    #[arg(long, global = true)]
    plugin_override: bool,
}

impl PluginArgs {
    /// The built-in adapters and every plugin found; notes go to stderr.
    fn registry(&self) -> Result<AdapterRegistry> {
        let options = PluginOptions {
            files: self.plugin.clone(),
            override_builtin: self.plugin_override,
        };
        let found = registry_with_plugins(&options, &PluginSearch::from_env())?;
        for note in &found.notes {
            eprintln!("note: {note}");
        }
        Ok(found.registry)
    }
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt.
    Generate(GenerateArgs),
    /// List the model families dspec can load, or explain which one a model dir uses.
    Adapters(AdaptersArgs),
    /// Convert a GGUF model file into a model directory `dspec generate` loads.
    Convert(ConvertArgs),
    /// Plain greedy vs speculative decoding on the same prompts, in one process.
    Bench(BenchArgs),
    /// How likely is a text: log-probability of a completion, rolling log-probabilities,
    /// or the next-token distribution; optionally with a LoRA adapter (--lora, --compare).
    Score(ScoreArgs),
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
enum VerifyArg {
    /// All positions of a verify in one forward (each weight read once).
    Batched,
    /// Each position through the one-token decode kernels: bitwise plain decoding.
    #[value(alias = "rowwise")]
    Exact,
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
    /// How a speculative verify runs the target. `batched`: all drafted positions in one
    /// forward, reading each weight once; where batched and one-row kernels round
    /// differently (bf16 on a GPU) greedy output may differ from plain greedy at
    /// near-ties of the logits (`dspec bench` reports each one). `exact`: each position
    /// through the one-token decode kernels, bitwise plain greedy on every backend, at the
    /// price of reading the weights once per position (on an H100, a 5-token verify of
    /// Qwen2.5-Coder-1.5B cost about 3 decode steps this way).
    #[arg(long, value_enum, default_value = "batched")]
    verify: VerifyArg,
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
        let rowwise_verify = matches!(self.verify, VerifyArg::Exact);
        Ok(LoadOptions {
            dtype,
            quantize,
            rowwise_verify,
        })
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
    /// Speculative decoding with this drafter: `ngram` (prompt lookup), a DFlash or
    /// DSpark checkpoint (directory or cached hub id; its config.json says which), or
    /// `model:DIR` (a smaller model with the target's tokenizer).
    #[arg(long)]
    drafter: Option<String>,
    #[command(flatten)]
    tuning: DraftTuning,
    /// Write one JSON line per speculative round (drafted tokens, accepted count) here.
    #[arg(long, requires = "drafter")]
    trace: Option<PathBuf>,
}

/// How a drafter drafts; shared by `generate` and `bench`.
#[derive(Args)]
struct DraftTuning {
    /// Longest n-gram the `ngram` drafter matches.
    #[arg(long, default_value_t = 3)]
    ngram: usize,
    /// Tokens drafted per round: N (always N, fewer only near the end), `auto` (chosen
    /// each round, up to 8, from the measured acceptance and draft/verify costs) or
    /// `auto:N` (the same, up to N).
    #[arg(long, default_value = "5", value_parser = parse_draft_length)]
    max_draft: DraftLengthArg,
    /// Quantize the drafter's weights on load: 4, 8, or 0 for full precision
    /// (default: DSpark 4, others full precision).
    #[arg(long, value_parser = ["0", "4", "8"])]
    drafter_bits: Option<String>,
    /// Cut a DSpark block where the drafter's confidence drops below this (0..1).
    #[arg(long)]
    confidence_threshold: Option<f32>,
    /// A draft model keeps drafting on its own thread while the target verifies, so the
    /// next round's drafts are often ready: `auto` (`on` for GPU backends, else `off`),
    /// `on`, `off`, or `eager` (a round whose drafts came true takes those ready then,
    /// at least one, instead of waiting for --max-draft of them).
    #[arg(long, default_value = "auto", value_parser = ["auto", "on", "off", "eager"])]
    draft_ahead: String,
}

/// `--max-draft`: a fixed count, or adaptive up to a bound.
#[derive(Debug, Clone, Copy)]
struct DraftLengthArg {
    max: usize,
    adaptive: bool,
}

/// Upper bound of `--max-draft auto`: past 8 drafts even a good drafter's later tokens
/// are rarely kept, and the rows of a verify are not free.
const AUTO_MAX_DRAFT: usize = 8;

fn parse_draft_length(s: &str) -> std::result::Result<DraftLengthArg, String> {
    let (adaptive, count) = match s.strip_prefix("auto") {
        Some("") => {
            return Ok(DraftLengthArg {
                max: AUTO_MAX_DRAFT,
                adaptive: true,
            })
        }
        Some(rest) => match rest.strip_prefix(':') {
            Some(n) => (true, n),
            None => (false, s),
        },
        None => (false, s),
    };
    match count.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(max) => Ok(DraftLengthArg { max, adaptive }),
        Err(_) => Err(format!(
            "expected a number of tokens (5), `auto` or `auto:N` (auto:12), got {s:?}"
        )),
    }
}

impl DraftTuning {
    fn options(&self, target_dtype: Dtype) -> Result<DrafterOptions> {
        if self.ngram == 0 {
            bail!("--ngram must be at least 1");
        }
        if let Some(t) = self.confidence_threshold {
            if !(0.0..=1.0).contains(&t) {
                bail!("--confidence-threshold must be between 0 and 1, got {t}");
            }
        }
        Ok(DrafterOptions {
            bits: match self.drafter_bits.as_deref() {
                Some(b) => Some(b.parse().context("--drafter-bits takes 0, 4 or 8")?),
                None => None,
            },
            confidence_threshold: self.confidence_threshold,
            ngram: self.ngram,
            dtype: Some(target_dtype),
            draft_ahead: match self.draft_ahead.as_str() {
                "on" => Some(DraftAhead::On),
                "off" => Some(DraftAhead::Off),
                "eager" => Some(DraftAhead::Eager),
                _ => None,
            },
        })
    }
}

#[derive(Args)]
struct BenchArgs {
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
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Feed prompts as raw text instead of through the model's chat template.
    #[arg(long)]
    no_chat_template: bool,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// Warm prefills timed per prompt after its first call (reported apart); the median
    /// is reported. 0 skips prefill measurement.
    #[arg(long, default_value_t = 3)]
    prefill_runs: usize,
    /// Also measure prefill of synthetic prompts of these lengths in tokens (the bench
    /// prompts' token ids repeated), e.g. 1024,4096,16384.
    #[arg(long, value_delimiter = ',', value_name = "TOKENS")]
    prefill_lengths: Vec<usize>,
}

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
struct ScoreArgs {
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
    /// Tokens listed by next-token (and its default for JSONL lines without "k").
    #[arg(long, default_value_t = 10)]
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
    /// Tokens per window for texts longer than this (default: the model's context).
    #[arg(long)]
    window: Option<usize>,
    /// Tokens between window starts (default: half the window).
    #[arg(long)]
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
        (false, Some(Command::Generate(args))) => run_generate(args, &cli.plugins),
        (false, Some(Command::Adapters(args))) => run_adapters(args, &cli.plugins),
        (false, Some(Command::Convert(args))) => run_convert(args),
        (false, Some(Command::Bench(args))) => run_bench(args, &cli.plugins),
        (false, Some(Command::Score(args))) => run_score(args, &cli.plugins),
        (false, None) => {
            eprintln!(
                "dspec: give a command (generate, bench, score, adapters, convert) or --help"
            );
            std::process::exit(2);
        }
    };
    let code = match result {
        Ok(()) => 0,
        Err(err) => {
            eprintln!("error: {err:#}");
            1
        }
    };
    exit_process(code);
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

/// The prompt as the model expects it: through its chat template (when it has one
/// and `use_template`), else as raw text.
fn encode_prompt(
    tokenizer: &TextTokenizer,
    text: &str,
    system: Option<&str>,
    use_template: bool,
    enable_thinking: Option<bool>,
) -> Result<Vec<u32>> {
    let Some(source) = tokenizer.chat_template().filter(|_| use_template) else {
        return Ok(tokenizer.encode_prompt(text, false)?);
    };
    let template = ChatTemplate::new(source, tokenizer.bos_token(), tokenizer.eos_token())?;
    let mut messages = Vec::new();
    if let Some(system) = system {
        messages.push(ChatMessage {
            role: "system".into(),
            content: system.to_string(),
        });
    }
    messages.push(ChatMessage {
        role: "user".into(),
        content: text.to_string(),
    });
    let mut extra = serde_json::Map::new();
    if let Some(thinking) = enable_thinking {
        extra.insert("enable_thinking".into(), thinking.into());
    }
    let rendered = template.render(&messages, true, &extra)?;
    Ok(tokenizer.encode_prompt(&rendered, true)?)
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

fn run_generate(args: GenerateArgs, plugins: &PluginArgs) -> Result<()> {
    let prompt_text = read_prompt(&args)?;
    let sampling = sampling_params(&args)?;
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let backend = Backend::detect();
    let options = args.model.load_options(backend)?;
    let registry = plugins.registry()?;
    let show_progress = std::io::stderr().is_terminal() && !args.json;
    let loaded = load_model(&args.model.target, &registry, &options, show_progress)?;
    let tokenizer = &loaded.tokenizer;

    let prompt_ids = encode_prompt(
        tokenizer,
        &prompt_text,
        args.system.as_deref(),
        !args.no_chat_template,
        args.enable_thinking,
    )?;

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
        Some(spec) => {
            let drafter_options = args.tuning.options(loaded.model.info().dtype)?;
            let mut drafter = load_drafter(spec, &loaded, &registry, &options, &drafter_options)
                .with_context(|| format!("loading --drafter {spec}"))?;
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
                },
                &mut on_text,
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

fn run_bench(args: BenchArgs, plugins: &PluginArgs) -> Result<()> {
    if args.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    if !args.prefill_lengths.is_empty() && args.prefill_runs == 0 {
        bail!("--prefill-lengths needs --prefill-runs of at least 1");
    }
    let prompts: Vec<String> = match &args.prompts {
        Some(path) => read_prompts(path)?,
        None => DEFAULT_PROMPTS.iter().map(|p| p.to_string()).collect(),
    };
    let backend = Backend::detect();
    let options = args.model.load_options(backend)?;
    let registry = plugins.registry()?;
    let show_progress = std::io::stderr().is_terminal() && !args.json;
    let loaded = load_model(&args.model.target, &registry, &options, show_progress)?;
    let drafter_options = args.tuning.options(loaded.model.info().dtype)?;
    let mut drafter = load_drafter(
        &args.drafter,
        &loaded,
        &registry,
        &options,
        &drafter_options,
    )
    .with_context(|| format!("loading --drafter {}", args.drafter))?;
    let ids = prompts
        .iter()
        .map(|p| encode_prompt(&loaded.tokenizer, p, None, !args.no_chat_template, None))
        .collect::<Result<Vec<_>>>()?;
    let settings = dspec_engine::bench::BenchSettings {
        max_tokens: args.max_tokens,
        max_draft: args.tuning.max_draft.max,
        adaptive: args.tuning.max_draft.adaptive,
        prefill: dspec_engine::bench::PrefillPlan {
            warm_runs: args.prefill_runs,
            synthetic_lengths: args.prefill_lengths.clone(),
        },
    };
    let report = bench_prompts(
        loaded.model.as_ref(),
        &loaded.tokenizer,
        drafter.as_mut(),
        &ids,
        &settings,
    )?;
    if args.json {
        let info = loaded.model.info();
        let out = serde_json::json!({
            "target": loaded.dir,
            "model_type": info.model_type,
            "dtype": format!("{:?}", info.dtype),
            "device": backend.device_name(),
            "drafter_arg": args.drafter,
            "report": report,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    } else {
        println!(
            "target {} on {}, drafter {} (max draft {}{}), {} greedy tokens per prompt",
            loaded.dir.display(),
            backend.device_name(),
            report.drafter,
            report.max_draft,
            if report.adaptive { ", adaptive" } else { "" },
            report.max_tokens
        );
        print!("{}", report.table());
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

fn run_score(args: ScoreArgs, plugins: &PluginArgs) -> Result<()> {
    // Bad requests fail before the weights load.
    let requests = args.requests()?;
    let backend = Backend::detect();
    let options = args.model.load_options(backend)?;
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
    let results = run_requests(&mut scorer, &requests, sides)?;
    let stats = scorer.stats();
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
            "stats": stats,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
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
    Ok(())
}

fn run_convert(args: ConvertArgs) -> Result<()> {
    use dspec_engine::formats::convert::{convert_gguf, ConvertOptions};
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

fn run_adapters(args: AdaptersArgs, plugins: &PluginArgs) -> Result<()> {
    let registry = plugins.registry()?;
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
    let drafters = available_drafters()?;
    let width = drafters.iter().map(|d| d.0.len()).max().unwrap_or(6).max(6);
    println!("\n{:<width$}  SUMMARY", "DRAFTER");
    for (kind, summary) in drafters {
        println!("{kind:<width$}  {summary}");
    }
    Ok(())
}
