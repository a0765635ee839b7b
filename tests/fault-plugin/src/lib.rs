//! A deliberately faulty adapter plugin, built by dspec's plugin tests to check that
//! every way a plugin can go wrong reaches the user as a clear error, never a crash.
//!
//! Its model needs no weights: config.json's `"fault"` picks what breaks
//! (`fail_load`, `panic_load`, `fail_forward`, `panic_forward`, `mlx_forward`; anything else works,
//! returning zero logits). `"recurrent"` is a model that works and has a cache with
//! recurrent state that goes back two positions unless the host asks for more; it
//! predicts config.json's `"next_token"` (default 97, `a`) after every position.
//! Three environment variables, read once when the descriptor is built, change the
//! descriptor itself: `DSPEC_FAULT_PLUGIN_ABI` (the ABI version it claims),
//! `DSPEC_FAULT_PLUGIN_MODEL_TYPES` (comma-separated; default `faulty`) and
//! `DSPEC_FAULT_PLUGIN_LAYOUT` (`first-v1`: a `struct_size` of v1's first layout, as a
//! plugin built before the rollback entries has, though the entries are there).

use std::ffi::{c_char, CString};
use std::sync::OnceLock;

use mlx_rs::ops::{eye, zeros};
use mlx_rs::{Array, Dtype};

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::plugin::abi::{PluginDescriptor, ABI_VERSION, V1_DESCRIPTOR_SIZE};
use dspec_plugin_api::plugin::export::{functions, rollback_functions, PluginExport};
use dspec_plugin_api::{
    ForwardOutput, LayerCache, LoadRequest, ModelCache, ModelInfo, RecurrentCache, TargetModel,
};

/// Past states the `recurrent` model's cache keeps until the host asks for another
/// number.
const RECURRENT_WINDOW: usize = 2;

struct Faulty {
    info: ModelInfo,
    fault: String,
    /// What the `recurrent` model predicts.
    next_token: u32,
}

impl TargetModel for Faulty {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn new_cache(&self) -> ModelCache {
        match self.fault.as_str() {
            "recurrent" => ModelCache::with_layers(vec![LayerCache::Recurrent(
                RecurrentCache::new(RECURRENT_WINDOW),
            )]),
            _ => ModelCache::new(self.info.num_layers),
        }
    }

    fn forward(
        &self,
        tokens: &Array,
        cache: &mut ModelCache,
        taps: &[usize],
    ) -> Result<ForwardOutput> {
        match self.fault.as_str() {
            "recurrent" => {
                let len = tokens.shape().get(1).copied().unwrap_or(1) as usize;
                let layer = cache
                    .layers_mut()
                    .first_mut()
                    .ok_or_else(|| ModelError::Unsupported("no cache layer".into()))?
                    .recurrent_mut()?;
                let states = (0..len).map(|_| zeros::<f32>(&[1]).map(|s| vec![s]));
                layer.advance(len, states.collect::<std::result::Result<_, _>>()?)?;
                let v = self.info.vocab_size as i32;
                let next = Array::from_slice(&vec![self.next_token; len], &[1, len as i32]);
                let logits = eye::<f32>(v, None, None)?.take_axis(&next, 0)?;
                Ok(ForwardOutput {
                    logits,
                    hidden: (!taps.is_empty())
                        .then(|| {
                            let h = self.info.hidden_size as i32;
                            zeros::<f32>(&[1, len as i32, h * taps.len() as i32])
                        })
                        .transpose()?,
                })
            }
            "panic_forward" => panic!("forward exploded on purpose"),
            "fail_forward" => Err(ModelError::Unsupported("forward failed on purpose".into())),
            // An exception inside MLX (shapes that cannot be multiplied), raised in the
            // plugin's own copy of mlx-c.
            "mlx_forward" => {
                let a = zeros::<f32>(&[2, 3])?;
                mlx_rs::ops::matmul(&a, &a)?;
                Err(ModelError::Unsupported(
                    "MLX accepted a [2,3]x[2,3] matmul".into(),
                ))
            }
            _ => {
                let len = tokens.shape().get(1).copied().unwrap_or(1);
                let (v, h) = (self.info.vocab_size as i32, self.info.hidden_size as i32);
                Ok(ForwardOutput {
                    logits: zeros::<f32>(&[1, len, v])?,
                    hidden: (!taps.is_empty())
                        .then(|| zeros::<f32>(&[1, len, h * taps.len() as i32]))
                        .transpose()?,
                })
            }
        }
    }

