//! config.json fields that most families share (HF names verbatim), and the one loading
//! path every built-in family goes through once it has a [`DecoderSpec`].

use std::path::Path;

use serde::de::DeserializeOwned;
use serde::Deserialize;

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::{LoadRequest, TargetModel, WeightSource};

use crate::attention::AttentionSpec;
use crate::layers::{Activation, ExpertsSpec, NormWeight, Rope};
use crate::transformer::{Decoder, DecoderSpec, NormLayout};
use crate::weights::ProgressWeights;

fn default_eps() -> f32 {
    1e-6
}

fn default_theta() -> f32 {
    10_000.0
}

/// Fields common to llama-like configs. Families add their own next to it with
/// `#[serde(flatten)]`; unknown keys are ignored.
#[derive(Debug, Clone, Deserialize)]
pub struct CommonConfig {
    pub vocab_size: i32,
    pub hidden_size: i32,
    /// The dense MLP's hidden units; absent (0) where every layer has experts.
    #[serde(default)]
    pub intermediate_size: i32,
    pub num_hidden_layers: i32,
    pub num_attention_heads: i32,
    pub num_key_value_heads: Option<i32>,
    pub head_dim: Option<i32>,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f32,
    #[serde(default = "default_theta")]
    pub rope_theta: f32,
    #[serde(default)]
    pub rope_scaling: serde_json::Value,
    /// transformers ≥ 5 moves rope_theta and the scaling into one object.
    #[serde(default)]
    pub rope_parameters: serde_json::Value,
    pub tie_word_embeddings: Option<bool>,
    pub max_position_embeddings: Option<usize>,
    pub hidden_act: Option<String>,
    pub hidden_activation: Option<String>,
    /// Per-layer attention kind ("full_attention" | "sliding_attention"), when given.
    pub layer_types: Option<Vec<String>>,
    pub sliding_window: Option<i32>,
}

fn default_sparse_step() -> i32 {
    1
}

/// The mixture-of-experts fields of Qwen's MoE configs (HF names).
#[derive(Debug, Clone, Deserialize)]
pub struct MoeConfig {
    pub num_experts: Option<i32>,
    /// transformers' current configs save `num_experts` under this name too, and read
    /// this one when both are there.
    pub num_local_experts: Option<i32>,
    pub num_experts_per_tok: Option<i32>,
    pub moe_intermediate_size: Option<i32>,
    /// Absent: the family's default (see [`MoeConfig::experts_per_layer`]).
    pub norm_topk_prob: Option<bool>,
    pub shared_expert_intermediate_size: Option<i32>,
    /// Layers whose MLP stays dense.
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
    /// Every `decoder_sparse_step`-th layer (counting from 1) is sparse.
    #[serde(default = "default_sparse_step")]
    pub decoder_sparse_step: i32,
}

/// What a family's config class assumes where a config leaves a MoE field out.
#[derive(Debug, Clone, Copy)]
pub struct MoeDefaults {
    /// `num_experts` (0: dense MLPs).
    pub experts: i32,
    pub norm_topk_prob: bool,
}

impl MoeConfig {
    /// Each of `layers` layers' experts, `None` for a dense one, with the family's
    /// defaults where the config is silent (transformers' config classes differ:
    /// Qwen3-MoE's renormalises the chosen experts' probabilities only when asked,
    /// Qwen3-Next's by default). Values that cannot work are refused, naming `path`.
    pub fn experts_per_layer(
        &self,
        layers: usize,
        defaults: MoeDefaults,
        path: &Path,
    ) -> Result<Vec<Option<ExpertsSpec>>> {
        let experts = self
            .num_local_experts
            .or(self.num_experts)
            .unwrap_or(defaults.experts);
        if experts == 0 {
            return Ok(Vec::new());
        }
        let bad = |message: String| Err(ModelError::config(path, message));
        if experts < 0 {
            return bad(format!("`num_experts` must be 0 or more, got {experts}"));
        }
        if self.decoder_sparse_step <= 0 {
            return bad(format!(
                "`decoder_sparse_step` must be positive, got {}",
                self.decoder_sparse_step
            ));
        }
        let step = self.decoder_sparse_step as usize;
        let sparse: Vec<bool> = (0..layers)
            .map(|i| !self.mlp_only_layers.contains(&i) && (i + 1) % step == 0)
            .collect();
        if !sparse.contains(&true) {
            // Every MLP dense: the routing fields play no part.
            return Ok(Vec::new());
        }
        let Some(top_k) = self.num_experts_per_tok else {
            return bad("a mixture-of-experts config needs `num_experts_per_tok`".into());
        };
        if !(1..=experts).contains(&top_k) {
            return bad(format!(
                "`num_experts_per_tok` must be from 1 to num_experts ({experts}), got {top_k}"
            ));
        }
        let Some(inner) = self.moe_intermediate_size else {
            return bad("a mixture-of-experts config needs `moe_intermediate_size`".into());
        };
        if inner <= 0 {
            return bad(format!(
                "`moe_intermediate_size` must be positive, got {inner}"
            ));
        }
        let shared_inner = self.shared_expert_intermediate_size.filter(|&n| n != 0);
        if let Some(n) = shared_inner.filter(|&n| n < 0) {
            return bad(format!(
                "`shared_expert_intermediate_size` must be 0 or more, got {n}"
            ));
        }
        let spec = ExpertsSpec {
            experts,
            top_k,
            inner,
            norm_topk_prob: self.norm_topk_prob.unwrap_or(defaults.norm_topk_prob),
            shared_inner,
        };
        Ok(sparse.into_iter().map(|s| s.then_some(spec)).collect())
    }
}

