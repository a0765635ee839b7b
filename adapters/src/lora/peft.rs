//! Hugging Face PEFT LoRA adapters: `adapter_config.json` (r, lora_alpha, rsLoRA,
//! per-module rank/alpha patterns) and `adapter_model.safetensors` with tensors named
//! `base_model.model.<module>.lora_A.weight` (`[r, in]`) and `.lora_B.weight` (`[out, r]`).

use std::collections::BTreeMap;
use std::path::Path;

use regex::Regex;
use serde_json::Value;

use dspec_plugin_api::error::{ModelError, Result};

use super::{open_tensor_file, take_matrix, FactorPairs, LoraAdapter, LoraFormat, LoraModule};

pub(super) const WEIGHTS_FILE: &str = "adapter_model.safetensors";

/// What PEFT puts in front of the base model's own module names.
const PEFT_PREFIX: &str = "base_model.model.";

pub(super) fn read(
    dir: &Path,
    config_path: &Path,
    config: &Value,
    file: &Path,
) -> Result<LoraAdapter> {
    let settings = PeftSettings::parse(config, config_path)?;
    let mut weights = open_tensor_file(file)?;
    // Right after opening, every tensor of the file is still unclaimed.
    let names: Vec<String> = weights.unused().iter().map(|s| s.to_string()).collect();
    let mut factors = FactorPairs::new();
    for name in names {
        let (module, is_a) = factor_of(&name, file)?;
        let matrix = take_matrix(&mut weights, &name, file)?;
        let slot = if is_a { &mut factors.a } else { &mut factors.b };
        slot.insert(module, (name, matrix));
    }
    let mut modules = BTreeMap::new();
    for (module, (a_name, a), (b_name, b)) in factors.into_pairs(file)? {
        let rank = a.shape()[0];
        let expected = settings.rank_for(&module, config_path)?;
        if rank as f64 != expected {
            return Err(ModelError::config(
                file,
                format!(
                    "`{a_name}` has rank {rank}, but {} says rank {expected} for `{module}` \
                     (`r`, or a `rank_pattern` entry); the config and the weights do not belong together",
                    config_path.display()
                ),
            ));
        }
        let alpha = settings.alpha_for(&module, config_path)?;
        let scale = if settings.rslora {
            alpha / (rank as f64).sqrt()
        } else {
            alpha / rank as f64
        };
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
        format: LoraFormat::Peft,
        weights_file: file.to_path_buf(),
        base_model: config["base_model_name_or_path"]
            .as_str()
            .map(str::to_string),
        modules,
    })
}

/// Maps a tensor name to (HF module name, whether it is the A factor), refusing every
/// tensor that is not a plain LoRA factor with what it is and why.
fn factor_of(name: &str, file: &Path) -> Result<(String, bool)> {
    let refuse = |why: &str| Err(ModelError::config(file, format!("tensor `{name}`: {why}")));
    let inner = name.strip_prefix(PEFT_PREFIX).unwrap_or(name);
    if inner.contains("lora_embedding_") {
        return refuse("LoRA on embeddings is not supported (only linear layers)");
    }
    if inner.contains("lora_magnitude_vector") {
        return refuse("DoRA magnitudes are not supported; use a plain LoRA adapter");
    }
    for (marker, is_a) in [(".lora_A.", true), (".lora_B.", false)] {
        if let Some((module, rest)) = inner.split_once(marker) {
            // PEFT drops the adapter name when saving; older files may keep `default.`.
            return match rest {
                "weight" | "default.weight" => Ok((module.to_string(), is_a)),
                "bias" | "default.bias" => refuse("LoRA biases (`lora_bias`) are not supported"),
                _ => refuse("not a LoRA factor dspec understands"),
            };
        }
    }
    refuse(
        "not a LoRA factor (a `modules_to_save` copy or a trained bias?); dspec applies \
         LoRA factors only — retrain without modules_to_save/bias, or merge the adapter with PEFT",
    )
}

