//! Writes a tiny random phi3 model directory, for trying the example adapter plugin
//! (`examples/adapter-plugin`): `write_tiny_phi3 OUT_DIR`. Then
//! `dspec generate --plugin target/debug/libdspec_example_adapter.so --target OUT_DIR --prompt hi`.
//!
//! The tokenizer files come from the tiny llama demo model; config.json and the weights
//! are replaced by phi3's, with its fused `qkv_proj` and `gate_up_proj` tensors.

use std::path::Path;

use dspec_adapters::fixtures::RandomWeights;
use dspec_engine::tiny_model::{write_tiny_model, SPECIAL_TOKENS};
use dspec_plugin_api::WeightSource;

fn main() -> anyhow::Result<()> {
    let dir = std::env::args()
        .nth(1)
        .ok_or_else(|| anyhow::anyhow!("usage: write_tiny_phi3 OUT_DIR"))?;
    let dir = Path::new(&dir);
    write_tiny_model(dir, "{}", 0)?;
    let vocab = (256 + SPECIAL_TOKENS.len()) as i32;
    let (hidden, inner, heads, kv_heads, layers) = (32, 64, 4, 2, 2);
    let head_dim = hidden / heads;
    let config = serde_json::json!({
        "model_type": "phi3", "architectures": ["Phi3ForCausalLM"],
        "vocab_size": vocab, "hidden_size": hidden, "intermediate_size": inner,
        "num_hidden_layers": layers, "num_attention_heads": heads,
        "num_key_value_heads": kv_heads, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5, "max_position_embeddings": 512,
        "tie_word_embeddings": false, "hidden_act": "silu", "torch_dtype": "float32"
    });
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&config)?,
    )?;
    let mut w = RandomWeights::new(0)?;
    w.tensor("model.embed_tokens.weight", &[vocab, hidden])?;
    for i in 0..layers {
        let p = format!("model.layers.{i}");
        w.tensor(&format!("{p}.input_layernorm.weight"), &[hidden])?;
        let qkv = (heads + 2 * kv_heads) * head_dim;
        w.tensor(&format!("{p}.self_attn.qkv_proj.weight"), &[qkv, hidden])?;
        w.tensor(&format!("{p}.self_attn.o_proj.weight"), &[hidden, hidden])?;
        w.tensor(&format!("{p}.post_attention_layernorm.weight"), &[hidden])?;
        w.tensor(
            &format!("{p}.mlp.gate_up_proj.weight"),
            &[2 * inner, hidden],
        )?;
        w.tensor(&format!("{p}.mlp.down_proj.weight"), &[hidden, inner])?;
    }
    w.tensor("model.norm.weight", &[hidden])?;
    w.tensor("lm_head.weight", &[vocab, hidden])?;
    w.save(dir, None)?;
    println!("wrote a tiny random phi3 model to {}", dir.display());
    Ok(())
}
