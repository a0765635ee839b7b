//! The decoder-only transformer every built-in family is an instance of: family files
//! turn their config.json into a [`DecoderSpec`]; this file builds and runs it.

use std::collections::HashMap;

use mlx_rs::ops::concatenate;
use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};

use dspec_plugin_api::error::Result;
use dspec_plugin_api::target::{check_forward_args, forward_rows_one_by_one, TapCollector};
use dspec_plugin_api::{
    BatchRow, ForwardOutput, ModelCache, ModelInfo, RowOutput, TargetModel, WeightSource,
};

use crate::attention::{
    attention_mask, whole_buffer_mask, whole_buffer_pays, Attention, AttentionSpec, Mask,
    WHOLE_BUFFER_MAX_TOKENS,
};
use crate::batch::{embedded_rows, rows_outputs};
use crate::continuation::ContinuationLayout;
use crate::cuda;
use crate::layers::{
    softcap, Activation, Embedding, ExpertsSpec, FeedForward, FeedForwardSpec, Linear, NormWeight,
    RmsNorm,
};
use crate::tensor_parallel::TensorParallel;

/// Where the norms sit around each sub-block.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormLayout {
    /// `x + attn(norm(x))`, `h + mlp(norm(h))` (llama, qwen, mistral, gemma).
    PreNorm,
    /// Norms before and after each sub-block (gemma2, gemma3): `x + norm(attn(norm(x)))`.
    Sandwich,
}

/// Everything needed to build a model, derived from config.json by a family file.
pub struct DecoderSpec {
    pub model_type: String,
    /// Tensor name prefix of the decoder (`model.` in HF checkpoints).
    pub prefix: String,
    /// Prefixes tried when the checkpoint has no `{prefix}embed_tokens`: multimodal
    /// checkpoints name their language model differently in HF and MLX conversions.
    pub other_prefixes: Vec<String>,
    pub vocab_size: i32,
    pub hidden_size: i32,
    pub intermediate_size: i32,
    pub rms_norm_eps: f32,
    pub norm_weight: NormWeight,
    pub norm_layout: NormLayout,
    pub activation: Activation,
    pub mlp_bias: bool,
    /// Multiplies token embeddings (gemma: √hidden, rounded to the activation dtype).
    pub embed_scale: Option<f32>,
    pub tie_word_embeddings: bool,
    pub final_logit_softcap: Option<f32>,
    /// Each layer's output is multiplied by its learned `layer_scalar` (gemma4).
    pub layer_scalar: bool,
    pub max_position_embeddings: Option<usize>,
    /// One entry per decoder layer.
    pub layers: Vec<AttentionSpec>,
    /// Per decoder layer, its experts where its MLP is a mixture of experts; layers past
    /// the end (all of them when empty) have a dense MLP.
    pub experts: Vec<Option<ExpertsSpec>>,
}

/// One decoder block (attention + MLP with the family's norms), as the target runs it
/// and as drafters built from the same families (DFlash, DSpark) run it over a draft block.
#[derive(Clone)]
pub struct DecoderLayer {
    attn: Attention,
    mlp: FeedForward,
    input_norm: RmsNorm,
    post_attn_norm: RmsNorm,
    /// Sandwich layout only: norm before the MLP and after it.
    ffn_norms: Option<(RmsNorm, RmsNorm)>,
    layer_scalar: Option<Array>,
}

impl DecoderLayer {
    /// Loads layer tensors under `prefix` (`model.layers.3`) as `spec` describes them,
    /// with `attn_spec` for its attention.
    pub fn load(
        w: &mut dyn WeightSource,
        prefix: &str,
        spec: &DecoderSpec,
        attn_spec: &AttentionSpec,
    ) -> Result<Self> {
        Self::load_parallel(w, prefix, spec, attn_spec, None, None)
    }

