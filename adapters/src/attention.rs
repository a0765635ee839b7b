//! Multi-head attention with grouped KV heads, shared by every family: optional q/k
//! norms, biases, sliding windows, and score softcapping (which needs the unfused path);
//! gemma4's values-from-keys and unscaled value norm. Drafters that attend from a block
//! to a context (DFlash, DSpark) reuse it through [`Attention::append_context`].

use std::cell::RefCell;

use mlx_rs::fast::{scaled_dot_product_attention, ScaledDotProductAttentionMask};
use mlx_rs::ops::{arange, broadcast_to, concatenate, matmul, select};
use mlx_rs::{Array, Dtype};

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::{KvCache, WeightSource};
use dspec_runtime::slicing::slice_axis;
use dspec_runtime::Backend;

use crate::layers::{
    is_row_layout, rms_norm_unscaled, seq_slice, softcap, split_last, Linear, NormWeight, RmsNorm,
    Rope, Split,
};
use crate::pooled_attention::{self, PooledStep, Queries};
use crate::tensor_parallel::TensorParallel;

/// Shape and options of one attention layer.
#[derive(Clone)]
pub struct AttentionSpec {
    pub hidden: i32,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    /// Multiplier of q·k (usually head_dim^-½).
    pub scale: f32,
    pub qkv_bias: bool,
    pub o_bias: bool,
    /// RMSNorm over head_dim on q and k (qwen3, gemma3), with its eps and weight style.
    pub qk_norm: Option<(f32, NormWeight)>,
    /// Keys older than this many positions are invisible to a query.
    pub sliding_window: Option<i32>,
    pub softcap: Option<f32>,
    pub rope: Rope,
    /// Values are the key projection's output taken before `k_norm`, and there is no
    /// `v_proj` (gemma4 full-attention layers with `attention_k_eq_v`).
    pub k_eq_v: bool,
    /// RMSNorm without a learned scale on each value head, with this eps (gemma4).
    pub v_norm: Option<f32>,
    /// `q_proj` yields, per head, the query followed by as many gate logits; the
    /// attention output is multiplied by their sigmoid before `o_proj` (Qwen3-Next and
    /// Qwen3.5 full-attention layers).
    pub output_gate: bool,
}

impl AttentionSpec {
    /// The build of dspec's CUDA attention kernel that takes this layer's short forwards
    /// in `dtype`, causal (a verify) or a drafter's block; `None` where the kernel cannot
    /// (head size, score softcapping, dtype, backend).
    pub fn kernel_shape(&self, dtype: Dtype, causal: bool) -> Option<crate::cuda::AttentionShape> {
        crate::cuda::attention::serves(self.head_dim, dtype, self.softcap.is_some()).then_some(
            crate::cuda::AttentionShape {
                head_dim: self.head_dim,
                window: self.sliding_window,
                scale: self.scale,
                causal,
            },
        )
    }
}

/// The q, k and v projections of one layer.
// One per layer, built at load and never moved on the hot path: the variants' sizes
// do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
enum Projections {
    Separate {
        q: Linear,
        k: Linear,
        /// `None` when values come from the key projection (`k_eq_v`).
        v: Option<Linear>,
    },
    /// Dense layers fused into one product whose output holds q, k (and v) side by
    /// side, in these sizes.
    Fused { qkv: Linear, sizes: Vec<i32> },
}

#[derive(Clone)]
pub struct Attention {
    spec: AttentionSpec,
    projections: Projections,
    o: Linear,
    q_norm: Option<RmsNorm>,
    k_norm: Option<RmsNorm>,
    /// Short causal forwards go through dspec's CUDA kernel ([`crate::cuda`]): off until
    /// the model turns it on where the kernels pay.
    short_kernels: bool,
}

/// Which keys each query of a forward may see.
pub enum Mask {
    /// Every cached key and every position of the input: one new token with no window
    /// cut, or a drafter's block that attends within itself both ways.
    All,
    /// Input position i sees the cache and input positions `..=i`: MLX's "causal"
    /// mode, aligned to the last key: the fused kernels need no mask array built.
    Causal,
    /// `[L, keys]` booleans: what a sliding window leaves visible.
    Keys(Array),
    /// Queries attend over the cache's whole buffer (see [`attends_whole_buffer`]):
    /// `bias` is `[1, 1, L, capacity]` in the activations' dtype, 0 where a key is
    /// visible and the dtype's lowest value elsewhere (past the written positions,
    /// later positions of the input, outside a window).
    WholeBuffer(WholeBufferBias),
    /// A drafter's block after the cache: every position sees the whole block and the
    /// cache, which the inner mask (`All`, `Keys` under a window, or `WholeBuffer`) says
    /// for MLX's attention, and dspec's CUDA kernel knows from the shapes alone.
    Block(Box<Mask>),
}

/// The additive bias of [`Mask::WholeBuffer`], with its broadcast to each head count a
/// layer asked for kept: MLX would otherwise add a broadcast node in every layer.
pub struct WholeBufferBias {
    bias: Array,
    per_heads: RefCell<Vec<(i32, Array)>>,
}

impl WholeBufferBias {
    /// `[1, heads, L, capacity]`.
    fn for_heads(&self, heads: i32) -> Result<Array> {
        let mut made = self.per_heads.borrow_mut();
        if let Some((_, b)) = made.iter().find(|(h, _)| *h == heads) {
            return Ok(b.clone());
        }
        let s = self.bias.shape();
        let b = broadcast_to(&self.bias, &[1, heads, s[2], s[3]])?;
        made.push((heads, b.clone()));
        Ok(b)
    }
}

/// The attention output times the sigmoid of the output gate's logits, where the layer
/// has one (`AttentionSpec::output_gate`).
fn gated(out: Array, gate: Option<Array>) -> Result<Array> {
    Ok(match gate {
        Some(gate) => out.multiply(mlx_rs::ops::sigmoid(&gate)?)?,
        None => out,
    })
}

// What a generation reserves and how long a continuation over the whole buffer may be
// are the cache contract's (plugin-api), so the engine reaches them through it; they are
// re-exported here for the layers that pad to them.
pub use dspec_plugin_api::cache::{whole_buffer_pays, WHOLE_BUFFER_MAX_TOKENS};