impl CommonConfig {
    pub fn head_dim(&self) -> i32 {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    pub fn kv_heads(&self) -> i32 {
        self.num_key_value_heads.unwrap_or(self.num_attention_heads)
    }

    /// Rope base and scaling object, from either the classic or the v5 layout.
    pub fn rope(&self) -> (f32, serde_json::Value) {
        if let Some(theta) = self.rope_parameters["rope_theta"].as_f64() {
            return (theta as f32, self.rope_parameters.clone());
        }
        (self.rope_theta, self.rope_scaling.clone())
    }

    /// The activation name, whichever key the family used.
    pub fn activation_name(&self, default: &str) -> String {
        self.hidden_activation
            .clone()
            .or_else(|| self.hidden_act.clone())
            .unwrap_or_else(|| default.to_string())
    }

    /// Whether layer `i` is a sliding-window layer according to `layer_types`, if present.
    pub fn layer_is_sliding(&self, i: usize) -> Option<bool> {
        self.layer_types
            .as_ref()
            .and_then(|t| t.get(i))
            .map(|t| t == "sliding_attention")
    }

    /// The rope of full-attention layers, from `rope_theta` and `rope_scaling`.
    pub fn global_rope(&self, path: &Path) -> Result<Rope> {
        let (theta, scaling) = self.rope();
        Rope::from_config(self.head_dim(), theta, &scaling, path)
    }

    /// The llama-style attention layer families start from (no biases, norms, window
    /// or softcap; queries scaled by head_dim^-½), changed with struct update syntax.
    pub fn attention(&self, rope: Rope) -> AttentionSpec {
        AttentionSpec {
            hidden: self.hidden_size,
            heads: self.num_attention_heads,
            kv_heads: self.kv_heads(),
            head_dim: self.head_dim(),
            scale: (self.head_dim() as f32).powf(-0.5),
            qkv_bias: false,
            o_bias: false,
            qk_norm: None,
            sliding_window: None,
            softcap: None,
            rope,
            k_eq_v: false,
            v_norm: None,
            output_gate: false,
        }
    }

    /// The llama-style decoder families start from: pre-norm, plain RMSNorm, untied
    /// unless the config says otherwise, the activation named in the config (or
    /// `default_act`). `layers` is left empty for the family to fill.
    pub fn decoder(&self, model_type: &str, path: &Path, default_act: &str) -> Result<DecoderSpec> {
        Ok(DecoderSpec {
            model_type: model_type.into(),
            prefix: "model.".into(),
            other_prefixes: Vec::new(),
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: self.intermediate_size,
            rms_norm_eps: self.rms_norm_eps,
            norm_weight: NormWeight::Plain,
            norm_layout: NormLayout::PreNorm,
            activation: Activation::from_name(&self.activation_name(default_act), path)?,
            mlp_bias: false,
            embed_scale: None,
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(false),
            final_logit_softcap: None,
            layer_scalar: false,
            max_position_embeddings: self.max_position_embeddings,
            layers: Vec::new(),
            experts: Vec::new(),
        })
    }

    /// The decoder the gemma families start from: (1 + w) norms, embeddings scaled by
    /// √hidden, tied head unless the config says otherwise, tanh-GELU (HF Gemma runs the
    /// tanh approximation even where configs say "gelu").
    pub fn gemma_decoder(
        &self,
        model_type: &str,
        path: &Path,
        layout: NormLayout,
    ) -> Result<DecoderSpec> {
        Ok(DecoderSpec {
            norm_weight: NormWeight::OffsetByOne,
            norm_layout: layout,
            embed_scale: Some((self.hidden_size as f32).sqrt()),
            tie_word_embeddings: self.tie_word_embeddings.unwrap_or(true),
            ..self.decoder(model_type, path, "gelu_pytorch_tanh")?
        })
    }

    /// Rejects shapes that would make the model meaningless before any tensor is read.
    pub fn validate(&self, path: &Path) -> Result<()> {
        let positive = [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.kv_heads()),
            ("head_dim", self.head_dim()),
        ];
        if let Some((name, value)) = positive.iter().find(|(_, v)| *v <= 0) {
            return Err(ModelError::config(
                path,
                format!("`{name}` must be positive, got {value}"),
            ));
        }
        // 0 (absent) only where every layer has experts: a dense layer refuses it.
        if self.intermediate_size < 0 {
            return Err(ModelError::config(
                path,
                format!(
                    "`intermediate_size` must be positive, got {}",
                    self.intermediate_size
                ),
            ));
        }
        // Values no model can have: each would make every logit NaN or infinite, and
        // generation would go on silently with garbage.
        let (theta, _) = self.rope();
        let floats = [
            (
                "rms_norm_eps",
                self.rms_norm_eps,
                "a small positive number such as 1e-6",
            ),
            ("rope_theta", theta, "a positive base such as 10000"),
        ];
        if let Some((name, value, hint)) =
            floats.iter().find(|(_, v, _)| !(v.is_finite() && *v > 0.0))
        {
            return Err(ModelError::config(
                path,
                format!("`{name}` is {value}, which no model can use; it must be {hint}"),
            ));
        }
        if let Some(window) = self.sliding_window.filter(|w| *w <= 0) {
            return Err(ModelError::config(
                path,
                format!("`sliding_window` must be positive, got {window}"),
            ));
        }
        if self.num_attention_heads % self.kv_heads() != 0 {
            return Err(ModelError::config(
                path,
                format!(
                    "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                    self.num_attention_heads,
                    self.kv_heads()
                ),
            ));
        }
        if let Some(types) = &self.layer_types {
            if types.len() != self.num_hidden_layers as usize {
                return Err(ModelError::config(
                    path,
                    format!(
                        "layer_types has {} entries for {} layers",
                        types.len(),
                        self.num_hidden_layers
                    ),
                ));
            }
        }
        Ok(())
    }
}

