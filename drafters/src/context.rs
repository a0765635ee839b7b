//! The context injection DFlash and DSpark share. The target's tap-layer outputs of
//! every verified position are fused by `fc` + `hidden_norm` and projected through each
//! draft layer's own keys and values into a per-layer cache that grows as rounds are
//! committed; a draft block then runs through the layers against `[context ; block]`
//! with no causal mask inside the block, and leaves the caches holding the context only.

use std::sync::Arc;

use mlx_rs::ops::concatenate;
use mlx_rs::{Array, Dtype};

use dspec_adapters::attention::{block_mask, whole_buffer_block_mask, whole_buffer_pays, Mask};
use dspec_adapters::cuda;
use dspec_adapters::layers::{Linear, RmsNorm};
use dspec_adapters::transformer::DecoderLayer;
use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::KvCache;

pub struct ContextLayers {
    pub fc: Linear,
    pub hidden_norm: RmsNorm,
    pub layers: Vec<DecoderLayer>,
    /// One per layer: keys and values of the verified context positions.
    caches: Vec<KvCache>,
    /// States handed over and not yet projected into the caches: they are projected
    /// together when a block next runs, so that a sequence decoded without drafts (a
    /// batch's, while drafts do not pay) does not run the layers' projections every step.
    pending: Vec<Array>,
    /// Width of the hidden states the target hands over (`taps × target hidden`).
    tap_width: i32,
    /// Activation dtype the target's hidden states are cast to.
    dtype: Option<Dtype>,
    /// Blocks of up to [`cuda::MAX_ROWS`] positions go through dspec's CUDA kernels
    /// ([`ContextLayers::use_kernels`]); the compile they started at load, if any,
    /// shared with the forks.
    kernels: Option<Arc<cuda::WarmUp>>,
}

impl ContextLayers {
    pub fn new(
        fc: Linear,
        hidden_norm: RmsNorm,
        layers: Vec<DecoderLayer>,
        tap_width: i32,
        dtype: Option<Dtype>,
    ) -> Self {
        let caches = layers.iter().map(|_| KvCache::new()).collect();
        Self {
            fc,
            hidden_norm,
            layers,
            caches,
            pending: Vec::new(),
            tap_width,
            dtype,
            kernels: None,
        }
    }

    /// Runs blocks through dspec's CUDA kernels where `asked` (the command runs the
    /// target's short continuations through them) and they serve every layer in
    /// `dtype`: products and attention as plain kernel nodes, each cheaper for the host
    /// than MLX's cuBLASLt products and cuDNN attention, whose host work a round waits
    /// on. Their compile starts now, on a thread of its own.
    pub fn use_kernels(&mut self, asked: bool, dtype: Dtype) -> Result<()> {
        if !asked || !cuda::available(dtype) || self.layers.is_empty() {
            return Ok(());
        }
        let Some(shapes) = self
            .layers
            .iter()
            .map(|layer| layer.attention().kernel_shape(dtype, false))
            .collect::<Option<Vec<_>>>()
        else {
            return Ok(());
        };
        self.fc.use_short_kernels(true)?;
        for layer in &mut self.layers {
            layer.use_short_kernels(true)?;
        }
        self.kernels = Some(Arc::new(cuda::warm_up(dtype, shapes)));
        Ok(())
    }

    /// The same layers, sharing their weights (MLX arrays are handles), over an empty
    /// context of their own: for another sequence drafted at the same time.
    pub fn fork(&self) -> Self {
        Self {
            fc: self.fc.clone(),
            hidden_norm: self.hidden_norm.clone(),
            layers: self.layers.clone(),
            caches: self.layers.iter().map(|_| KvCache::new()).collect(),
            pending: Vec::new(),
            tap_width: self.tap_width,
            dtype: self.dtype,
            kernels: self.kernels.clone(),
        }
    }

    /// Forgets the context: a new sequence starts.
    pub fn reset(&mut self) {
        self.caches = self.layers.iter().map(|_| KvCache::new()).collect();
        self.pending.clear();
    }

