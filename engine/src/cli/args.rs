//! Argument groups more than one subcommand takes: the plugins to load (global), the
//! target and how to load it, and how a drafter drafts.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};
use mlx_rs::Dtype;

use dspec_engine::decoding::sampling::{SamplingParams, MAX_TOP_K};
use dspec_engine::decoding::speculative::VerifyAheadMode;
use dspec_engine::loading::distributed::{self, Distributed};
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

/// `--quantize`: bits of MLX's affine quantization (group size 64).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum QuantizeBits {
    #[value(name = "4")]
    Four,
    #[value(name = "8")]
    Eight,
}

impl QuantizeBits {
    pub fn bits(self) -> i32 {
        match self {
            QuantizeBits::Four => 4,
            QuantizeBits::Eight => 8,
        }
    }
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
    #[arg(long, value_enum)]
    quantize: Option<QuantizeBits>,
    /// How a speculative verify runs the target. `batched`: all drafted positions in one
    /// forward, reading each weight once; where batched and one-row kernels round
    /// differently (bf16 on a GPU) greedy output may differ from plain greedy at
    /// near-ties of the logits (`dspec bench` reports each one). `exact`: each position
    /// through the one-token decode kernels, bitwise plain greedy on every backend, at the
    /// price of reading the weights once per position (docs/benchmarks.md measures what
    /// a verify costs either way).
    #[arg(long, value_enum, default_value = "batched")]
    verify: VerifyArg,
}

impl ModelArgs {
    pub fn load_options(&self, backend: Backend) -> LoadOptions {
        let dtype = match self.dtype {
            DtypeArg::Auto => backend.auto_dtype(),
            DtypeArg::F32 => Some(Dtype::Float32),
            DtypeArg::Bf16 => Some(Dtype::Bfloat16),
            DtypeArg::F16 => Some(Dtype::Float16),
        };
        let quantize = self.quantize.map(|bits| Quantization {
            bits: bits.bits(),
            group_size: 64,
        });
        let rowwise_verify = matches!(self.verify, VerifyArg::Exact);
        LoadOptions {
            dtype,
            quantize,
            rowwise_verify,
            verify_kernels: false,
            verifies_waited_on: false,
        }
    }
}

/// A whole-number flag's parser that refuses values outside `lo..=hi`, naming the range
/// (clap's own range parsers give `u64`/`i64`, not the `usize` the code counts in).
pub fn count_in(
    lo: usize,
    hi: usize,
) -> impl Fn(&str) -> std::result::Result<usize, String> + Clone {
    move |s: &str| match s.trim().parse::<usize>() {
        Ok(n) if (lo..=hi).contains(&n) => Ok(n),
        _ => Err(format!(
            "expected a whole number from {lo} to {hi}, got {s:?}"
        )),
    }
}

/// A clap value parser for a number from `lo` to `hi`, the ends included except `lo`
/// when `lo_open` (a rate that must be above 0); the message gives the range.
pub fn number_in(
    lo: f32,
    hi: f32,
    lo_open: bool,
) -> impl Fn(&str) -> std::result::Result<f32, String> + Clone {
    move |s: &str| {
        let above_lo = |x: f32| if lo_open { x > lo } else { x >= lo };
        match s.trim().parse::<f32>() {
            Ok(x) if above_lo(x) && x <= hi => Ok(x),
            _ => Err(format!(
                "expected a number {} {lo} and at most {hi}, got {s:?}",
                if lo_open { "above" } else { "from" }
            )),
        }
    }
}

/// How tokens are sampled; shared by `generate` and `bench` (whose help says what it
/// does with them).
#[derive(Args)]
pub struct SamplingArgs {
    /// 0 means greedy decoding; else 0.001 to 100.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Keep only the k most likely tokens (0 = off; 0 to 1000000).
    #[arg(long, default_value_t = 0, value_parser = count_in(0, MAX_TOP_K))]
    top_k: usize,
    /// Nucleus sampling mass, in (0, 1] (1 = off).
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Drop tokens less likely than min_p × the most likely one, in [0, 1) (0 = off).
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    /// Seed for reproducible sampling, 0 to 2^64 − 1 (default: from the OS).
    #[arg(long)]
    seed: Option<u64>,
}