/// Parses a family config from config.json's JSON. An error names the file and the
/// field it is about (`rope_parameters.rope_theta`); a missing field names itself.
pub fn parse_config<T: DeserializeOwned>(config: &serde_json::Value, dir: &Path) -> Result<T> {
    serde_path_to_error::deserialize(config).map_err(|e| {
        let message = match e.path().iter().next() {
            // Reported on the object that lacks it: serde's message names the field.
            None => format!("unexpected contents: {}", e.inner()),
            Some(_) => format!("unexpected contents: `{}`: {}", e.path(), e.inner()),
        };
        ModelError::config(dir.join("config.json"), message)
    })
}

/// Opens the checkpoint's weights and builds the decoder described by `spec`.
pub fn load_decoder(req: &LoadRequest, spec: DecoderSpec) -> Result<Box<dyn TargetModel>> {
    let mut weights = ProgressWeights::open(req)?;
    let model = Decoder::load(spec, &mut weights)?;
    Ok(Box::new(model))
}

/// A built-in decoder family's config mapping, registered next to its adapter so
/// test fixtures can build random models of any family without a central list.
pub struct DecoderFamily {
    pub model_type: &'static str,
    pub spec: fn(&serde_json::Value, &Path) -> Result<DecoderSpec>,
}

inventory::collect!(DecoderFamily);

/// Builds a family's model from its parsed config.json, the model directory (for error
/// messages) and a weight source.
pub type BuildFn =
    fn(&serde_json::Value, &Path, &mut dyn WeightSource) -> Result<Box<dyn TargetModel>>;

/// Any built-in family's model built from its config over a weight source, registered
/// next to its adapter so test fixtures can make random checkpoints of every family
/// (decoder and hybrid alike) by running the very code that loads them.
pub struct FamilyBuilder {
    pub model_type: &'static str,
    pub build: BuildFn,
}

inventory::collect!(FamilyBuilder);

/// Registers a family whose model is the shared decoder: its adapter (loading through
/// [`load_decoder`]), its [`DecoderFamily`] and its [`FamilyBuilder`] entries.
#[macro_export]
macro_rules! decoder_family {
    (name: $name:literal, model_types: [$($mt:literal),*], aliases: [$($alias:literal),*],
     architectures: [$($arch:literal),*], spec: $spec:path $(,)?) => {
        fn load_family(
            req: &dspec_plugin_api::LoadRequest,
        ) -> dspec_plugin_api::error::Result<Box<dyn dspec_plugin_api::TargetModel>> {
            $crate::config::load_decoder(req, $spec(req.config, req.dir)?)
        }
        inventory::submit! {
            dspec_plugin_api::AdapterRegistration {
                name: $name,
                model_types: &[$($mt),*],
                aliases: &[$($alias),*],
                architectures: &[$($arch),*],
                load: load_family,
            }
        }
        inventory::submit! {
            $crate::config::DecoderFamily { model_type: $name, spec: $spec }
        }
        fn build_family(
            config: &serde_json::Value,
            dir: &std::path::Path,
            weights: &mut dyn dspec_plugin_api::WeightSource,
        ) -> dspec_plugin_api::error::Result<Box<dyn dspec_plugin_api::TargetModel>> {
            Ok(Box::new($crate::transformer::Decoder::load($spec(config, dir)?, weights)?))
        }
        inventory::submit! {
            $crate::config::FamilyBuilder { model_type: $name, build: build_family }
        }
    };
}
