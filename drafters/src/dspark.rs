//! DSpark (DeepSeek DeepSpec): a few decoder layers draft a whole block per pass,
//! attending to the target's fused hidden states; a rank-r Markov head corrects each
//! position from the token before it, and a confidence head can end the block early.
//!
//! One code path for both published families (`qwen3` and `gemma4`): they differ only
//! by config (norm layout, values from keys + value norm, RoPE, activation, embedding
//! scale, logit softcap), and their layers are the adapters' own Qwen3 and Gemma 4
//! layers. Facts from the public inference path (mlx-dspark, seed 003); written fresh.
//!
//! Per round: block input `[last, mask × (B−1)]` through the drafter's own embedding;
//! every layer attends from the block (no mask inside it) to [context ; block], where
//! the context is `hidden_norm(fc(target taps))` projected through the layer's k/v
//! (cached, grown on `commit`); `norm` and its own `lm_head` give base logits at all B
//! positions; tokens are then chosen left to right from `base_i + w2(w1[prev])`.

use std::path::Path;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{concatenate, sigmoid};
use mlx_rs::{Array, Dtype};
use serde::{Deserialize, Deserializer};
use serde_json::Value;

use dspec_adapters::attention::AttentionSpec;
use dspec_adapters::config::parse_config;
use dspec_adapters::layers::{softcap, Activation, Embedding, Linear, NormWeight, RmsNorm, Rope};
use dspec_adapters::transformer::{DecoderLayer, DecoderSpec, NormLayout};
use dspec_adapters::weights::Weights;
use dspec_runtime::Backend;

use crate::context::ContextLayers;
use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::{
    inventory, Draft, Drafter, DrafterLoadRequest, DrafterRegistration, LoadOptions, TargetModel,
    TokenPicker, WeightSource,
};

/// `--drafter-bits` when the user gives none: the drafter runs every round, and 4-bit
/// is what makes it cheap enough where its weights' reading is the cost (the seed's
/// default). Not on CUDA: MLX's 4-bit products of a block's few rows are slower there
/// than bf16 ones, which cost a round 0.3–0.8 plain steps more (docs/benchmarks.md).
fn default_bits() -> i32 {
    match Backend::current() {
        Backend::Cuda => 0,
        _ => 4,
    }
}

/// A tiny qwen3-family DSpark checkpoint config fitting the tiny qwen3 target of
/// `dspec_engine::tiny_model` (vocab 259, hidden 32, 2 layers): taps both target layers.
#[cfg(any(test, feature = "test-fixtures"))]
pub const TINY_DSPARK_QWEN3: &str = r#"{
    "model_type": "qwen3",
    "hidden_size": 32,
    "vocab_size": 259,
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "attention_bias": false,
    "block_size": 4,
    "mask_token_id": 256,
    "target_layer_ids": [0, 1],
    "num_target_layers": 2,
    "markov_rank": 32,
    "markov_head_type": "vanilla",
    "enable_confidence_head": true,
    "confidence_head_with_markov": true
}"#;

/// The gemma4-family counterpart, fitting the tiny gemma4 target
/// (`dspec_adapters::fixtures::TINY_GEMMA4_OVERRIDES` on the tiny model).
#[cfg(any(test, feature = "test-fixtures"))]
pub const TINY_DSPARK_GEMMA4: &str = r#"{
    "model_type": "gemma4_text",
    "hidden_size": 32,
    "vocab_size": 259,
    "num_hidden_layers": 1,
    "intermediate_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_global_key_value_heads": 1,
    "head_dim": 16,
    "global_head_dim": 32,
    "attention_k_eq_v": true,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}
    },
    "final_logit_softcapping": 30.0,
    "block_size": 4,
    "mask_token_id": 256,
    "target_layer_ids": [0, 1],
    "num_target_layers": 2,
    "markov_rank": 32,
    "markov_head_type": "vanilla",
    "enable_confidence_head": true,
    "confidence_head_with_markov": true
}"#;

/// The two drafter families of the published checkpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    Qwen3,
    Gemma4,
}

/// A DSpark checkpoint's config.json, as the loader reads it.
#[derive(Debug, Clone)]
pub struct DSparkConfig {
    pub family: Family,
    pub hidden_size: i32,
    pub vocab_size: i32,
    pub num_hidden_layers: i32,
    pub intermediate_size: i32,
    pub rms_norm_eps: f32,
    pub num_attention_heads: i32,
    /// KV heads of the drafter's attention (gemma4 with k_eq_v: the global ones).
    pub kv_heads: i32,
    /// Head size of the drafter's attention (gemma4: `global_head_dim`).
    pub head_dim: i32,
    pub k_eq_v: bool,
    pub attention_bias: bool,
    pub rope_theta: f32,
    /// The RoPE variant object (`rope_parameters.full_attention` for gemma4).
    pub rope: Value,
    pub block_size: usize,
    pub mask_token_id: u32,
    pub target_layer_ids: Vec<usize>,
    pub num_target_layers: Option<usize>,
    /// Width of each tapped target layer the `fc` expects (`target_hidden_size`, else
    /// the drafter's own hidden size, as the published drafters are built).
    pub target_hidden_size: i32,
    /// 0: no Markov head.
    pub markov_rank: i32,
    pub confidence_head: bool,
    pub confidence_with_markov: bool,
    pub final_logit_softcapping: Option<f32>,
}