    /// [`DecoderLayer::load`] of this rank's share under `tp`: attention heads and MLP
    /// hidden units split across the group (norms whole on every rank); a mixture of
    /// `experts` in place of the dense MLP when given.
    pub fn load_parallel(
        w: &mut dyn WeightSource,
        prefix: &str,
        spec: &DecoderSpec,
        attn_spec: &AttentionSpec,
        experts: Option<ExpertsSpec>,
        tp: Option<&TensorParallel>,
    ) -> Result<Self> {
        let (h, eps, style) = (spec.hidden_size, spec.rms_norm_eps, spec.norm_weight);
        let norm = |w: &mut dyn WeightSource, name: &str| {
            RmsNorm::load(w, &format!("{prefix}.{name}.weight"), h, eps, style)
        };
        let input_norm = norm(w, "input_layernorm")?;
        let attn =
            Attention::load_parallel(w, &format!("{prefix}.self_attn"), attn_spec.clone(), tp)?;
        let post_attn_norm = norm(w, "post_attention_layernorm")?;
        let ffn_norms = match spec.norm_layout {
            NormLayout::PreNorm => None,
            NormLayout::Sandwich => Some((
                norm(w, "pre_feedforward_layernorm")?,
                norm(w, "post_feedforward_layernorm")?,
            )),
        };
        let mlp = FeedForward::load(
            w,
            &format!("{prefix}.mlp"),
            FeedForwardSpec {
                hidden: h,
                inner: spec.intermediate_size,
                bias: spec.mlp_bias,
                act: spec.activation,
                experts,
            },
            tp,
        )?;
        let layer_scalar = if spec.layer_scalar {
            Some(w.tensor(&format!("{prefix}.layer_scalar"), &[1])?)
        } else {
            None
        };
        Ok(Self {
            attn,
            mlp,
            input_norm,
            post_attn_norm,
            ffn_norms,
            layer_scalar,
        })
    }

    pub fn attention(&self) -> &Attention {
        &self.attn
    }

    /// Whether this layer's short forwards go through dspec's CUDA kernels.
    pub fn use_short_kernels(&mut self, on: bool) -> Result<()> {
        self.attn.use_short_kernels(on)?;
        self.mlp.use_short_kernels(on)
    }

    /// `x`: `[1, L, hidden]` after what `cache` holds; `mask` as for [`Attention::forward`].
    pub fn forward(
        &self,
        x: &Array,
        cache: &mut dspec_plugin_api::KvCache,
        mask: &Mask,
    ) -> Result<Array> {
        self.blocks(x, |normed| self.attn.forward(normed, cache, mask))
    }

    /// Several sequences packed one after another in `x` (`[1, T, hidden]`), each over
    /// its own cache: see [`Attention::forward_packed`].
    pub fn forward_packed(
        &self,
        x: &Array,
        caches: &mut [&mut dspec_plugin_api::KvCache],
        lens: &[i32],
    ) -> Result<Array> {
        self.blocks(x, |normed| self.attn.forward_packed(normed, caches, lens))
    }

    /// The residual blocks around `attend` (this layer's attention of the normed input).
    fn blocks(&self, x: &Array, attend: impl FnOnce(&Array) -> Result<Array>) -> Result<Array> {
        let out = match &self.ffn_norms {
            None => {
                let h = x.add(attend(&self.input_norm.forward(x)?)?)?;
                h.add(self.mlp.forward(&self.post_attn_norm.forward(&h)?)?)?
            }
            Some((pre_ffn, post_ffn)) => {
                let attn = attend(&self.input_norm.forward(x)?)?;
                let h = x.add(self.post_attn_norm.forward(&attn)?)?;
                let mlp = self.mlp.forward(&pre_ffn.forward(&h)?)?;
                h.add(post_ffn.forward(&mlp)?)?
            }
        };
        match &self.layer_scalar {
            Some(scalar) => Ok(out.multiply(scalar)?),
            None => Ok(out),
        }
    }
}

pub struct Decoder {
    info: ModelInfo,
    embed: Embedding,
    embed_scale: Option<f32>,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    /// `None`: tied to the embedding.
    lm_head: Option<Linear>,
    final_logit_softcap: Option<f32>,
    /// Run short continuations position by position (`LoadOptions::rowwise_verify`).
    rowwise_verify: bool,
    /// Short continuations attend over the whole cache buffer ([`whole_buffer_pays`]).
    whole_buffer: bool,
    /// Every layer's attention takes continuations of up to [`cuda::MAX_ROWS`] positions
    /// through dspec's CUDA kernel, which needs neither the whole buffer nor padding.
    short_kernels: bool,
    /// Compiling those kernels, started while the weights loaded ([`cuda::warm_up`]).
    _warm_up: Option<cuda::WarmUp>,
    /// Whether [`TargetModel::share`] hands out handles: not on a rank of a
    /// tensor-parallel group (its forwards are collectives, which every rank enters in
    /// the same order), nor over a LoRA adapter behind a switch (every handle would read
    /// the one switch).
    shareable: bool,
}

/// Bytes of weights one decode step reads, from the spec's shapes at `bytes_per_weight`:
/// every layer's projections and the output head (a tied embedding is read whole as the
/// head; as an embedding only one row is gathered).
fn step_weight_bytes(spec: &DecoderSpec, bytes_per_weight: f64) -> f64 {
    let hidden = spec.hidden_size as f64;
    let layers: f64 = spec
        .layers
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let (q, kv) = (
                (a.heads * a.head_dim) as f64,
                (a.kv_heads * a.head_dim) as f64,
            );
            // A step reads only the experts its token was routed to.
            let mlp_inner = match spec.experts.get(i).copied().flatten() {
                Some(e) => (e.top_k * e.inner + e.shared_inner.unwrap_or(0)) as f64,
                None => spec.intermediate_size as f64,
            };
            hidden * (2.0 * q + 2.0 * kv) + 3.0 * hidden * mlp_inner
        })
        .sum();
    (layers + hidden * spec.vocab_size as f64) * bytes_per_weight
}

