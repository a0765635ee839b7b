//! phi3 (Phi-3, Phi-3.5, Phi-4-mini) as a dspec adapter plugin: a family dspec does not
//! build in, whose layers differ from the built-ins' (one fused `qkv_proj`, one fused
//! `gate_up_proj`, optionally partial rotary embeddings), shipped as a shared library.
//!
//! Ordered like a built-in family file: Config → layers → Model → `impl TargetModel`
//! → export. It reuses dspec-adapters' building blocks (linear layers with MLX
//! quantization, RMSNorm, rotary embeddings, the attention mask), as any third party
//! depending on the published crates can.

use std::path::Path;

use mlx_rs::fast::scaled_dot_product_attention;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{nn, Array};
use serde::Deserialize;

use dspec_adapters::attention::{attention_mask, Mask};
use dspec_adapters::config::{parse_config, CommonConfig};
use dspec_adapters::layers::{Embedding, Linear, NormWeight, RmsNorm, Rope};
use dspec_adapters::weights::Weights;
use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::target::{check_forward_args, TapCollector};
use dspec_plugin_api::{
    ForwardOutput, KvCache, LoadRequest, ModelCache, ModelInfo, TargetModel, WeightSource,
};

/// config.json of phi3 checkpoints: the llama-like common fields plus the fraction of
/// each head that is rotated (Phi-4-mini rotates 3/4 of it).
#[derive(Debug, Deserialize)]
struct Phi3Config {
    #[serde(flatten)]
    common: CommonConfig,
    #[serde(default = "full_rotation")]
    partial_rotary_factor: f32,
}

fn full_rotation() -> f32 {
    1.0
}

/// Attention with one fused projection producing queries, keys and values side by side.
struct Phi3Attention {
    qkv: Linear,
    o: Linear,
    rope: Rope,
    heads: i32,
    kv_heads: i32,
    head_dim: i32,
    scale: f32,
}

impl Phi3Attention {
    fn load(w: &mut dyn WeightSource, prefix: &str, c: &CommonConfig, rope: Rope) -> Result<Self> {
        let (heads, kv_heads, head_dim) = (c.num_attention_heads, c.kv_heads(), c.head_dim());
        let qkv_width = (heads + 2 * kv_heads) * head_dim;
        Ok(Self {
            qkv: Linear::load(
                w,
                &format!("{prefix}.qkv_proj"),
                c.hidden_size,
                qkv_width,
                false,
            )?,
            o: Linear::load(
                w,
                &format!("{prefix}.o_proj"),
                heads * head_dim,
                c.hidden_size,
                false,
            )?,
            rope,
            heads,
            kv_heads,
            head_dim,
            scale: (head_dim as f32).powf(-0.5),
        })
    }

    fn forward(&self, x: &Array, cache: &mut KvCache, mask: &Mask) -> Result<Array> {
        let (b, len) = (x.shape()[0], x.shape()[1]);
        let offset = cache.offset() as i32;
        let qkv = self.qkv.forward(x)?;
        // Columns: all query heads, then key heads, then value heads.
        let q_end = self.heads * self.head_dim;
        let k_end = q_end + self.kv_heads * self.head_dim;
        let heads = |cols: std::ops::Range<i32>, n: i32| -> Result<Array> {
            Ok(qkv
                .try_index((.., .., cols))?
                .reshape(&[b, len, n, self.head_dim])?
                .transpose_axes(&[0, 2, 1, 3])?)
        };
        let q = self.rope.forward(&heads(0..q_end, self.heads)?, offset)?;
        let k = self
            .rope
            .forward(&heads(q_end..k_end, self.kv_heads)?, offset)?;
        let v = heads(k_end..k_end + self.kv_heads * self.head_dim, self.kv_heads)?;
        let (keys, values) = cache.update_and_fetch(&k, &v)?;
        let out =
            scaled_dot_product_attention(&q, &keys, &values, self.scale, mask.for_sdpa(), None)?
                .transpose_axes(&[0, 2, 1, 3])?
                .reshape(&[b, len, self.heads * self.head_dim])?;
        self.o.forward(&out)
    }
}