/// A count or size that must be at least 1.
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(try_from = "i64")]
struct Positive(i32);

impl TryFrom<i64> for Positive {
    type Error = String;

    fn try_from(v: i64) -> std::result::Result<Self, String> {
        i32::try_from(v)
            .ok()
            .filter(|&v| v > 0)
            .map(Positive)
            .ok_or_else(|| format!("must be a positive integer, got {v}"))
    }
}

/// A rank that may be 0 (no head).
#[derive(Debug, Clone, Copy, Deserialize)]
#[serde(try_from = "i64")]
struct Rank(i32);

impl TryFrom<i64> for Rank {
    type Error = String;

    fn try_from(v: i64) -> std::result::Result<Self, String> {
        i32::try_from(v)
            .ok()
            .filter(|&v| v >= 0)
            .map(Rank)
            .ok_or_else(|| format!("must be 0 or a positive integer, got {v}"))
    }
}

/// `Some(None)` for a field written as `null`, against `None` (serde's default) for an
/// absent one: `final_logit_softcapping: null` turns off a family's default cap.
fn null_or_value<'de, D, T>(d: D) -> std::result::Result<Option<Option<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    Option::<T>::deserialize(d).map(Some)
}

/// config.json of a DSpark checkpoint as published, HF names verbatim; unknown keys
/// are ignored. `None` (absent or `null`) takes the published inference path's default,
/// which [`DSparkConfig::parse`] fills in, per family where the families differ.
#[derive(Debug, Deserialize)]
struct DSparkJson {
    #[serde(default)]
    model_type: String,
    hidden_size: Positive,
    vocab_size: Positive,
    num_hidden_layers: Positive,
    intermediate_size: Positive,
    num_attention_heads: Positive,
    num_key_value_heads: Option<Positive>,
    head_dim: Option<Positive>,
    /// gemma4: head size of the full-attention layers, which the drafter's layers are.
    global_head_dim: Option<Positive>,
    /// gemma4 with `attention_k_eq_v`: KV heads of the full-attention layers.
    num_global_key_value_heads: Option<Positive>,
    attention_k_eq_v: Option<bool>,
    rms_norm_eps: Option<f32>,
    attention_bias: Option<bool>,
    rope_theta: Option<f32>,
    rope_parameters: Option<RopeParameters>,
    block_size: Positive,
    mask_token_id: u32,
    target_layer_ids: Vec<usize>,
    num_target_layers: Option<Positive>,
    target_hidden_size: Option<Positive>,
    markov_rank: Option<Rank>,
    markov_head_type: Option<String>,
    enable_confidence_head: Option<bool>,
    confidence_head_with_markov: Option<bool>,
    #[serde(default, deserialize_with = "null_or_value")]
    final_logit_softcapping: Option<Option<f32>>,
}

/// `rope_parameters`: transformers ≥ 5 puts the qwen3 base here; gemma4 one RoPE per
/// attention kind, of which the drafter's layers use the full-attention one.
#[derive(Debug, Deserialize)]
struct RopeParameters {
    rope_theta: Option<f32>,
    full_attention: Option<RopeVariant>,
}

#[derive(Debug, Deserialize)]
struct RopeVariant {
    rope_theta: Option<f32>,
    /// Everything else (`rope_type`, `partial_rotary_factor`, …), for [`Rope::from_config`].
    #[serde(flatten)]
    scaling: serde_json::Map<String, Value>,
}