/// Longest prompt read, where whole-buffer attention pays ([`whole_buffer_pays`]), as
/// its first token and then continuations over the whole cache buffer rather than in
/// one forward: one forward builds an attention plan for its own length, so nearly every
/// new prompt would pay one (as much as dozens of decode steps on CUDA), while the pieces
/// use the plan every verify needs anyway. Each piece reads the weights once more, so
/// past a few pieces one forward is cheaper than the plan it saves.
pub const SHORT_PROMPT_MAX_TOKENS: i32 = 8 * WHOLE_BUFFER_MAX_TOKENS;

impl Decoder {
    pub fn load(spec: DecoderSpec, w: &mut dyn WeightSource) -> Result<Self> {
        Self::load_parallel(spec, w, None)
    }

    /// [`Decoder::load`] of this rank's share under `tp` (see
    /// [`crate::tensor_parallel`]): the decoder layers split, the embedding, final norm
    /// and head whole on every rank, so every rank computes the same logits.
    pub fn load_parallel(
        spec: DecoderSpec,
        w: &mut dyn WeightSource,
        tp: Option<&TensorParallel>,
    ) -> Result<Self> {
        let has_embedding = |w: &dyn WeightSource, p: &str| {
            ["weight", "scales"]
                .iter()
                .any(|part| w.contains(&format!("{p}embed_tokens.{part}")))
        };
        let p = spec
            .other_prefixes
            .iter()
            .find(|p| !has_embedding(&*w, &spec.prefix) && has_embedding(&*w, p))
            .unwrap_or(&spec.prefix)
            .clone();
        let (h, eps, style) = (spec.hidden_size, spec.rms_norm_eps, spec.norm_weight);
        let mut embed = Embedding::load(w, &format!("{p}embed_tokens"), spec.vocab_size, h)?;
        // dspec's CUDA kernels for short continuations where they pay and every layer's
        // attention fits them (otherwise continuations stay padded for MLX's attention,
        // and the products would never see few enough rows), compiled while the rest of
        // the weights load.
        let dtype = embed.dtype();
        let bytes_per_weight = match (w.options().quantize, dtype) {
            (Some(q), _) => q.bits as f64 / 8.0,
            (None, Dtype::Float32) => 4.0,
            (None, _) => 2.0,
        };
        // `--verify exact` promises one-token kernels for verifies, and reads prompts
        // whole rather than in pieces: nothing for these kernels to do.
        // The attention kernel builds the layers call, where it serves every layer.
        let shapes: Option<Vec<cuda::AttentionShape>> = spec
            .layers
            .iter()
            .map(|a| a.kernel_shape(dtype, true))
            .collect();
        let shapes = shapes.filter(|_| {
            cuda::available(dtype)
                && !w.options().rowwise_verify
                && cuda::wanted(
                    step_weight_bytes(&spec, bytes_per_weight),
                    w.options().verify_kernels,
                    w.options().verifies_waited_on,
                )
        });
        let kernels = shapes.is_some();
        let warm_up = shapes.map(|shapes| cuda::warm_up(dtype, shapes));
        let mut layers = Vec::with_capacity(spec.layers.len());
        for (i, attn_spec) in spec.layers.iter().enumerate() {
            layers.push(DecoderLayer::load_parallel(
                w,
                &format!("{p}layers.{i}"),
                &spec,
                attn_spec,
                spec.experts.get(i).copied().flatten(),
                tp,
            )?);
        }
        for layer in &mut layers {
            layer.use_short_kernels(kernels)?;
        }
        let norm = RmsNorm::load(w, &format!("{p}norm.weight"), h, eps, style)?;
        // Some checkpoints ship an lm_head even when tied; an untied config requires one.
        let mut lm_head = if spec.tie_word_embeddings && !w.contains("lm_head.weight") {
            None
        } else {
            Some(Linear::load(w, "lm_head", h, spec.vocab_size, false)?)
        };
        embed.use_short_kernels(kernels)?;
        if let Some(head) = &mut lm_head {
            head.use_short_kernels(kernels)?;
        }

        let info = ModelInfo {
            model_type: spec.model_type.clone(),
            num_layers: layers.len(),
            hidden_size: h as usize,
            vocab_size: spec.vocab_size as usize,
            dtype: embed.dtype(),
            quantized_bits: layers.first().and_then(|l| l.attn.quantized_bits()),
            max_context: spec.max_position_embeddings,
        };
        Ok(Self {
            info,
            embed,
            embed_scale: spec.embed_scale,
            layers,
            norm,
            lm_head,
            final_logit_softcap: spec.final_logit_softcap,
            rowwise_verify: w.options().rowwise_verify,
            whole_buffer: whole_buffer_pays(),
            short_kernels: kernels,
            _warm_up: warm_up,
            shareable: tp.is_none(),
        })
    }

