//! Hybrid decoders: full-attention layers among Gated DeltaNet (linear-attention)
//! layers, as Qwen3-Next and Qwen3.5 build them. The family files (qwen3_next.rs,
//! qwen3_5.rs) read their config.json into a [`HybridSpec`] with [`HybridConfig`]; this
//! file builds and runs it.
//!
//! Every layer is pre-norm: `h = x + mixer(norm(x))`, `h + mlp(norm(h))`, the mixer
//! being gated attention (q/k norms, partial RoPE, a sigmoid gate on the output) or a
//! Gated DeltaNet. The cache holds keys and values for the former and recurrent state
//! for the latter ([`LayerCache`]).

use std::path::Path;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{concatenate, zeros_dtype};
use mlx_rs::Array;
use serde::Deserialize;

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::target::{check_forward_args, forward_rows_one_by_one, TapCollector};
use dspec_plugin_api::{
    BatchRow, ForwardOutput, KvCache, LayerCache, ModelCache, ModelInfo, RecurrentCache, RowOutput,
    TargetModel, WeightSource,
};
use dspec_runtime::slicing::slice_axis;

use crate::attention::{
    attention_mask, whole_buffer_mask, whole_buffer_pays, Attention, AttentionSpec, Mask,
};
use crate::batch::{embedded_rows, rows_outputs};
use crate::config::{CommonConfig, MoeConfig, MoeDefaults};
use crate::continuation::ContinuationLayout;
use crate::gated_delta::{
    read_conv_weight, CheckpointLayout, DeltaNetSpec, GatedDeltaNet, ProjectionLayout,
};
use crate::layers::{
    Activation, Embedding, ExpertsSpec, FeedForward, FeedForwardSpec, Linear, RmsNorm, Rope,
};

/// States a recurrent layer keeps for rolling back until the engine says how many it
/// needs ([`ModelCache::set_rollback_window`]): enough for `--max-draft auto`'s 8
/// drafts, for callers that never set one.
pub const DEFAULT_ROLLBACK_WINDOW: usize = 8;

fn default_interval() -> usize {
    4
}

fn default_partial_rotary() -> f32 {
    0.25
}

/// The config.json fields both hybrid families share (HF names), next to the common
/// decoder ones. Families add theirs with `#[serde(flatten)]`.
#[derive(Debug, Deserialize)]
pub struct HybridConfig {
    #[serde(flatten)]
    pub common: CommonConfig,
    #[serde(default)]
    pub attention_bias: bool,
    pub linear_conv_kernel_dim: i32,
    pub linear_key_head_dim: i32,
    pub linear_value_head_dim: i32,
    pub linear_num_key_heads: i32,
    pub linear_num_value_heads: i32,
    /// Used when `layer_types` is absent: every `full_attention_interval`-th layer is
    /// full attention.
    #[serde(default = "default_interval")]
    pub full_attention_interval: usize,
    /// transformers 4 and mlx-lm conversions; transformers 5 moves it into
    /// `rope_parameters`.
    pub partial_rotary_factor: Option<f32>,
    /// Mixture-of-experts fields (Qwen3-Next's MLPs are sparse unless these say not).
    #[serde(flatten)]
    pub moe: MoeConfig,
}

/// What one layer mixes positions with.
pub enum MixerSpec {
    /// Gated full attention (its q/k norm style is set at load, from the checkpoint's
    /// layout).
    Attention(AttentionSpec),
    DeltaNet(DeltaNetSpec),
}

/// Everything needed to build a hybrid model, from config.json by a family file.
pub struct HybridSpec {
    /// The `model_type` reported (config.json's).
    pub model_type: String,
    /// Tensor name prefixes of the decoder, tried in order: the first whose embedding
    /// the checkpoint holds is used (HF and MLX name a multimodal checkpoint's language
    /// model differently).
    pub prefixes: Vec<String>,
    pub vocab_size: i32,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub rms_norm_eps: f32,
    pub activation: Activation,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: Option<usize>,
    pub layers: Vec<MixerSpec>,
    /// Per layer, its experts where its MLP is a mixture of experts (none past the end).
    pub experts: Vec<Option<ExpertsSpec>>,
}

