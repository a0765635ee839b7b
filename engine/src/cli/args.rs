//! Argument groups more than one subcommand takes: the plugins to load (global), the
//! target and how to load it, and how a drafter drafts.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use mlx_rs::Dtype;

use dspec_engine::loading::plugins::{registry_with_plugins, PluginOptions, PluginSearch};
use dspec_engine::runtime::Backend;
use dspec_plugin_api::{AdapterRegistry, DraftAhead, DrafterOptions, LoadOptions, Quantization};

/// Adapter plugins: shared libraries adding model families (see examples/adapter-plugin).
#[derive(Args)]
pub struct PluginArgs {
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
    pub fn registry(&self) -> Result<AdapterRegistry> {
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
pub struct ModelArgs {
    /// Model directory (config.json, tokenizer.json, *.safetensors) or a cached hub id.
    #[arg(long)]
    pub target: String,
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
    pub fn load_options(&self, backend: Backend) -> Result<LoadOptions> {
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

/// How a drafter drafts; shared by `generate` and `bench`.
#[derive(Args)]
pub struct DraftTuning {
    /// Longest n-gram the `ngram` drafter matches.
    #[arg(long, default_value_t = 3)]
    ngram: usize,
    /// Tokens drafted per round: N (always N, fewer only near the end), `auto` (chosen
    /// each round, up to 8, from the measured acceptance and draft/verify costs) or
    /// `auto:N` (the same, up to N).
    #[arg(long, default_value = "5", value_parser = parse_draft_length)]
    pub max_draft: DraftLengthArg,
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
pub struct DraftLengthArg {
    pub max: usize,
    pub adaptive: bool,
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
    pub fn options(&self, target_dtype: Dtype) -> Result<DrafterOptions> {
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