    /// A model whose [`TargetModel::share`] hands out nothing: its layers read a LoRA
    /// adapter's switch, which would flip every handle's forwards at once.
    pub(crate) fn unshareable(self) -> Self {
        Self {
            shareable: false,
            ..self
        }
    }

    /// One forward pass over `tokens` after the cache (arguments already checked).
    fn forward_once(
        &self,
        tokens: &Array,
        cache: &mut ModelCache,
        taps: &[usize],
    ) -> Result<ForwardOutput> {
        let offset = cache.offset() as i32;
        let asked = tokens.shape()[1];
        // A short continuation of a cached sequence (a speculative verify) runs in the
        // row layout or over the whole cache buffer, padded; the padding's outputs are
        // cut and its cache positions trimmed below. Continuations dspec's CUDA kernels
        // take stay unpadded: those kernels are built for their own width.
        let layout = ContinuationLayout::choose(
            offset,
            asked,
            self.rowwise_verify,
            self.whole_buffer && !(self.short_kernels && asked <= cuda::MAX_ROWS),
        );
        let (rows, over_whole_buffer, pad) = (layout.rows, layout.over_whole_buffer, layout.pad);
        let tokens = layout.padded(tokens)?;
        let len = asked + pad;
        let hidden_size = self.info.hidden_size as i32;
        let as_sequence = |x: &Array| -> Result<Array> {
            if rows {
                Ok(x.reshape(&[1, len, x.shape()[2]])?)
            } else {
                Ok(x.clone())
            }
        };
        let mut h = self.embed(&tokens)?;
        // Every layer's cache grows in lockstep, so the first one tells the capacity the
        // whole-buffer masks span once this forward has written its keys.
        let whole_buffer = match cache.layers_mut().first_mut() {
            Some(first) if over_whole_buffer => {
                Some(first.kv_mut()?.capacity_for((offset + len) as usize) as i32)
            }
            _ => None,
        };
        // One mask per distinct window, shared by the layers that use it.
        let mut masks: HashMap<Option<i32>, Mask> = HashMap::new();
        let dtype = h.dtype();
        let mask_for = |window: Option<i32>| -> Result<Mask> {
            if rows {
                return Ok(Mask::All);
            }
            match whole_buffer {
                Some(capacity) => whole_buffer_mask(offset, len, capacity, window, dtype),
                None => attention_mask(offset, len, window),
            }
        };
        if rows {
            h = h.reshape(&[len, 1, hidden_size])?;
        }
        let mut tapped = TapCollector::new(taps, self.layers.len());
        for (i, (layer, layer_cache)) in self.layers.iter().zip(cache.layers_mut()).enumerate() {
            let window = layer.attn.sliding_window();
            let mask = match masks.entry(window) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => e.insert(mask_for(window)?),
            };
            h = layer.forward(&h, layer_cache.kv_mut()?, mask)?;
            if taps.contains(&i) {
                tapped.offer(i, &as_sequence(&h)?);
            }
        }
        let mut logits = as_sequence(&self.lm_head(&self.final_norm(&h)?)?)?;
        let mut hidden = tapped.finish()?;
        if pad > 0 {
            logits = logits.try_index((.., ..asked, ..))?;
            hidden = hidden.map(|h| h.try_index((.., ..asked, ..))).transpose()?;
            cache.trim(pad as usize)?;
        }
        Ok(ForwardOutput { logits, hidden })
    }
}