/// Whether a short continuation after the cache (a verify: `len` positions after `offset`
/// cached ones, under a causal or window mask) attends one position at a time, each as a
/// one-token step does, though its products take every position at once: on the CPU,
/// where MLX's attention of several queries rounds each query apart from a one-query call
/// (its scores span the whole call's keys, the later ones masked out), which left a
/// verify's logits a few bits off one-token decoding's. A call per position costs host
/// time that a CPU step barely notices and that would be most of a GPU verify.
fn attends_position_by_position(offset: i32, len: i32, mask: &Mask) -> bool {
    matches!(mask, Mask::Causal | Mask::Keys(_))
        && is_short_continuation(offset, len)
        && Backend::current() == Backend::Cpu
}

/// The longest row a batched step attends over a key/value pool with the others (a new
/// token and its drafts): the pool's queries are padded to the longest row (on the CPU,
/// attend once per position of it), so longer rows (prompt chunks) attend on their own.
const POOLED_ROW_MAX: i32 = 16;

/// MLX splits an array into up to this many pieces with one graph node (and into more
/// with a slice each).
const PIECES_PER_SPLIT: usize = 10;

/// `a` split along axis 0 into pieces of `lens` rows, in few graph nodes: up to
/// [`PIECES_PER_SPLIT`] pieces at once, more through groups split again (a batch of 32
/// rows takes 5 nodes, not 32). Graph nodes are host time, which bounds a batched step
/// on a GPU.
fn split_rows(a: &Array, lens: &[i32]) -> Result<Vec<Array>> {
    if lens.len() <= PIECES_PER_SPLIT {
        let ends: Vec<i32> = lens[..lens.len().saturating_sub(1)]
            .iter()
            .scan(0, |end, &len| {
                *end += len;
                Some(*end)
            })
            .collect();
        return Ok(a.split_at_indices(&ends, 0)?);
    }
    let groups: Vec<&[i32]> = lens.chunks(PIECES_PER_SPLIT).collect();
    let group_lens: Vec<i32> = groups.iter().map(|g| g.iter().sum()).collect();
    let mut pieces = Vec::with_capacity(lens.len());
    for (group, lens) in split_rows(a, &group_lens)?.iter().zip(groups) {
        pieces.extend(split_rows(group, lens)?);
    }
    Ok(pieces)
}

/// A forward of `len` positions after `offset` cached ones that may attend over the
/// whole cache buffer.
pub fn is_short_continuation(offset: i32, len: i32) -> bool {
    offset > 0 && len > 1 && len <= WHOLE_BUFFER_MAX_TOKENS
}

/// The [`Mask::WholeBuffer`] of `len` positions after `offset` cached ones, over a
/// buffer of `capacity` positions, under an optional window, in `dtype`.
pub fn whole_buffer_mask(
    offset: i32,
    len: i32,
    capacity: i32,
    window: Option<i32>,
    dtype: Dtype,
) -> Result<Mask> {
    let (q_pos, k_pos) = buffer_positions(offset, len, capacity)?;
    whole_buffer_bias(&visible(&q_pos, &k_pos, window)?, len, capacity, dtype)
}

/// The positions of `len` queries after `offset` cached ones (`[len, 1]`) and of a
/// buffer's `capacity` keys (`[1, capacity]`).
fn buffer_positions(offset: i32, len: i32, capacity: i32) -> Result<(Array, Array)> {
    Ok((
        arange::<_, i32>(offset, offset + len, None)?.reshape(&[len, 1])?,
        arange::<_, i32>(0, capacity, None)?.reshape(&[1, capacity])?,
    ))
}

/// The [`Mask::Block`] of a drafter's block: `len` positions after `offset` cached ones,
/// each seeing every position of the block (no causal mask inside it) and the cached
/// keys, under a window only those fewer than `window` positions behind it.
pub fn block_mask(offset: i32, len: i32, window: Option<i32>) -> Result<Mask> {
    let inner = match window {
        None => Mask::All,
        Some(w) => {
            let (q_pos, k_pos) = buffer_positions(offset, len, offset + len)?;
            Mask::Keys(block_sees(&q_pos, &k_pos, offset, w)?)
        }
    };
    Ok(Mask::Block(Box::new(inner)))
}

/// [`block_mask`] over a cache buffer of `capacity` positions, as an additive bias in
/// `dtype` that also hides the buffer's unwritten rest. Over the whole buffer the key
/// length is the capacity, so a backend that builds an attention plan per key length
/// (cuDNN on CUDA, see [`whole_buffer_pays`]) builds one per capacity, not one per round
/// as the context grows.
pub fn whole_buffer_block_mask(
    offset: i32,
    len: i32,
    capacity: i32,
    window: Option<i32>,
    dtype: Dtype,
) -> Result<Mask> {
    let (q_pos, k_pos) = buffer_positions(offset, len, capacity)?;
    let written = broadcast_to(&k_pos.lt(Array::from_int(offset + len))?, &[len, capacity])?;
    let visible = match window {
        None => written,
        Some(w) => written.logical_and(&block_sees(&q_pos, &k_pos, offset, w)?)?,
    };
    Ok(Mask::Block(Box::new(whole_buffer_bias(
        &visible, len, capacity, dtype,
    )?)))
}

/// Keys `k_pos` a block's queries at `q_pos` see under a window `w` when the block starts
/// at `offset`: the whole block, and the cached keys fewer than `w` positions behind.
fn block_sees(q_pos: &Array, k_pos: &Array, offset: i32, w: i32) -> Result<Array> {
    let in_block = k_pos.ge(Array::from_int(offset))?;
    let near = q_pos.subtract(k_pos)?.lt(Array::from_int(w))?;
    Ok(in_block.logical_or(&near)?)
}

