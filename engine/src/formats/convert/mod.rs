//! `dspec convert FILE.gguf OUT_DIR`: a GGUF model → an HF-layout directory that
//! `dspec generate` loads (config.json, safetensors, tokenizer and generation configs).
//! Tensors are dequantized to f32 on the host, then stored as bf16/f16/f32 or MLX-quantized.

mod config;
mod tensors;
mod tokenizer;

use std::path::{Path, PathBuf};

use mlx_rs::{Array, Dtype};

pub use config::SUPPORTED_ARCHITECTURES;
use tensors::{hf_name, is_norm_weight, unpermute_qk};

use crate::formats::gguf::{GgufError, GgufFile};

#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(
        "GGUF architecture `{arch}` is not supported by dspec convert (supported: {supported})"
    )]
    UnsupportedArchitecture { arch: String, supported: String },
    #[error("{0}")]
    Invalid(String),
    #[error("{path}: {cause}")]
    Io {
        path: PathBuf,
        cause: std::io::Error,
    },
    #[error("MLX error: {0}")]
    Mlx(String),
}

impl From<mlx_rs::error::Exception> for ConvertError {
    fn from(e: mlx_rs::error::Exception) -> Self {
        ConvertError::Mlx(e.to_string())
    }
}

/// How to store the converted weights.
#[derive(Debug, Clone, Copy)]
pub struct ConvertOptions {
    pub dtype: Dtype,
    /// MLX affine quantization (bits) of linear and embedding weights, group size 64.
    pub quantize_bits: Option<i32>,
    /// A shard is closed once it holds this many bytes (so memory stays bounded too).
    pub max_shard_bytes: usize,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        Self {
            dtype: Dtype::Bfloat16,
            quantize_bits: None,
            max_shard_bytes: 2_000_000_000,
        }
    }
}

/// What a conversion produced.
pub struct ConvertReport {
    pub model_type: String,
    pub tensors: usize,
    pub shards: usize,
}

const QUANT_GROUP: i32 = 64;

fn write_json(dir: &Path, name: &str, value: &serde_json::Value) -> Result<(), ConvertError> {
    let path = dir.join(name);
    let text =
        serde_json::to_string_pretty(value).map_err(|e| ConvertError::Invalid(e.to_string()))?;
    std::fs::write(&path, text).map_err(|source| ConvertError::Io {
        path,
        cause: source,
    })
}