    /// Context positions handed over so far.
    pub fn len(&self) -> usize {
        let pending: usize = self.pending.iter().map(|h| h.shape()[1] as usize).sum();
        self.caches.first().map_or(0, KvCache::offset) + pending
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Appends the target's hidden states of newly verified positions
    /// (`[1, L, taps × hidden]`); `what` names them in errors (`the prompt`, …).
    pub fn extend(&mut self, kind: &str, hidden: Option<&Array>, what: &str) -> Result<()> {
        let hidden = hidden.ok_or_else(|| {
            ModelError::Unsupported(format!(
                "{kind}: {what} came without the target's hidden states at the tap layers"
            ))
        })?;
        let shape = hidden.shape();
        if shape.len() != 3 || shape[0] != 1 || shape[2] != self.tap_width {
            return Err(ModelError::Unsupported(format!(
                "{kind}: {what} hidden states have shape {shape:?}, expected [1, L, {}] (taps × target hidden)",
                self.tap_width
            )));
        }
        if shape[1] > 0 {
            self.pending.push(hidden.clone());
        }
        Ok(())
    }

    /// Projects the states handed over since the last block into every layer's keys
    /// and values, in one forward.
    fn project_pending(&mut self) -> Result<()> {
        let hidden = match self.pending.len() {
            0 => return Ok(()),
            1 => self.pending.remove(0),
            _ => concatenate(&std::mem::take(&mut self.pending), 1)?,
        };
        let hidden = match self.dtype {
            Some(d) if d != hidden.dtype() => hidden.as_dtype(d)?,
            _ => hidden,
        };
        let fused = self.hidden_norm.forward(&self.fc.forward(&hidden)?)?;
        for (layer, cache) in self.layers.iter().zip(self.caches.iter_mut()) {
            layer.attention().append_context(&fused, cache)?;
        }
        // Queued now, without waiting: each round's graph stays one round long, and the
        // device computes the context while the host builds the next block.
        mlx_rs::transforms::async_eval(self.caches.iter().flat_map(KvCache::state))?;
        Ok(())
    }

    /// Runs the block `x` (`[1, B, hidden]`, at the positions after the context)
    /// through every layer; the caches hold the context alone again afterwards.
    ///
    /// With dspec's CUDA kernels ([`ContextLayers::use_kernels`]) the block attends over
    /// the written keys. Otherwise, where attention plans are built per key length
    /// ([`whole_buffer_pays`]: CUDA), over each cache's whole buffer under an additive
    /// mask, so that its shapes stay the same from round to round while the context
    /// grows; elsewhere over the written keys alone.
    pub fn run_block(&mut self, mut x: Array) -> Result<Array> {
        self.project_pending()?;
        let (context, block) = (self.len(), x.shape()[1]);
        // The kernels read the written keys; MLX's CUDA attention wants the whole buffer.
        let kernels = self.kernels.is_some() && block <= cuda::MAX_ROWS;
        let whole = !kernels && whole_buffer_pays();
        // One mask per distinct window: a mask built once is shared by the layers, with
        // its broadcast over the heads.
        let mut masks: Vec<(Option<i32>, Mask)> = Vec::new();
        for (layer, cache) in self.layers.iter().zip(self.caches.iter_mut()) {
            let window = layer.attention().sliding_window();
            let at = match masks.iter().position(|(w, _)| *w == window) {
                Some(at) => at,
                None => {
                    let mask = if whole {
                        let capacity = cache.capacity_for(context + block as usize) as i32;
                        whole_buffer_block_mask(context as i32, block, capacity, window, x.dtype())?
                    } else {
                        block_mask(context as i32, block, window)?
                    };
                    masks.push((window, mask));
                    masks.len() - 1
                }
            };
            let out = layer.forward(&x, cache, &masks[at].1);
            // The layer appended the block's keys and values; they go again (an offset
            // move) even when it failed, so the context never holds unverified positions.
            let trimmed = cache.trim(cache.offset().saturating_sub(context));
            x = out?;
            trimmed?;
        }
        Ok(x)
    }
}