/// The additive bias of `visible` (`[len, capacity]` booleans) in `dtype`.
fn whole_buffer_bias(visible: &Array, len: i32, capacity: i32, dtype: Dtype) -> Result<Mask> {
    let lowest = Array::from_f32(lowest_value(dtype)).as_dtype(dtype)?;
    let zero = Array::from_f32(0.0).as_dtype(dtype)?;
    let bias = select(visible, &zero, &lowest)?.reshape(&[1, 1, len, capacity])?;
    Ok(Mask::WholeBuffer(WholeBufferBias {
        bias,
        per_heads: RefCell::new(Vec::new()),
    }))
}

/// The lowest finite value of a float dtype: an additive mask of it hides a key as
/// surely as −∞ does, without the NaN that −∞ gives a row (or a kernel's tile of a row)
/// whose keys are all hidden.
pub(crate) fn lowest_value(dtype: Dtype) -> f32 {
    match dtype {
        Dtype::Float16 => -65504.0,
        Dtype::Bfloat16 => -3.389_531_4e38,
        _ => f32::MIN,
    }
}

impl Mask {
    /// As MLX's attention takes it (which broadcasts a whole-buffer bias over the heads
    /// itself).
    pub fn for_sdpa(&self) -> Option<ScaledDotProductAttentionMask<'_>> {
        match self {
            Mask::All => None,
            Mask::Causal => Some(ScaledDotProductAttentionMask::Causal),
            Mask::Keys(keys) => Some(ScaledDotProductAttentionMask::Array(keys)),
            Mask::WholeBuffer(bias) => Some(ScaledDotProductAttentionMask::Array(&bias.bias)),
            Mask::Block(inner) => inner.for_sdpa(),
        }
    }
}

/// The mask of `len` positions after `offset` cached ones under an optional window.
pub fn attention_mask(offset: i32, len: i32, window: Option<i32>) -> Result<Mask> {
    let total = offset + len;
    if window.is_none_or(|w| total <= w) {
        return Ok(if len == 1 { Mask::All } else { Mask::Causal });
    }
    Ok(Mask::Keys(visible_keys(offset, len, window)?))
}

/// `[len, offset+len]` booleans: key j is visible to query i when `j <= offset + i`
/// and, under a window, `offset + i - j < window`.
fn visible_keys(offset: i32, len: i32, window: Option<i32>) -> Result<Array> {
    let total = offset + len;
    let q_pos = arange::<_, i32>(offset, total, None)?.reshape(&[len, 1])?;
    let k_pos = arange::<_, i32>(0, total, None)?.reshape(&[1, total])?;
    visible(&q_pos, &k_pos, window)
}

/// Key positions `k_pos` (`[1, K]`) visible to query positions `q_pos` (`[L, 1]`).
fn visible(q_pos: &Array, k_pos: &Array, window: Option<i32>) -> Result<Array> {
    let mut visible = k_pos.le(q_pos)?;
    if let Some(w) = window {
        visible = visible.logical_and(&k_pos.gt(q_pos.subtract(Array::from_int(w))?)?)?;
    }
    Ok(visible)
}

impl Attention {
    pub fn load(w: &mut dyn WeightSource, prefix: &str, spec: AttentionSpec) -> Result<Self> {
        Self::load_parallel(w, prefix, spec, None)
    }

    /// [`Attention::load`] of this rank's share of the heads under `tp`: q, k and v
    /// column-parallel (whole heads: query heads and KV heads split alike, so each rank's
    /// query heads share its KV heads), o row-parallel (one all-sum). The layer then
    /// runs, and its cache holds, `heads / size` query and `kv_heads / size` KV heads.
    pub fn load_parallel(
        w: &mut dyn WeightSource,
        prefix: &str,
        spec: AttentionSpec,
        tp: Option<&TensorParallel>,
    ) -> Result<Self> {
        let (h, hd) = (spec.hidden, spec.head_dim);
        let (outputs, inputs) = (tp.map(Split::Outputs), tp.map(Split::Inputs));
        let q = Linear::load_split(
            w,
            &format!("{prefix}.q_proj"),
            h,
            spec.heads * hd * if spec.output_gate { 2 } else { 1 },
            spec.qkv_bias,
            outputs,
        )?;
        let k = Linear::load_split(
            w,
            &format!("{prefix}.k_proj"),
            h,
            spec.kv_heads * hd,
            spec.qkv_bias,
            outputs,
        )?;
        let v = if spec.k_eq_v {
            None
        } else {
            Some(Linear::load_split(
                w,
                &format!("{prefix}.v_proj"),
                h,
                spec.kv_heads * hd,
                spec.qkv_bias,
                outputs,
            )?)
        };
        let o = Linear::load_split(
            w,
            &format!("{prefix}.o_proj"),
            spec.heads * hd,
            h,
            spec.o_bias,
            inputs,
        )?;
        // From here on the layer is its rank's share: heads split as the weights were.
        let size = tp.map_or(1, TensorParallel::size);
        let spec = AttentionSpec {
            heads: spec.heads / size,
            kv_heads: spec.kv_heads / size,
            ..spec
        };
        let (q_norm, k_norm) = match spec.qk_norm {
            Some((eps, style)) => (
                Some(RmsNorm::load(
                    w,
                    &format!("{prefix}.q_norm.weight"),
                    hd,
                    eps,
                    style,
                )?),
                Some(RmsNorm::load(
                    w,
                    &format!("{prefix}.k_norm.weight"),
                    hd,
                    eps,
                    style,
                )?),
            ),
            None => (None, None),
        };
        let q_size = spec.heads * hd * if spec.output_gate { 2 } else { 1 };
        let kv_size = spec.kv_heads * hd;
        let mut parts = vec![&q, &k];
        parts.extend(v.as_ref());
        let projections = match Linear::fuse(&parts)? {
            Some(qkv) => Projections::Fused {
                qkv,
                sizes: [q_size, kv_size, kv_size][..parts.len()].to_vec(),
            },
            None => Projections::Separate { q, k, v },
        };
        Ok(Self {
            spec,
            projections,
            o,
            q_norm,
            k_norm,
            short_kernels: false,
        })
    }