/// Converts `gguf` into `out_dir` (created; must not hold a model already).
/// `progress(done, total)` is called after each tensor.
pub fn convert_gguf(
    gguf: &Path,
    out_dir: &Path,
    options: ConvertOptions,
    progress: &dyn Fn(usize, usize),
) -> Result<ConvertReport, ConvertError> {
    let g = GgufFile::open(gguf)?;
    if out_dir.join("config.json").exists() {
        return Err(ConvertError::Invalid(format!(
            "{} already holds a model (config.json); choose an empty OUT_DIR",
            out_dir.display()
        )));
    }
    std::fs::create_dir_all(out_dir).map_err(|source| ConvertError::Io {
        path: out_dir.to_path_buf(),
        cause: source,
    })?;

    let embd = g
        .tensors()
        .iter()
        .find(|t| t.name == "token_embd.weight")
        .ok_or_else(|| ConvertError::Invalid("no token_embd.weight tensor".into()))?;
    let vocab_size = *embd.dims.last().unwrap_or(&0) as usize;
    let has_output = g.tensors().iter().any(|t| t.name == "output.weight");
    let hf = config::hf_config(&g, vocab_size, has_output)?;
    let model_type = hf.config["model_type"]
        .as_str()
        .unwrap_or_default()
        .to_string();

    let mut shard: Vec<(String, Array)> = Vec::new();
    let mut shard_bytes = 0usize;
    // Each tensor's shard, by index: shards get their names once their count is known.
    let mut weight_map: Vec<(String, usize)> = Vec::new();
    let mut shard_files: Vec<PathBuf> = Vec::new();
    let total = g.tensors().len();
    let mut converted = 0;
    let flush = |shard: &mut Vec<(String, Array)>,
                 files: &mut Vec<PathBuf>,
                 map: &mut Vec<(String, usize)>|
     -> Result<(), ConvertError> {
        if shard.is_empty() {
            return Ok(());
        }
        let path = out_dir.join(format!("shard-{:05}.safetensors", files.len() + 1));
        Array::save_safetensors(shard.iter().map(|(n, a)| (n.as_str(), a)), None, &path)
            .map_err(|e| ConvertError::Mlx(format!("writing {}: {e}", path.display())))?;
        map.extend(shard.iter().map(|(name, _)| (name.clone(), files.len())));
        files.push(path);
        shard.clear();
        Ok(())
    };

    for (i, info) in g.tensors().iter().enumerate() {
        progress(i, total);
        let Some(name) = hf_name(&info.name, hf.conventions) else {
            continue;
        };
        let shape = crate::formats::gguf::hf_shape(info);
        let mut data = g.dequantize_f32(info)?;
        if hf.conventions.permuted_qk {
            let rows = shape[0];
            let cols = shape.get(1).copied().unwrap_or(1);
            if name.contains("self_attn.q_proj") {
                data = unpermute_qk(&data, rows, cols, hf.heads);
            } else if name.contains("self_attn.k_proj") {
                data = unpermute_qk(&data, rows, cols, hf.kv_heads);
            }
        }
        if hf.conventions.norm_plus_one && is_norm_weight(&name) {
            data.iter_mut().for_each(|x| *x -= 1.0);
        }
        let dims: Vec<i32> = shape.iter().map(|&d| d as i32).collect();
        let array = Array::from_slice(&data, &dims).as_dtype(options.dtype)?;
        drop(data);
        // Linear weights, and stacked experts (`[experts, out, in]`), by their inputs.
        let quantizable = name.ends_with(".weight")
            && dims.len() >= 2
            && dims.last().is_some_and(|&inputs| inputs % QUANT_GROUP == 0);
        match options.quantize_bits.filter(|_| quantizable) {
            Some(bits) => {
                let (w, scales, biases) = mlx_rs::ops::quantize(&array, QUANT_GROUP, bits)?;
                let stem = name.trim_end_matches(".weight").to_string();
                for (n, a) in [
                    (name.clone(), w),
                    (format!("{stem}.scales"), scales),
                    (format!("{stem}.biases"), biases),
                ] {
                    a.eval()?;
                    shard_bytes += a.nbytes();
                    shard.push((n, a));
                }
            }
            None => {
                array.eval()?;
                shard_bytes += array.nbytes();
                shard.push((name, array));
            }
        }
        converted += 1;
        if shard_bytes >= options.max_shard_bytes {
            flush(&mut shard, &mut shard_files, &mut weight_map)?;
            shard_bytes = 0;
        }
    }
    flush(&mut shard, &mut shard_files, &mut weight_map)?;
    progress(total, total);

    // One shard is model.safetensors; several get Hugging Face's names
    // (model-00001-of-00003.safetensors), which mlx-lm and transformers find them by, and
    // an index.
    let count = shard_files.len();
    let final_name = |i: usize| match count {
        1 => "model.safetensors".to_string(),
        _ => format!("model-{:05}-of-{count:05}.safetensors", i + 1),
    };
    let mut total_size = 0u64;
    for (i, written) in shard_files.iter().enumerate() {
        total_size += std::fs::metadata(written).map_or(0, |m| m.len());
        let path = out_dir.join(final_name(i));
        std::fs::rename(written, &path).map_err(|source| ConvertError::Io {
            path,
            cause: source,
        })?;
    }
    if count > 1 {
        let weight_map: serde_json::Map<String, serde_json::Value> = weight_map
            .into_iter()
            .map(|(name, shard)| (name, final_name(shard).into()))
            .collect();
        write_json(
            out_dir,
            "model.safetensors.index.json",
            &serde_json::json!({"metadata": {"total_size": total_size}, "weight_map": weight_map}),
        )?;
    }

    let mut config = hf.config;
    config["torch_dtype"] = serde_json::json!(match options.dtype {
        Dtype::Float32 => "float32",
        Dtype::Float16 => "float16",
        _ => "bfloat16",
    });
    if let Some(bits) = options.quantize_bits {
        config["quantization"] = serde_json::json!({"group_size": QUANT_GROUP, "bits": bits});
    }
    write_json(out_dir, "config.json", &config)?;
    let (tok, tok_config, generation) = tokenizer::tokenizer_files(&g)?;
    write_json(out_dir, "tokenizer.json", &tok)?;
    write_json(out_dir, "tokenizer_config.json", &tok_config)?;
    write_json(out_dir, "generation_config.json", &generation)?;
    Ok(ConvertReport {
        model_type,
        tensors: converted,
        shards: shard_files.len(),
    })
}