impl HybridConfig {
    /// The spec of a config, with the family's MoE defaults where the config is silent
    /// (HF's Qwen3-Next config defaults to 512 experts; Qwen3.5's dense config has none).
    pub fn spec(
        &self,
        model_type: &str,
        path: &Path,
        projections: ProjectionLayout,
        moe_defaults: MoeDefaults,
    ) -> Result<HybridSpec> {
        let c = &self.common;
        c.validate(path)?;
        self.validate(path)?;
        let layers = c.num_hidden_layers as usize;
        let experts = self.moe.experts_per_layer(layers, moe_defaults, path)?;
        let (theta, rope_parameters) = c.rope();
        let partial = rope_parameters["partial_rotary_factor"]
            .as_f64()
            .map(|p| p as f32)
            .or(self.partial_rotary_factor)
            .unwrap_or_else(default_partial_rotary);
        if !(partial > 0.0 && partial <= 1.0) {
            return Err(ModelError::config(
                path,
                format!("`partial_rotary_factor` must be in (0, 1], got {partial}"),
            ));
        }
        // The convolution's activation is the config's `hidden_act` in HF, and SiLU here.
        let activation = c.activation_name("silu");
        if activation != "silu" && activation != "swish" {
            return Err(ModelError::config(
                path,
                format!("`hidden_act` is `{activation}`; {model_type} models use silu"),
            ));
        }
        let rotated = (c.head_dim() as f32 * partial) as i32;
        let rope = Rope::from_config(rotated, theta, &rope_parameters, path)?;
        let attention = AttentionSpec {
            qkv_bias: self.attention_bias,
            o_bias: self.attention_bias,
            qk_norm: Some((c.rms_norm_eps, crate::layers::NormWeight::Plain)),
            output_gate: true,
            ..c.attention(rope)
        };
        let delta_net = DeltaNetSpec {
            hidden: c.hidden_size,
            key_heads: self.linear_num_key_heads,
            value_heads: self.linear_num_value_heads,
            key_dim: self.linear_key_head_dim,
            value_dim: self.linear_value_head_dim,
            conv_kernel: self.linear_conv_kernel_dim,
            norm_eps: c.rms_norm_eps,
            projections,
        };
        let mut specs = Vec::with_capacity(layers);
        for i in 0..layers {
            let full = match c.layer_types.as_ref().map(|t| t[i].as_str()) {
                Some("full_attention") => true,
                Some("linear_attention") => false,
                Some(other) => {
                    return Err(ModelError::config(
                        path,
                        format!(
                            "layer_types[{i}] is `{other}`; {model_type} layers are \
                             `full_attention` or `linear_attention`"
                        ),
                    ))
                }
                None => (i + 1) % self.full_attention_interval.max(1) == 0,
            };
            specs.push(match full {
                true => MixerSpec::Attention(attention.clone()),
                false => MixerSpec::DeltaNet(delta_net),
            });
        }
        if !specs.iter().any(|s| matches!(s, MixerSpec::DeltaNet(_))) {
            return Err(ModelError::config(
                path,
                "no layer is `linear_attention`: dspec tells HF checkpoints from MLX \
                 conversions by a linear-attention layer's conv1d weight, and a model without \
                 one is not a hybrid model (load it as qwen3)",
            ));
        }
        Ok(HybridSpec {
            model_type: model_type.into(),
            prefixes: vec!["model.".into()],
            vocab_size: c.vocab_size,
            hidden_size: c.hidden_size,
            intermediate_size: c.intermediate_size,
            rms_norm_eps: c.rms_norm_eps,
            activation: Activation::from_name(&activation, path)?,
            tie_word_embeddings: c.tie_word_embeddings.unwrap_or(false),
            max_position_embeddings: c.max_position_embeddings,
            layers: specs,
            experts,
        })
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let positive = [
            ("linear_key_head_dim", self.linear_key_head_dim),
            ("linear_value_head_dim", self.linear_value_head_dim),
            ("linear_num_key_heads", self.linear_num_key_heads),
            ("linear_num_value_heads", self.linear_num_value_heads),
        ];
        if let Some((name, value)) = positive.iter().find(|(_, v)| *v <= 0) {
            return Err(ModelError::config(
                path,
                format!("`{name}` must be positive, got {value}"),
            ));
        }
        if self.linear_num_value_heads % self.linear_num_key_heads != 0 {
            return Err(ModelError::config(
                path,
                format!(
                    "linear_num_value_heads ({}) must be a multiple of linear_num_key_heads ({})",
                    self.linear_num_value_heads, self.linear_num_key_heads
                ),
            ));
        }
        if self.linear_conv_kernel_dim < 2 {
            return Err(ModelError::config(
                path,
                format!(
                    "`linear_conv_kernel_dim` must be at least 2, got {}: with a kernel of 1 \
                     the HF (`[C, 1, K]`) and MLX (`[C, K, 1]`) layouts of conv1d weights look \
                     alike, and dspec could not tell whether the norm weights are stored as w \
                     or as 1 + w",
                    self.linear_conv_kernel_dim
                ),
            ));
        }
        Ok(())
    }
}