impl TargetModel for Decoder {
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
        let asked = tokens.shape()[1];
        let in_pieces = self.whole_buffer
            && !self.rowwise_verify
            && cache.offset() == 0
            && asked > 1
            && asked <= SHORT_PROMPT_MAX_TOKENS;
        if !in_pieces {
            return self.forward_once(tokens, cache, taps);
        }
        // A short prompt: its first token alone, then continuations over the whole
        // buffer (see `SHORT_PROMPT_MAX_TOKENS`).
        let mut outs = Vec::new();
        let mut start = 0;
        while start < asked {
            let end = if start == 0 {
                1
            } else {
                (start + WHOLE_BUFFER_MAX_TOKENS).min(asked)
            };
            outs.push(self.forward_once(&tokens.try_index((.., start..end))?, cache, taps)?);
            start = end;
        }
        let logits: Vec<&Array> = outs.iter().map(|o| &o.logits).collect();
        let hidden: Vec<&Array> = outs.iter().filter_map(|o| o.hidden.as_ref()).collect();
        Ok(ForwardOutput {
            logits: concatenate(&logits, 1)?,
            hidden: match hidden.is_empty() {
                true => None,
                false => Some(concatenate(&hidden, 1)?),
            },
        })
    }

    fn forward_batch(&self, rows: &mut [BatchRow<'_>], taps: &[usize]) -> Result<Vec<RowOutput>> {
        if rows.len() < 2 {
            return forward_rows_one_by_one(self, rows, taps);
        }
        let (lens, mut h) = embedded_rows(self, rows, taps, self.layers.len())?;
        let mut tapped = TapCollector::new(taps, self.layers.len());
        for (i, layer) in self.layers.iter().enumerate() {
            let mut caches = rows
                .iter_mut()
                .map(|r| r.cache.layers_mut()[i].kv_mut())
                .collect::<Result<Vec<_>>>()?;
            h = layer.forward_packed(&h, &mut caches, &lens)?;
            tapped.offer(i, &h);
        }
        rows_outputs(self, &h, &tapped, rows, &lens)
    }

    fn batches_rows(&self) -> bool {
        true
    }

    fn share(&self) -> Option<Box<dyn TargetModel>> {
        // Named field by field, so that a field added later is thought about here.
        let Self {
            info,
            embed,
            embed_scale,
            layers,
            norm,
            lm_head,
            final_logit_softcap,
            rowwise_verify,
            whole_buffer,
            short_kernels,
            _warm_up: _,
            shareable,
        } = self;
        if !shareable {
            return None;
        }
        Some(Box::new(Self {
            info: info.clone(),
            embed: embed.clone(),
            embed_scale: *embed_scale,
            layers: layers.clone(),
            norm: norm.clone(),
            lm_head: lm_head.clone(),
            final_logit_softcap: *final_logit_softcap,
            rowwise_verify: *rowwise_verify,
            whole_buffer: *whole_buffer,
            short_kernels: *short_kernels,
            // The compile is the process's (MLX keeps what it compiled for every thread,
            // and a call that comes first waits for it); the model that started it
            // waits for it when dropped.
            _warm_up: None,
            shareable: true,
        }))
    }

    fn embed(&self, tokens: &Array) -> Result<Array> {
        let x = self.embed.forward(tokens)?;
        match self.embed_scale {
            Some(scale) => Ok(x.multiply(Array::from_f32(scale).as_dtype(x.dtype())?)?),
            None => Ok(x),
        }
    }

    fn lm_head(&self, hidden: &Array) -> Result<Array> {
        let logits = match &self.lm_head {
            Some(head) => head.forward(hidden)?,
            None => self.embed.as_linear(hidden)?,
        };
        match self.final_logit_softcap {
            Some(cap) => softcap(&logits, cap),
            None => Ok(logits),
        }
    }

    fn final_norm(&self, hidden: &Array) -> Result<Array> {
        self.norm.forward(hidden)
    }
}

#[cfg(test)]
mod tests {
    use mlx_rs::{Array, Dtype};

    use dspec_plugin_api::{LoadOptions, TargetModel};

    use crate::fixtures::{differing_bits, load_dir, with, write_random_model, TINY_LLAMA};
    use dspec_runtime::Backend;

