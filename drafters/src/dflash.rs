//! DFlash (z-lab): a few Qwen3-style layers that draft a whole block in one pass,
//! conditioned on the target's hidden states and drafting through its embedding and head.
//!
//! Per round the block `[last, mask, …, mask]` is embedded with the target's own
//! embedding; every draft layer attends from the block to `[context ; block]` without a
//! causal mask inside the block, where the context is the target's tap-layer outputs of
//! everything it has verified, fused by `fc` + `hidden_norm`. Each layer keeps that
//! context's keys and values in its own cache, which grows as rounds are committed;
//! positions `1..B` of the block, normed and sent through the target's `lm_head`, are
//! the `B − 1` drafts.

use std::path::Path;

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::{Array, Dtype};
use serde::Deserialize;

use dspec_adapters::attention::AttentionSpec;
use dspec_adapters::config::{parse_config, CommonConfig};
use dspec_adapters::layers::{Linear, NormWeight, RmsNorm};
use dspec_adapters::transformer::DecoderLayer;

use dspec_adapters::weights::Weights;

use crate::context::ContextLayers;
use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::{
    inventory, Draft, Drafter, DrafterLoadRequest, DrafterRegistration, LoadOptions, ModelInfo,
    TargetModel, TokenPicker, WeightSource,
};

/// What a DFlash checkpoint's config.json lists under `architectures`.
pub const ARCHITECTURE: &str = "DFlashDraftModel";

/// A tiny DFlash drafter in the real schema, shaped for the tiny targets of
/// `dspec_engine::tiny_model` (vocabulary 259, hidden 32, 2 decoder layers). Tests
/// override fields of it the way adapter fixtures do.
#[cfg(any(test, feature = "test-fixtures"))]
pub const TINY_DFLASH: &str = r#"{
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "vocab_size": 259,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "rope_scaling": null,
    "max_position_embeddings": 256,
    "attention_bias": false,
    "layer_types": ["full_attention", "full_attention"],
    "sliding_window": null,
    "use_sliding_window": false,
    "tie_word_embeddings": false,
    "torch_dtype": "float32",
    "block_size": 8,
    "num_target_layers": 2,
    "dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": 256}
}"#;

/// HF Qwen3's default for `max_window_layers`: with `use_sliding_window` and no
/// `layer_types`, layers from this index on use the window.
const DEFAULT_MAX_WINDOW_LAYERS: usize = 28;

/// A DFlash config.json, read against the z-lab schema. `target_layer_ids`,
/// `mask_token_id` and `block_size` may sit in `dflash_config` or at the top level.
#[derive(Debug, Clone)]
pub struct DFlashConfig {
    pub common: CommonConfig,
    pub block_size: usize,
    pub target_layer_ids: Vec<usize>,
    pub mask_token_id: u32,
    /// Per draft layer: the window of a `sliding_attention` layer, `None` for full attention.
    pub windows: Vec<Option<i32>>,
    pub attention_bias: bool,
}

/// The keys of config.json that DFlash reads besides the decoder's own ([`CommonConfig`]),
/// HF names verbatim; unknown keys are ignored. Absent and `null` are the same.
/// `dflash_config`'s entries win over the top-level ones of the same name: the z-lab
/// checkpoints keep the taps and the mask token there and `block_size` at the top,
/// the Qwen3.5 ones all three inside.
#[derive(Debug, Deserialize)]
struct DFlashJson {
    dflash_config: Option<DFlashKeys>,
    target_layer_ids: Option<Vec<usize>>,
    mask_token_id: Option<u32>,
    block_size: Option<usize>,
    attention_bias: Option<bool>,
    use_sliding_window: Option<bool>,
    max_window_layers: Option<usize>,
}

/// `dflash_config`: the keys that may also sit at the top level.
#[derive(Debug, Default, Deserialize)]
struct DFlashKeys {
    target_layer_ids: Option<Vec<usize>>,
    mask_token_id: Option<u32>,
    block_size: Option<usize>,
}

/// What a DFlash config must give under `key`, to say how to fix a missing or malformed
/// entry.
fn expected(key: &str) -> Option<&'static str> {
    Some(match key {
        "target_layer_ids" => {
            "the target layers whose outputs the drafter reads: a non-empty list of layer \
             indices, e.g. [1, 9, 17, 25, 33]"
        }
        "mask_token_id" => "the token id that fills the block's undrafted positions",
        "block_size" => {
            "the number of positions drafted per pass, at least 2 (16 for the z-lab b16 \
             checkpoints)"
        }
        "dflash_config" => "an object holding target_layer_ids, mask_token_id and block_size",
        "attention_bias" | "use_sliding_window" => "true or false",
        "max_window_layers" => "the index of the first sliding-window layer",
        _ => return None,
    })
}