/// The parts of adapter_config.json that decide how factors are scaled, after refusing
/// every feature dspec does not implement.
struct PeftSettings {
    r: f64,
    alpha: f64,
    rslora: bool,
    rank_pattern: Vec<(String, Regex, f64)>,
    alpha_pattern: Vec<(String, Regex, f64)>,
}

impl PeftSettings {
    fn parse(config: &Value, path: &Path) -> Result<Self> {
        let err = |message: String| ModelError::config(path, message);
        if let Some(kind) = config["peft_type"].as_str() {
            if !kind.eq_ignore_ascii_case("lora") {
                return Err(err(format!(
                    "peft_type is `{kind}`; dspec loads LoRA adapters only"
                )));
            }
        }
        let flag = |key: &str| config[key].as_bool().unwrap_or(false);
        let refused = [
            (
                "use_dora",
                "DoRA adapters are not supported; use a plain LoRA adapter",
            ),
            (
                "fan_in_fan_out",
                "fan_in_fan_out (GPT-2 style Conv1D layers) is not supported",
            ),
            ("lora_bias", "LoRA biases are not supported"),
        ];
        if let Some((key, why)) = refused.iter().find(|(key, _)| flag(key)) {
            return Err(err(format!("`{key}: true`: {why}")));
        }
        if let Some(bias) = config["bias"].as_str().filter(|b| *b != "none") {
            return Err(err(format!(
                "`bias: \"{bias}\"` trains base biases, which dspec does not apply; only `\"none\"` is supported"
            )));
        }
        if config["modules_to_save"]
            .as_array()
            .is_some_and(|m| !m.is_empty())
        {
            return Err(err(
                "`modules_to_save` replaces whole modules, which dspec does not apply; merge the adapter with PEFT instead".into(),
            ));
        }
        if !config["layer_replication"].is_null() {
            return Err(err("`layer_replication` is not supported".into()));
        }
        let number = |key: &str| {
            config[key]
                .as_f64()
                .ok_or_else(|| err(format!("needs a number `{key}`")))
        };
        Ok(Self {
            r: number("r")?,
            alpha: number("lora_alpha")?,
            rslora: flag("use_rslora"),
            rank_pattern: patterns(config, "rank_pattern", path)?,
            alpha_pattern: patterns(config, "alpha_pattern", path)?,
        })
    }

    fn rank_for(&self, module: &str, path: &Path) -> Result<f64> {
        Ok(pattern_value(&self.rank_pattern, module, "rank_pattern", path)?.unwrap_or(self.r))
    }

    fn alpha_for(&self, module: &str, path: &Path) -> Result<f64> {
        Ok(
            pattern_value(&self.alpha_pattern, module, "alpha_pattern", path)?
                .unwrap_or(self.alpha),
        )
    }
}

/// A `{pattern: number}` object. PEFT matches a pattern against the end of a module's
/// dotted name, at a dot boundary: `q_proj` matches `model.layers.0.self_attn.q_proj`.
fn patterns(config: &Value, key: &str, path: &Path) -> Result<Vec<(String, Regex, f64)>> {
    let Some(map) = config[key].as_object() else {
        return Ok(Vec::new());
    };
    map.iter()
        .map(|(pattern, value)| {
            let number = value.as_f64().ok_or_else(|| {
                ModelError::config(path, format!("`{key}` entry `{pattern}` is not a number"))
            })?;
            let regex = Regex::new(&format!(r"^(?:.*\.)?(?:{pattern})$")).map_err(|e| {
                ModelError::config(
                    path,
                    format!(
                        "`{key}` entry `{pattern}` is not a regular expression dspec can use: {e}"
                    ),
                )
            })?;
            Ok((pattern.clone(), regex, number))
        })
        .collect()
}