/// SwiGLU MLP with gate and up projections fused into one matrix (gate rows first).
struct Phi3Mlp {
    gate_up: Linear,
    down: Linear,
    inner: i32,
}

impl Phi3Mlp {
    fn load(w: &mut dyn WeightSource, prefix: &str, c: &CommonConfig) -> Result<Self> {
        let (hidden, inner) = (c.hidden_size, c.intermediate_size);
        Ok(Self {
            gate_up: Linear::load(
                w,
                &format!("{prefix}.gate_up_proj"),
                hidden,
                2 * inner,
                false,
            )?,
            down: Linear::load(w, &format!("{prefix}.down_proj"), inner, hidden, false)?,
            inner,
        })
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        let gate_up = self.gate_up.forward(x)?;
        let gate = gate_up.try_index((.., .., ..self.inner))?;
        let up = gate_up.try_index((.., .., self.inner..))?;
        self.down.forward(&nn::silu(&gate)?.multiply(&up)?)
    }
}

struct Phi3Layer {
    input_norm: RmsNorm,
    attn: Phi3Attention,
    post_attn_norm: RmsNorm,
    mlp: Phi3Mlp,
}

/// A loaded phi3 model.
pub struct Phi3 {
    info: ModelInfo,
    embed: Embedding,
    layers: Vec<Phi3Layer>,
    norm: RmsNorm,
    /// `None`: tied to the embedding.
    lm_head: Option<Linear>,
}

impl Phi3 {
    /// Builds the model from its config.json and weights by HF tensor name.
    pub fn load(config: &serde_json::Value, dir: &Path, w: &mut dyn WeightSource) -> Result<Self> {
        let cfg: Phi3Config = parse_config(config, dir)?;
        let c = &cfg.common;
        let path = dir.join("config.json");
        c.validate(&path)?;
        if !(cfg.partial_rotary_factor > 0.0 && cfg.partial_rotary_factor <= 1.0) {
            return Err(ModelError::config(
                &path,
                format!(
                    "partial_rotary_factor must be in (0, 1], got {}",
                    cfg.partial_rotary_factor
                ),
            ));
        }
        let activation = c.activation_name("silu");
        if activation != "silu" {
            return Err(ModelError::config(
                &path,
                format!("phi3 uses a SiLU MLP; hidden_act `{activation}` is not supported"),
            ));
        }
        // Rotary dims: an even number of the head's leading dims.
        let rotary_dims = ((c.head_dim() as f32 * cfg.partial_rotary_factor) as i32) / 2 * 2;
        let (theta, scaling) = c.rope();
        // Long-context checkpoints use `longrope` scaling, which the shared Rope rejects
        // with a clear message (the 4k-context ones load).
        let rope = Rope::from_config(rotary_dims, theta, &scaling, &path)?;
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let norm = |w: &mut dyn WeightSource, name: &str| {
            RmsNorm::load(w, name, h, eps, NormWeight::Plain)
        };
        let embed = Embedding::load(w, "model.embed_tokens", c.vocab_size, h)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers as usize);
        for i in 0..c.num_hidden_layers {
            let p = format!("model.layers.{i}");
            layers.push(Phi3Layer {
                input_norm: norm(w, &format!("{p}.input_layernorm.weight"))?,
                attn: Phi3Attention::load(w, &format!("{p}.self_attn"), c, rope.clone())?,
                post_attn_norm: norm(w, &format!("{p}.post_attention_layernorm.weight"))?,
                mlp: Phi3Mlp::load(w, &format!("{p}.mlp"), c)?,
            });
        }
        let final_norm = norm(w, "model.norm.weight")?;
        let lm_head = if c.tie_word_embeddings.unwrap_or(false) && !w.contains("lm_head.weight") {
            None
        } else {
            Some(Linear::load(w, "lm_head", h, c.vocab_size, false)?)
        };
        let info = ModelInfo {
            model_type: "phi3".into(),
            num_layers: layers.len(),
            hidden_size: h as usize,
            vocab_size: c.vocab_size as usize,
            dtype: embed.dtype(),
            quantized_bits: layers.first().and_then(|l| l.attn.qkv.quantized_bits()),
            max_context: c.max_position_embeddings,
        };
        Ok(Self {
            info,
            embed,
            layers,
            norm: final_norm,
            lm_head,
        })
    }
}