    /// Whether this layer's short forwards (attention and products) go through dspec's
    /// CUDA kernels: see [`crate::cuda::wanted`].
    pub fn use_short_kernels(&mut self, on: bool) -> Result<()> {
        self.short_kernels = on;
        self.o.use_short_kernels(on)?;
        match &mut self.projections {
            Projections::Separate { q, k, v } => {
                q.use_short_kernels(on)?;
                k.use_short_kernels(on)?;
                if let Some(v) = v {
                    v.use_short_kernels(on)?;
                }
                Ok(())
            }
            Projections::Fused { qkv, .. } => qkv.use_short_kernels(on),
        }
    }

    /// Raw (unnormed, unrotated) q, k and v of `x`; v is `None` under `k_eq_v`.
    fn project(&self, x: &Array) -> Result<(Array, Array, Option<Array>)> {
        match &self.projections {
            Projections::Separate { q, k, v } => Ok((
                q.forward(x)?,
                k.forward(x)?,
                v.as_ref().map(|v| v.forward(x)).transpose()?,
            )),
            Projections::Fused { qkv, sizes } => {
                let mut parts = split_last(&qkv.forward(x)?, sizes)?.into_iter();
                let (Some(q), Some(k)) = (parts.next(), parts.next()) else {
                    unreachable!("a fused projection has at least q and k");
                };
                Ok((q, k, parts.next()))
            }
        }
    }

    pub fn sliding_window(&self) -> Option<i32> {
        self.spec.sliding_window
    }

    /// See [`AttentionSpec::kernel_shape`].
    pub fn kernel_shape(&self, dtype: Dtype, causal: bool) -> Option<crate::cuda::AttentionShape> {
        self.spec.kernel_shape(dtype, causal)
    }

    pub fn quantized_bits(&self) -> Option<i32> {
        match &self.projections {
            Projections::Separate { q, .. } => q.quantized_bits(),
            Projections::Fused { qkv, .. } => qkv.quantized_bits(),
        }
    }

    /// `[B, L, n·head_dim] -> [B, n, L, head_dim]`; the row layout `[R, 1, ..]` becomes
    /// the one sequence `[1, n, R, head_dim]` it stands for.
    fn split_heads(&self, y: Array, n: i32) -> Result<Array> {
        let y = if is_row_layout(&y) {
            y.reshape(&[1, y.shape()[0], y.shape()[2]])?
        } else {
            y
        };
        let (b, len) = (y.shape()[0], y.shape()[1]);
        // One position: `[B, 1, n·D]` already lies in memory as `[B, n, 1, D]`, so a
        // reshape does without the transpose (a graph node fewer per call).
        if len == 1 {
            return Ok(y.reshape(&[b, n, 1, self.spec.head_dim])?);
        }
        Ok(y.reshape(&[b, len, n, self.spec.head_dim])?
            .transpose_axes(&[0, 2, 1, 3])?)
    }

    /// Rotated q and k and plain v, `[B, heads, L, D]` each, for the common layer: one
    /// fused q|k|v product, no q/k/v norms. Per layer and step it makes one reshape and
    /// three head slices instead of a split, three reshapes and three transposes, and
    /// rotates q and k in one rope call (heads are rotated independently, so the values
    /// are the same). At decode sizes every graph node costs host time in MLX's
    /// evaluation, which is what bounds the speed on a GPU. `None`: another layout.
    fn packed_heads(&self, x: &Array, offset: i32) -> Result<Option<(Array, Array, Array)>> {
        let s = &self.spec;
        let Projections::Fused { qkv, sizes } = &self.projections else {
            return Ok(None);
        };
        if sizes.len() != 3
            || self.q_norm.is_some()
            || self.k_norm.is_some()
            || s.v_norm.is_some()
            || s.output_gate
        {
            return Ok(None);
        }
        let (heads, qk_heads) = (s.heads + 2 * s.kv_heads, s.heads + s.kv_heads);
        let y = self.split_heads(qkv.forward(x)?, heads)?;
        let qk = s.rope.forward(&slice_axis(&y, 1, 0, qk_heads)?, offset)?;
        Ok(Some((
            slice_axis(&qk, 1, 0, s.heads)?,
            slice_axis(&qk, 1, s.heads, qk_heads)?,
            slice_axis(&y, 1, qk_heads, heads)?,
        )))
    }

    /// Normed and rotated keys, and values, at positions `offset..` from the raw
    /// projections.
    fn keys_values(
        &self,
        raw_k: Array,
        raw_v: Option<Array>,
        offset: i32,
    ) -> Result<(Array, Array)> {
        let s = &self.spec;
        let raw_k = self.split_heads(raw_k, s.kv_heads)?;
        let mut v = match raw_v {
            Some(v) => self.split_heads(v, s.kv_heads)?,
            None => raw_k.clone(),
        };
        if let Some(eps) = s.v_norm {
            v = rms_norm_unscaled(&v, eps)?;
        }
        let k = match &self.k_norm {
            Some(kn) => kn.forward(&raw_k)?,
            None => raw_k,
        };
        Ok((s.rope.forward(&k, offset)?, v))
    }

    /// Appends the keys and values of `x` (`[1, L, hidden]`, positions after what the
    /// cache holds) without attending: how a drafter caches its target context.
    pub fn append_context(&self, x: &Array, cache: &mut KvCache) -> Result<()> {
        let (_, raw_k, raw_v) = self.project(x)?;
        let (k, v) = self.keys_values(raw_k, raw_v, cache.offset() as i32)?;
        cache.update_and_fetch(&k, &v)?;
        Ok(())
    }