impl DSparkConfig {
    /// Reads the config.json of the checkpoint in `dir`; an error names the file and the
    /// field. Defaults are the ones the published inference path uses.
    pub fn parse(config: &Value, dir: &Path) -> Result<Self> {
        let json: DSparkJson = parse_config(config, dir)?;
        let bad = |message: String| ModelError::config(dir.join("config.json"), message);
        let family = if json.model_type.contains("qwen3") {
            Family::Qwen3
        } else if json.model_type.contains("gemma4") {
            Family::Gemma4
        } else {
            return Err(bad(format!(
                "DSpark `model_type` `{}` names no known drafter family (supported: qwen3, gemma4_text)",
                json.model_type
            )));
        };
        let gemma = family == Family::Gemma4;
        let or = |field: Option<Positive>, default: i32| field.map_or(default, |p| p.0);
        let hidden_size = json.hidden_size.0;
        let num_attention_heads = json.num_attention_heads.0;
        let local_kv = or(json.num_key_value_heads, 8);
        let k_eq_v = gemma && json.attention_k_eq_v.unwrap_or(true);
        let (kv_heads, head_dim) = if gemma {
            let kv = if k_eq_v {
                or(json.num_global_key_value_heads, 1)
            } else {
                local_kv
            };
            (kv, or(json.global_head_dim, 512))
        } else {
            (
                local_kv,
                or(json.head_dim, hidden_size / num_attention_heads),
            )
        };
        if num_attention_heads % kv_heads != 0 {
            return Err(bad(format!(
                "num_attention_heads ({num_attention_heads}) must be a multiple of the drafter's KV heads ({kv_heads})"
            )));
        }
        let (rope_theta, rope) = match (family, json.rope_parameters) {
            (Family::Gemma4, parameters) => match parameters.and_then(|p| p.full_attention) {
                Some(full) => (
                    full.rope_theta.unwrap_or(1_000_000.0),
                    Value::Object(full.scaling),
                ),
                None => (
                    1_000_000.0,
                    serde_json::json!({"rope_type": "proportional", "partial_rotary_factor": 0.25}),
                ),
            },
            // The qwen3 drafters use plain RoPE, whichever layout carries the base.
            (Family::Qwen3, parameters) => (
                parameters
                    .and_then(|p| p.rope_theta)
                    .or(json.rope_theta)
                    .unwrap_or(1_000_000.0),
                Value::Null,
            ),
        };
        if json.target_layer_ids.is_empty() {
            return Err(bad(
                "`target_layer_ids` is empty; it must list the target layers the drafter taps"
                    .into(),
            ));
        }
        let markov_type = json.markov_head_type.as_deref().unwrap_or("vanilla");
        if markov_type != "vanilla" {
            return Err(bad(format!(
                "`markov_head_type` `{markov_type}` is not supported (supported: vanilla)"
            )));
        }
        Ok(Self {
            family,
            hidden_size,
            vocab_size: json.vocab_size.0,
            num_hidden_layers: json.num_hidden_layers.0,
            intermediate_size: json.intermediate_size.0,
            rms_norm_eps: json.rms_norm_eps.unwrap_or(1e-6),
            num_attention_heads,
            kv_heads,
            head_dim,
            k_eq_v,
            attention_bias: json.attention_bias.unwrap_or(false),
            rope_theta,
            rope,
            block_size: json.block_size.0 as usize,
            mask_token_id: json.mask_token_id,
            target_layer_ids: json.target_layer_ids,
            num_target_layers: json.num_target_layers.map(|n| n.0 as usize),
            target_hidden_size: or(json.target_hidden_size, hidden_size),
            markov_rank: json.markov_rank.map_or(256, |r| r.0),
            confidence_head: json.enable_confidence_head.unwrap_or(true),
            confidence_with_markov: json.confidence_head_with_markov.unwrap_or(true),
            final_logit_softcapping: json.final_logit_softcapping.unwrap_or(if gemma {
                Some(30.0)
            } else {
                None
            }),
        })
    }

    /// The drafter's layers as the adapters' decoder describes them.
    fn decoder_spec(&self, config_path: &Path) -> Result<DecoderSpec> {
        let gemma = self.family == Family::Gemma4;
        let eps = self.rms_norm_eps;
        let rope = Rope::from_config(self.head_dim, self.rope_theta, &self.rope, config_path)?;
        let attention = AttentionSpec {
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            // Gemma 4 lets the q/k norms set the scale.
            scale: if gemma {
                1.0
            } else {
                (self.head_dim as f32).powf(-0.5)
            },
            qkv_bias: self.attention_bias,
            o_bias: self.attention_bias,
            qk_norm: Some((eps, NormWeight::Plain)),
            sliding_window: None,
            softcap: None,
            rope,
            k_eq_v: self.k_eq_v,
            v_norm: gemma.then_some(eps),
            output_gate: false,
        };
        Ok(DecoderSpec {
            model_type: "dspark".into(),
            prefix: String::new(),
            other_prefixes: Vec::new(),
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            rms_norm_eps: eps,
            norm_weight: NormWeight::Plain,
            norm_layout: if gemma {
                NormLayout::Sandwich
            } else {
                NormLayout::PreNorm
            },
            activation: if gemma {
                Activation::GeluTanh
            } else {
                Activation::Silu
            },
            mlp_bias: false,
            embed_scale: gemma.then(|| (self.hidden_size as f32).sqrt()),
            tie_word_embeddings: false,
            final_logit_softcap: self.final_logit_softcapping,
            layer_scalar: gemma,
            max_position_embeddings: None,
            layers: vec![attention; self.num_hidden_layers as usize],
            experts: Vec::new(),
        })
    }
}

