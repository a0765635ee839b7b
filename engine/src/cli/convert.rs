//! `dspec convert`: a GGUF file into a model directory that `dspec generate` loads, with
//! a progress bar on a terminal.

use std::io::IsTerminal;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Args, ValueEnum};
use mlx_rs::Dtype;

use super::args::{parse_positive_byte_size, QuantizeBits};

#[derive(Clone, Copy, ValueEnum)]
enum StoreDtype {
    Bf16,
    F16,
    F32,
}

#[derive(Args)]
pub struct ConvertArgs {
    /// The .gguf file.
    gguf: PathBuf,
    /// Directory to create (config.json, *.safetensors, tokenizer files).
    out_dir: PathBuf,
    /// Dtype of the stored float weights.
    #[arg(long, value_enum, default_value = "bf16")]
    dtype: StoreDtype,
    /// Store linear and embedding weights MLX-quantized (group size 64).
    #[arg(long, value_enum)]
    quantize: Option<QuantizeBits>,
    /// Start a new output shard once one holds this much: bytes, or with a KB, MB or GB
    /// suffix (powers of 1000). Several shards get Hugging Face's names
    /// (model-00001-of-00002.safetensors) and an index, so mlx-lm and transformers load them.
    #[arg(long, value_name = "SIZE", default_value = "2GB", value_parser = parse_positive_byte_size)]
    max_shard_size: u64,
}

pub fn run(args: ConvertArgs) -> Result<()> {
    use dspec_engine::formats::convert::{convert_gguf, ConvertError, ConvertOptions};
    let options = ConvertOptions {
        dtype: match args.dtype {
            StoreDtype::Bf16 => Dtype::Bfloat16,
            StoreDtype::F16 => Dtype::Float16,
            StoreDtype::F32 => Dtype::Float32,
        },
        quantize_bits: args.quantize.map(QuantizeBits::bits),
        max_shard_bytes: usize::try_from(args.max_shard_size).unwrap_or(usize::MAX),
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
    let report = match convert_gguf(&args.gguf, &args.out_dir, options, &progress) {
        Ok(report) => report,
        // The GGUF reader's errors and the file errors name their file already.
        Err(e @ (ConvertError::Gguf(_) | ConvertError::Io { .. })) => return Err(e.into()),
        Err(e) => return Err(e).with_context(|| format!("converting {}", args.gguf.display())),
    };
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