    /// The largest absolute difference between two equally long runs of logits.
    fn largest_difference(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0f32, f32::max)
    }

    /// Logits of `tokens[prefix..]` after a `prefix`-token prefill, run either one token
    /// at a time (plain decoding) or as one continuation (a speculative verify).
    fn continuation_logits(
        model: &dyn TargetModel,
        tokens: &[u32],
        prefix: usize,
        one_at_a_time: bool,
    ) -> Vec<f32> {
        let ids = |t: &[u32]| Array::from_slice(t, &[1, t.len() as i32]);
        let mut cache = model.new_cache();
        model
            .forward(&ids(&tokens[..prefix]), &mut cache, &[])
            .expect("prefill");
        let chunks: Vec<&[u32]> = if one_at_a_time {
            tokens[prefix..].chunks(1).collect()
        } else {
            vec![&tokens[prefix..]]
        };
        let mut out = Vec::new();
        for chunk in chunks {
            let logits = model
                .forward(&ids(chunk), &mut cache, &[])
                .expect("forward")
                .logits
                .as_dtype(Dtype::Float32)
                .expect("cast");
            out.extend_from_slice(logits.as_slice::<f32>());
        }
        out
    }

    /// The batched verify's promise on the CPU in f32: a verify's logits are bitwise those
    /// of decoding the same tokens one by one, at every width a verify takes, for plain
    /// attention, q/k/v biases, a sliding window, and windows plus score softcapping (the
    /// products agree across row counts, and attention runs position by position: see
    /// `attends_position_by_position`). Widths past what the BLAS kernels here sum alike
    /// (`rows_summed_alike_here`) are left out.
    #[test]
    fn batched_f32_verifies_are_bitwise_one_token_decoding_on_the_cpu() {
        assert_eq!(Backend::current(), Backend::Cpu, "the tests run on the CPU");
        let tokens: Vec<u32> = (0..40).map(|i| (i * 31 + 5) % 97).collect();
        let shape = r#""hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 64"#;
        let alike = crate::fixtures::rows_summed_alike_here();
        for family in [
            r#""model_type": "llama""#,
            r#""model_type": "qwen2""#,
            r#""model_type": "mistral", "sliding_window": 7"#,
            r#""model_type": "gemma2", "query_pre_attn_scalar": 64, "sliding_window": 5,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                "hidden_activation": "gelu_pytorch_tanh""#,
        ] {
            let dir = tempfile::tempdir().expect("temp dir");
            let config = with(TINY_LLAMA, &format!("{{{shape}, {family}}}"));
            write_random_model(dir.path(), &config, 3, None).expect("fixture");
            let options = LoadOptions {
                dtype: Some(Dtype::Float32),
                ..LoadOptions::default()
            };
            let model = load_dir(dir.path(), &options).expect("load");
            for width in [2, 3, 5, 16, 32].into_iter().filter(|&w| w <= alike) {
                let cached = tokens.len() - width as usize;
                let decoded = continuation_logits(model.as_ref(), &tokens, cached, true);
                let verified = continuation_logits(model.as_ref(), &tokens, cached, false);
                let differing = differing_bits(&decoded, &verified);
                assert_eq!(differing, 0, "{family}, {width} positions: logits differ");
            }
        }
    }

    /// The row layout's promise: a verify's logits are bitwise those of decoding the same
    /// tokens one by one — for plain attention, and for windows plus score softcapping.
    #[test]
    fn rowwise_verify_is_bitwise_one_token_decoding() {
        let gemma2 = with(
            TINY_LLAMA,
            r#"{"model_type": "gemma2", "head_dim": 16, "query_pre_attn_scalar": 24, "sliding_window": 5,
                "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
                "hidden_activation": "gelu_pytorch_tanh"}"#,
        );
        let tokens: Vec<u32> = (0..14).map(|i| (i * 31 + 5) % 97).collect();
        // The hybrid decoder (hybrid.rs) makes the same promise for its linear-attention
        // layers, whose verify positions step through the recurrence as decoding does.
        let qwen3_5 = with(TINY_LLAMA, crate::fixtures::TINY_QWEN3_5_OVERRIDES);
        for (name, config) in [
            ("llama", TINY_LLAMA.to_string()),
            ("gemma2", gemma2),
            ("qwen3_5", qwen3_5),
        ] {
            let dir = tempfile::tempdir().expect("temp dir");
            write_random_model(dir.path(), &config, 3, None).expect("fixture");
            for dtype in [Dtype::Float32, Dtype::Bfloat16] {
                let options = LoadOptions {
                    dtype: Some(dtype),
                    rowwise_verify: true,
                    ..LoadOptions::default()
                };
                let model = load_dir(dir.path(), &options).expect("load");
                let decoded = continuation_logits(model.as_ref(), &tokens, 6, true);
                let verified = continuation_logits(model.as_ref(), &tokens, 6, false);
                assert_eq!(decoded.len(), 8 * 97);
                let differing = differing_bits(&decoded, &verified);
                assert_eq!(differing, 0, "{name} {dtype:?}: {differing} logits differ");
            }
        }
    }

    /// A verify of 5 or 14 positions in bf16 (on CUDA through dspec's kernels, a tiny model
    /// being one they pay for; elsewhere through MLX) gives the logits of decoding the same
    /// tokens one by one within bf16 rounding, with and without a sliding window that cuts
    /// into the continuation, for head sizes the kernels take.
    #[test]
    fn short_bf16_verifies_agree_with_one_token_decoding() {
        let tokens: Vec<u32> = (0..17).map(|i| (i * 29 + 7) % 97).collect();
        for overrides in [
            r#"{"head_dim": 64}"#,
            r#"{"model_type": "mistral", "head_dim": 64, "sliding_window": 7}"#,
            r#"{"head_dim": 128, "num_attention_heads": 6, "num_key_value_heads": 2}"#,
        ] {
            let dir = tempfile::tempdir().expect("temp dir");
            write_random_model(dir.path(), &with(TINY_LLAMA, overrides), 5, None).expect("fixture");
            let options = LoadOptions {
                dtype: Some(Dtype::Bfloat16),
                verify_kernels: true,
                ..LoadOptions::default()
            };
            let model = load_dir(dir.path(), &options).expect("load");
            // 5 positions, and 14 (the kernels' second tile of rows).
            for cached in [12, 3] {
                let decoded = continuation_logits(model.as_ref(), &tokens, cached, true);
                let verified = continuation_logits(model.as_ref(), &tokens, cached, false);
                assert_eq!(decoded.len(), (tokens.len() - cached) * 97);
                let largest = decoded.iter().fold(0.0f32, |m, x| m.max(x.abs()));
                let worst = largest_difference(&decoded, &verified);
                assert!(
                    worst <= 0.03 * largest,
                    "{overrides}, {cached} cached: logits differ by {worst} (largest {largest})"
                );
            }
        }
    }

    /// A model loaded on one thread and run there once, as a draft model is before it
    /// moves to a thread of its own, verifies on that other thread: nothing a verify
    /// reads, the weights' views for dspec's kernels included where they run, is left
    /// unevaluated on the loading thread, whose streams MLX does not run elsewhere.
    #[test]
    fn a_model_loaded_on_one_thread_verifies_on_another() {
        let tokens: Vec<u32> = (0..17).map(|i| (i * 29 + 7) % 97).collect();
        let dir = tempfile::tempdir().expect("temp dir");
        let config = with(TINY_LLAMA, r#"{"head_dim": 64}"#);
        write_random_model(dir.path(), &config, 5, None).expect("fixture");
        let options = LoadOptions {
            dtype: Some(Dtype::Bfloat16),
            verify_kernels: true,
            ..LoadOptions::default()
        };
        let model = load_dir(dir.path(), &options).expect("load");
        let mut cache = model.new_cache();
        let first = Array::from_slice(&tokens[..1], &[1, 1]);
        let logits = model
            .forward(&first, &mut cache, &[])
            .expect("a step")
            .logits;
        logits.eval().expect("a step");
        let (decoded, verified) = std::thread::spawn(move || {
            let verified = continuation_logits(model.as_ref(), &tokens, 12, false);
            let decoded = continuation_logits(model.as_ref(), &tokens, 12, true);
            (decoded, verified)
        })
        .join()
        .expect("the verify on the other thread failed");
        let largest = decoded.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        assert!(largest_difference(&decoded, &verified) <= 0.03 * largest);
    }

    /// What a decode step reads, from the spec: Qwen2.5-Coder-1.5B's shapes in bf16 come
    /// to its 3.1 GB (tied head read whole, embedding gathered), under the size up to which
    /// the CUDA kernels pay; Qwen2.5-7B's 14 GB are over it.
    #[test]
    fn step_weight_bytes_follow_the_shapes() {
        use crate::llama::llama_spec;
        let shape = |hidden: i64, inter: i64, layers: i64, heads: i64, kv: i64, vocab: i64| {
            let config = serde_json::json!({
                "model_type": "llama", "vocab_size": vocab, "hidden_size": hidden,
                "intermediate_size": inter, "num_hidden_layers": layers,
                "num_attention_heads": heads, "num_key_value_heads": kv, "rms_norm_eps": 1e-6,
                "rope_theta": 1e6, "tie_word_embeddings": true,
            });
            let spec = llama_spec(&config, std::path::Path::new("."), "llama", None).expect("spec");
            // q and o square, k and v `kv` heads of hidden/heads, three MLP products.
            let per_layer =
                2 * hidden * hidden + 2 * hidden * kv * (hidden / heads) + 3 * hidden * inter;
            let params = (layers * per_layer + vocab * hidden) as f64;
            (super::step_weight_bytes(&spec, 2.0), 2.0 * params)
        };
        let (small, small_by_hand) = shape(1536, 8960, 28, 12, 2, 151_936);
        let (large, large_by_hand) = shape(3584, 18944, 28, 28, 4, 152_064);
        assert_eq!(small, small_by_hand);
        assert_eq!(large, large_by_hand);
        assert!((3.0e9..3.2e9).contains(&small), "1.5B: {small}");
        assert!((14.0e9..14.3e9).contains(&large), "7B: {large}");
        assert!(small <= crate::cuda::HOST_BOUND_WEIGHT_BYTES);
        assert!(large > crate::cuda::HOST_BOUND_WEIGHT_BYTES);
    }

    /// A short prompt read in pieces over the whole buffer (CUDA's prefill path) gives
    /// the logits, taps and cache of one causal forward, and what follows it agrees.
    #[test]
    fn short_prompts_read_in_pieces_equal_one_forward() {
        use super::Decoder;
        use crate::fixtures::RandomWeights;
        use crate::llama::llama_spec;

        let config: serde_json::Value = serde_json::from_str(TINY_LLAMA).expect("config");
        let dir = std::path::Path::new(".");
        let tokens: Vec<u32> = (0..75).map(|i| (i * 41 + 3) % 97).collect();
        let ids = |t: &[u32]| Array::from_slice(t, &[1, t.len() as i32]);
        for prompt in [2usize, 33, 70] {
            let run = |whole_buffer: bool| -> (Vec<f32>, Vec<f32>) {
                let spec = llama_spec(&config, dir, "llama", Some(6)).expect("spec");
                let mut weights = RandomWeights::new(17).expect("weights");
                let mut model = Decoder::load(spec, &mut weights).expect("load");
                model.whole_buffer = whole_buffer;
                let mut cache = model.new_cache();
                let out = model
                    .forward(&ids(&tokens[..prompt]), &mut cache, &[0])
                    .expect("prefill");
                assert_eq!(cache.offset(), prompt);
                let mut logits = out.logits.as_slice::<f32>().to_vec();
                assert_eq!(logits.len(), prompt * 97, "every position's logits");
                let tapped = out.hidden.expect("taps");
                assert_eq!(tapped.shape()[1] as usize, prompt);
                let next = model
                    .forward(&ids(&tokens[prompt..prompt + 4]), &mut cache, &[])
                    .expect("a continuation");
                logits.extend_from_slice(next.logits.as_slice::<f32>());
                (logits, tapped.as_slice::<f32>().to_vec())
            };
            let (pieces, one) = (run(true), run(false));
            for (what, a, b) in [("logits", &pieces.0, &one.0), ("taps", &pieces.1, &one.1)] {
                assert_eq!(a.len(), b.len());
                let worst = largest_difference(a, b);
                assert!(worst < 1e-4, "prompt {prompt}, {what}: differ by {worst}");
            }
        }
    }

    /// Attention over the whole cache buffer (CUDA's verify path, padded to a fixed
    /// width) computes what the causal path over the written keys does, with stale keys
    /// left past the offset by a trim, with and without a sliding window that cuts into
    /// the continuation.
    #[test]
    fn whole_buffer_continuations_equal_causal_ones() {
        use super::Decoder;
        use crate::fixtures::RandomWeights;
        use crate::llama::llama_spec;

        let config: serde_json::Value = serde_json::from_str(TINY_LLAMA).expect("config");
        let dir = std::path::Path::new(".");
        let tokens: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 97).collect();
        let ids = |t: &[u32]| Array::from_slice(t, &[1, t.len() as i32]);
        for window in [None, Some(6)] {
            let run = |whole_buffer: bool| -> Vec<f32> {
                let spec = llama_spec(&config, dir, "llama", window).expect("spec");
                let mut weights = RandomWeights::new(13).expect("weights");
                let mut model = Decoder::load(spec, &mut weights).expect("load");
                model.whole_buffer = whole_buffer;
                let mut cache = model.new_cache();
                model
                    .forward(&ids(&tokens[..9]), &mut cache, &[])
                    .expect("prefill");
                // A rejected round leaves its keys in the buffer past the offset.
                model
                    .forward(&ids(&tokens[9..13]), &mut cache, &[])
                    .expect("round");
                // Padding (on the whole-buffer path) leaves no positions behind.
                assert_eq!(cache.offset(), 13);
                cache.trim(3).expect("trim");
                let mut logits = model
                    .forward(&ids(&tokens[10..16]), &mut cache, &[])
                    .expect("verify")
                    .logits
                    .as_slice::<f32>()
                    .to_vec();
                assert_eq!(cache.offset(), 16);
                // A longer continuation, padded the same way.
                let wide = model
                    .forward(&ids(&tokens[16..36]), &mut cache, &[1])
                    .expect("catch-up");
                assert_eq!(cache.offset(), 36);
                let tapped = wide.hidden.expect("the tapped layer's hidden states");
                assert_eq!(tapped.shape()[1], 20, "taps cover the real positions only");
                let wide = wide.logits;
                logits.extend_from_slice(wide.as_slice::<f32>());
                logits
            };
            let (whole, causal) = (run(true), run(false));
            assert_eq!(whole.len(), (6 + 20) * 97);
            let worst = largest_difference(&whole, &causal);
            assert!(
                worst < 1e-4,
                "window {window:?}: logits differ by up to {worst}"
            );
        }
    }
}