/// The Markov head: `w2(w1[prev])`, a rank-r correction from the previous token.
#[derive(Clone)]
struct MarkovHead {
    w1: Embedding,
    w2: Linear,
}

/// The drafter's weights, by the checkpoint's tensor names (no prefix).
struct DSparkModel {
    embed: Embedding,
    embed_scale: Option<f32>,
    /// `fc`, `hidden_norm` and the layers, with their context caches.
    context: ContextLayers,
    norm: RmsNorm,
    lm_head: Linear,
    softcap: Option<f32>,
    markov: Option<MarkovHead>,
    confidence: Option<Linear>,
}

impl DSparkModel {
    fn load(
        cfg: &DSparkConfig,
        w: &mut dyn WeightSource,
        config_path: &Path,
        dtype: Option<Dtype>,
    ) -> Result<Self> {
        let spec = cfg.decoder_spec(config_path)?;
        let (h, v, eps) = (cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps);
        let embed = Embedding::load(w, "embed_tokens", v, h)?;
        let taps_width = cfg.target_layer_ids.len() as i32 * cfg.target_hidden_size;
        let fc = Linear::load(w, "fc", taps_width, h, false)?;
        let hidden_norm = RmsNorm::load(w, "hidden_norm.weight", h, eps, NormWeight::Plain)?;
        let layers = spec
            .layers
            .iter()
            .enumerate()
            .map(|(i, attn)| DecoderLayer::load(w, &format!("layers.{i}"), &spec, attn))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(w, "norm.weight", h, eps, NormWeight::Plain)?;
        let lm_head = Linear::load(w, "lm_head", h, v, false)?;
        let r = cfg.markov_rank;
        let markov = if r > 0 {
            Some(MarkovHead {
                w1: Embedding::load(w, "markov_head.markov_w1", v, r)?,
                w2: Linear::load(w, "markov_head.markov_w2", r, v, false)?,
            })
        } else {
            None
        };
        let confidence = if cfg.confidence_head {
            let width = h + if cfg.confidence_with_markov { r } else { 0 };
            Some(Linear::load(w, "confidence_head.proj", width, 1, true)?)
        } else {
            None
        };
        Ok(Self {
            embed,
            embed_scale: spec.embed_scale,
            context: ContextLayers::new(fc, hidden_norm, layers, taps_width, dtype),
            norm,
            lm_head,
            softcap: cfg.final_logit_softcapping,
            markov,
            confidence,
        })
    }
}

/// The DSpark drafter over one sequence: weights plus the per-layer context K/V cache.
pub struct DSparkDrafter {
    cfg: DSparkConfig,
    model: DSparkModel,
    confidence_threshold: Option<f32>,
}

impl DSparkDrafter {
    /// Loads and checks a DSpark checkpoint against the target it will draft for.
    pub fn load(request: &DrafterLoadRequest) -> Result<Self> {
        let dir = request.dir.ok_or_else(|| {
            request.mismatch("dspark needs a checkpoint directory (pass --drafter DIR)")
        })?;
        let config_path = dir.join("config.json");
        let cfg = DSparkConfig::parse(request.config, dir)?;
        validate_against_target(&cfg, request)?;
        let quantize = request
            .options
            .quantization(default_bits())
            .map_err(|m| request.mismatch(m))?;
        let options = LoadOptions {
            dtype: request.options.dtype,
            quantize,
            ..LoadOptions::default()
        };
        let mut weights = Weights::open(dir, &options)?;
        let mut model = DSparkModel::load(&cfg, &mut weights, &config_path, options.dtype)?;
        // Tensors nobody asked for mean the config describes another model (e.g. a
        // v_proj the config says k_eq_v has none of): refuse rather than draft wrong.
        let unused: Vec<&str> = weights
            .unused()
            .into_iter()
            .filter(|n| !n.contains("rotary_emb"))
            .collect();
        if !unused.is_empty() {
            return Err(ModelError::CorruptWeights {
                path: dir.to_path_buf(),
                reason: format!(
                    "{} tensor(s) the DSpark config does not describe, e.g. {:?}; check config.json matches the weights",
                    unused.len(),
                    &unused[..unused.len().min(5)]
                ),
            });
        }
        let threshold = request.options.confidence_threshold;
        if threshold.is_some() && model.confidence.is_none() {
            return Err(request.mismatch(
                "--confidence-threshold needs a confidence head, but this checkpoint has `enable_confidence_head: false`; drop the flag",
            ));
        }
        let dtype = options.dtype.unwrap_or(request.target.dtype);
        model.context.use_kernels(request.options.kernels, dtype)?;
        Ok(Self {
            confidence_threshold: threshold,
            model,
            cfg,
        })
    }