/// One hybrid layer's mixer. A few per model, built once: their sizes do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
enum Mixer {
    Attention(Attention),
    DeltaNet(GatedDeltaNet),
}

#[derive(Clone)]
struct HybridLayer {
    mixer: Mixer,
    mlp: FeedForward,
    input_norm: RmsNorm,
    post_norm: RmsNorm,
}

/// A clone shares the weights (MLX arrays are handles): see [`TargetModel::share`].
#[derive(Clone)]
pub struct HybridDecoder {
    info: ModelInfo,
    embed: Embedding,
    layers: Vec<HybridLayer>,
    norm: RmsNorm,
    /// `None`: tied to the embedding.
    lm_head: Option<Linear>,
    /// Run short continuations position by position (`LoadOptions::rowwise_verify`).
    rowwise_verify: bool,
    /// Short continuations attend over the whole cache buffer (CUDA, see
    /// [`whole_buffer_pays`]).
    whole_buffer: bool,
}

impl HybridDecoder {
    pub fn load(spec: HybridSpec, w: &mut dyn WeightSource) -> Result<Self> {
        let has_embedding = |w: &dyn WeightSource, p: &str| {
            ["weight", "scales"]
                .iter()
                .any(|part| w.contains(&format!("{p}embed_tokens.{part}")))
        };
        let p = spec
            .prefixes
            .iter()
            .find(|p| has_embedding(&*w, p))
            .or(spec.prefixes.first())
            .cloned()
            .unwrap_or_default();
        // The checkpoint's layout, from every linear-attention layer's conv1d weight: all
        // must agree, as a checkpoint half converted cannot be read right.
        let mut convs = Vec::with_capacity(spec.layers.len());
        let mut layout: Option<(CheckpointLayout, String)> = None;
        for (i, mixer) in spec.layers.iter().enumerate() {
            let MixerSpec::DeltaNet(d) = mixer else {
                convs.push(None);
                continue;
            };
            let name = format!("{p}layers.{i}.linear_attn.conv1d.weight");
            let (taps, found) = read_conv_weight(w, &name, d.conv_channels(), d.conv_kernel)?;
            match &layout {
                Some((first, first_name)) if *first != found => {
                    return Err(ModelError::Unsupported(format!(
                        "`{name}` is stored in the {found:?} layout but `{first_name}` in the \
                         {first:?} layout (HF: [channels, 1, kernel] with norms as w; MLX: \
                         [channels, kernel, 1] with norms as 1 + w): the checkpoint mixes both; \
                         convert it again from the original"
                    )))
                }
                Some(_) => {}
                None => layout = Some((found, name)),
            }
            convs.push(Some(taps));
        }
        let Some((layout, _)) = layout else {
            return Err(ModelError::Unsupported(
                "a hybrid model without linear-attention layers".into(),
            ));
        };
        let style = layout.norm_weight();
        let (h, eps) = (spec.hidden_size, spec.rms_norm_eps);
        let embed = Embedding::load(w, &format!("{p}embed_tokens"), spec.vocab_size, h)?;
        let mut layers = Vec::with_capacity(spec.layers.len());
        for (i, (mixer, conv)) in spec.layers.into_iter().zip(convs).enumerate() {
            let lp = format!("{p}layers.{i}");
            let input_norm =
                RmsNorm::load(w, &format!("{lp}.input_layernorm.weight"), h, eps, style)?;
            let mixer = match (mixer, conv) {
                (MixerSpec::Attention(a), _) => Mixer::Attention(Attention::load(
                    w,
                    &format!("{lp}.self_attn"),
                    AttentionSpec {
                        qk_norm: a.qk_norm.map(|(eps, _)| (eps, style)),
                        ..a
                    },
                )?),
                (MixerSpec::DeltaNet(d), Some(conv)) => Mixer::DeltaNet(GatedDeltaNet::load(
                    w,
                    &format!("{lp}.linear_attn"),
                    d,
                    &conv,
                )?),
                (MixerSpec::DeltaNet(_), None) => {
                    unreachable!("every linear-attention layer's conv weight was read above")
                }
            };
            let post_norm = RmsNorm::load(
                w,
                &format!("{lp}.post_attention_layernorm.weight"),
                h,
                eps,
                style,
            )?;
            let mlp = FeedForward::load(
                w,
                &format!("{lp}.mlp"),
                FeedForwardSpec {
                    hidden: h,
                    inner: spec.intermediate_size,
                    bias: false,
                    act: spec.activation,
                    experts: spec.experts.get(i).copied().flatten(),
                },
                None,
            )?;
            layers.push(HybridLayer {
                mixer,
                mlp,
                input_norm,
                post_norm,
            });
        }
        let norm = RmsNorm::load(w, &format!("{p}norm.weight"), h, eps, style)?;
        // mlx-lm's conversion of a multimodal checkpoint keeps the head beside the
        // language model (`language_model.lm_head`); HF keeps it at the top.
        let head = match p.starts_with("language_model.") {
            true => "language_model.lm_head",
            false => "lm_head",
        };
        let lm_head = if spec.tie_word_embeddings && !w.contains(&format!("{head}.weight")) {
            None
        } else {
            Some(Linear::load(w, head, h, spec.vocab_size, false)?)
        };
        let quantized_bits = layers.iter().find_map(|l| match &l.mixer {
            Mixer::Attention(a) => a.quantized_bits(),
            Mixer::DeltaNet(d) => d.quantized_bits(),
        });
        let info = ModelInfo {
            model_type: spec.model_type,
            num_layers: layers.len(),
            hidden_size: h as usize,
            vocab_size: spec.vocab_size as usize,
            dtype: embed.dtype(),
            quantized_bits,
            max_context: spec.max_position_embeddings,
        };
        Ok(Self {
            info,
            embed,
            layers,
            norm,
            lm_head,
            rowwise_verify: w.options().rowwise_verify,
            whole_buffer: whole_buffer_pays(),
        })
    }
}