    /// `x`: `[1, L, hidden]`; `mask` from [`attention_mask`] for this layer's window.
    ///
    /// In the row layout (`[R, 1, hidden]`, see [`is_row_layout`]) `mask` is unused:
    /// each position attends exactly as a one-token decode step at that position would,
    /// window included. That also keeps MLX's CUDA attention on its one-query kernel
    /// instead of a cuDNN plan built for every new key length.
    pub fn forward(&self, x: &Array, cache: &mut KvCache, mask: &Mask) -> Result<Array> {
        let s = &self.spec;
        let (mask, block) = match mask {
            Mask::Block(inner) => (inner.as_ref(), true),
            other => (other, false),
        };
        let rows = is_row_layout(x);
        let offset = cache.offset() as i32;
        let mut gate = None;
        let (q, k, v) = match self.packed_heads(x, offset)? {
            Some(qkv) => qkv,
            None => {
                let (raw_q, raw_k, raw_v) = self.project(x)?;
                let raw_q = match self.split_gate(raw_q)? {
                    (q, Some(g)) => {
                        gate = Some(g);
                        q
                    }
                    (q, None) => q,
                };
                let mut q = self.split_heads(raw_q, s.heads)?;
                if let Some(qn) = &self.q_norm {
                    q = qn.forward(&q)?;
                }
                let q = s.rope.forward(&q, offset)?;
                let (k, v) = self.keys_values(raw_k, raw_v, offset)?;
                (q, k, v)
            }
        };
        let (keys, values) = match mask {
            Mask::WholeBuffer(_) if !rows => cache.update_and_fetch_whole(&k, &v)?,
            _ => cache.update_and_fetch(&k, &v)?,
        };
        let len = q.shape()[2];
        if !rows && self.short_kernel_serves(&q, &keys, &values, mask, block) {
            let out = crate::cuda::attention::attend(
                &q,
                &keys,
                &values,
                s.scale,
                s.sliding_window,
                !block,
            )?;
            return self.o.forward(&gated(out, gate)?);
        }

        // A block is not causal: its positions never attend one by one.
        let out = if rows || (!block && attends_position_by_position(offset, len, mask)) {
            self.attend_each_position(&q, &keys, &values, offset)?
        } else {
            self.attend(&q, &keys, &values, mask)?
        };
        // Back to the caller's layout: `[1, L, ..]`, or `[R, 1, ..]` for rows. One
        // position needs no transpose: `[B, H, 1, D]` already lies in memory as
        // `[B, 1, H·D]` (one view fewer in every layer of every decode step).
        let (b, l) = if rows { (len, 1) } else { (x.shape()[0], len) };
        let out = if len == 1 {
            out.reshape(&[b, 1, s.heads * s.head_dim])?
        } else {
            out.transpose_axes(&[0, 2, 1, 3])?
                .reshape(&[b, l, s.heads * s.head_dim])?
        };
        self.o.forward(&gated(out, gate)?)
    }

    /// Attention of `q`'s `L` positions after `offset` cached keys, one call per
    /// position, each as a one-token step makes it: MLX's attention computes several
    /// causal queries differently from one, on CUDA and on the CPU
    /// (docs/verify-numerics.md). The last position sees every key: its keys and values
    /// need no slice (a graph node is host time on a GPU).
    fn attend_each_position(
        &self,
        q: &Array,
        keys: &Array,
        values: &Array,
        offset: i32,
    ) -> Result<Array> {
        let len = q.shape()[2];
        let upto = |a: &Array, row: i32| match row + 1 {
            r if r == len => Ok(a.clone()),
            r => seq_slice(a, 0, offset + r),
        };
        let mut outs = Vec::with_capacity(len as usize);
        for r in 0..len {
            let row_mask = attention_mask(offset + r, 1, self.spec.sliding_window)?;
            outs.push(self.attend(
                &seq_slice(q, r, r + 1)?,
                &upto(keys, r)?,
                &upto(values, r)?,
                &row_mask,
            )?);
        }
        Ok(concatenate(&outs, 2)?)
    }