    pub fn config(&self) -> &DSparkConfig {
        &self.cfg
    }

    /// The block after the context: `[last, mask…]` through every layer and the final
    /// norm, `[1, B, hidden]`. The block's keys are dropped from the caches afterwards.
    fn backbone(&mut self, last: u32) -> Result<Array> {
        let b = self.cfg.block_size;
        let mut ids = vec![self.cfg.mask_token_id; b];
        ids[0] = last;
        let ids = Array::from_slice(&ids, &[1, b as i32]);
        let mut h = self.model.embed.forward(&ids)?;
        if let Some(scale) = self.model.embed_scale {
            h = h.multiply(Array::from_f32(scale).as_dtype(h.dtype())?)?;
        }
        let h = self.model.context.run_block(h)?;
        self.model.norm.forward(&h)
    }

    fn logits(&self, hidden: &Array) -> Result<Array> {
        let logits = self.model.lm_head.forward(hidden)?;
        match self.model.softcap {
            Some(cap) => softcap(&logits, cap),
            None => Ok(logits),
        }
    }

    /// Confidence (sigmoid) of positions `0..k`, where `prev` (`[k]` ids, lazy or not)
    /// holds the token before each position: `[k]` f32, lazy; `None` without a
    /// confidence head.
    fn confidences(&self, hidden: &Array, prev: &Array) -> Result<Option<Array>> {
        let Some(head) = &self.model.confidence else {
            return Ok(None);
        };
        let k = prev.shape()[0];
        let mut features = hidden.try_index((0, ..k, ..))?;
        if let (true, Some(markov)) = (self.cfg.confidence_with_markov, &self.model.markov) {
            let prev_embed = markov.w1.forward(prev)?.as_dtype(features.dtype())?;
            features = concatenate(&[features, prev_embed], -1)?;
        }
        Ok(Some(
            sigmoid(&head.forward(&features)?)?
                .reshape(&[k])?
                .as_dtype(Dtype::Float32)?,
        ))
    }

    /// `draft` cut where a position's confidence first falls below the threshold (never
    /// below one token: a round always has something to verify).
    fn cut(&self, draft: &mut Draft, confidences: Option<&Array>) -> Result<()> {
        let (Some(threshold), Some(conf)) = (self.confidence_threshold, confidences) else {
            return Ok(());
        };
        conf.eval()?;
        let conf = conf.as_slice::<f32>();
        let keep = conf
            .iter()
            .skip(1)
            .position(|&c| c < threshold)
            .map_or(conf.len(), |i| i + 1);
        draft.truncate(keep)
    }

    /// Greedy drafts chained on the device, where the picker leaves its picks there:
    /// each row's argmax feeds the next row's Markov correction without a host read.
    /// Without a confidence cut the drafts stay on the device for the verify; with one,
    /// they cross to the host once, with the confidences. `None` when the picker picks
    /// on the host only.
    fn propose_on_device(
        &self,
        hidden: &Array,
        base: &Array,
        last: u32,
        k: usize,
        picker: &mut dyn TokenPicker,
    ) -> Result<Option<Draft>> {
        let mut prev = Array::from_slice(&[last], &[1]);
        let mut chain = Vec::with_capacity(k + 1);
        chain.push(prev.clone());
        for i in 0..k as i32 {
            let mut row = base.try_index((0, i..i + 1, ..))?;
            if let Some(markov) = &self.model.markov {
                let bias = markov.w2.forward(&markov.w1.forward(&prev)?)?;
                row = row.add(bias.as_dtype(row.dtype())?)?;
            }
            let Some(picked) = picker.pick_on_device(&row)? else {
                return Ok(None);
            };
            prev = picked.reshape(&[1])?;
            chain.push(prev.clone());
        }
        // `[last, t1, …, tk]`: the drafts are its tail, the token before each its head.
        let chain = concatenate(&chain, 0)?;
        let tokens = chain.try_index(1..)?;
        let confidences = match self.confidence_threshold {
            Some(_) => self.confidences(hidden, &chain.try_index(..k as i32)?)?,
            None => None,
        };
        let Some(confidences) = confidences else {
            return Draft::on_device(tokens).map(Some);
        };
        mlx_rs::transforms::eval([&tokens, &confidences])?;
        let mut draft = Draft {
            tokens: tokens.as_slice::<u32>().to_vec(),
            ..Draft::default()
        };
        self.cut(&mut draft, Some(&confidences))?;
        Ok(Some(draft))
    }
}

impl Drafter for DSparkDrafter {
    fn name(&self) -> &str {
        "dspark"
    }

    fn taps(&self) -> &[usize] {
        &self.cfg.target_layer_ids
    }

