//! LoRA adapters (PEFT and MLX-LM files) on built-in models: read and checked here,
//! attached to each targeted linear layer as it loads, and switched on or off as a whole.
//!
//! Unfused, every adapted layer keeps its low-rank pair beside the untouched base weight
//! and one shared [`LoraSwitch`] decides per forward pass whether it is added, so base
//! and adapted scores come from one copy of the base weights. Fused, the pair is merged
//! into the weight at load (faster, no way back).

mod mlx_lm;
mod peft;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use mlx_rs::{Array, Dtype};

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::{LoadOptions, LoadRequest, LoraUpdate, TargetModel, WeightSource};

use crate::config::DecoderFamily;
use crate::transformer::Decoder;
use crate::weights::{ProgressWeights, Weights};

/// Which tool wrote the adapter files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraFormat {
    /// Hugging Face PEFT: `adapter_config.json` + `adapter_model.safetensors`.
    Peft,
    /// mlx-lm's trainer: `adapter_config.json` + `adapters.safetensors`.
    MlxLm,
}

impl fmt::Display for LoraFormat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LoraFormat::Peft => "PEFT",
            LoraFormat::MlxLm => "MLX-LM",
        })
    }
}

/// One adapted linear layer, in PEFT's layout whatever the file format.
pub struct LoraModule {
    /// `[rank, in]`, f32.
    pub a: Array,
    /// `[out, rank]`, f32.
    pub b: Array,
    pub scale: f32,
    /// Names of the two tensors in the adapter file, for messages.
    pub a_name: String,
    pub b_name: String,
}

impl LoraModule {
    pub fn rank(&self) -> i32 {
        self.a.shape()[0]
    }
}

/// A parsed, self-consistent LoRA adapter, not yet matched to a model.
pub struct LoraAdapter {
    pub dir: PathBuf,
    pub format: LoraFormat,
    /// The tensor file the modules came from.
    pub weights_file: PathBuf,
    /// The base model the adapter says it was trained on, if it says.
    pub base_model: Option<String>,
    /// Keyed by the HF module name the built-in families load (`model.layers.0.self_attn.q_proj`).
    pub modules: BTreeMap<String, LoraModule>,
}

const CONFIG_FILE: &str = "adapter_config.json";

impl LoraAdapter {
    /// Reads the adapter in `dir`; which format it is follows from the files present.
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(ModelError::config(
                dir,
                "no such adapter directory; --lora wants a directory holding adapter_config.json \
                 and adapter_model.safetensors (PEFT) or adapters.safetensors (MLX-LM)",
            ));
        }
        let config_path = dir.join(CONFIG_FILE);
        if !config_path.is_file() {
            return Err(ModelError::config(
                &config_path,
                "not found; a LoRA adapter directory needs its adapter_config.json next to the weights",
            ));
        }
        let text = std::fs::read_to_string(&config_path).map_err(|source| ModelError::Io {
            path: config_path.clone(),
            source,
        })?;
        let config: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| ModelError::config(&config_path, format!("invalid JSON: {e}")))?;
        let peft_file = dir.join(peft::WEIGHTS_FILE);
        let mlx_file = dir.join(mlx_lm::WEIGHTS_FILE);
        if peft_file.is_file() {
            peft::read(dir, &config_path, &config, &peft_file)
        } else if mlx_file.is_file() {
            mlx_lm::read(dir, &config_path, &config, &mlx_file)
        } else if dir.join("adapter_model.bin").is_file() {
            Err(ModelError::config(
                dir,
                "holds adapter_model.bin (PyTorch pickle), which dspec does not read; save the \
                 adapter as safetensors (PEFT: model.save_pretrained(dir, safe_serialization=True))",
            ))
        } else {
            Err(ModelError::config(
                dir,
                format!(
                    "no adapter weights: expected {} (PEFT) or {} (MLX-LM)",
                    peft::WEIGHTS_FILE,
                    mlx_lm::WEIGHTS_FILE
                ),
            ))
        }
    }

    /// One line for people: format, module count, ranks and scales.
    pub fn summary(&self) -> String {
        let span = |values: Vec<String>| {
            let set: BTreeSet<String> = values.into_iter().collect();
            set.into_iter().collect::<Vec<_>>().join("/")
        };
        let ranks = span(
            self.modules
                .values()
                .map(|m| m.rank().to_string())
                .collect(),
        );
        let scales = span(
            self.modules
                .values()
                .map(|m| format!("{}", m.scale))
                .collect(),
        );
        format!(
            "{} LoRA adapter {}: {} modules, rank {ranks}, scale {scales}",
            self.format,
            self.dir.display(),
            self.modules.len()
        )
    }

    /// A warning when the adapter names a base model that does not look like the one
    /// loaded. Only a warning: local and converted model directories rarely carry the
    /// hub name, and the shape and module-name checks catch a real mismatch anyway.
    pub fn base_model_warning(
        &self,
        model_dir: &Path,
        config: &serde_json::Value,
    ) -> Option<String> {
        let base = self.base_model.as_deref()?;
        let wanted = squash(base.rsplit('/').next().unwrap_or(base));
        if wanted.is_empty() {
            return None;
        }
        let mut names: Vec<String> = model_dir
            .components()
            .rev()
            .take(3)
            .map(|c| squash(&c.as_os_str().to_string_lossy()))
            .collect();
        if let Some(name) = config["_name_or_path"].as_str() {
            names.push(squash(name));
        }
        let related = names
            .iter()
            .any(|n| !n.is_empty() && (n.contains(&wanted) || wanted.contains(n.as_str())));
        (!related).then(|| {
            format!(
                "the adapter in {} was trained on `{base}`, and the model in {} does not look \
                 like it by name; its shapes and module names match, so it is applied anyway",
                self.dir.display(),
                model_dir.display()
            )
        })
    }
}