    /// Several sequences at once: `x` is `[1, T, hidden]`, the rows' positions one after
    /// another (`lens` of them each, after what each row's cache in `caches` holds). What
    /// is the same for every position runs once over all `T`: the projections, the q/k
    /// norms and the rotation (each position at its own place, as a batch row of its
    /// own). Every row then attends over its own cache, causally, as
    /// [`Attention::forward`] attends a sequence alone.
    pub fn forward_packed(
        &self,
        x: &Array,
        caches: &mut [&mut KvCache],
        lens: &[i32],
    ) -> Result<Array> {
        let s = &self.spec;
        let total: i32 = lens.iter().sum();
        let (raw_q, raw_k, raw_v) = self.project(x)?;
        let (raw_q, gate) = self.split_gate(raw_q)?;
        // `[T, heads, 1, D]`: every position a batch row.
        let per_position = |y: &Array, heads: i32| y.reshape(&[total, heads, 1, s.head_dim]);
        let mut q = per_position(&raw_q, s.heads)?;
        let raw_k = per_position(&raw_k, s.kv_heads)?;
        let mut v = match &raw_v {
            Some(v) => per_position(v, s.kv_heads)?,
            None => raw_k.clone(),
        };
        if let Some(eps) = s.v_norm {
            v = rms_norm_unscaled(&v, eps)?;
        }
        if let Some(qn) = &self.q_norm {
            q = qn.forward(&q)?;
        }
        let k = match &self.k_norm {
            Some(kn) => kn.forward(&raw_k)?,
            None => raw_k,
        };
        let mut positions = Vec::with_capacity(total as usize);
        for (cache, &len) in caches.iter().zip(lens) {
            let offset = cache.offset() as i32;
            positions.extend(offset..offset + len);
        }
        let positions = Array::from_slice(&positions, &[total]);
        let (q, k) = (
            s.rope.forward_at(&q, &positions)?,
            s.rope.forward_at(&k, &positions)?,
        );
        // Decoding rows (a new token, with any drafts) whose caches share a pool write
        // and attend together; the others (prompt chunks, caches of their own) row by row.
        let together = self.pooled_rows(caches, lens);
        let mut pooled_row = vec![false; lens.len()];
        together.iter().for_each(|&r| pooled_row[r] = true);
        let alone: Vec<usize> = (0..lens.len()).filter(|&r| !pooled_row[r]).collect();
        let starts: Vec<i32> = lens
            .iter()
            .scan(0, |at, &len| {
                *at += len;
                Some(*at - len)
            })
            .collect();
        // Each row's positions split off (few graph nodes: see `split_rows`), back as one
        // sequence: `[1, heads, L, D]`.
        let as_sequence = |rows: Array| -> Result<Array> {
            Ok(match rows.shape()[0] {
                1 => rows,
                _ => rows.transpose_axes(&[2, 1, 0, 3])?,
            })
        };
        // Every write before any read: caches sharing a pool then update it in place,
        // one write after the other, and every read sees the last.
        let offsets: Vec<i32> = caches.iter().map(|c| c.offset() as i32).collect();
        let (qs, ks, vs) = match alone.is_empty() {
            true => (Vec::new(), Vec::new(), Vec::new()),
            false => (
                split_rows(&q, lens)?,
                split_rows(&k, lens)?,
                split_rows(&v, lens)?,
            ),
        };
        for &r in &alone {
            caches[r].append(&as_sequence(ks[r].clone())?, &as_sequence(vs[r].clone())?)?;
        }
        // The outputs' positions, in the order the pieces come.
        let mut order: Vec<u32> = Vec::with_capacity(total as usize);
        let mut outs = Vec::with_capacity(alone.len() + 1);
        if !together.is_empty() {
            let mut pooled: Vec<&mut KvCache> = Vec::with_capacity(together.len());
            for (cache, _) in caches.iter_mut().zip(&pooled_row).filter(|(_, &p)| p) {
                pooled.push(&mut **cache);
            }
            let row_starts: Vec<i32> = together.iter().map(|&r| starts[r]).collect();
            let row_lens: Vec<i32> = together.iter().map(|&r| lens[r]).collect();
            let (out, positions) = self
                .attend_pooled(&q, &k, &v, &mut pooled, &row_starts, &row_lens)?
                .ok_or_else(|| {
                    ModelError::Unsupported("rows chosen for one pool were not in one".into())
                })?;
            outs.push(out);
            order.extend(positions);
        }
        for &r in &alone {
            let (len, offset) = (lens[r], offsets[r]);
            let q = as_sequence(qs[r].clone())?;
            let (keys, values) = caches[r].fetch()?;
            let mask = attention_mask(offset, len, s.sliding_window)?;
            let out = if attends_position_by_position(offset, len, &mask) {
                self.attend_each_position(&q, &keys, &values, offset)?
            } else {
                self.attend(&q, &keys, &values, &mask)?
            };
            outs.push(match len {
                1 => out,
                _ => out.transpose_axes(&[2, 1, 0, 3])?,
            });
            order.extend((starts[r]..starts[r] + len).map(|p| p as u32));
        }
        let mut out = concatenate(&outs, 0)?;
        if order.iter().enumerate().any(|(i, &p)| i as u32 != p) {
            let mut back = vec![0u32; order.len()];
            for (at, &p) in order.iter().enumerate() {
                back[p as usize] = at as u32;
            }
            out = out.take_axis(Array::from_slice(&back, &[total]), 0)?;
        }
        // `[T, heads, 1, D]` lies in memory as `[1, T, heads·D]`.
        let out = out.reshape(&[1, total, s.heads * s.head_dim])?;
        self.o.forward(&gated(out, gate)?)
    }

    /// The rows of at most [`POOLED_ROW_MAX`] positions (a new token and its drafts)
    /// whose caches are in the pool of the first such row, when there are at least two
    /// of them and the layer's attention can run over a pool (not with score
    /// softcapping); otherwise none.
    fn pooled_rows(&self, caches: &[&mut KvCache], lens: &[i32]) -> Vec<usize> {
        if self.spec.softcap.is_some() {
            return Vec::new();
        }
        let short = |r: usize| lens[r] <= POOLED_ROW_MAX;
        let Some(pool) = (0..caches.len())
            .filter(|&r| short(r))
            .find_map(|r| caches[r].pool())
        else {
            return Vec::new();
        };
        let rows: Vec<usize> = (0..caches.len())
            .filter(|&r| short(r) && caches[r].pool().is_some_and(|p| p.same(pool)))
            .collect();
        match rows.len() {
            0 | 1 => Vec::new(),
            _ => rows,
        }
    }

    /// Rows whose caches are all in one pool (`q` `[T, heads, 1, D]`, `k`/`v` `[T,
    /// kv_heads, 1, D]`, one position a row; cache r's `lens[r]` positions from row
    /// `starts[r]` on): every row's keys and values written in a few graph nodes per
    /// buffer, then attention over the pool's whole buffers ([`pooled_attention`]). The
    /// outputs `[P, heads, 1, D]` and the rows of `q` they belong to, in their order;
    /// `None` when the caches are not in one pool.
    fn attend_pooled(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
        caches: &mut [&mut KvCache],
        starts: &[i32],
        lens: &[i32],
    ) -> Result<Option<(Array, Vec<u32>)>> {
        let s = &self.spec;
        let Some((view, slots)) = KvCache::append_each(caches, k, v, starts, lens)? else {
            return Ok(None);
        };
        let mut first = vec![0i32; view.lengths.len()];
        for (&slot, &start) in slots.iter().zip(starts) {
            first[slot] = start;
        }
        let step = PooledStep {
            view: &view,
            first,
            scale: s.scale,
            sliding_window: s.sliding_window,
        };
        // One query a call on the CPU, where it rounds as a one-token step does; all at
        // once elsewhere, where every call's graph nodes cost host time.
        let queries = match Backend::current() {
            Backend::Cpu => Queries::EachAlone,
            _ => Queries::AtOnce,
        };
        let (out, order) = pooled_attention::attend(q, &step, queries)?;
        Ok(Some((out, order)))
    }

    /// Whether dspec's CUDA attention kernel takes this forward of `q` over
    /// `keys`/`values` in this layer ([`crate::cuda::attention`]; the kernel reads all
    /// three as one dtype): causal, or a drafter's `block`, over the written keys (not
    /// the whole buffer). Cheapest checks first: every decode step asks.
    fn short_kernel_serves(
        &self,
        q: &Array,
        keys: &Array,
        values: &Array,
        mask: &Mask,
        block: bool,
    ) -> bool {
        let dtype = q.dtype();
        self.short_kernels
            && (2..=crate::cuda::MAX_ROWS).contains(&q.shape()[2])
            && match mask {
                Mask::Causal | Mask::Keys(_) => true,
                Mask::All => block,
                Mask::WholeBuffer(_) | Mask::Block(_) => false,
            }
            && keys.dtype() == dtype
            && values.dtype() == dtype
            && crate::cuda::attention::serves(
                self.spec.head_dim,
                dtype,
                self.spec.softcap.is_some(),
            )
    }