    fn begin(
        &mut self,
        _target: &dyn TargetModel,
        _prompt: &[u32],
        hidden: Option<&Array>,
    ) -> Result<()> {
        self.model.context.reset();
        self.model.context.extend("dspark", hidden, "the prompt")
    }

    fn propose(
        &mut self,
        _target: &dyn TargetModel,
        last: u32,
        max_k: usize,
        picker: &mut dyn TokenPicker,
    ) -> Result<Draft> {
        let k = max_k.min(self.cfg.block_size);
        if k == 0 {
            return Ok(Draft::default());
        }
        let hidden = self.backbone(last)?;
        let base = self.logits(&hidden.try_index((.., ..k as i32, ..))?)?;
        if let Some(draft) = self.propose_on_device(&hidden, &base, last, k, picker)? {
            return Ok(draft);
        }
        let mut draft = Draft::default();
        let mut prev = vec![last];
        for i in 0..k as i32 {
            let mut row = base.try_index((0, i..i + 1, ..))?;
            if let Some(markov) = &self.model.markov {
                let p = prev.last().copied().unwrap_or(last);
                let bias = markov
                    .w2
                    .forward(&markov.w1.forward(&Array::from_slice(&[p], &[1]))?)?;
                row = row.add(bias.as_dtype(row.dtype())?)?;
            }
            // The picker sees the Markov-corrected row, so under sampling the q it
            // records is exactly the distribution the token came from; each sample
            // needs the one before it on the host.
            let picked = picker.pick(&row)?;
            let token = *picked.tokens.first().ok_or_else(|| {
                ModelError::Unsupported("token picker returned no token for a row".into())
            })?;
            draft.extend(picked)?;
            prev.push(token);
        }
        prev.truncate(k);
        let confidences = match self.confidence_threshold {
            Some(_) => self.confidences(&hidden, &Array::from_slice(&prev, &[k as i32]))?,
            None => None,
        };
        self.cut(&mut draft, confidences.as_ref())?;
        Ok(draft)
    }

    fn commit(&mut self, verified: &[u32], hidden: Option<&Array>) -> Result<()> {
        if verified.is_empty() {
            return Ok(());
        }
        self.model
            .context
            .extend("dspark", hidden, "the verified tokens")
    }

    /// The same weights (shared, not copied) over an empty context.
    fn fork(&self) -> Option<Box<dyn Drafter>> {
        let m = &self.model;
        Some(Box::new(Self {
            cfg: self.cfg.clone(),
            model: DSparkModel {
                embed: m.embed.clone(),
                embed_scale: m.embed_scale,
                context: m.context.fork(),
                norm: m.norm.clone(),
                lm_head: m.lm_head.clone(),
                softcap: m.softcap,
                markov: m.markov.clone(),
                confidence: m.confidence.clone(),
            },
            confidence_threshold: self.confidence_threshold,
        }))
    }

    fn forks(&self) -> bool {
        true
    }
}

/// Every way a DSpark checkpoint can fail to fit the target, caught before loading
/// weights, each naming the field, both values and the fix.
fn validate_against_target(cfg: &DSparkConfig, request: &DrafterLoadRequest) -> Result<()> {
    let t = request.target;
    if cfg.vocab_size as usize != t.vocab_size {
        return Err(request.mismatch(format!(
            "vocab_size is {} but the target's ({}) is {}: the drafter was trained for another tokenizer; use the DSpark checkpoint made for this target",
            cfg.vocab_size, t.model_type, t.vocab_size
        )));
    }
    let taps = cfg.target_layer_ids.len();
    let fc_in = taps * cfg.target_hidden_size as usize;
    if fc_in != taps * t.hidden_size {
        return Err(request.mismatch(format!(
            "fc input width is {fc_in} ({taps} taps × {}) but the target gives {} ({taps} taps × hidden_size {}): the drafter was trained for another target; use the DSpark checkpoint made for this one",
            cfg.target_hidden_size,
            taps * t.hidden_size,
            t.hidden_size
        )));
    }
    if let Some(&bad) = cfg.target_layer_ids.iter().find(|&&id| id >= t.num_layers) {
        return Err(request.mismatch(format!(
            "target_layer_ids {:?} include layer {bad} but the target has {} layers (0..={}): use the DSpark checkpoint made for this target",
            cfg.target_layer_ids,
            t.num_layers,
            t.num_layers.saturating_sub(1)
        )));
    }
    if let Some(n) = cfg.num_target_layers.filter(|&n| n != t.num_layers) {
        return Err(request.mismatch(format!(
            "num_target_layers is {n} but the target has {} layers: the drafter was trained for another target; use the DSpark checkpoint made for this one",
            t.num_layers
        )));
    }
    if cfg.mask_token_id as usize >= t.vocab_size {
        return Err(request.mismatch(format!(
            "mask_token_id {} is outside the target's vocabulary of {} tokens: fix `mask_token_id` in the drafter's config.json",
            cfg.mask_token_id, t.vocab_size
        )));
    }
    Ok(())
}