/// Lower-case letters and digits only, so `SmolLM2-135M` and `smollm2_135m` compare equal.
fn squash(name: &str) -> String {
    name.chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .collect()
}

/// Turns a loaded adapter on or off for the forward passes that follow; clones share
/// the one switch every adapted layer reads.
#[derive(Clone, Debug)]
pub struct LoraSwitch(Arc<AtomicBool>);

impl LoraSwitch {
    fn new(enabled: bool) -> Self {
        Self(Arc::new(AtomicBool::new(enabled)))
    }

    pub fn set_enabled(&self, enabled: bool) {
        self.0.store(enabled, Ordering::Relaxed);
    }

    pub fn is_enabled(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }
}

/// How the adapter is applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LoraMode {
    /// Beside the base weights, behind a [`LoraSwitch`] (starts enabled).
    Switchable,
    /// Merged into the weights at load: `W + scale · B A` (quantized weights are
    /// dequantized, merged and quantized again with their own bits and group size).
    Fused,
}

pub struct AdaptedModel {
    pub model: Box<dyn TargetModel>,
    /// `None` when fused.
    pub switch: Option<LoraSwitch>,
}

/// Builds the built-in family `family` (an adapter name from the registry) from `req`
/// with `adapter` attached. Every adapter module must land on a linear layer of the
/// model with matching shapes, or this fails naming the module.
pub fn load_adapted(
    req: &LoadRequest,
    family: &str,
    adapter: &LoraAdapter,
    mode: LoraMode,
) -> Result<AdaptedModel> {
    crate::link();
    let decoder_family = inventory::iter::<DecoderFamily>
        .into_iter()
        .find(|f| f.model_type == family)
        .ok_or_else(|| {
            ModelError::Unsupported(format!(
                "LoRA adapters apply to dspec's built-in decoder families; `{family}` is not one"
            ))
        })?;
    let spec = (decoder_family.spec)(req.config, req.dir)?;
    let switch = match mode {
        LoraMode::Switchable => Some(LoraSwitch::new(true)),
        LoraMode::Fused => None,
    };
    let mut source = AdaptedSource {
        inner: ProgressWeights::open(req)?,
        adapter,
        switch: switch.clone(),
        attached: BTreeSet::new(),
        linear_layers: Vec::new(),
    };
    let model = Decoder::load(spec, &mut source)?;
    source.check_all_attached()?;
    let model = match switch {
        Some(_) => model.unshareable(),
        None => model,
    };
    Ok(AdaptedModel {
        model: Box::new(model),
        switch,
    })
}

/// The checkpoint's weights plus the adapter's update for each linear layer that asks.
struct AdaptedSource<'a, W: WeightSource> {
    inner: W,
    adapter: &'a LoraAdapter,
    switch: Option<LoraSwitch>,
    attached: BTreeSet<String>,
    /// Every linear layer the model loaded, for the message when a module is missing.
    linear_layers: Vec<String>,
}

impl<W: WeightSource> AdaptedSource<'_, W> {
    fn check_all_attached(&self) -> Result<()> {
        let missing: Vec<&str> = self
            .adapter
            .modules
            .keys()
            .filter(|m| !self.attached.contains(*m))
            .map(String::as_str)
            .collect();
        if missing.is_empty() {
            return Ok(());
        }
        let shown: Vec<&str> = missing.iter().take(6).copied().collect();
        let more = missing.len().saturating_sub(shown.len());
        let mut message = format!(
            "the adapter targets {} module(s) the model has no linear layer for: {}{}",
            missing.len(),
            shown.join(", "),
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            }
        );
        if missing.iter().any(|m| m.ends_with("embed_tokens")) {
            message.push_str("; LoRA on embeddings is not supported");
        }
        if missing.contains(&"lm_head") {
            message.push_str("; this model ties its output head to the embeddings, so it has no lm_head layer to adapt");
        }
        let examples: Vec<&str> = self
            .linear_layers
            .iter()
            .take(4)
            .map(String::as_str)
            .collect();
        message.push_str(&format!(
            ". The model's linear layers are named like {} …; the adapter was probably \
             trained for another model",
            examples.join(", ")
        ));
        Err(ModelError::config(&self.adapter.weights_file, message))
    }
}