impl SamplingArgs {
    /// The flags as sampling parameters, each checked against its range.
    pub fn params(&self) -> Result<SamplingParams> {
        let params = SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            seed: self.seed,
        };
        if let Some(bad) = params.out_of_range() {
            bail!(
                "--{} must be {}, got {}",
                bad.field.replace('_', "-"),
                bad.range,
                bad.got
            );
        }
        Ok(params)
    }

    /// The filters given without a temperature, which greedy decoding ignores (for a
    /// command where that is a mistake worth naming).
    pub fn filters_without_temperature(&self) -> Vec<&'static str> {
        if self.temperature > 0.0 {
            return Vec::new();
        }
        [
            (self.top_k != 0, "--top-k"),
            (self.top_p != 1.0, "--top-p"),
            (self.min_p != 0.0, "--min-p"),
            (self.seed.is_some(), "--seed"),
        ]
        .into_iter()
        .filter_map(|(given, flag)| given.then_some(flag))
        .collect()
    }
}

/// How a drafter drafts; shared by `generate` and `bench`.
#[derive(Args)]
pub struct DraftTuning {
    /// Longest n-gram the `ngram` drafter matches (1 to 32).
    #[arg(long, default_value_t = 3, value_parser = count_in(1, 32))]
    ngram: usize,
    /// Tokens drafted per round: N (always N, fewer only near the end), `auto` (chosen
    /// each round, up to 8, from the measured acceptance and draft/verify costs) or
    /// `auto:N` (the same, up to N); N from 1 to 64.
    #[arg(long, default_value = "5", value_parser = parse_draft_length)]
    pub max_draft: DraftLengthArg,
    /// Quantize the drafter's weights on load: 4, 8, or 0 for full precision
    /// (default: DSpark 4, or 0 on CUDA; others full precision).
    #[arg(long, value_enum)]
    drafter_bits: Option<DrafterBits>,
    /// Cut a DSpark block where the drafter's confidence drops below this (0 to 1).
    #[arg(long, value_parser = number_in(0.0, 1.0, false))]
    confidence_threshold: Option<f32>,
    /// A draft model keeps drafting on its own thread while the target verifies, so the
    /// next round's drafts are often ready.
    #[arg(long, value_enum, default_value = "auto")]
    draft_ahead: DraftAheadArg,
    /// Greedy rounds of the `ngram` drafter queue the next round's verify before reading
    /// this one's, guessing that it keeps every draft, so the host builds a round while
    /// the device runs the one before.
    #[arg(long, value_enum, default_value = "auto")]
    verify_ahead: VerifyAheadArg,
}

/// `--verify-ahead`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum VerifyAheadArg {
    /// Behind rounds whose lookup found nothing to draft, which nothing can reject, at a
    /// fixed --max-draft: those then run at plain decoding's pipelined speed. Off on the
    /// CPU, whose host work and arithmetic share the cores.
    Auto,
    /// Behind every round, on the guess that it keeps every draft.
    Always,
    /// Read each round before queueing the next.
    Off,
}

/// `--drafter-bits`: 0 keeps the drafter's weights at full precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DrafterBits {
    #[value(name = "0")]
    Full,
    #[value(name = "4")]
    Four,
    #[value(name = "8")]
    Eight,
}

impl DrafterBits {
    fn bits(self) -> i32 {
        match self {
            DrafterBits::Full => 0,
            DrafterBits::Four => 4,
            DrafterBits::Eight => 8,
        }
    }
}

