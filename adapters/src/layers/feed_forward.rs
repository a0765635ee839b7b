//! A decoder layer's feed-forward block: one gated MLP, or a mixture of experts.

use mlx_rs::Array;

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::WeightSource;

use super::activation::Activation;
use super::experts::{ExpertsSpec, SparseMoe};
use super::mlp::GatedMlp;
use crate::tensor_parallel::TensorParallel;

/// Each kind boxed: they differ in size by hundreds of bytes, and a layer holds one.
#[derive(Clone)]
pub enum FeedForward {
    Dense(Box<GatedMlp>),
    Experts(Box<SparseMoe>),
}

/// What [`FeedForward::load`] reads: a dense MLP of `inner` hidden units, or the experts.
#[derive(Debug, Clone, Copy)]
pub struct FeedForwardSpec {
    pub hidden: i32,
    pub inner: i32,
    pub bias: bool,
    pub act: Activation,
    pub experts: Option<ExpertsSpec>,
}

impl FeedForward {
    /// Loads the block under `prefix` (`model.layers.3.mlp`), under `tp` this rank's
    /// share of a dense one.
    pub fn load(
        w: &mut dyn WeightSource,
        prefix: &str,
        spec: FeedForwardSpec,
        tp: Option<&TensorParallel>,
    ) -> Result<Self> {
        match spec.experts {
            None if spec.inner <= 0 => Err(ModelError::Unsupported(format!(
                "{prefix}: a dense MLP needs config.json's `intermediate_size` (positive), got {}",
                spec.inner
            ))),
            None => Ok(FeedForward::Dense(Box::new(GatedMlp::load_parallel(
                w,
                prefix,
                spec.hidden,
                spec.inner,
                spec.bias,
                spec.act,
                tp,
            )?))),
            Some(_) if tp.is_some() => Err(ModelError::Unsupported(format!(
                "{prefix}: tensor parallelism over mixture-of-experts layers is not \
                 implemented; run this model on one device"
            ))),
            Some(experts) => Ok(FeedForward::Experts(Box::new(SparseMoe::load(
                w,
                prefix,
                spec.hidden,
                experts,
                spec.act,
            )?))),
        }
    }

    /// Whether a dense block's products of a few rows go through dspec's CUDA kernel;
    /// experts run through MLX's gathered products either way.
    pub fn use_short_kernels(&mut self, on: bool) -> Result<()> {
        match self {
            FeedForward::Dense(mlp) => mlp.use_short_kernels(on),
            FeedForward::Experts(_) => Ok(()),
        }
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        match self {
            FeedForward::Dense(mlp) => mlp.forward(x),
            FeedForward::Experts(moe) => moe.forward(x),
        }
    }
}