    /// The query and, under `output_gate`, the gate logits, each `[B, L, heads·D]`,
    /// from the raw `q_proj` output that holds them per head side by side.
    fn split_gate(&self, raw_q: Array) -> Result<(Array, Option<Array>)> {
        let s = &self.spec;
        if !s.output_gate {
            return Ok((raw_q, None));
        }
        let (b, l) = (raw_q.shape()[0], raw_q.shape()[1]);
        let per_head = raw_q.reshape(&[b, l, s.heads, 2 * s.head_dim])?;
        let flat = |part: Array| part.reshape(&[b, l, s.heads * s.head_dim]);
        Ok((
            flat(slice_axis(&per_head, 3, 0, s.head_dim)?)?,
            Some(flat(slice_axis(&per_head, 3, s.head_dim, 2 * s.head_dim)?)?),
        ))
    }

    /// Attention of `q` (`[1, heads, L, D]`) over `keys`/`values`.
    fn attend(&self, q: &Array, keys: &Array, values: &Array, mask: &Mask) -> Result<Array> {
        let s = &self.spec;
        match s.softcap {
            None if crate::cpu_attention::serves(q, keys, values) => {
                crate::cpu_attention::attend(q, keys, values, s.scale, mask.for_sdpa())
            }
            None => {
                let broadcast = match mask {
                    Mask::WholeBuffer(bias) => Some(bias.for_heads(s.heads)?),
                    _ => None,
                };
                let mask = match &broadcast {
                    Some(bias) => Some(ScaledDotProductAttentionMask::Array(bias)),
                    None => mask.for_sdpa(),
                };
                Ok(scaled_dot_product_attention(
                    q, keys, values, s.scale, mask, None,
                )?)
            }
            Some(cap) => self.softcapped_attention(q, keys, values, mask, cap),
        }
    }