/// Reads DFlash's own keys; an error names the file, the field (`a.b[2]`) and what the
/// field must hold.
fn parse_dflash_keys(config: &serde_json::Value, path: &Path) -> Result<DFlashJson> {
    // serde reads a struct from an array too, by position, which would blame the
    // array's first element rather than its shape.
    let nested = &config["dflash_config"];
    if !(nested.is_null() || nested.is_object()) {
        return Err(ModelError::config(
            path,
            format!(
                "`dflash_config`: expected an object, got {nested}; `dflash_config` must be {}",
                expected("dflash_config").unwrap_or_default()
            ),
        ));
    }
    serde_path_to_error::deserialize(config).map_err(|e| {
        let key = e.path().iter().rev().find_map(|segment| match segment {
            serde_path_to_error::Segment::Map { key } => Some(key.as_str()),
            _ => None,
        });
        let message = match key {
            None => format!("unexpected contents: {}", e.inner()),
            Some(key) => {
                let fix = expected(key)
                    .map(|what| format!("; `{key}` must be {what}"))
                    .unwrap_or_default();
                format!("`{}`: {}{fix}", e.path(), e.inner())
            }
        };
        ModelError::config(path, message)
    })
}

/// `dflash_config.KEY` when given, else the top-level `KEY`, with the name of where it
/// was found for later messages; an error when neither gives it.
fn nested_or_top<T>(
    nested: Option<T>,
    top: Option<T>,
    key: &str,
    path: &Path,
) -> Result<(T, String)> {
    match (nested, top) {
        (Some(value), _) => Ok((value, format!("dflash_config.{key}"))),
        (None, Some(value)) => Ok((value, key.to_string())),
        (None, None) => Err(ModelError::config(
            path,
            format!(
                "`dflash_config.{key}` (or top-level `{key}`) is missing; a DFlash config must give {}",
                expected(key).unwrap_or(key)
            ),
        )),
    }
}

impl DFlashConfig {
    /// Parses and checks the drafter's own config (nothing about the target yet).
    pub fn from_json(config: &serde_json::Value, dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let common: CommonConfig = parse_config(config, dir)?;
        common.validate(&path)?;
        let json = parse_dflash_keys(config, &path)?;
        let nested = json.dflash_config.unwrap_or_default();

        let (target_layer_ids, at) = nested_or_top(
            nested.target_layer_ids,
            json.target_layer_ids,
            "target_layer_ids",
            &path,
        )?;
        if target_layer_ids.is_empty() {
            return Err(ModelError::config(
                &path,
                format!(
                    "`{at}` is empty; a DFlash config must give {}",
                    expected("target_layer_ids").unwrap_or_default()
                ),
            ));
        }
        let (mask_token_id, _) = nested_or_top(
            nested.mask_token_id,
            json.mask_token_id,
            "mask_token_id",
            &path,
        )?;
        let (block_size, at) =
            nested_or_top(nested.block_size, json.block_size, "block_size", &path)?;
        if block_size < 2 {
            return Err(ModelError::config(
                &path,
                format!(
                    "`{at}` must be at least 2 (the committed token plus at least one draft), \
                     got {block_size}"
                ),
            ));
        }

        let sliding_from = json
            .use_sliding_window
            .unwrap_or(false)
            .then(|| json.max_window_layers.unwrap_or(DEFAULT_MAX_WINDOW_LAYERS));
        let windows = Self::windows(&common, sliding_from, &path)?;
        Ok(Self {
            block_size,
            target_layer_ids,
            mask_token_id,
            windows,
            attention_bias: json.attention_bias.unwrap_or(false),
            common,
        })
    }

    /// Which layers use a sliding window: `layer_types` when given, else HF Qwen3's rule
    /// (with `use_sliding_window`, layers from `max_window_layers` on, passed here as
    /// `sliding_from`).
    fn windows(
        common: &CommonConfig,
        sliding_from: Option<usize>,
        path: &Path,
    ) -> Result<Vec<Option<i32>>> {
        let layers = common.num_hidden_layers as usize;
        let window = || match common.sliding_window {
            Some(w) if w >= 1 => Ok(w),
            other => Err(ModelError::config(
                path,
                format!("sliding_attention layers need a positive `sliding_window`, got {other:?}"),
            )),
        };
        match (&common.layer_types, sliding_from) {
            (Some(types), _) => types
                .iter()
                .map(|t| match t.as_str() {
                    "full_attention" => Ok(None),
                    "sliding_attention" => window().map(Some),
                    other => Err(ModelError::config(
                        path,
                        format!(
                            "layer type `{other}` is not supported by the DFlash drafter \
                             (supported: full_attention, sliding_attention)"
                        ),
                    )),
                })
                .collect(),
            (None, Some(from)) if common.sliding_window.is_some() => (0..layers)
                .map(|i| {
                    if i >= from {
                        window().map(Some)
                    } else {
                        Ok(None)
                    }
                })
                .collect(),
            (None, _) => Ok(vec![None; layers]),
        }
    }