    fn embed(&self, tokens: &Array) -> Result<Array> {
        let len = tokens.shape().get(1).copied().unwrap_or(1);
        Ok(zeros::<f32>(&[1, len, self.info.hidden_size as i32])?)
    }

    fn lm_head(&self, hidden: &Array) -> Result<Array> {
        let mut shape = hidden.shape().to_vec();
        if let Some(last) = shape.last_mut() {
            *last = self.info.vocab_size as i32;
        }
        Ok(zeros::<f32>(&shape)?)
    }

    fn final_norm(&self, hidden: &Array) -> Result<Array> {
        Ok(hidden.clone())
    }
}

struct Export;

impl PluginExport for Export {
    fn load(request: &LoadRequest<'_>) -> Result<Box<dyn TargetModel>> {
        let fault = request.config["fault"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        match fault.as_str() {
            "panic_load" => panic!("load exploded on purpose"),
            "fail_load" => Err(ModelError::Unsupported("load failed on purpose".into())),
            _ => Ok(Box::new(Faulty {
                info: ModelInfo {
                    model_type: request.config["model_type"]
                        .as_str()
                        .unwrap_or("faulty")
                        .into(),
                    num_layers: 2,
                    hidden_size: 8,
                    vocab_size: request.config["vocab_size"].as_u64().unwrap_or(259) as usize,
                    dtype: Dtype::Float32,
                    quantized_bits: None,
                    max_context: None,
                },
                fault,
                next_token: request.config["next_token"]
                    .as_u64()
                    .and_then(|t| u32::try_from(t).ok())
                    .unwrap_or(97),
            })),
        }
    }
}

struct Descriptor(PluginDescriptor);

// SAFETY: the descriptor points only at leaked strings that are never written.
unsafe impl Send for Descriptor {}
unsafe impl Sync for Descriptor {}

fn leak(text: &str) -> *const c_char {
    CString::new(text).unwrap_or_default().into_raw()
}

fn build() -> Descriptor {
    let abi_version = std::env::var("DSPEC_FAULT_PLUGIN_ABI")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(ABI_VERSION);
    let struct_size = match std::env::var("DSPEC_FAULT_PLUGIN_LAYOUT").as_deref() {
        Ok("first-v1") => V1_DESCRIPTOR_SIZE,
        _ => std::mem::size_of::<PluginDescriptor>(),
    };
    let model_types: Vec<*const c_char> = std::env::var("DSPEC_FAULT_PLUGIN_MODEL_TYPES")
        .unwrap_or_else(|_| "faulty".into())
        .split(',')
        .map(leak)
        .collect();
    let model_types_len = model_types.len();
    Descriptor(PluginDescriptor {
        struct_size: struct_size as u32,
        abi_version,
        name: leak("fault-plugin"),
        version: leak(env!("CARGO_PKG_VERSION")),
        model_types: Box::leak(model_types.into_boxed_slice()).as_ptr(),
        model_types_len,
        architectures: std::ptr::null(),
        architectures_len: 0,
        functions: functions::<Export>(),
        rollback: rollback_functions(),
    })
}

/// The entry point, written out by hand (no `export_plugin!`) to shape the descriptor.
#[unsafe(no_mangle)]
pub extern "C" fn dspec_plugin_descriptor() -> *const PluginDescriptor {
    static DESCRIPTOR: OnceLock<Descriptor> = OnceLock::new();
    std::panic::catch_unwind(|| &DESCRIPTOR.get_or_init(build).0 as *const PluginDescriptor)
        .unwrap_or(std::ptr::null())
}