/// Whether a config.json describes a DSpark drafter: its Markov/confidence head fields
/// (which no other drafter or model config carries) or a name saying so.
fn is_dspark_config(config: &Value) -> bool {
    let named = |v: &Value| {
        v.as_str()
            .is_some_and(|s| s.to_ascii_lowercase().contains("dspark"))
    };
    let by_name = named(&config["model_type"])
        || config["architectures"]
            .as_array()
            .is_some_and(|a| a.iter().any(named));
    let by_fields = [
        "markov_rank",
        "markov_head_type",
        "enable_confidence_head",
        "confidence_head_with_markov",
    ]
    .iter()
    .any(|k| config.get(k).is_some());
    let dflash = config.get("dflash_config").is_some()
        || config["architectures"].as_array().is_some_and(|a| {
            a.iter()
                .any(|v| v.as_str().is_some_and(|s| s.contains("DFlash")))
        });
    (by_name || by_fields) && !dflash
}

fn load(request: &DrafterLoadRequest) -> Result<Box<dyn Drafter>> {
    Ok(Box::new(DSparkDrafter::load(request)?))
}

inventory::submit! {
    DrafterRegistration {
        kind: "dspark",
        summary: "DSpark (DeepSeek DeepSpec): drafts a block per pass from the target's hidden states with its own embedding and head, a Markov head and a confidence head (--confidence-threshold)",
        detect: is_dspark_config,
        by_name: false,
        load,
    }
}