    /// Why this drafter cannot serve `target`, if it cannot; the message names the
    /// field, both values and the fix.
    pub fn check_fits(&self, target: &ModelInfo) -> std::result::Result<(), String> {
        let c = &self.common;
        if c.vocab_size as usize != target.vocab_size {
            return Err(format!(
                "vocab_size is {} but the target's is {}; DFlash drafts through the target's \
                 embedding and lm_head, so use the DFlash checkpoint trained for this target",
                c.vocab_size, target.vocab_size
            ));
        }
        let taps = self.target_layer_ids.len();
        if c.hidden_size as usize != target.hidden_size {
            return Err(format!(
                "fc takes {taps} target_layer_ids × hidden_size {} = {} inputs, but the target's \
                 {taps} taps give {taps} × hidden_size {} = {}; this drafter was trained for a \
                 target of another width: use the DFlash checkpoint made for this target",
                c.hidden_size,
                taps * c.hidden_size as usize,
                target.hidden_size,
                taps * target.hidden_size
            ));
        }
        if let Some(&bad) = self
            .target_layer_ids
            .iter()
            .find(|&&id| id >= target.num_layers)
        {
            return Err(format!(
                "target_layer_ids {:?} includes layer {bad}, but the target has {} layers \
                 (0..={}); this drafter was trained for a deeper target: use the DFlash \
                 checkpoint made for this target",
                self.target_layer_ids,
                target.num_layers,
                target.num_layers.saturating_sub(1)
            ));
        }
        if self.mask_token_id as usize >= target.vocab_size {
            return Err(format!(
                "mask_token_id {} is outside the target's vocabulary of {} tokens; the mask \
                 token must be an id the target's embedding has: fix `mask_token_id` or use the \
                 DFlash checkpoint made for this target",
                self.mask_token_id, target.vocab_size
            ));
        }
        Ok(())
    }

    /// Why a checkpoint whose `fc` takes `width` inputs does not match this config.
    fn fc_width_mismatch(&self, width: i32) -> String {
        format!(
            "fc.weight takes {width} inputs, but {} target_layer_ids × hidden_size {} = {}; the \
             checkpoint was trained on another number of target layers: make \
             `target_layer_ids` list the layers it was trained with",
            self.target_layer_ids.len(),
            self.common.hidden_size,
            self.fc_inputs()
        )
    }

    fn fc_inputs(&self) -> i32 {
        self.target_layer_ids.len() as i32 * self.common.hidden_size
    }
}

/// The drafter's weights: `fc`, `hidden_norm`, `layers.N.*` (Qwen3 decoder layers, as
/// the adapters run them) with their context caches, and `norm` (no embedding and no
/// head: those are the target's).
struct DraftNet {
    context: ContextLayers,
    norm: RmsNorm,
}