    /// Explicit attention for score softcapping, which the fused kernel cannot do.
    /// Query heads are grouped under their KV head instead of repeating keys.
    fn softcapped_attention(
        &self,
        q: &Array,
        k: &Array,
        v: &Array,
        mask: &Mask,
        cap: f32,
    ) -> Result<Array> {
        let s = &self.spec;
        let (b, len, total) = (q.shape()[0], q.shape()[2], k.shape()[2]);
        let group = s.heads / s.kv_heads;
        let q = q
            .multiply(Array::from_f32(s.scale).as_dtype(q.dtype())?)?
            .reshape(&[b, s.kv_heads, group, len, s.head_dim])?;
        let k = k.reshape(&[b, s.kv_heads, 1, total, s.head_dim])?;
        let v = v.reshape(&[b, s.kv_heads, 1, total, s.head_dim])?;
        let mut scores = softcap(&matmul(&q, k.transpose_axes(&[0, 1, 2, 4, 3])?)?, cap)?;
        let keys = match mask {
            Mask::All => None,
            Mask::Causal => Some(visible_keys(total - len, len, None)?),
            Mask::Keys(keys) => Some(keys.clone()),
            Mask::WholeBuffer(bias) => {
                let bias = bias.bias.reshape(&[1, 1, 1, len, total])?;
                scores = scores.add(bias.as_dtype(scores.dtype())?)?;
                None
            }
            Mask::Block(_) => {
                return Err(ModelError::Unsupported(
                    "a block mask reached softcapped attention unwrapped".into(),
                ))
            }
        };
        if let Some(keys) = keys {
            let hidden = Array::from_f32(f32::NEG_INFINITY).as_dtype(scores.dtype())?;
            scores = select(&keys, &scores, &hidden)?;
        }
        let probs = dspec_runtime::cpu_kernels::softmax_last_axis(&scores)?;
        Ok(matmul(&probs, &v)?.reshape(&[b, s.heads, len, s.head_dim])?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::RandomWeights;
    use mlx_rs::ops::indexing::TryIndexOp;
    use mlx_rs::random;

    /// A qwen2-style layer (biased q/k/v, no norms): hidden 32, 4 query heads of 8 over
    /// 2 KV heads, plain RoPE.
    fn spec() -> AttentionSpec {
        let rope = Rope::from_config(
            8,
            10_000.0,
            &serde_json::Value::Null,
            std::path::Path::new("config.json"),
        )
        .unwrap();
        AttentionSpec {
            hidden: 32,
            heads: 4,
            kv_heads: 2,
            head_dim: 8,
            scale: 8f32.powf(-0.5),
            qkv_bias: true,
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

    /// A layer of [`spec`] under `window`, its weights drawn from `seed`.
    fn layer(window: Option<i32>, seed: u64) -> Attention {
        let spec = AttentionSpec {
            sliding_window: window,
            ..spec()
        };
        let mut weights = RandomWeights::new(seed).unwrap();
        Attention::load(&mut weights, "layer.self_attn", spec).unwrap()
    }

    /// Rows split in groups come out as the plain slices would, for batches under, at
    /// and over what one split takes, with rows of several positions among them.
    #[test]
    fn split_rows_gives_each_rows_positions() {
        for n in [2usize, 10, 16, 27, 103] {
            let lens: Vec<i32> = (0..n).map(|i| 1 + (i % 3 == 0) as i32 * 2).collect();
            let total: i32 = lens.iter().sum();
            let a = arange::<_, f32>(0.0, total as f32, None)
                .unwrap()
                .reshape(&[total, 1])
                .unwrap();
            let pieces = split_rows(&a, &lens).unwrap();
            assert_eq!(pieces.len(), n);
            let mut start = 0;
            for (piece, &len) in pieces.iter().zip(&lens) {
                let want: Vec<f32> = (start..start + len).map(|x| x as f32).collect();
                assert_eq!(piece.as_slice::<f32>(), &want[..], "{n} rows");
                start += len;
            }
        }
    }

    /// Attention in the row layout equals one-token decoding at each position, bitwise,
    /// with and without a window that cuts partway through the rows.
    #[test]
    fn rows_attend_like_single_positions() {
        let key = random::key(5).unwrap();
        for (offset, window) in [(9, None), (20, Some(23))] {
            let attn = layer(window, 3);
            let total = offset + 6;
            let x = random::normal::<f32>(&[total, 1, 32], None, None, Some(&key)).unwrap();
            // The cache holds `offset` positions, written by one ordinary forward.
            let prefix = x
                .try_index((0..offset, 0, ..))
                .unwrap()
                .reshape(&[1, offset, 32])
                .unwrap();
            let mask = attention_mask(0, offset, window).unwrap();
            let mut rows_cache = KvCache::default();
            attn.forward(&prefix, &mut rows_cache, &mask).unwrap();
            let mut single_cache = KvCache::default();
            attn.forward(&prefix, &mut single_cache, &mask).unwrap();

            let rows = attn
                .forward(&x.try_index(offset..).unwrap(), &mut rows_cache, &Mask::All)
                .unwrap();
            for r in 0..6 {
                let one = x.try_index((offset + r)..(offset + r + 1)).unwrap();
                let mask = attention_mask(offset + r, 1, window).unwrap();
                let single = attn.forward(&one, &mut single_cache, &mask).unwrap();
                let row = rows.try_index(r..r + 1).unwrap();
                assert!(
                    row.eq_values(&single).unwrap(),
                    "offset {offset}, window {window:?}: row {r} differs"
                );
            }
        }
    }

    /// A drafter's block attends by the block rule, over the written keys ([`block_mask`])
    /// and over the cache's whole buffer as it runs on CUDA ([`whole_buffer_block_mask`]):
    /// every block position sees the whole block and the context (under a window, only
    /// the context within it), never the buffer's unwritten rest, which holds stale keys
    /// here on purpose.
    #[test]
    fn blocks_over_the_whole_buffer_attend_like_blocks_over_the_written_keys() {
        let key = random::key(8).unwrap();
        // A window shorter than the block too: the block must still see all of itself.
        for (context, window) in [(9, None), (20, Some(7)), (20, Some(3))] {
            let attn = layer(window, 4);
            let block = 5;
            let x = random::normal::<f32>(&[1, context + 2 * block, 32], None, None, Some(&key))
                .unwrap();
            let ctx = x.try_index((.., 0..context, ..)).unwrap();
            let blk = x.try_index((.., context..context + block, ..)).unwrap();
            let stale = x.try_index((.., context.., ..)).unwrap();
            let mut written = KvCache::default();
            attn.append_context(&ctx, &mut written).unwrap();
            let mut whole = KvCache::default();
            attn.append_context(&ctx, &mut whole).unwrap();
            // Stale positions past the context, as a trimmed earlier block leaves them.
            attn.append_context(&stale, &mut whole).unwrap();
            whole.trim(2 * block as usize).unwrap();

            // What a block position sees, written out here rather than taken from the
            // code under test: every key without a window; under one, the block and the
            // context keys fewer than `w` behind the query.
            let sees = |q: i32, k: i32| window.is_none_or(|w| k >= context || q - k < w);
            let total = context + block;
            let rule: Vec<bool> = (context..total)
                .flat_map(|q| (0..total).map(move |k| (q, k)))
                .map(|(q, k)| sees(q, k))
                .collect();
            let rule = Mask::Block(Box::new(Mask::Keys(Array::from_slice(
                &rule,
                &[block, total],
            ))));
            let mut reference = KvCache::default();
            attn.append_context(&ctx, &mut reference).unwrap();
            let want = attn.forward(&blk, &mut reference, &rule).unwrap();
            let capacity = whole.capacity_for(context as usize + block as usize) as i32;
            let over_buffer =
                whole_buffer_block_mask(context, block, capacity, window, Dtype::Float32).unwrap();
            for (path, got) in [
                (
                    "block_mask",
                    attn.forward(
                        &blk,
                        &mut written,
                        &block_mask(context, block, window).unwrap(),
                    ),
                ),
                (
                    "whole_buffer_block_mask",
                    attn.forward(&blk, &mut whole, &over_buffer),
                ),
            ] {
                let gap = got
                    .unwrap()
                    .subtract(&want)
                    .unwrap()
                    .abs()
                    .unwrap()
                    .max(None)
                    .unwrap()
                    .try_item_cast::<f32>()
                    .unwrap();
                assert!(
                    gap < 1e-5,
                    "{path}, context {context}, window {window:?}: off by {gap}"
                );
            }
        }
    }

    /// The packed path (one reshape, head slices, one rope for q and k) must give
    /// exactly what projecting, splitting and rotating q and k one by one gives, for a
    /// decode step, a multi-token forward and the row layout.
    #[test]
    fn packed_heads_equal_the_general_path() {
        let mut weights = RandomWeights::new(7).unwrap();
        let attn = Attention::load(&mut weights, "layer.self_attn", spec()).unwrap();
        assert!(matches!(attn.projections, Projections::Fused { .. }));
        let key = random::key(11).unwrap();
        for (shape, offset) in [([1, 1, 32], 5), ([1, 3, 32], 5), ([3, 1, 32], 9)] {
            let x = random::normal::<f32>(&shape, None, None, Some(&key)).unwrap();
            let (q, k, v) = attn
                .packed_heads(&x, offset)
                .unwrap()
                .expect("a fused, norm-free layer takes the packed path");
            let (raw_q, raw_k, raw_v) = attn.project(&x).unwrap();
            let q_ref = attn
                .spec
                .rope
                .forward(&attn.split_heads(raw_q, 4).unwrap(), offset)
                .unwrap();
            let (k_ref, v_ref) = attn.keys_values(raw_k, raw_v, offset).unwrap();
            for (name, got, want) in [("q", &q, &q_ref), ("k", &k, &k_ref), ("v", &v, &v_ref)] {
                assert_eq!(got.shape(), want.shape(), "{name} for input {shape:?}");
                assert!(
                    got.eq_values(want).unwrap(),
                    "{name} differs for input {shape:?}"
                );
            }
        }
    }
}