impl TargetModel for HybridDecoder {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_cache(&self) -> ModelCache {
        ModelCache::with_layers(
            self.layers
                .iter()
                .map(|l| match l.mixer {
                    Mixer::Attention(_) => LayerCache::Attention(KvCache::new()),
                    Mixer::DeltaNet(_) => {
                        LayerCache::Recurrent(RecurrentCache::new(DEFAULT_ROLLBACK_WINDOW))
                    }
                })
                .collect(),
        )
    }

    fn forward(
        &self,
        tokens: &Array,
        cache: &mut ModelCache,
        taps: &[usize],
    ) -> Result<ForwardOutput> {
        check_forward_args(tokens, cache, taps, self.layers.len())?;
        let offset = cache.checked_offset()? as i32;
        let asked = tokens.shape()[1];
        // A short continuation runs as the plain decoder runs it ([`ContinuationLayout`]).
        // The padding is for attention's sake only: the linear-attention layers see the
        // real positions alone (their state never takes in a pad) and hand zeros on for
        // the padded ones, whose outputs are cut and whose keys and values are trimmed
        // below; a pad cannot change a real position, all of which come before it.
        let layout =
            ContinuationLayout::choose(offset, asked, self.rowwise_verify, self.whole_buffer);
        let (rows, over_whole_buffer, pad) = (layout.rows, layout.over_whole_buffer, layout.pad);
        let tokens = layout.padded(tokens)?;
        let len = asked + pad;
        let hidden_size = self.info.hidden_size as i32;
        let mut h = self.embed(&tokens)?;
        let dtype = h.dtype();
        let mask = if rows {
            Mask::All
        } else if over_whole_buffer {
            let first = cache.layers_mut().iter_mut().find_map(|l| match l {
                LayerCache::Attention(kv) => Some(kv),
                LayerCache::Recurrent(_) => None,
            });
            match first {
                Some(kv) => {
                    let capacity = kv.capacity_for((offset + len) as usize) as i32;
                    whole_buffer_mask(offset, len, capacity, None, dtype)?
                }
                None => attention_mask(offset, len, None)?,
            }
        } else {
            attention_mask(offset, len, None)?
        };
        if rows {
            h = h.reshape(&[len, 1, hidden_size])?;
        }
        let as_sequence = |x: &Array| -> Result<Array> {
            if rows {
                Ok(x.reshape(&[1, len, x.shape()[2]])?)
            } else {
                Ok(x.clone())
            }
        };
        let mut tapped = TapCollector::new(taps, self.layers.len());
        for (i, (layer, layer_cache)) in self.layers.iter().zip(cache.layers_mut()).enumerate() {
            let x = layer.input_norm.forward(&h)?;
            let mixed = match &layer.mixer {
                Mixer::Attention(attn) => attn.forward(&x, layer_cache.kv_mut()?, &mask)?,
                Mixer::DeltaNet(net) if pad > 0 => {
                    let real =
                        net.forward(&slice_axis(&x, 1, 0, asked)?, layer_cache.recurrent_mut()?)?;
                    concatenate(&[real, zeros_dtype(&[1, pad, hidden_size], dtype)?], 1)?
                }
                Mixer::DeltaNet(net) => net.forward(&x, layer_cache.recurrent_mut()?)?,
            };
            let mid = h.add(mixed)?;
            h = mid.add(layer.mlp.forward(&layer.post_norm.forward(&mid)?)?)?;
            if taps.contains(&i) {
                tapped.offer(i, &as_sequence(&h)?);
            }
        }
        let mut logits = as_sequence(&self.lm_head(&self.final_norm(&h)?)?)?;
        let mut hidden = tapped.finish()?;
        if pad > 0 {
            logits = logits.try_index((.., ..asked, ..))?;
            hidden = hidden.map(|h| h.try_index((.., ..asked, ..))).transpose()?;
            for layer in cache.layers_mut() {
                if let LayerCache::Attention(kv) = layer {
                    kv.trim(pad as usize)?;
                }
            }
        }
        Ok(ForwardOutput { logits, hidden })
    }