impl DraftNet {
    /// Loads by the checkpoint's tensor names, each under `prefix` (`""`, or `"model."`
    /// for checkpoints saved from a wrapper).
    fn load(
        w: &mut dyn WeightSource,
        cfg: &DFlashConfig,
        prefix: &str,
        dir: &Path,
        dtype: Option<Dtype>,
    ) -> Result<Self> {
        let c = &cfg.common;
        let config_path = dir.join("config.json");
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let fc = Linear::load(w, &format!("{prefix}fc"), cfg.fc_inputs(), h, false)?;
        let hidden_norm = RmsNorm::load(
            w,
            &format!("{prefix}hidden_norm.weight"),
            h,
            eps,
            NormWeight::Plain,
        )?;
        // Qwen3 attention: q/k norms, biases as the config says.
        let attention = AttentionSpec {
            qkv_bias: cfg.attention_bias,
            o_bias: cfg.attention_bias,
            qk_norm: Some((eps, NormWeight::Plain)),
            ..c.attention(c.global_rope(&config_path)?)
        };
        let spec = c.decoder("dflash", &config_path, "silu")?;
        let layers = cfg
            .windows
            .iter()
            .enumerate()
            .map(|(i, &window)| {
                let attention = AttentionSpec {
                    sliding_window: window,
                    ..attention.clone()
                };
                DecoderLayer::load(w, &format!("{prefix}layers.{i}"), &spec, &attention)
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::load(
            w,
            &format!("{prefix}norm.weight"),
            h,
            eps,
            NormWeight::Plain,
        )?;
        Ok(Self {
            context: ContextLayers::new(fc, hidden_norm, layers, cfg.fc_inputs(), dtype),
            norm,
        })
    }
}

/// The DFlash drafter: its weights, and per draft layer the keys and values of every
/// context position the target has verified so far.
pub struct DFlashDrafter {
    config: DFlashConfig,
    net: DraftNet,
    dtype: Option<Dtype>,
}

impl DFlashDrafter {
    /// Loads the checkpoint of `request.dir` after checking its config against the
    /// target (what the registry's `load` does, without boxing).
    pub fn load(request: &DrafterLoadRequest) -> Result<Self> {
        let dir = request.dir.ok_or_else(|| {
            request.mismatch(
                "a DFlash drafter needs its checkpoint directory (config.json + *.safetensors)",
            )
        })?;
        let config = DFlashConfig::from_json(request.config, dir)?;
        config
            .check_fits(request.target)
            .map_err(|m| request.mismatch(m))?;
        let options = LoadOptions {
            dtype: request.options.dtype,
            quantize: request
                .options
                .quantization(0)
                .map_err(|m| request.mismatch(m))?,
            ..LoadOptions::default()
        };
        let mut weights = Weights::open(dir, &options)?;
        let prefix = if weights.contains("model.fc.weight") {
            "model."
        } else {
            ""
        };
        let mut net = DraftNet::load(&mut weights, &config, prefix, dir, options.dtype).map_err(
            |e| match e {
                // The fc width is the one shape that depends on the target: say so.
                ModelError::ShapeMismatch { name, actual, .. }
                    if name == format!("{prefix}fc.weight") && actual.len() == 2 =>
                {
                    request.mismatch(config.fc_width_mismatch(actual[1]))
                }
                other => other,
            },
        )?;
        let dtype = options.dtype.unwrap_or(request.target.dtype);
        net.context.use_kernels(request.options.kernels, dtype)?;
        Ok(Self {
            config,
            net,
            dtype: options.dtype,
        })
    }

    /// Positions drafted per pass, the committed token included.
    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    /// Context positions cached so far (prompt plus verified tokens).
    pub fn context_len(&self) -> usize {
        self.net.context.len()
    }

    /// `Some(bits)` when the drafter's linear layers are quantized.
    pub fn quantized_bits(&self) -> Option<i32> {
        self.net.context.fc.quantized_bits()
    }

    pub fn config(&self) -> &DFlashConfig {
        &self.config
    }

    fn cast(&self, x: &Array) -> Result<Array> {
        match self.dtype {
            Some(d) if d != x.dtype() => Ok(x.as_dtype(d)?),
            _ => Ok(x.clone()),
        }
    }
}

impl Drafter for DFlashDrafter {
    fn name(&self) -> &str {
        "dflash"
    }

    fn taps(&self) -> &[usize] {
        &self.config.target_layer_ids
    }

    fn begin(
        &mut self,
        _target: &dyn TargetModel,
        _prompt: &[u32],
        hidden: Option<&Array>,
    ) -> Result<()> {
        self.net.context.reset();
        self.net.context.extend("dflash", hidden, "the prompt")
    }

    fn propose(
        &mut self,
        target: &dyn TargetModel,
        last: u32,
        max_k: usize,
        picker: &mut dyn TokenPicker,
    ) -> Result<Draft> {
        let wanted = max_k.min(self.config.block_size - 1);
        if wanted == 0 {
            return Ok(Draft::default());
        }
        if self.net.context.is_empty() {
            return Err(ModelError::Unsupported(
                "dflash: propose called before begin gave it the prompt's hidden states".into(),
            ));
        }
        // The whole block always runs: positions attend to each other, so a shorter
        // block would change the drafts. Only the head is limited to what is wanted.
        let block = self.config.block_size;
        let mut ids = vec![self.config.mask_token_id; block];
        ids[0] = last;
        let x = self.cast(&target.embed(&Array::from_slice(&ids, &[1, block as i32]))?)?;
        let x = self.net.context.run_block(x)?;
        let drafts = x.try_index((.., 1..1 + wanted as i32, ..))?;
        let logits = target.lm_head(&self.net.norm.forward(&drafts)?)?;
        let vocab = logits.shape().last().copied().unwrap_or(0);
        let rows = logits.reshape(&[wanted as i32, vocab])?;
        if let Some(ids) = picker.pick_on_device(&rows)? {
            return Draft::on_device(ids);
        }
        let mut draft = Draft::default();
        draft.extend(picker.pick(&rows)?)?;
        Ok(draft)
    }

    fn commit(&mut self, verified: &[u32], hidden: Option<&Array>) -> Result<()> {
        if verified.is_empty() {
            return Ok(());
        }
        self.net
            .context
            .extend("dflash", hidden, "a verified round")
    }

    /// The same weights (shared, not copied) over an empty context.
    fn fork(&self) -> Option<Box<dyn Drafter>> {
        Some(Box::new(Self {
            config: self.config.clone(),
            net: DraftNet {
                context: self.net.context.fork(),
                norm: self.net.norm.clone(),
            },
            dtype: self.dtype,
        }))
    }

    fn forks(&self) -> bool {
        true
    }
}

/// Whether a config.json describes a DFlash drafter.
fn is_dflash_config(config: &serde_json::Value) -> bool {
    config["architectures"]
        .as_array()
        .is_some_and(|a| a.iter().any(|v| v.as_str() == Some(ARCHITECTURE)))
}

fn load(request: &DrafterLoadRequest) -> Result<Box<dyn Drafter>> {
    Ok(Box::new(DFlashDrafter::load(request)?))
}

inventory::submit! {
    DrafterRegistration {
        kind: "dflash",
        summary: "DFlash (z-lab) block diffusion: drafts a block per pass from the target's hidden states, through its embedding and lm_head",
        detect: is_dflash_config,
        by_name: false,
        load,
    }
}

/// Writes a DFlash checkpoint with random weights: `config_json` as config.json and
/// every tensor the loader asks for (same names and shapes) as model.safetensors.
#[cfg(any(test, feature = "test-fixtures"))]
pub fn write_random_checkpoint(dir: &Path, config_json: &str, seed: u64) -> Result<()> {
    write_random_checkpoint_with_prefix(dir, config_json, seed, "")
}

/// [`write_random_checkpoint`] with every tensor name under `prefix` (e.g. `"model."`).
#[cfg(any(test, feature = "test-fixtures"))]
pub fn write_random_checkpoint_with_prefix(
    dir: &Path,
    config_json: &str,
    seed: u64,
    prefix: &str,
) -> Result<()> {
    let path = dir.join("config.json");
    std::fs::create_dir_all(dir).map_err(|source| ModelError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let config: serde_json::Value = serde_json::from_str(config_json)
        .map_err(|e| ModelError::config(&path, format!("invalid JSON: {e}")))?;
    let parsed = DFlashConfig::from_json(&config, dir)?;
    let mut weights = dspec_adapters::fixtures::RandomWeights::new(seed)?;
    DraftNet::load(&mut weights, &parsed, prefix, dir, None)?;
    weights.save(dir, None)?;
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&config).unwrap_or_default(),
    )
    .map_err(|source| ModelError::Io { path, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dspec_adapters::fixtures::with;
    use dspec_plugin_api::DrafterOptions;

    fn parse(json: &str) -> Result<DFlashConfig> {
        let value: serde_json::Value = serde_json::from_str(json).unwrap();
        DFlashConfig::from_json(&value, Path::new("/drafter"))
    }

    fn target() -> ModelInfo {
        ModelInfo {
            model_type: "llama".into(),
            num_layers: 2,
            hidden_size: 32,
            vocab_size: 259,
            dtype: Dtype::Float32,
            quantized_bits: None,
            max_context: Some(256),
        }
    }

    fn err(json: &str) -> String {
        parse(json).unwrap_err().to_string()
    }

    fn misfit(json: &str) -> String {
        parse(json).unwrap().check_fits(&target()).unwrap_err()
    }

    #[test]
    fn reads_nested_dflash_fields() {
        let c = parse(TINY_DFLASH).unwrap();
        assert_eq!(c.target_layer_ids, vec![0, 1]);
        assert_eq!(c.mask_token_id, 256);
        assert_eq!(c.block_size, 8);
        assert_eq!(c.windows, vec![None, None]);
        assert_eq!(c.common.head_dim(), 16);
        assert!(c.check_fits(&target()).is_ok());
    }

    #[test]
    fn reads_top_level_fields_and_nested_block_size() {
        let top = with(
            TINY_DFLASH,
            r#"{"dflash_config": null, "target_layer_ids": [1], "mask_token_id": 7}"#,
        );
        let c = parse(&top).unwrap();
        assert_eq!(
            (c.target_layer_ids, c.mask_token_id, c.block_size),
            (vec![1], 7, 8)
        );
        // The Qwen3.5 checkpoints put block_size inside dflash_config.
        let nested = with(
            TINY_DFLASH,
            r#"{"block_size": null, "dflash_config": {"block_size": 16, "target_layer_ids": [0], "mask_token_id": 3}}"#,
        );
        assert_eq!(parse(&nested).unwrap().block_size, 16);
    }

    /// A drafter for a Qwen3.5 target, in the layout of the published Qwen3.5 drafter
    /// configs (transformers 5 keys, the taps and mask token inside `dflash_config`),
    /// shaped for a 32-layer target of width 2560 with Qwen3.5's vocabulary.
    fn qwen3_5_drafter(taps: &str, mask: u32) -> String {
        format!(
            r#"{{
            "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
            "vocab_size": 248320, "hidden_size": 2560, "intermediate_size": 9728,
            "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "hidden_act": "silu", "rms_norm_eps": 1e-6,
            "rope_parameters": {{"rope_type": "default", "rope_theta": 10000000}},
            "max_position_embeddings": 262144, "attention_bias": false,
            "layer_types": ["full_attention", "full_attention", "full_attention",
                            "full_attention", "full_attention"],
            "use_sliding_window": false, "sliding_window": null, "max_window_layers": 5,
            "tie_word_embeddings": false, "dtype": "bfloat16", "block_size": 16,
            "num_target_layers": 32,
            "dflash_config": {{"target_layer_ids": {taps}, "mask_token_id": {mask}}}
        }}"#
        )
    }

    /// Drafters for one Qwen3.5 target differ in their taps and mask token: both are
    /// read from the config, never assumed, and both fit the hybrid target (taps on
    /// Gated DeltaNet layers as well as attention layers).
    #[test]
    fn reads_qwen3_5_drafter_configs_with_their_own_taps_and_mask_token() {
        let target = ModelInfo {
            model_type: "qwen3_5".into(),
            num_layers: 32,
            hidden_size: 2560,
            vocab_size: 248320,
            dtype: Dtype::Bfloat16,
            quantized_bits: None,
            max_context: Some(262144),
        };
        for (taps, mask) in [
            (vec![1, 8, 15, 22, 29], 248070),
            (vec![2, 9, 16, 23, 31], 248077),
        ] {
            let c = parse(&qwen3_5_drafter(&format!("{taps:?}"), mask)).unwrap();
            assert_eq!((c.target_layer_ids.clone(), c.mask_token_id), (taps, mask));
            assert_eq!(c.block_size, 16);
            assert_eq!(c.windows, vec![None; 5]);
            assert_eq!(c.common.rope().0, 10_000_000.0);
            assert_eq!(c.fc_inputs(), 5 * 2560);
            c.check_fits(&target).unwrap_or_else(|m| panic!("{m}"));
        }
        let m = parse(&qwen3_5_drafter("[1, 8, 32]", 248070))
            .unwrap()
            .check_fits(&target)
            .unwrap_err();
        assert!(m.contains("layer 32") && m.contains("32 layers"), "{m}");
    }

    #[test]
    fn reads_sliding_layers_and_v5_rope_parameters() {
        let c = parse(&with(
            TINY_DFLASH,
            r#"{"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5,
                "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}"#,
        ))
        .unwrap();
        assert_eq!(c.windows, vec![Some(5), None]);
        assert_eq!(c.common.rope().0, 500000.0);
        // No layer_types: HF's use_sliding_window + max_window_layers rule.
        let c = parse(&with(
            TINY_DFLASH,
            r#"{"layer_types": null, "use_sliding_window": true, "sliding_window": 4, "max_window_layers": 1}"#,
        ))
        .unwrap();
        assert_eq!(c.windows, vec![None, Some(4)]);
        let e = err(&with(
            TINY_DFLASH,
            r#"{"layer_types": ["sliding_attention", "full_attention"], "sliding_window": null}"#,
        ));
        assert!(e.contains("sliding_window"), "{e}");
        let e = err(&with(
            TINY_DFLASH,
            r#"{"layer_types": ["linear_attention", "full_attention"]}"#,
        ));
        assert!(e.contains("linear_attention"), "{e}");
    }

    #[test]
    fn missing_or_bad_dflash_fields_are_named() {
        let e = err(&with(
            TINY_DFLASH,
            r#"{"dflash_config": {"mask_token_id": 256}}"#,
        ));
        assert!(
            e.contains("target_layer_ids") && e.contains("/drafter/config.json"),
            "{e}"
        );
        let e = err(&with(
            TINY_DFLASH,
            r#"{"dflash_config": {"target_layer_ids": [0]}}"#,
        ));
        assert!(e.contains("mask_token_id"), "{e}");
        let e = err(&with(TINY_DFLASH, r#"{"block_size": null}"#));
        assert!(e.contains("block_size") && e.contains("missing"), "{e}");
        let e = err(&with(TINY_DFLASH, r#"{"block_size": 1}"#));
        assert!(e.contains("block_size") && e.contains("at least 2"), "{e}");
        let e = err(&with(
            TINY_DFLASH,
            r#"{"dflash_config": {"target_layer_ids": [], "mask_token_id": 1}}"#,
        ));
        assert!(e.contains("target_layer_ids"), "{e}");
        let mut no_hidden: serde_json::Value = serde_json::from_str(TINY_DFLASH).unwrap();
        no_hidden.as_object_mut().unwrap().remove("hidden_size");
        let e = err(&no_hidden.to_string());
        assert!(e.contains("hidden_size"), "{e}");
    }

    #[test]
    fn every_field_it_reads_parses_to_its_value() {
        let c = parse(&with(
            TINY_DFLASH,
            r#"{"attention_bias": true, "block_size": 4, "target_layer_ids": [7],
                "mask_token_id": 9, "rms_norm_eps": 1e-5, "rope_theta": 20000.0,
                "dflash_config": {"target_layer_ids": [1, 0], "mask_token_id": 258}}"#,
        ))
        .unwrap();
        // dflash_config wins over the top level; block_size comes from the top level.
        assert_eq!(
            (c.target_layer_ids.clone(), c.mask_token_id, c.block_size),
            (vec![1, 0], 258, 4)
        );
        assert!(c.attention_bias);
        assert_eq!(c.windows, vec![None, None]);
        let common = &c.common;
        assert_eq!(
            (
                common.vocab_size,
                common.hidden_size,
                common.intermediate_size,
                common.num_hidden_layers,
                common.num_attention_heads,
                common.kv_heads(),
                common.head_dim(),
            ),
            (259, 32, 64, 2, 4, 2, 16)
        );
        assert_eq!((common.rms_norm_eps, common.rope().0), (1e-5, 20000.0));
        // Left out: no bias, and Qwen3's max_window_layers of 28 keeps both layers full.
        let mut bare: serde_json::Value = serde_json::from_str(&with(
            TINY_DFLASH,
            r#"{"layer_types": null, "use_sliding_window": true, "sliding_window": 4}"#,
        ))
        .unwrap();
        bare.as_object_mut().unwrap().remove("attention_bias");
        let c = DFlashConfig::from_json(&bare, Path::new("/drafter")).unwrap();
        assert!(!c.attention_bias);
        assert_eq!(c.windows, vec![None, None]);
    }

    #[test]
    fn a_missing_field_is_named_with_the_file_and_the_fix() {
        for (key, fix) in [
            ("target_layer_ids", "e.g. [1, 9, 17, 25, 33]"),
            ("mask_token_id", "undrafted positions"),
            ("block_size", "positions drafted per pass"),
        ] {
            let mut config: serde_json::Value = serde_json::from_str(TINY_DFLASH).unwrap();
            config.as_object_mut().unwrap().remove(key);
            config["dflash_config"].as_object_mut().unwrap().remove(key);
            let e = DFlashConfig::from_json(&config, Path::new("/drafter"))
                .unwrap_err()
                .to_string();
            for needle in [
                "/drafter/config.json",
                &format!("`dflash_config.{key}` (or top-level `{key}`) is missing"),
                fix,
            ] {
                assert!(e.contains(needle), "{key}: `{needle}` missing in: {e}");
            }
        }
    }

    #[test]
    fn a_wrongly_typed_field_is_named_with_the_file_and_the_fix() {
        let cases: [(&str, &[&str]); 8] = [
            (
                r#"{"dflash_config": {"target_layer_ids": [0, "one"], "mask_token_id": 256}}"#,
                &[
                    "`dflash_config.target_layer_ids[1]`",
                    "\"one\"",
                    "list of layer indices",
                ],
            ),
            (
                r#"{"dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": "<mask>"}}"#,
                &["`dflash_config.mask_token_id`", "expected u32", "token id"],
            ),
            (
                r#"{"dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": -5}}"#,
                &["`dflash_config.mask_token_id`", "-5"],
            ),
            (
                r#"{"block_size": "eight"}"#,
                &["`block_size`", "\"eight\"", "at least 2"],
            ),
            (
                r#"{"dflash_config": [0, 1]}"#,
                &[
                    "`dflash_config`: expected an object, got [0,1]",
                    "an object holding target_layer_ids",
                ],
            ),
            (
                r#"{"attention_bias": "yes"}"#,
                &["`attention_bias`", "true or false"],
            ),
            (
                r#"{"use_sliding_window": true, "max_window_layers": -1}"#,
                &["`max_window_layers`", "-1"],
            ),
            (r#"{"hidden_size": "wide"}"#, &["`hidden_size`", "\"wide\""]),
        ];
        for (overrides, needles) in cases {
            let e = err(&with(TINY_DFLASH, overrides));
            assert!(e.contains("/drafter/config.json"), "{overrides}: {e}");
            for needle in needles {
                assert!(
                    e.contains(needle),
                    "{overrides}: `{needle}` missing in: {e}"
                );
            }
        }
    }

    #[test]
    fn mismatches_with_the_target_name_field_values_and_fix() {
        let m = misfit(&with(TINY_DFLASH, r#"{"vocab_size": 300}"#));
        assert!(
            m.contains("vocab_size") && m.contains("300") && m.contains("259"),
            "{m}"
        );
        let m = misfit(&with(TINY_DFLASH, r#"{"hidden_size": 48}"#));
        assert!(
            m.contains("fc") && m.contains("96") && m.contains("64"),
            "{m}"
        );
        let m = misfit(&with(
            TINY_DFLASH,
            r#"{"dflash_config": {"target_layer_ids": [1, 9], "mask_token_id": 256}}"#,
        ));
        assert!(
            m.contains("target_layer_ids") && m.contains('9') && m.contains("2 layers"),
            "{m}"
        );
        let m = misfit(&with(
            TINY_DFLASH,
            r#"{"dflash_config": {"target_layer_ids": [0, 1], "mask_token_id": 259}}"#,
        ));
        assert!(
            m.contains("mask_token_id 259") && m.contains("259 tokens"),
            "{m}"
        );
    }

    #[test]
    fn detects_only_dflash_configs() {
        let v: serde_json::Value = serde_json::from_str(TINY_DFLASH).unwrap();
        assert!(is_dflash_config(&v));
        let other: serde_json::Value =
            serde_json::from_str(r#"{"architectures": ["Qwen3ForCausalLM"]}"#).unwrap();
        assert!(!is_dflash_config(&other));
        assert!(!is_dflash_config(&serde_json::Value::Null));
    }

    fn request<'a>(
        dir: &'a Path,
        config: &'a serde_json::Value,
        target: &'a ModelInfo,
        options: &'a DrafterOptions,
    ) -> DrafterLoadRequest<'a> {
        DrafterLoadRequest {
            dir: Some(dir),
            config,
            target,
            options,
            load_model: &|_| Err(ModelError::Unsupported("dflash loads no model".into())),
        }
    }

    #[test]
    fn loads_checkpoints_with_a_model_prefix_and_quantizes_on_request() {
        let dir = tempfile::tempdir().unwrap();
        write_random_checkpoint_with_prefix(dir.path(), TINY_DFLASH, 3, "model.").unwrap();
        let config: serde_json::Value = serde_json::from_str(TINY_DFLASH).unwrap();
        let info = target();
        for (bits, expected) in [
            (None, None),
            (Some(0), None),
            (Some(4), Some(4)),
            (Some(8), Some(8)),
        ] {
            let options = DrafterOptions {
                bits,
                ..Default::default()
            };
            let drafter =
                DFlashDrafter::load(&request(dir.path(), &config, &info, &options)).unwrap();
            assert_eq!(drafter.taps(), &[0, 1]);
            assert_eq!(drafter.quantized_bits(), expected, "bits {bits:?}");
        }
        let options = DrafterOptions {
            bits: Some(3),
            ..Default::default()
        };
        let e = load(&request(dir.path(), &config, &info, &options))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--drafter-bits 3"), "{e}");
    }

    #[test]
    fn a_checkpoint_whose_fc_disagrees_with_its_taps_is_a_mismatch() {
        let dir = tempfile::tempdir().unwrap();
        write_random_checkpoint(dir.path(), TINY_DFLASH, 3).unwrap();
        let config: serde_json::Value = serde_json::from_str(&with(
            TINY_DFLASH,
            r#"{"dflash_config": {"target_layer_ids": [1], "mask_token_id": 256}}"#,
        ))
        .unwrap();
        let info = target();
        let options = DrafterOptions::default();
        let e = load(&request(dir.path(), &config, &info, &options))
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("fc.weight takes 64 inputs") && e.contains("= 32"),
            "{e}"
        );
    }
}