impl TargetModel for Phi3 {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_cache(&self) -> ModelCache {
        ModelCache::new(self.layers.len())
    }

    fn forward(
        &self,
        tokens: &Array,
        cache: &mut ModelCache,
        taps: &[usize],
    ) -> Result<ForwardOutput> {
        check_forward_args(tokens, cache, taps, self.layers.len())?;
        let mask = attention_mask(cache.offset() as i32, tokens.shape()[1], None)?;
        let mut h = self.embed(tokens)?;
        let mut tapped = TapCollector::new(taps, self.layers.len());
        for (i, (layer, layer_cache)) in self.layers.iter().zip(cache.layers_mut()).enumerate() {
            let attn =
                layer
                    .attn
                    .forward(&layer.input_norm.forward(&h)?, layer_cache.kv_mut()?, &mask)?;
            let x = h.add(attn)?;
            h = x.add(layer.mlp.forward(&layer.post_attn_norm.forward(&x)?)?)?;
            tapped.offer(i, &h);
        }
        let logits = self.lm_head(&self.final_norm(&h)?)?;
        let hidden = tapped.finish()?;
        Ok(ForwardOutput { logits, hidden })
    }

    fn embed(&self, tokens: &Array) -> Result<Array> {
        self.embed.forward(tokens)
    }

    fn lm_head(&self, hidden: &Array) -> Result<Array> {
        match &self.lm_head {
            Some(head) => head.forward(hidden),
            None => self.embed.as_linear(hidden),
        }
    }

    fn final_norm(&self, hidden: &Array) -> Result<Array> {
        self.norm.forward(hidden)
    }
}

/// The plugin's constructor, with the signature of a built-in adapter's.
fn load_phi3(request: &LoadRequest) -> Result<Box<dyn TargetModel>> {
    let mut weights = Weights::open(request.dir, request.options)?;
    let model = Phi3::load(request.config, request.dir, &mut weights)?;
    (request.progress)(weights.taken(), weights.total());
    Ok(Box::new(model))
}

// The whole C ABI: one entry point, generated.
dspec_plugin_api::export_plugin! {
    name: "example-phi3",
    version: env!("CARGO_PKG_VERSION"),
    model_types: ["phi3"],
    architectures: ["Phi3ForCausalLM"],
    load: load_phi3,
}

#[cfg(test)]
mod tests {
    use super::*;
    use dspec_adapters::fixtures::RandomWeights;
    use dspec_plugin_api::conformance::check_target_model;

    /// Test a family in-process first (faster to debug), then across the ABI (engine's
    /// `tests/plugins.rs` does that with the built library).
    #[test]
    fn tiny_phi3_conforms_in_process() {
        let config = serde_json::json!({
            "model_type": "phi3", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "partial_rotary_factor": 0.5,
            "max_position_embeddings": 128
        });
        let mut weights = RandomWeights::new(5).unwrap();
        let model = Phi3::load(&config, Path::new("."), &mut weights).unwrap();
        assert!(weights
            .created
            .contains_key("model.layers.1.self_attn.qkv_proj.weight"));
        assert!(weights
            .created
            .contains_key("model.layers.0.mlp.gate_up_proj.weight"));
        check_target_model(&model).unwrap();
    }
}