/// `--draft-ahead`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DraftAheadArg {
    /// `on` for GPU backends, else `off`.
    Auto,
    /// Draft ahead; a round still waits for --max-draft drafts.
    On,
    /// Draft only when a round asks.
    Off,
    /// Draft ahead, and a round whose drafts came true takes those ready then, at least
    /// one, instead of waiting for --max-draft of them.
    Eager,
}

/// `--max-draft`: a fixed count, or adaptive up to a bound.
#[derive(Debug, Clone, Copy)]
pub struct DraftLengthArg {
    pub max: usize,
    pub adaptive: bool,
}

/// The most `--max-draft` takes.
const MAX_DRAFT: usize = 64;

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
        Ok(max @ 1..=MAX_DRAFT) => Ok(DraftLengthArg { max, adaptive }),
        Ok(n) => Err(format!(
            "{n} drafts a round is outside 1 to {MAX_DRAFT}: later drafts are almost never kept, and a verify's rows are not free"
        )),
        Err(_) => Err(format!(
            "expected a number of tokens (5), `auto` or `auto:N` (auto:12), got {s:?}"
        )),
    }
}

impl DraftTuning {
    /// Refuses what would make ranks of a group draft differently, and turns drafting
    /// ahead off: every rank runs the drafter and must propose the same drafts, while
    /// `--max-draft auto` chooses from each rank's own timings and a draft thread's
    /// forwards depend on when the target's rounds end.
    pub fn for_group(&mut self) -> Result<()> {
        if self.max_draft.adaptive {
            bail!(
                "--max-draft auto chooses draft lengths from this process's timings, which differ \
                 between the ranks of a distributed group; give a fixed --max-draft N"
            );
        }
        match self.draft_ahead {
            DraftAheadArg::Auto | DraftAheadArg::Off => {
                self.draft_ahead = DraftAheadArg::Off;
                Ok(())
            }
            DraftAheadArg::On | DraftAheadArg::Eager => bail!(
                "--draft-ahead on/eager lets timing decide how the draft model batches its \
                 forwards, and the ranks of a distributed group must draft the same tokens; \
                 use --draft-ahead off (the default in a group)"
            ),
        }
    }

    /// When rounds are queued ahead (`--verify-ahead`). On the CPU nothing overlaps, so
    /// a round queued ahead saves nothing, and a lookup of one token, which a round queued
    /// behind one without drafts takes as its guess, goes undrafted.
    pub fn verify_ahead(&self) -> VerifyAheadMode {
        match self.verify_ahead {
            VerifyAheadArg::Auto => match Backend::current() {
                Backend::Cpu => VerifyAheadMode::Off,
                Backend::Cuda | Backend::Metal => VerifyAheadMode::Auto,
            },
            VerifyAheadArg::Always => VerifyAheadMode::Always,
            VerifyAheadArg::Off => VerifyAheadMode::Off,
        }
    }

    /// `max_new_tokens`: `--max-tokens`, so a draft model can size its cache once.
    pub fn options(&self, target_dtype: Dtype, max_new_tokens: usize) -> Result<DrafterOptions> {
        Ok(DrafterOptions {
            bits: self.drafter_bits.map(DrafterBits::bits),
            confidence_threshold: self.confidence_threshold,
            ngram: self.ngram,
            dtype: Some(target_dtype),
            draft_ahead: match self.draft_ahead {
                DraftAheadArg::Auto => None,
                DraftAheadArg::On => Some(DraftAhead::On),
                DraftAheadArg::Off => Some(DraftAhead::Off),
                DraftAheadArg::Eager => Some(DraftAhead::Eager),
            },
            max_new_tokens: Some(max_new_tokens),
            // Decided with the target's load options, in `load_drafter`.
            kernels: false,
        })
    }
}

/// `--distributed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum DistributedArg {
    /// Join a group when MLX's launch environment describes one (MLX_RANK with
    /// MLX_HOSTFILE, as mlx.launch sets them) or --mlx-hostfile is given.
    Auto,
    /// Require a group.
    On,
    /// Run alone whatever the environment says.
    Off,
}

