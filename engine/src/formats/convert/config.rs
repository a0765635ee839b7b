//! GGUF metadata (`{arch}.block_count`, `.embedding_length`, …) → an HF config.json
//! for the matching built-in family, plus the tensor conventions that arch uses.

use serde_json::{json, Value};

use super::tensors::TensorConventions;
use super::ConvertError;
use crate::formats::gguf::GgufFile;

/// GGUF architectures `dspec convert` handles, and the HF model_type each becomes.
pub const SUPPORTED_ARCHITECTURES: &[(&str, &str)] = &[
    (
        "llama",
        "llama (or mistral when the file names a Mistral model)",
    ),
    ("qwen2", "qwen2"),
    ("qwen3", "qwen3"),
    ("qwen3moe", "qwen3_moe"),
    ("gemma", "gemma"),
    ("gemma2", "gemma2"),
    ("gemma3", "gemma3_text"),
];

pub struct HfConfig {
    pub config: Value,
    pub conventions: TensorConventions,
    pub heads: usize,
    pub kv_heads: usize,
}

pub fn hf_config(
    g: &GgufFile,
    vocab_size: usize,
    has_output: bool,
) -> Result<HfConfig, ConvertError> {
    let arch = g
        .get_str("general.architecture")
        .ok_or_else(|| ConvertError::Invalid("no general.architecture".into()))?;
    let key = |k: &str| format!("{arch}.{k}");
    let need_u = |k: &str| {
        g.get_u64(&key(k))
            .ok_or_else(|| ConvertError::Invalid(format!("missing metadata {}", key(k))))
    };
    let name = format!(
        "{} {}",
        g.get_str("general.name").unwrap_or_default(),
        g.get_str("general.basename").unwrap_or_default()
    )
    .to_lowercase();
    let model_type = match arch {
        "llama" if name.contains("mistral") => "mistral",
        "llama" => "llama",
        "qwen2" => "qwen2",
        "qwen3" => "qwen3",
        "qwen3moe" => "qwen3_moe",
        "gemma" => "gemma",
        "gemma2" => "gemma2",
        "gemma3" => "gemma3_text",
        other => {
            let list: Vec<&str> = SUPPORTED_ARCHITECTURES.iter().map(|(a, _)| *a).collect();
            return Err(ConvertError::UnsupportedArchitecture {
                arch: other.to_string(),
                supported: list.join(", "),
            });
        }
    };
    if g.tensors().iter().any(|t| t.name == "rope_freqs.weight") {
        return Err(ConvertError::Invalid(
            "this file carries rope_freqs (Llama 3.1-style rope scaling factors), which dspec convert does not map yet".into(),
        ));
    }
    let hidden = need_u("embedding_length")?;
    let heads = need_u("attention.head_count")?;
    let kv_heads = g.get_u64(&key("attention.head_count_kv")).unwrap_or(heads);
    let head_dim = g
        .get_u64(&key("attention.key_length"))
        .unwrap_or(hidden / heads.max(1));
    let gemma = arch.starts_with("gemma");
    let mut config = json!({
        "model_type": model_type,
        "architectures": [match model_type {
            "llama" => "LlamaForCausalLM",
            "mistral" => "MistralForCausalLM",
            "qwen2" => "Qwen2ForCausalLM",
            "qwen3" => "Qwen3ForCausalLM",
            "qwen3_moe" => "Qwen3MoeForCausalLM",
            "gemma" => "GemmaForCausalLM",
            "gemma2" => "Gemma2ForCausalLM",
            _ => "Gemma3ForCausalLM",
        }],
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        // A mixture of experts may have no dense MLP to size.
        "intermediate_size": match arch {
            "qwen3moe" => g.get_u64(&key("feed_forward_length")).unwrap_or(0),
            _ => need_u("feed_forward_length")?,
        },
        "num_hidden_layers": need_u("block_count")?,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": g.get_f64(&key("attention.layer_norm_rms_epsilon")).unwrap_or(1e-6),
        "rope_theta": g.get_f64(&key("rope.freq_base")).unwrap_or(10_000.0),
        "max_position_embeddings": g.get_u64(&key("context_length")).unwrap_or(4096),
        "tie_word_embeddings": !has_output,
        "hidden_act": if gemma { "gelu_pytorch_tanh" } else { "silu" },
        "torch_dtype": "bfloat16",
    });
    let obj = config
        .as_object_mut()
        .ok_or_else(|| ConvertError::Invalid("config is not an object".into()))?;
    if let Some(window) = g.get_u64(&key("attention.sliding_window")) {
        obj.insert("sliding_window".into(), json!(window));
    }
    if let (Some(kind), Some(factor)) = (
        g.get_str(&key("rope.scaling.type")),
        g.get_f64(&key("rope.scaling.factor")),
    ) {
        if kind != "none" {
            let mut scaling = json!({"rope_type": kind, "factor": factor});
            if let Some(orig) = g.get_u64(&key("rope.scaling.original_context_length")) {
                scaling["original_max_position_embeddings"] = json!(orig);
            }
            obj.insert("rope_scaling".into(), scaling);
        }
    }
    match arch {
        "gemma2" => {
            obj.insert("query_pre_attn_scalar".into(), json!(head_dim));
            if let Some(cap) = g.get_f64(&key("attn_logit_softcapping")) {
                obj.insert("attn_logit_softcapping".into(), json!(cap));
            }
            if let Some(cap) = g.get_f64(&key("final_logit_softcapping")) {
                obj.insert("final_logit_softcapping".into(), json!(cap));
            }
        }
        "gemma3" => {
            // llama.cpp scales gemma3 queries by head_dim^-½ (27B aside) and fixes the
            // local layers' rope base at 10000 with a global layer every 6th.
            obj.insert("query_pre_attn_scalar".into(), json!(head_dim));
            obj.insert("rope_local_base_freq".into(), json!(10_000.0));
            obj.insert("sliding_window_pattern".into(), json!(6));
        }
        "qwen2" => {
            obj.insert("use_sliding_window".into(), json!(false));
        }
        "qwen3moe" => {
            // Every layer sparse; llama.cpp renormalises the chosen experts' weights
            // unless the file says not to.
            for (hf, gguf) in [
                ("num_experts", "expert_count"),
                ("num_experts_per_tok", "expert_used_count"),
                ("moe_intermediate_size", "expert_feed_forward_length"),
            ] {
                obj.insert(hf.into(), json!(need_u(gguf)?));
            }
            let norm = g.get_bool(&key("expert_weights_norm")).unwrap_or(true);
            obj.insert("norm_topk_prob".into(), json!(norm));
            obj.insert("decoder_sparse_step".into(), json!(1));
            obj.insert("mlp_only_layers".into(), json!([]));
        }
        _ => {}
    }
    let conventions = TensorConventions {
        permuted_qk: arch == "llama",
        norm_plus_one: gemma,
        sandwich_norms: arch == "gemma2" || arch == "gemma3",
    };
    Ok(HfConfig {
        config,
        conventions,
        heads: heads as usize,
        kv_heads: kv_heads as usize,
    })
}
