//! Gemma 4 (text): gemma3's sandwich norms with plain-weight RMSNorm, an unscaled norm
//! on values, a learned per-layer output scalar, attention scale 1 (q/k norms do the
//! scaling), and full-attention layers with their own head size, KV heads, values taken
//! from the key projection (`attention_k_eq_v`) and proportional partial RoPE.
//!
//! Sources (read for the architecture, nothing copied): HF transformers
//! `models/gemma4/modeling_gemma4.py` and `configuration_gemma4.py` (Gemma4TextAttention,
//! Gemma4TextDecoderLayer, Gemma4TextModel, `_compute_proportional_rope_parameters`),
//! mlx-vlm `models/gemma4/language.py` and `rope_utils.py` (MLX tensor names), and the
//! DSpark drafter config in mlx-dspark (seed 003), which uses the same layer.
//!
//! Also reads multimodal `gemma4` configs (`text_config`; tensors under
//! `language_model.model.` in MLX conversions or `model.language_model.` in HF ones).
//! Refused at load, each naming its config key: per-layer input embeddings
//! (`hidden_size_per_layer_input`, the E2B/E4B models), KV sharing between layers
//! (`num_kv_shared_layers`), mixture-of-experts blocks (`enable_moe_block`, 26B-A4B) and
//! fully bidirectional attention (`use_bidirectional_attention: "all"`).

use std::collections::HashMap;
use std::path::Path;

use serde::Deserialize;

use dspec_plugin_api::error::{ModelError, Result};

use crate::attention::AttentionSpec;
use crate::config::{parse_config, CommonConfig};
use crate::layers::{NormWeight, Rope};
use crate::transformer::{DecoderSpec, NormLayout};

/// HF's defaults where a config leaves a key out.
fn default_global_head_dim() -> i32 {
    512
}

fn default_per_layer_input() -> Option<i32> {
    Some(256)
}

fn default_window() -> i32 {
    512
}

#[derive(Debug, Deserialize)]
struct Gemma4TextConfig {
    #[serde(flatten)]
    common: CommonConfig,
    #[serde(default)]
    attention_bias: bool,
    final_logit_softcapping: Option<f32>,
    #[serde(default = "default_global_head_dim")]
    global_head_dim: i32,
    num_global_key_value_heads: Option<i32>,
    #[serde(default)]
    attention_k_eq_v: bool,
    #[serde(default = "default_per_layer_input")]
    hidden_size_per_layer_input: Option<i32>,
    #[serde(default)]
    num_kv_shared_layers: i32,
    #[serde(default)]
    enable_moe_block: bool,
    use_bidirectional_attention: Option<String>,
    /// transformers ≥ 5 writes each full-attention layer's head size and KV heads here,
    /// keyed by layer index, in place of `global_head_dim` / `num_global_key_value_heads`.
    per_layer_config: Option<HashMap<String, LayerOverrides>>,
}

/// A layer's entries in `per_layer_config`; any other key is refused, since ignoring it
/// would compute another model.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct LayerOverrides {
    head_dim: Option<i32>,
    num_key_value_heads: Option<i32>,
}

/// Refuses the Gemma 4 variants this dense decoder would silently compute wrong.
fn refuse_unsupported(cfg: &Gemma4TextConfig, path: &Path) -> Result<()> {
    let refuse = |key: &str, what: String| {
        Err(ModelError::config(
            path,
            format!("`{key}` {what}; only the dense Gemma 4 text decoder (31B-style) is supported"),
        ))
    };
    if let Some(n) = cfg.hidden_size_per_layer_input.filter(|&n| n > 0) {
        return refuse(
            "hidden_size_per_layer_input",
            format!("= {n} asks for per-layer input embeddings (Gemma 4 E2B/E4B), which dspec does not implement (an absent key means HF's default, 256; dense models set 0)"),
        );
    }
    if cfg.num_kv_shared_layers > 0 {
        return refuse(
            "num_kv_shared_layers",
            format!(
                "= {} asks for KV sharing between layers, which dspec does not implement",
                cfg.num_kv_shared_layers
            ),
        );
    }
    if cfg.enable_moe_block {
        return refuse(
            "enable_moe_block",
            "= true asks for mixture-of-experts blocks (Gemma 4 26B-A4B), which dspec does not implement".into(),
        );
    }
    if cfg.use_bidirectional_attention.as_deref() == Some("all") {
        return refuse(
            "use_bidirectional_attention",
            "= \"all\" makes every layer non-causal, which text generation cannot use".into(),
        );
    }
    Ok(())
}

/// Per-layer-type rope parameters (`rope_parameters.{sliding,full}_attention`), with HF's
/// defaults for a missing entry.
fn rope_params(config: &serde_json::Value, layer_type: &str) -> serde_json::Value {
    match config.get(layer_type) {
        Some(p) if p.is_object() => p.clone(),
        _ if layer_type == "full_attention" => serde_json::json!({
            "rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0
        }),
        _ => serde_json::json!({"rope_type": "default", "rope_theta": 10_000.0}),
    }
}