/// Writes a random DSpark checkpoint (config.json + model.safetensors, the real schema
/// and tensor names) for tests. The tensors are the ones the loader asks for, so the
/// fixture and the loader cannot drift apart.
#[cfg(any(test, feature = "test-fixtures"))]
pub fn write_random_checkpoint(dir: &Path, config_json: &str, seed: u64) -> Result<()> {
    let path = dir.join("config.json");
    let config: Value = serde_json::from_str(config_json)
        .map_err(|e| ModelError::config(&path, format!("invalid JSON: {e}")))?;
    let cfg = DSparkConfig::parse(&config, dir)?;
    std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let mut weights = dspec_adapters::fixtures::RandomWeights::new(seed)?;
    DSparkModel::load(&cfg, &mut weights, &path, None)?;
    weights.save(dir, None)?;
    let text = serde_json::to_string_pretty(&config)
        .map_err(|e| ModelError::config(&path, format!("cannot serialise: {e}")))?;
    std::fs::write(&path, text).map_err(|source| ModelError::Io { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_dspark_configs_only() {
        for tiny in [TINY_DSPARK_QWEN3, TINY_DSPARK_GEMMA4] {
            let config: Value = serde_json::from_str(tiny).unwrap();
            assert!(is_dspark_config(&config));
        }
        let named = serde_json::json!({"architectures": ["DSparkDrafter"]});
        assert!(is_dspark_config(&named));
        let dflash = serde_json::json!({"architectures": ["DFlashDraftModel"], "block_size": 16,
            "dflash_config": {"target_layer_ids": [1], "mask_token_id": 5}});
        assert!(!is_dspark_config(&dflash));
        let model = serde_json::json!({"model_type": "qwen3", "hidden_size": 32});
        assert!(!is_dspark_config(&model));
    }

    fn parse(config: &Value) -> Result<DSparkConfig> {
        DSparkConfig::parse(config, Path::new("/drafter"))
    }

    fn tiny(json: &str) -> Value {
        serde_json::from_str(json).unwrap()
    }

    #[test]
    fn parse_reads_both_families_and_applies_family_defaults() {
        let q = parse(&tiny(TINY_DSPARK_QWEN3)).unwrap();
        assert_eq!(q.family, Family::Qwen3);
        assert_eq!((q.kv_heads, q.head_dim, q.k_eq_v), (2, 16, false));
        assert_eq!(q.final_logit_softcapping, None);
        assert_eq!(q.rope_theta, 1_000_000.0);
        let g = parse(&tiny(TINY_DSPARK_GEMMA4)).unwrap();
        assert_eq!(g.family, Family::Gemma4);
        assert_eq!((g.kv_heads, g.head_dim, g.k_eq_v), (1, 32, true));
        assert_eq!(g.final_logit_softcapping, Some(30.0));
        assert_eq!(g.rope["rope_type"], "proportional");
        assert_eq!(g.rope["partial_rotary_factor"], 0.25);
        assert_eq!(g.rope_theta, 1_000_000.0);

        // Absent optional fields take the published defaults; `null` counts as absent,
        // except for the softcap, where it turns the family's cap off.
        let mut sparse = tiny(TINY_DSPARK_GEMMA4);
        let fields = sparse.as_object_mut().unwrap();
        for key in [
            "global_head_dim",
            "markov_rank",
            "rope_parameters",
            "enable_confidence_head",
        ] {
            fields.remove(key);
        }
        fields.insert("num_global_key_value_heads".into(), Value::Null);
        fields.insert("final_logit_softcapping".into(), Value::Null);
        let d = parse(&sparse).unwrap();
        assert_eq!((d.kv_heads, d.head_dim, d.markov_rank), (1, 512, 256));
        assert!(d.confidence_head);
        assert_eq!(d.final_logit_softcapping, None);
        assert_eq!(d.rope["rope_type"], "proportional");
        assert_eq!(d.rope_theta, 1_000_000.0);

        // transformers ≥ 5 moves the qwen3 base into `rope_parameters`.
        let mut v5 = tiny(TINY_DSPARK_QWEN3);
        v5["rope_parameters"] = serde_json::json!({"rope_theta": 5000.0});
        assert_eq!(parse(&v5).unwrap().rope_theta, 5000.0);
    }

    #[test]
    fn a_missing_or_malformed_field_is_an_error_naming_the_file_and_the_field() {
        let cases: [(&str, Option<Value>, &[&str]); 7] = [
            ("block_size", None, &["missing field `block_size`"]),
            ("block_size", Some(Value::Null), &["`block_size`"]),
            (
                "block_size",
                Some("four".into()),
                &["`block_size`", "\"four\""],
            ),
            (
                "hidden_size",
                Some(0.into()),
                &["`hidden_size`", "positive", "got 0"],
            ),
            (
                "markov_rank",
                Some((-1).into()),
                &["`markov_rank`", "got -1"],
            ),
            (
                "mask_token_id",
                Some((-5).into()),
                &["`mask_token_id`", "-5"],
            ),
            (
                "rope_parameters",
                Some(serde_json::json!({"full_attention": {"rope_theta": "big"}})),
                &["`rope_parameters.full_attention", "\"big\""],
            ),
        ];
        for (key, value, needles) in cases {
            let mut config = tiny(TINY_DSPARK_GEMMA4);
            let fields = config.as_object_mut().unwrap();
            match value {
                Some(v) => fields.insert(key.into(), v),
                None => fields.remove(key),
            };
            let e = parse(&config).unwrap_err().to_string();
            assert!(
                e.contains("/drafter/config.json"),
                "{key}: names the file: {e}"
            );
            for needle in needles {
                assert!(e.contains(needle), "{key}: `{needle}` missing in: {e}");
            }
        }
        let mut empty = tiny(TINY_DSPARK_QWEN3);
        empty["target_layer_ids"] = serde_json::json!([]);
        let e = parse(&empty).unwrap_err().to_string();
        assert!(e.contains("`target_layer_ids` is empty"), "{e}");
        let mut other = tiny(TINY_DSPARK_QWEN3);
        other["markov_head_type"] = "gated".into();
        let e = parse(&other).unwrap_err().to_string();
        assert!(e.contains("`markov_head_type` `gated`"), "{e}");
        other["model_type"] = "llama".into();
        let e = parse(&other).unwrap_err().to_string();
        assert!(e.contains("`llama` names no known drafter family"), "{e}");
    }

    #[test]
    fn random_checkpoint_holds_the_real_tensor_names() {
        let dir = tempfile::tempdir().unwrap();
        write_random_checkpoint(dir.path(), TINY_DSPARK_GEMMA4, 1).unwrap();
        let names: Vec<String> = Array::load_safetensors(dir.path().join("model.safetensors"))
            .unwrap()
            .into_keys()
            .collect();
        for name in [
            "embed_tokens.weight",
            "fc.weight",
            "hidden_norm.weight",
            "layers.0.self_attn.q_proj.weight",
            "layers.0.self_attn.k_proj.weight",
            "layers.0.self_attn.q_norm.weight",
            "layers.0.self_attn.k_norm.weight",
            "layers.0.self_attn.o_proj.weight",
            "layers.0.pre_feedforward_layernorm.weight",
            "layers.0.layer_scalar",
            "layers.0.mlp.gate_proj.weight",
            "norm.weight",
            "lm_head.weight",
            "markov_head.markov_w1.weight",
            "markov_head.markov_w2.weight",
            "confidence_head.proj.weight",
            "confidence_head.proj.bias",
        ] {
            assert!(names.iter().any(|n| n == name), "missing {name}: {names:?}");
        }
        assert!(
            !names.iter().any(|n| n.contains("v_proj")),
            "k_eq_v: values come from k_proj"
        );
    }
}