/// `--distributed-backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    /// The backend whose environment is set.
    Any,
    /// TCP between the ranks (MLX_HOSTFILE).
    Ring,
    Mpi,
    /// NVIDIA GPUs (a CUDA libmlx).
    Nccl,
    /// Thunderbolt RDMA between Macs.
    Jaccl,
}

/// Running as one rank of an MLX distributed group: the target's layers split across
/// the ranks (tensor parallelism); see docs/distributed.md.
#[derive(Args)]
pub struct DistributedArgs {
    /// Split the target across an MLX distributed group: `auto` joins one when MLX's
    /// launch environment (mlx.launch) or --mlx-hostfile describes one, `on` requires
    /// one, `off` runs alone. Only rank 0 prints.
    #[arg(long, value_enum, default_value = "auto")]
    distributed: DistributedArg,
    /// MLX backend to join through (`any`: the one whose environment is set).
    #[arg(long, value_enum, default_value = "any")]
    distributed_backend: BackendArg,
    /// The ring backend's hostfile, as MLX_HOSTFILE would name it: a JSON list with,
    /// per rank, the list of "ip:port" it listens on. With --mlx-rank, instead of
    /// mlx.launch.
    #[arg(long, value_name = "FILE", requires = "mlx_rank")]
    mlx_hostfile: Option<PathBuf>,
    /// This process's rank in --mlx-hostfile, from 0 (the first) to its ranks less one.
    #[arg(long, value_name = "N", requires = "mlx_hostfile", value_parser = clap::value_parser!(i32).range(0..))]
    mlx_rank: Option<i32>,
    /// Seconds a rank waits for the group to form, or goes without progress while
    /// computing with it, before it exits with an error naming the ranks it waits on
    /// (1 or more).
    #[arg(long, default_value_t = 300, value_name = "SECONDS", value_parser = clap::value_parser!(u64).range(1..))]
    distributed_timeout: u64,
}

impl DistributedArgs {
    /// The group to join, or `None` to run alone.
    pub fn join(&self) -> Result<Option<Distributed>> {
        let settings = distributed::Settings {
            mode: match self.distributed {
                DistributedArg::Auto => distributed::Mode::Auto,
                DistributedArg::On => distributed::Mode::On,
                DistributedArg::Off => distributed::Mode::Off,
            },
            backend: match self.distributed_backend {
                BackendArg::Any => "any",
                BackendArg::Ring => "ring",
                BackendArg::Mpi => "mpi",
                BackendArg::Nccl => "nccl",
                BackendArg::Jaccl => "jaccl",
            }
            .to_string(),
            hostfile: self.mlx_hostfile.clone(),
            rank: self.mlx_rank,
            timeout: std::time::Duration::from_secs(self.distributed_timeout),
        };
        Ok(distributed::join(&settings)?)
    }
}

/// Runs `run` alone, or as one rank of `joined` (from [`DistributedArgs::join`], which
/// must come first: joining starts MLX's backend, before any thread uses MLX). In a group,
/// every rank ends only once all have finished: a rank that failed late makes the others
/// fail too, rather than report a success it cannot vouch for.
pub fn run_joined(
    joined: Option<Distributed>,
    run: impl FnOnce(Option<&Distributed>) -> Result<()>,
) -> Result<()> {
    match joined {
        None => run(None),
        Some(group) => {
            run(Some(&group)).with_context(|| group.describe_failure())?;
            group.finish().with_context(|| group.describe_failure())?;
            Ok(())
        }
    }
}

/// `123`, `64KB`, `500MB`, `2GB` → bytes (powers of 1000).
pub fn parse_byte_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let upper = t.to_ascii_uppercase();
    let (digits, unit) = match ["KB", "MB", "GB"].iter().position(|u| upper.ends_with(u)) {
        Some(i) => (&t[..t.len() - 2], 1000u64.pow(i as u32 + 1)),
        None => (t, 1),
    };
    digits
        .trim()
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(|| {
            format!("'{s}' is not a size: write bytes or a number with KB, MB or GB, e.g. 2GB")
        })
}