fn rope_for(params: &serde_json::Value, head_dim: i32, path: &Path) -> Result<Rope> {
    let default_theta = if params["rope_type"] == "proportional" {
        1_000_000.0
    } else {
        10_000.0
    };
    let theta = params["rope_theta"].as_f64().unwrap_or(default_theta) as f32;
    Rope::from_config(head_dim, theta, params, path)
}

fn spec(config: &serde_json::Value, dir: &Path) -> Result<DecoderSpec> {
    let (text, prefix, other) = match config.get("text_config") {
        Some(text) => (text, "language_model.model.", "model.language_model."),
        None => (config, "model.", "model."),
    };
    let cfg: Gemma4TextConfig = parse_config(text, dir)?;
    let c = &cfg.common;
    let path = dir.join("config.json");
    c.validate(&path)?;
    refuse_unsupported(&cfg, &path)?;
    let layers_n = c.num_hidden_layers as usize;
    // HF's default pattern is five sliding layers per full one, and HF forces the last
    // layer to full attention whatever the config says; so do we.
    let mut types: Vec<String> = c.layer_types.clone().unwrap_or_else(|| {
        (0..layers_n)
            .map(|i| {
                if (i + 1) % 6 == 0 {
                    "full_attention".to_string()
                } else {
                    "sliding_attention".to_string()
                }
            })
            .collect()
    });
    if let Some(last) = types.last_mut() {
        *last = "full_attention".into();
    }
    // Each layer's (head_dim, KV heads): `per_layer_config` when the config has it, else
    // the global_* keys for full-attention layers.
    let global_kv = match (cfg.attention_k_eq_v, cfg.num_global_key_value_heads) {
        (true, Some(n)) => n,
        _ => c.kv_heads(),
    };
    let shape_of = |i: usize, full: bool| -> (i32, i32) {
        match &cfg.per_layer_config {
            Some(per_layer) => {
                let o = per_layer.get(&i.to_string());
                (
                    o.and_then(|o| o.head_dim).unwrap_or(c.head_dim()),
                    o.and_then(|o| o.num_key_value_heads)
                        .unwrap_or(c.kv_heads()),
                )
            }
            None if full => (cfg.global_head_dim, global_kv),
            None => (c.head_dim(), c.kv_heads()),
        }
    };
    let window = c.sliding_window.unwrap_or(default_window());
    let local_params = rope_params(&c.rope_parameters, "sliding_attention");
    let global_params = rope_params(&c.rope_parameters, "full_attention");
    let eps = c.rms_norm_eps;
    let base = AttentionSpec {
        scale: 1.0,
        qkv_bias: cfg.attention_bias,
        o_bias: cfg.attention_bias,
        qk_norm: Some((eps, NormWeight::Plain)),
        v_norm: Some(eps),
        ..c.attention(rope_for(&local_params, c.head_dim(), &path)?)
    };
    let layers = types
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let full = match t.as_str() {
                "sliding_attention" => false,
                "full_attention" => true,
                other => {
                    return Err(ModelError::config(
                        &path,
                        format!("layer_types entry `{other}` is not sliding_attention or full_attention"),
                    ))
                }
            };
            let (head_dim, kv_heads) = shape_of(i, full);
            if kv_heads <= 0 || c.num_attention_heads % kv_heads != 0 || head_dim <= 0 {
                return Err(ModelError::config(
                    &path,
                    format!(
                        "layer {i}: num_attention_heads ({}) must be a positive multiple of its KV heads ({kv_heads}), and its head_dim ({head_dim}) positive",
                        c.num_attention_heads
                    ),
                ));
            }
            let params = if full { &global_params } else { &local_params };
            Ok(AttentionSpec {
                kv_heads,
                head_dim,
                sliding_window: if full { None } else { Some(window) },
                k_eq_v: full && cfg.attention_k_eq_v,
                rope: rope_for(params, head_dim, &path)?,
                ..base.clone()
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(DecoderSpec {
        prefix: prefix.into(),
        other_prefixes: vec![other.into()],
        norm_weight: NormWeight::Plain,
        norm_layout: NormLayout::Sandwich,
        embed_scale: Some((c.hidden_size as f32).sqrt()),
        tie_word_embeddings: c.tie_word_embeddings.unwrap_or(true),
        final_logit_softcap: cfg.final_logit_softcapping,
        layer_scalar: true,
        layers,
        ..c.decoder("gemma4_text", &path, "gelu_pytorch_tanh")?
    })
}

crate::decoder_family! {
    name: "gemma4_text",
    model_types: ["gemma4_text"],
    aliases: ["gemma4"],
    architectures: ["Gemma4ForCausalLM", "Gemma4ForConditionalGeneration"],
    spec: spec,
}

#[cfg(test)]
mod tests {
    use mlx_rs::random;

    use crate::fixtures::{
        check_family, load_dir, with, write_random_model, TINY_GEMMA4_OVERRIDES, TINY_LLAMA,
    };
    use crate::layers::Rope;

    #[test]
    fn tiny_gemma4_text_conforms() {
        check_family(&with(TINY_LLAMA, TINY_GEMMA4_OVERRIDES));
    }

    #[test]
    fn multimodal_config_reads_the_nested_text_config() {
        let text: serde_json::Value =
            serde_json::from_str(&with(TINY_LLAMA, TINY_GEMMA4_OVERRIDES)).unwrap();
        let wrapped = serde_json::json!({"model_type": "gemma4", "text_config": text});
        let dir = tempfile::tempdir().unwrap();
        // Written as gemma4_text, then relabelled: the tensors then sit under `model.`,
        // which neither multimodal prefix matches, so loading must name the missing tensor.
        write_random_model(
            dir.path(),
            &with(TINY_LLAMA, TINY_GEMMA4_OVERRIDES),
            3,
            None,
        )
        .unwrap();
        std::fs::write(dir.path().join("config.json"), wrapped.to_string()).unwrap();
        let err = load_dir(dir.path(), &Default::default())
            .err()
            .expect("tensors under the wrong prefix");
        assert!(
            err.to_string()
                .contains("language_model.model.embed_tokens"),
            "{err}"
        );
        // Under the HF multimodal prefix it loads.
        let weights =
            mlx_rs::Array::load_safetensors(dir.path().join("model.safetensors")).unwrap();
        let renamed: Vec<(String, mlx_rs::Array)> = weights
            .into_iter()
            .map(|(k, v)| (k.replacen("model.", "model.language_model.", 1), v))
            .collect();
        // MLX reads lazily: materialise before overwriting the file they come from.
        for (_, v) in &renamed {
            v.eval().unwrap();
        }
        mlx_rs::Array::save_safetensors(
            renamed.iter().map(|(k, v)| (k.as_str(), v)),
            None,
            dir.path().join("model.safetensors"),
        )
        .unwrap();
        let model = load_dir(dir.path(), &Default::default()).unwrap();
        assert_eq!(model.info().model_type, "gemma4_text");
        assert_eq!(model.info().num_layers, 2);
    }

    #[test]
    fn unsupported_variants_are_refused_naming_the_key() {
        for (overrides, key) in [
            (
                r#"{"hidden_size_per_layer_input": 8}"#,
                "hidden_size_per_layer_input",
            ),
            (r#"{"num_kv_shared_layers": 1}"#, "num_kv_shared_layers"),
            (r#"{"enable_moe_block": true}"#, "enable_moe_block"),
            (
                r#"{"use_bidirectional_attention": "all"}"#,
                "use_bidirectional_attention",
            ),
        ] {
            let config = with(&with(TINY_LLAMA, TINY_GEMMA4_OVERRIDES), overrides);
            let dir = tempfile::tempdir().unwrap();
            let err = write_random_model(dir.path(), &config, 1, None)
                .err()
                .unwrap_or_else(|| panic!("{key} should be refused"));
            assert!(err.to_string().contains(key), "{key}: {err}");
        }
        // An absent key means HF's default (256 per-layer dims), which is refused too.
        let mut config: serde_json::Value =
            serde_json::from_str(&with(TINY_LLAMA, TINY_GEMMA4_OVERRIDES)).unwrap();
        config
            .as_object_mut()
            .unwrap()
            .remove("hidden_size_per_layer_input");
        let dir = tempfile::tempdir().unwrap();
        let err = write_random_model(dir.path(), &config.to_string(), 1, None).unwrap_err();
        assert!(err.to_string().contains("256"), "{err}");
    }

    #[test]
    fn proportional_rope_rotates_only_the_leading_pairs_of_each_half() {
        // head_dim 16, factor 0.25: pairs 0 and 1 of 8 rotate (dims 0,1 with 8,9), with
        // frequencies base^(-2i/16); every other dim passes through unchanged.
        let (dims, base, pos) = (16, 10_000.0f32, 5);
        let params =
            serde_json::json!({"rope_type": "proportional", "partial_rotary_factor": 0.25});
        let rope =
            Rope::from_config(dims, base, &params, std::path::Path::new("config.json")).unwrap();
        let key = random::key(3).unwrap();
        let x = random::normal::<f32>(&[1, 1, 1, dims], None, None, Some(&key)).unwrap();
        let y = rope.forward(&x, pos).unwrap();
        let host = |a: &mlx_rs::Array| -> Vec<f32> {
            let flat = a.reshape(&[dims]).unwrap();
            flat.eval().unwrap();
            flat.as_slice::<f32>().to_vec()
        };
        let (xs, ys) = (host(&x), host(&y));
        let half = (dims / 2) as usize;
        for i in 0..half {
            let (a, b) = (xs[i], xs[i + half]);
            let (ea, eb) = if i < 2 {
                let theta = pos as f32 * base.powf(-2.0 * i as f32 / dims as f32);
                (
                    a * theta.cos() - b * theta.sin(),
                    b * theta.cos() + a * theta.sin(),
                )
            } else {
                (a, b)
            };
            assert!((ys[i] - ea).abs() < 1e-5, "dim {i}: {} vs {ea}", ys[i]);
            assert!(
                (ys[i + half] - eb).abs() < 1e-5,
                "dim {}: {} vs {eb}",
                i + half,
                ys[i + half]
            );
        }
    }
}