impl<W: WeightSource> WeightSource for AdaptedSource<'_, W> {
    fn tensor(&mut self, name: &str, shape: &[i32]) -> Result<Array> {
        self.inner.tensor(name, shape)
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn raw(&mut self, name: &str) -> Result<Array> {
        self.inner.raw(name)
    }

    fn options(&self) -> &LoadOptions {
        self.inner.options()
    }

    fn lora_update(
        &mut self,
        module: &str,
        in_dim: i32,
        out_dim: i32,
    ) -> Result<Option<LoraUpdate>> {
        self.linear_layers.push(module.to_string());
        let Some(m) = self.adapter.modules.get(module) else {
            return Ok(None);
        };
        let rank = m.rank();
        for (name, actual, expected) in [
            (&m.a_name, m.a.shape(), [rank, in_dim]),
            (&m.b_name, m.b.shape(), [out_dim, rank]),
        ] {
            if actual != expected {
                return Err(ModelError::config(
                    &self.adapter.weights_file,
                    format!(
                        "tensor `{name}` has shape {actual:?}, but the model's `{module}` \
                         ({out_dim}×{in_dim}) needs {expected:?} in PEFT layout; the adapter \
                         was trained for a model of another size"
                    ),
                ));
            }
        }
        self.attached.insert(module.to_string());
        Ok(Some(LoraUpdate {
            a: m.a.clone(),
            b: m.b.clone(),
            scale: m.scale,
            switch: self.switch.as_ref().map(|s| s.0.clone()),
        }))
    }
}

/// Opens one adapter tensor file (validated like a checkpoint).
fn open_tensor_file(path: &Path) -> Result<Weights> {
    Weights::open_file(path, &LoadOptions::default()).map_err(|e| match e {
        ModelError::CorruptWeights { path, reason } => ModelError::config(
            path,
            format!("not a valid safetensors file ({reason}); re-save the adapter"),
        ),
        other => other,
    })
}

/// Takes tensor `name` as f32, refusing non-float and non-2-D tensors by name.
fn take_matrix(weights: &mut Weights, name: &str, file: &Path) -> Result<Array> {
    let t = weights.raw(name)?;
    if !matches!(
        t.dtype(),
        Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float64
    ) {
        return Err(ModelError::config(
            file,
            format!(
                "tensor `{name}` has dtype {:?}; LoRA factors must be float (quantized adapters are not supported)",
                t.dtype()
            ),
        ));
    }
    if t.ndim() != 2 {
        return Err(ModelError::config(
            file,
            format!(
                "tensor `{name}` has shape {:?}; a LoRA factor is a matrix",
                t.shape()
            ),
        ));
    }
    let t = t.as_dtype(Dtype::Float32)?;
    t.eval()?;
    Ok(t)
}

/// Factors collected by module name (already in PEFT layout), paired up once the whole
/// file is read so that a missing half or a rank disagreement is reported by name.
struct FactorPairs {
    a: BTreeMap<String, (String, Array)>,
    b: BTreeMap<String, (String, Array)>,
}

impl FactorPairs {
    fn new() -> Self {
        Self {
            a: BTreeMap::new(),
            b: BTreeMap::new(),
        }
    }

    /// Every module with both factors, as (module, (a_name, a), (b_name, b)), A in
    /// `[r, in]` and B in `[out, r]` layout.
    #[allow(clippy::type_complexity)]
    fn into_pairs(self, file: &Path) -> Result<Vec<(String, (String, Array), (String, Array))>> {
        let FactorPairs { a, mut b } = self;
        let mut pairs = Vec::with_capacity(a.len());
        for (module, a) in a {
            let b = b.remove(&module).ok_or_else(|| {
                ModelError::config(
                    file,
                    format!(
                        "tensor `{}` has no matching B factor for module `{module}`; the file is incomplete",
                        a.0
                    ),
                )
            })?;
            let (ra, rb) = (a.1.shape()[0], b.1.shape()[1]);
            if ra != rb {
                return Err(ModelError::config(
                    file,
                    format!(
                        "`{}` has rank {ra} but `{}` has rank {rb}; the two factors of a module must share their rank",
                        a.0, b.0
                    ),
                ));
            }
            pairs.push((module, a, b));
        }
        if let Some((module, (name, _))) = b.into_iter().next() {
            return Err(ModelError::config(
                file,
                format!("tensor `{name}` has no matching A factor for module `{module}`; the file is incomplete"),
            ));
        }
        if pairs.is_empty() {
            return Err(ModelError::config(file, "holds no LoRA factors"));
        }
        Ok(pairs)
    }
}