/// The value the patterns give `module`, if any. PEFT takes the first listed match;
/// key order is not kept here, so two matches with different values are refused as
/// ambiguous rather than resolved by a guess.
fn pattern_value(
    patterns: &[(String, Regex, f64)],
    module: &str,
    key: &str,
    path: &Path,
) -> Result<Option<f64>> {
    let mut found: Option<(&str, f64)> = None;
    for (pattern, regex, value) in patterns {
        if !regex.is_match(module) {
            continue;
        }
        match found {
            Some((first, v)) if v != *value => {
                return Err(ModelError::config(
                    path,
                    format!(
                        "`{key}` entries `{first}` ({v}) and `{pattern}` ({value}) both match `{module}`; \
                         make the patterns non-overlapping"
                    ),
                ))
            }
            Some(_) => {}
            None => found = Some((pattern, *value)),
        }
    }
    Ok(found.map(|(_, v)| v))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensor_names_map_to_hf_modules() {
        let file = Path::new("adapter_model.safetensors");
        assert_eq!(
            factor_of(
                "base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight",
                file
            )
            .unwrap(),
            ("model.layers.3.self_attn.q_proj".to_string(), true)
        );
        assert_eq!(
            factor_of("base_model.model.lm_head.lora_B.default.weight", file).unwrap(),
            ("lm_head".to_string(), false)
        );
        for (bad, says) in [
            (
                "base_model.model.model.embed_tokens.lora_embedding_A",
                "embeddings",
            ),
            (
                "base_model.model.model.layers.0.mlp.up_proj.lora_magnitude_vector",
                "DoRA",
            ),
            ("base_model.model.lm_head.weight", "modules_to_save"),
            (
                "base_model.model.model.layers.0.mlp.up_proj.lora_B.bias",
                "biases",
            ),
        ] {
            let e = factor_of(bad, file).unwrap_err().to_string();
            assert!(e.contains(bad) && e.contains(says), "{e}");
        }
    }

    #[test]
    fn patterns_match_dotted_suffixes_and_refuse_ambiguity() {
        let path = Path::new("adapter_config.json");
        let config = serde_json::json!({
            "rank_pattern": {"q_proj": 4, "layers.1.self_attn.v_proj": 16, "proj": 2},
        });
        let p = patterns(&config, "rank_pattern", path).unwrap();
        let value = |m: &str| pattern_value(&p, m, "rank_pattern", path);
        // `proj` must match at a dot boundary, so it does not reach into `q_proj`.
        assert_eq!(value("model.layers.0.self_attn.q_proj").unwrap(), Some(4.0));
        assert_eq!(
            value("model.layers.1.self_attn.v_proj").unwrap(),
            Some(16.0)
        );
        assert_eq!(value("model.layers.0.self_attn.v_proj").unwrap(), None);
        let overlapping =
            serde_json::json!({"rank_pattern": {"q_proj": 4, "layers.0.self_attn.q_proj": 8}});
        let p = patterns(&overlapping, "rank_pattern", path).unwrap();
        let e = pattern_value(&p, "model.layers.0.self_attn.q_proj", "rank_pattern", path)
            .unwrap_err()
            .to_string();
        assert!(e.contains("both match"), "{e}");
    }

    #[test]
    fn unsupported_features_are_refused_by_name() {
        let path = Path::new("adapter_config.json");
        let base = serde_json::json!({"peft_type": "LORA", "r": 8, "lora_alpha": 16});
        assert!(PeftSettings::parse(&base, path).is_ok());
        for (key, value, says) in [
            ("use_dora", serde_json::json!(true), "DoRA"),
            ("peft_type", serde_json::json!("IA3"), "LoRA adapters only"),
            ("bias", serde_json::json!("all"), "bias"),
            (
                "modules_to_save",
                serde_json::json!(["lm_head"]),
                "modules_to_save",
            ),
            ("r", serde_json::json!(null), "`r`"),
        ] {
            let mut config = base.clone();
            config[key] = value;
            let e = PeftSettings::parse(&config, path)
                .err()
                .map(|e| e.to_string());
            assert!(
                e.as_deref().is_some_and(|e| e.contains(says)),
                "{key}: {e:?}"
            );
        }
    }
}