    fn forward_batch(&self, rows: &mut [BatchRow<'_>], taps: &[usize]) -> Result<Vec<RowOutput>> {
        if rows.len() < 2 {
            return forward_rows_one_by_one(self, rows, taps);
        }
        let (lens, mut h) = embedded_rows(self, rows, taps, self.layers.len())?;
        let mut tapped = TapCollector::new(taps, self.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let x = layer.input_norm.forward(&h)?;
            let mixed = match &layer.mixer {
                Mixer::Attention(attn) => {
                    let mut caches = rows
                        .iter_mut()
                        .map(|r| r.cache.layers_mut()[i].kv_mut())
                        .collect::<Result<Vec<_>>>()?;
                    attn.forward_packed(&x, &mut caches, &lens)?
                }
                Mixer::DeltaNet(net) => {
                    let mut caches = rows
                        .iter_mut()
                        .map(|r| r.cache.layers_mut()[i].recurrent_mut())
                        .collect::<Result<Vec<_>>>()?;
                    net.forward_packed(&x, &mut caches, &lens)?
                }
            };
            let mid = h.add(mixed)?;
            h = mid.add(layer.mlp.forward(&layer.post_norm.forward(&mid)?)?)?;
            tapped.offer(i, &h);
        }
        rows_outputs(self, &h, &tapped, rows, &lens)
    }

    fn batches_rows(&self) -> bool {
        true
    }

    fn share(&self) -> Option<Box<dyn TargetModel>> {
        Some(Box::new(self.clone()))
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

#[cfg(test)]
mod tests {
    use mlx_rs::{Array, Dtype};

    use dspec_plugin_api::{ModelCache, ModelError, TargetModel};

    use super::*;
    use crate::fixtures::{
        differing_bits, load_dir, with, write_random_model, RandomWeights, TINY_LLAMA,
        TINY_QWEN3_5_OVERRIDES, TINY_QWEN3_NEXT_OVERRIDES,
    };

    fn qwen3_5_config() -> String {
        with(TINY_LLAMA, TINY_QWEN3_5_OVERRIDES)
    }

    fn qwen3_next_config() -> String {
        with(&qwen3_5_config(), TINY_QWEN3_NEXT_OVERRIDES)
    }

    /// A tiny random Qwen3.5 built in memory (the whole-buffer switch is reachable).
    fn tiny(seed: u64) -> HybridDecoder {
        let config: serde_json::Value = serde_json::from_str(&qwen3_5_config()).expect("json");
        let cfg: HybridConfig =
            crate::config::parse_config(&config, Path::new(".")).expect("config");
        let spec = cfg
            .spec(
                "qwen3_5_text",
                Path::new("config.json"),
                ProjectionLayout::Separate,
                crate::qwen3_5::MOE_DEFAULTS,
            )
            .expect("spec");
        HybridDecoder::load(spec, &mut RandomWeights::new(seed).expect("weights")).expect("load")
    }

    fn ids(tokens: &[u32]) -> Array {
        Array::from_slice(tokens, &[1, tokens.len() as i32])
    }

    fn logits(model: &dyn TargetModel, tokens: &[u32], cache: &mut ModelCache) -> Vec<f32> {
        model
            .forward(&ids(tokens), cache, &[])
            .expect("forward")
            .logits
            .as_dtype(Dtype::Float32)
            .expect("f32")
            .as_slice::<f32>()
            .to_vec()
    }

    fn one_by_one(model: &dyn TargetModel, tokens: &[u32], cache: &mut ModelCache) -> Vec<f32> {
        tokens
            .iter()
            .flat_map(|&t| logits(model, &[t], cache))
            .collect()
    }

    fn worst(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    fn sequence(len: usize) -> Vec<u32> {
        (0..len).map(|i| ((i * 37 + 11) % 97) as u32).collect()
    }

    /// A prompt longer than the stepwise limit runs its head chunked: its logits are those
    /// of decoding it one token at a time, and afterwards the cache can still go back
    /// as far as its window, to the same states one-token decoding had there.
    #[test]
    fn a_long_prefill_runs_chunked_and_agrees_with_one_token_steps() {
        let model = tiny(3);
        let tokens = sequence(150);
        let (whole_cache, step_cache) = (&mut model.new_cache(), &mut model.new_cache());
        let whole = logits(&model, &tokens, whole_cache);
        let stepped = one_by_one(&model, &tokens, step_cache);
        let diff = worst(&whole, &stepped);
        assert!(diff < 1e-4, "logits differ by {diff}");
        assert_eq!(whole_cache.rollback_limit(), DEFAULT_ROLLBACK_WINDOW);
        whole_cache
            .trim(DEFAULT_ROLLBACK_WINDOW)
            .expect("within the window");
        step_cache
            .trim(DEFAULT_ROLLBACK_WINDOW)
            .expect("within the window");
        let err = whole_cache.trim(1).expect_err("the window is spent");
        assert!(
            matches!(err, ModelError::CannotRollBack { limit: 0, .. }),
            "{err}"
        );
        let next = [5, 6, 7];
        let diff = worst(
            &one_by_one(&model, &next, whole_cache),
            &one_by_one(&model, &next, step_cache),
        );
        assert!(diff < 1e-4, "after the rollback, logits differ by {diff}");
    }

    /// Rolling back inside a block of one-token forwards (a draft model's drafts) returns
    /// to exactly the state that was there: feeding the same tokens again gives bitwise
    /// the logits they gave the first time, from every position of the block.
    #[test]
    fn rollback_inside_a_block_restores_states_bitwise() {
        let model = tiny(4);
        let tokens = sequence(12);
        let (prefix, block) = (6, 5);
        let mut cache = model.new_cache();
        logits(&model, &tokens[..prefix], &mut cache);
        let first = one_by_one(&model, &tokens[prefix..prefix + block], &mut cache);
        let vocab = first.len() / block;
        for back in 1..=block {
            let mut cache = model.new_cache();
            logits(&model, &tokens[..prefix], &mut cache);
            one_by_one(&model, &tokens[prefix..prefix + block], &mut cache);
            cache.trim(back).expect("within the window");
            let from = block - back;
            let again = one_by_one(&model, &tokens[prefix + from..prefix + block], &mut cache);
            let differing = differing_bits(&again, &first[from * vocab..]);
            assert_eq!(
                differing, 0,
                "rolled back {back}: {differing} logits differ"
            );
        }
    }

    /// On CUDA short continuations run padded to a fixed width over the whole cache
    /// buffer. Forced on here: the linear-attention layers take in the real positions
    /// only, so the logits are those of the causal path and the cache ends where it
    /// should, able to roll back through the continuation.
    #[test]
    fn padded_whole_buffer_continuations_leave_recurrent_state_untouched() {
        let tokens = sequence(30);
        let run = |whole_buffer: bool| -> Vec<f32> {
            let mut model = tiny(5);
            model.whole_buffer = whole_buffer;
            let mut cache = model.new_cache();
            logits(&model, &tokens[..9], &mut cache);
            let mut out = logits(&model, &tokens[9..14], &mut cache);
            assert_eq!(cache.checked_offset().expect("consistent"), 14);
            assert_eq!(cache.rollback_limit(), DEFAULT_ROLLBACK_WINDOW);
            cache.trim(3).expect("trim");
            out.extend(logits(&model, &tokens[11..30], &mut cache));
            assert_eq!(cache.checked_offset().expect("consistent"), 30);
            out
        };
        let (whole, causal) = (run(true), run(false));
        let diff = worst(&whole, &causal);
        assert!(diff < 1e-4, "logits differ by {diff}");
    }

    /// Plain decoding keeps no past states: the window set to 0 leaves nothing to roll
    /// back to, and a trim says so.
    #[test]
    fn a_window_of_zero_keeps_no_states() {
        let model = tiny(6);
        let mut cache = model.new_cache();
        cache.set_rollback_window(0);
        logits(&model, &sequence(40), &mut cache);
        one_by_one(&model, &[1, 2], &mut cache);
        assert_eq!(cache.rollback_limit(), 0);
        assert_eq!(cache.rollback_window(), Some(0));
        let err = cache.trim(1).expect_err("nothing kept").to_string();
        assert!(err.contains("at most 0"), "{err}");
    }

    /// Half-precision activations (weights cast on load, `A_log` kept f32, the recurrence
    /// in f32) run through a chunked prefill and stepped decoding and stay near f32. The
    /// bound is loose: on the golden checkpoints bf16 moves transformers' logits and dspec's
    /// by a few percent of their range, and this random model is touchier.
    #[test]
    fn bf16_stays_close_to_f32() {
        let dir = tempfile::tempdir().expect("temp dir");
        write_random_model(dir.path(), &qwen3_5_config(), 8, None).expect("fixture");
        let tokens = sequence(40);
        let run = |dtype: Dtype| {
            let options = dspec_plugin_api::LoadOptions {
                dtype: Some(dtype),
                ..Default::default()
            };
            let model = load_dir(dir.path(), &options).expect("load");
            let mut cache = model.new_cache();
            let mut out = logits(model.as_ref(), &tokens[..30], &mut cache);
            out.extend(one_by_one(model.as_ref(), &tokens[30..], &mut cache));
            out
        };
        let (full, half) = (run(Dtype::Float32), run(Dtype::Bfloat16));
        let scale = full.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let diff = worst(&full, &half);
        assert!(
            diff < 0.12 * scale,
            "bf16 differs by {diff} on logits up to {scale}"
        );
    }

    fn load_error(config: &str) -> String {
        let dir = tempfile::tempdir().expect("temp dir");
        match write_random_model(dir.path(), config, 1, None) {
            Err(e) => e.to_string(),
            Ok(()) => match load_dir(dir.path(), &Default::default()) {
                Err(e) => e.to_string(),
                Ok(_) => panic!("loaded: {config}"),
            },
        }
    }

    /// Configs dspec cannot run fail naming the file, the field and what to do.
    #[test]
    fn bad_configs_are_refused_with_the_field_named() {
        let mut missing: serde_json::Value = serde_json::from_str(&qwen3_5_config()).expect("json");
        missing
            .as_object_mut()
            .expect("object")
            .remove("linear_num_key_heads");
        let err = load_error(&missing.to_string());
        assert!(
            err.contains("config.json") && err.contains("linear_num_key_heads"),
            "{err}"
        );

        let nested = serde_json::json!({
            "model_type": "qwen3_5",
            "text_config": missing,
        });
        let err = load_error(&nested.to_string());
        assert!(
            err.contains("text_config") && err.contains("linear_num_key_heads"),
            "{err}"
        );

        let cases = [
            (r#"{"linear_conv_kernel_dim": 1}"#, "at least 2"),
            (
                r#"{"linear_num_value_heads": 3}"#,
                "multiple of linear_num_key_heads",
            ),
            (
                r#"{"layer_types": ["linear_attention", "sliding_attention", "linear_attention"]}"#,
                "layer_types[1]",
            ),
            (
                r#"{"layer_types": ["full_attention", "full_attention", "full_attention"]}"#,
                "no layer is `linear_attention`",
            ),
            (r#"{"hidden_act": "gelu"}"#, "silu"),
        ];
        for (overrides, expected) in cases {
            let err = load_error(&with(&qwen3_5_config(), overrides));
            assert!(err.contains(expected), "{overrides}: {err}");
        }
        // Qwen3-Next's MLPs are mixtures of experts unless the config says otherwise, and
        // then the config must say how they route.
        let mut moe: serde_json::Value = serde_json::from_str(&qwen3_next_config()).expect("json");
        moe.as_object_mut().expect("object").remove("num_experts");
        let err = load_error(&moe.to_string());
        assert!(err.contains("num_experts_per_tok"), "{err}");
        for (overrides, expected) in [
            (
                r#"{"num_experts": 4, "num_experts_per_tok": 5, "moe_intermediate_size": 8}"#,
                "from 1 to num_experts (4)",
            ),
            (
                r#"{"num_experts": 4, "num_experts_per_tok": 2}"#,
                "moe_intermediate_size",
            ),
            (
                r#"{"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 8, "decoder_sparse_step": 0}"#,
                "decoder_sparse_step",
            ),
        ] {
            let err = load_error(&with(&qwen3_next_config(), overrides));
            assert!(err.contains(expected), "{overrides}: {err}");
        }
        let dense_layers = with(
            &qwen3_next_config(),
            r#"{"num_experts": 8, "mlp_only_layers": [0, 1, 2]}"#,
        );
        let dir = tempfile::tempdir().expect("temp dir");
        write_random_model(dir.path(), &dense_layers, 1, None).expect("every MLP dense");
    }

    /// A checkpoint whose conv1d weights mix the HF and MLX layouts cannot say how its
    /// norms are stored: refused, naming both tensors.
    #[test]
    fn a_checkpoint_mixing_layouts_is_refused() {
        let config: serde_json::Value = serde_json::from_str(&qwen3_5_config()).expect("json");
        let cfg: HybridConfig =
            crate::config::parse_config(&config, Path::new(".")).expect("config");
        let spec = || {
            cfg.spec(
                "qwen3_5_text",
                Path::new("config.json"),
                ProjectionLayout::Separate,
                crate::qwen3_5::MOE_DEFAULTS,
            )
            .expect("spec")
        };
        let mut weights = RandomWeights::new(1).expect("weights");
        HybridDecoder::load(spec(), &mut weights).expect("load");
        let name = "model.layers.2.linear_attn.conv1d.weight";
        let mlx = weights.created.get(name).expect("conv").clone();
        weights
            .created
            .insert(name.into(), mlx.swap_axes(1, 2).expect("HF layout"));
        let err = match HybridDecoder::load(spec(), &mut weights) {
            Err(e) => e.to_string(),
            Ok(_) => panic!("a mixed checkpoint loaded"),
        };
        assert!(
            err.contains(name) && err.contains("model.layers.0.linear_attn.conv1d.weight"),
            "{err}"
        );
    }
}