/// [`parse_byte_size`], refusing 0.
pub fn parse_positive_byte_size(s: &str) -> std::result::Result<u64, String> {
    match parse_byte_size(s)? {
        0 => Err(format!("'{s}' is not a size above 0: write e.g. 2GB")),
        n => Ok(n),
    }
}

#[cfg(test)]
mod tests {
    use clap::error::ErrorKind;
    use clap::Parser;

    use super::*;

    /// The shared groups as `generate` and `bench` flatten them.
    #[derive(Parser)]
    struct Probe {
        #[command(flatten)]
        model: ModelArgs,
        #[command(flatten)]
        tuning: DraftTuning,
    }

    fn parse(extra: &[&str]) -> Result<Probe, clap::Error> {
        let args = ["dspec", "--target", "model-dir"];
        Probe::try_parse_from(args.iter().chain(extra))
    }

    fn rejected(extra: &[&str], flag: &str) {
        let err = parse(extra)
            .err()
            .unwrap_or_else(|| panic!("{extra:?} accepted"));
        assert_eq!(err.kind(), ErrorKind::InvalidValue, "{extra:?}: {err}");
        assert!(err.to_string().contains(flag), "{err}");
    }

    fn drafter_options(extra: &[&str]) -> DrafterOptions {
        let probe = parse(extra).unwrap_or_else(|e| panic!("{extra:?}: {e}"));
        probe
            .tuning
            .options(Dtype::Float32, 16)
            .unwrap_or_else(|e| panic!("{extra:?}: {e}"))
    }

    #[test]
    fn quantize_takes_4_or_8() {
        let bits = |extra: &[&str]| {
            let probe = parse(extra).unwrap_or_else(|e| panic!("{extra:?}: {e}"));
            let options = probe.model.load_options(Backend::Cpu);
            options.quantize.map(|q| (q.bits, q.group_size))
        };
        assert_eq!(bits(&[]), None);
        assert_eq!(bits(&["--quantize", "4"]), Some((4, 64)));
        assert_eq!(bits(&["--quantize", "8"]), Some((8, 64)));
        for bad in ["3", "16", "four"] {
            rejected(&["--quantize", bad], "--quantize");
        }
    }

    #[test]
    fn verify_exact_and_its_alias_rowwise_select_the_rowwise_verify() {
        let rowwise = |extra: &[&str]| {
            let probe = parse(extra).unwrap_or_else(|e| panic!("{extra:?}: {e}"));
            probe.model.load_options(Backend::Cpu).rowwise_verify
        };
        assert!(!rowwise(&[]));
        assert!(!rowwise(&["--verify", "batched"]));
        assert!(rowwise(&["--verify", "exact"]));
        assert!(rowwise(&["--verify", "rowwise"]));
        rejected(&["--verify", "fast"], "--verify");
    }

    #[test]
    fn dtype_auto_follows_the_backend() {
        let probe = parse(&[]).expect("defaults parse");
        assert_eq!(
            probe.model.load_options(Backend::Cpu).dtype,
            Backend::Cpu.auto_dtype()
        );
        let probe = parse(&["--dtype", "bf16"]).expect("bf16 parses");
        assert_eq!(
            probe.model.load_options(Backend::Cpu).dtype,
            Some(Dtype::Bfloat16)
        );
    }

    #[test]
    fn drafter_bits_take_0_4_or_8() {
        assert_eq!(drafter_options(&[]).bits, None);
        for (arg, bits) in [("0", 0), ("4", 4), ("8", 8)] {
            assert_eq!(
                drafter_options(&["--drafter-bits", arg]).bits,
                Some(bits),
                "{arg}"
            );
        }
        rejected(&["--drafter-bits", "2"], "--drafter-bits");
    }

