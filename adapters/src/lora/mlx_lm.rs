//! mlx-lm LoRA adapters: `adapter_config.json` (`fine_tune_type`, `lora_parameters`
//! with `rank` and `scale`) and `adapters.safetensors` with tensors named
//! `<module>.lora_a` (`[in, r]`) and `<module>.lora_b` (`[r, out]`), transposed here
//! into PEFT's layout. mlx-lm adds `scale · (x A) B` with the scale as written.

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

use dspec_plugin_api::error::{ModelError, Result};

use super::{open_tensor_file, take_matrix, FactorPairs, LoraAdapter, LoraFormat, LoraModule};

pub(super) const WEIGHTS_FILE: &str = "adapters.safetensors";

pub(super) fn read(
    dir: &Path,
    config_path: &Path,
    config: &Value,
    file: &Path,
) -> Result<LoraAdapter> {
    let err = |message: String| ModelError::config(config_path, message);
    match config["fine_tune_type"].as_str().unwrap_or("lora") {
        "lora" => {}
        "dora" => {
            return Err(err(
                "`fine_tune_type: \"dora\"`: DoRA adapters are not supported; use a plain LoRA adapter".into(),
            ))
        }
        "full" => {
            return Err(err(
                "`fine_tune_type: \"full\"` is a full fine-tune, not an adapter; fuse it into a model with mlx_lm.fuse and load that as --target".into(),
            ))
        }
        other => return Err(err(format!("unknown `fine_tune_type` `{other}`"))),
    }
    let params = &config["lora_parameters"];
    // mlx-lm's own default scale changed over time, so a file without one is ambiguous.
    let scale = params["scale"].as_f64().ok_or_else(|| {
        err("needs `lora_parameters.scale` (mlx-lm writes it when training)".into())
    })?;
    let declared_rank = params["rank"].as_f64();

    let mut weights = open_tensor_file(file)?;
    // Right after opening, every tensor of the file is still unclaimed.
    let names: Vec<String> = weights.unused().iter().map(|s| s.to_string()).collect();
    let mut factors = FactorPairs::new();
    for name in names {
        let (module, is_a) = factor_of(&name, file)?;
        // Stored as x·A·B factors; PEFT layout is their transposes.
        let matrix = take_matrix(&mut weights, &name, file)?.t();
        let slot = if is_a { &mut factors.a } else { &mut factors.b };
        slot.insert(module, (name, matrix));
    }
    let mut modules = BTreeMap::new();
    for (module, (a_name, a), (b_name, b)) in factors.into_pairs(file)? {
        let rank = a.shape()[0];
        if declared_rank.is_some_and(|r| r != rank as f64) {
            return Err(ModelError::config(
                file,
                format!(
                    "`{a_name}` has rank {rank}, but {} says `lora_parameters.rank` {}; the config and the weights do not belong together",
                    config_path.display(),
                    declared_rank.unwrap_or_default()
                ),
            ));
        }
        modules.insert(
            module,
            LoraModule {
                a,
                b,
                scale: scale as f32,
                a_name,
                b_name,
            },
        );
    }
    Ok(LoraAdapter {
        dir: dir.to_path_buf(),
        format: LoraFormat::MlxLm,
        weights_file: file.to_path_buf(),
        base_model: config["model"].as_str().map(str::to_string),
        modules,
    })
}

/// Maps a tensor name to (module name, whether it is the A factor), refusing what is no
/// plain LoRA factor.
fn factor_of(name: &str, file: &Path) -> Result<(String, bool)> {
    let refuse = |why: &str| Err(ModelError::config(file, format!("tensor `{name}`: {why}")));
    if let Some(module) = name.strip_suffix(".lora_a") {
        return Ok((module.to_string(), true));
    }
    if let Some(module) = name.strip_suffix(".lora_b") {
        return Ok((module.to_string(), false));
    }
    if name.ends_with(".m") {
        return refuse("DoRA magnitudes are not supported; use a plain LoRA adapter");
    }
    if name.contains(".lora_a_") || name.contains(".lora_b_") {
        return refuse("quantized LoRA factors are not supported; save the adapter unquantized");
    }
    refuse("not a LoRA factor (`lora_a`/`lora_b`); was this adapter trained with --fine-tune-type full?")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_names_map_to_modules_and_others_are_refused() {
        let file = Path::new("adapters.safetensors");
        assert_eq!(
            factor_of("model.layers.2.mlp.down_proj.lora_b", file).unwrap(),
            ("model.layers.2.mlp.down_proj".to_string(), false)
        );
        for (bad, says) in [
            ("model.layers.0.self_attn.q_proj.m", "DoRA"),
            ("model.layers.0.self_attn.q_proj.lora_a_scales", "quantized"),
            ("model.layers.0.self_attn.q_proj.weight", "full"),
        ] {
            let e = factor_of(bad, file).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains(says), "{e}");
        }
    }
}