    #[test]
    fn draft_ahead_values_map_to_the_drafter_option() {
        assert_eq!(drafter_options(&[]).draft_ahead, None, "default auto");
        for (arg, ahead) in [
            ("auto", None),
            ("on", Some(DraftAhead::On)),
            ("off", Some(DraftAhead::Off)),
            ("eager", Some(DraftAhead::Eager)),
        ] {
            assert_eq!(
                drafter_options(&["--draft-ahead", arg]).draft_ahead,
                ahead,
                "{arg}"
            );
        }
        rejected(&["--draft-ahead", "sometimes"], "--draft-ahead");
    }

    #[test]
    fn verify_ahead_values_map_to_the_modes() {
        let mode = |extra: &[&str]| parse(extra).expect("parses").tuning.verify_ahead();
        let auto = match Backend::current() {
            Backend::Cpu => VerifyAheadMode::Off,
            Backend::Cuda | Backend::Metal => VerifyAheadMode::Auto,
        };
        assert_eq!(mode(&[]), auto, "default auto: off on the CPU");
        assert_eq!(mode(&["--verify-ahead", "auto"]), auto);
        assert_eq!(mode(&["--verify-ahead", "always"]), VerifyAheadMode::Always);
        assert_eq!(mode(&["--verify-ahead", "off"]), VerifyAheadMode::Off);
        rejected(&["--verify-ahead", "on"], "--verify-ahead");
    }

    #[test]
    fn max_draft_is_a_count_auto_or_auto_with_a_bound() {
        let length = |extra: &[&str]| {
            let probe = parse(extra).unwrap_or_else(|e| panic!("{extra:?}: {e}"));
            (probe.tuning.max_draft.max, probe.tuning.max_draft.adaptive)
        };
        assert_eq!(length(&[]), (5, false));
        assert_eq!(length(&["--max-draft", "12"]), (12, false));
        assert_eq!(length(&["--max-draft", "auto"]), (AUTO_MAX_DRAFT, true));
        assert_eq!(length(&["--max-draft", "auto:3"]), (3, true));
        for bad in ["0", "auto:0", "many", "auto3", "-1"] {
            assert!(parse(&["--max-draft", bad]).is_err(), "{bad}");
        }
    }

    /// In a group: a fixed draft length and no draft thread running ahead, since both
    /// would let each rank's own timing choose what it drafts.
    #[test]
    fn a_group_needs_timing_free_drafting() {
        let mut probe = parse(&[]).expect("defaults parse");
        probe.tuning.for_group().expect("defaults suit a group");
        let options = probe.tuning.options(Dtype::Float32, 16).expect("options");
        assert_eq!(options.draft_ahead, Some(DraftAhead::Off), "auto is off");
        let mut always = parse(&["--verify-ahead", "always"]).expect("parses");
        always
            .tuning
            .for_group()
            .expect("queueing ahead does not depend on timings");
        assert_eq!(always.tuning.verify_ahead(), VerifyAheadMode::Always);
        for (extra, says) in [
            (&["--max-draft", "auto:4"][..], "--max-draft"),
            (&["--draft-ahead", "on"][..], "--draft-ahead"),
            (&["--draft-ahead", "eager"][..], "--draft-ahead"),
        ] {
            let mut probe = parse(extra).expect("parses");
            let err = probe.tuning.for_group().expect_err("refused in a group");
            assert!(err.to_string().contains(says), "{extra:?}: {err}");
        }
    }

    #[test]
    fn drafter_option_ranges_are_checked() {
        let err = parse(&["--ngram", "0"])
            .err()
            .expect("refused while parsing");
        assert!(err.to_string().contains("1 to 32"), "{err}");
        let err = parse(&["--confidence-threshold", "1.5"])
            .err()
            .expect("refused while parsing");
        assert!(err.to_string().contains("from 0 and at most 1"), "{err}");
        let probe = parse(&["--confidence-threshold", "0.5"]).expect("parses");
        let options = probe.tuning.options(Dtype::Float32, 16).expect("in range");
        assert_eq!(options.confidence_threshold, Some(0.5));
    }
}
