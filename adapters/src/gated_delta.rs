//! Gated DeltaNet, the linear-attention layer of the hybrid Qwen families (Qwen3-Next,
//! Qwen3.5). Per position: q|k|v projected and passed through a causal depthwise
//! convolution and SiLU; q and k L2-normalised (q also scaled by Dk^-½). Per value head
//! a matrix state S (Dv × Dk, f32) decays by exp(g), with g = −exp(A_log) ·
//! softplus(a + dt_bias), and learns the value the state mispredicts for the key at rate
//! β = sigmoid(b): S ← exp(g)·S; S ← S + β (v − S k) kᵀ. The output S q goes through an
//! RMSNorm gated by SiLU(z) and `out_proj`.
//!
//! The layer's cache is a [`RecurrentCache`] of two arrays, the convolution's window of
//! the last K − 1 inputs and S, kept after each recent position so that a rollback
//! picks one (see [`RecurrentCache`] for why).

use std::path::PathBuf;

use mlx_rs::ops::{
    broadcast_to, concatenate, eye, logaddexp, matmul, ones, select, sigmoid, tril, zeros_dtype,
};
use mlx_rs::{fast, Array, Dtype};

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::{RecurrentCache, WeightSource};
use dspec_runtime::slicing::slice_axis;

use crate::layers::{is_row_layout, split_last, Linear, NormWeight, RmsNorm};

/// Forwards up to this long (or up to the cache's rollback window, if longer) run the
/// recurrence position by position; longer ones run all but their last
/// window's worth of positions in chunks. Stepping costs a few small ops per position,
/// cheaper than a chunk's fixed work for a short forward (a verify, a decode step).
pub const STEPWISE_MAX: usize = 16;

/// Positions per chunk of the chunked recurrence: the chunk's C × C products grow with
/// it, the sequential steps over chunks shrink.
pub const CHUNK: i32 = 64;

/// The eps of the L2 norm of q and k (HF's `l2norm`, FLA's kernels).
const L2_EPS: f32 = 1e-6;

/// How the checkpoint's projections are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProjectionLayout {
    /// `in_proj_qkv`, `in_proj_z`, `in_proj_b` and `in_proj_a` (Qwen3.5).
    Separate,
    /// `in_proj_qkvz` and `in_proj_ba`, each with its outputs grouped per key head:
    /// for key head h, its q, k, then the v and z of its value heads (Qwen3-Next).
    GroupedByKeyHead,
}

/// Shape of one layer, from config.json's `linear_*` fields.
#[derive(Debug, Clone, Copy)]
pub struct DeltaNetSpec {
    pub hidden: i32,
    pub key_heads: i32,
    pub value_heads: i32,
    pub key_dim: i32,
    pub value_dim: i32,
    pub conv_kernel: i32,
    /// eps of the gated output norm.
    pub norm_eps: f32,
    pub projections: ProjectionLayout,
}

impl DeltaNetSpec {
    fn key_width(&self) -> i32 {
        self.key_heads * self.key_dim
    }

    fn value_width(&self) -> i32 {
        self.value_heads * self.value_dim
    }

    /// Channels of the convolution: q, k and v side by side.
    pub fn conv_channels(&self) -> i32 {
        2 * self.key_width() + self.value_width()
    }

    /// Bytes of one kept state: the f32 recurrence state of every value head and the
    /// convolution window in `activation_bytes`-wide elements.
    pub fn state_bytes(&self, activation_bytes: usize) -> usize {
        let recurrence = (self.value_heads * self.value_dim * self.key_dim) as usize * 4;
        let window = ((self.conv_kernel - 1) * self.conv_channels()) as usize * activation_bytes;
        recurrence + window
    }
}

/// Where HF checkpoints and mlx-lm conversions store things differently.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CheckpointLayout {
    /// HF: conv1d weights `[C, 1, K]`; RMSNorm weights (but the gated one) as the w of
    /// `x̂ · (1 + w)`.
    HuggingFace,
    /// mlx-lm conversions: conv1d weights `[C, K, 1]`; those RMSNorm weights stored as
    /// `1 + w`, so they scale plainly.
    Mlx,
}

impl CheckpointLayout {
    /// How the decoder's RMSNorm weights (layer norms, the final norm, q/k norms) apply.
    pub fn norm_weight(self) -> NormWeight {
        match self {
            CheckpointLayout::HuggingFace => NormWeight::OffsetByOne,
            CheckpointLayout::Mlx => NormWeight::Plain,
        }
    }
}

/// Reads a conv1d weight and tells the checkpoint's layout from its shape, the way
/// mlx-lm does: its conversion moves the kernel axis last-but-one (`[C, 1, K]` to
/// `[C, K, 1]`) and adds 1 to the norm weights in the same step, so the conv shape says
/// whether the norms were shifted. A kernel of 1 would make the two shapes one; configs
/// with it are refused before this runs. Returns the weight as `[K, C]` (tap `j` of
/// every channel in row `j`) in the requested dtype.
pub fn read_conv_weight(
    w: &mut dyn WeightSource,
    name: &str,
    channels: i32,
    kernel: i32,
) -> Result<(Array, CheckpointLayout)> {
    // A source without it (random test weights) makes it in the MLX layout; a checkpoint
    // without it fails naming the tensor.
    let (raw, layout) = if !w.contains(name) {
        (
            w.tensor(name, &[channels, kernel, 1])?,
            CheckpointLayout::Mlx,
        )
    } else {
        let raw = w.raw(name)?;
        let layout = match raw.shape() {
            [c, 1, k] if *c == channels && *k == kernel => CheckpointLayout::HuggingFace,
            [c, k, 1] if *c == channels && *k == kernel => CheckpointLayout::Mlx,
            other => {
                return Err(ModelError::ShapeMismatch {
                    name: name.into(),
                    file: PathBuf::from("(checkpoint)"),
                    expected: vec![channels, kernel, 1],
                    actual: other.to_vec(),
                })
            }
        };
        (float_as_requested(w, name, raw)?, layout)
    };
    let taps = raw.reshape(&[channels, kernel])?.t();
    Ok((taps, layout))
}

/// A tensor taken with [`WeightSource::raw`] must be a float one.
fn check_float(name: &str, raw: &Array) -> Result<()> {
    if matches!(
        raw.dtype(),
        Dtype::Float32 | Dtype::Float16 | Dtype::Bfloat16 | Dtype::Float64
    ) {
        return Ok(());
    }
    Err(ModelError::UnsupportedDtype {
        name: name.into(),
        file: PathBuf::from("(checkpoint)"),
        dtype: format!("{:?}", raw.dtype()),
        wanted: "a float tensor".into(),
    })
}

/// A float tensor taken with [`WeightSource::raw`], cast as the user asked.
fn float_as_requested(w: &dyn WeightSource, name: &str, raw: Array) -> Result<Array> {
    check_float(name, &raw)?;
    match w.options().dtype {
        Some(dtype) if dtype != raw.dtype() => Ok(raw.as_dtype(dtype)?),
        _ => Ok(raw),
    }
}

/// `A_log` (`[heads]`) in f32 as stored: the decay rate goes through exp twice, and a
/// cast to a half-precision dtype first would change it (mlx-lm keeps it f32 too).
fn read_a_log(w: &mut dyn WeightSource, name: &str, heads: i32) -> Result<Array> {
    if !w.contains(name) {
        return Ok(w.tensor(name, &[heads])?.as_dtype(Dtype::Float32)?);
    }
    let raw = w.raw(name)?;
    if raw.shape() != [heads] {
        return Err(ModelError::ShapeMismatch {
            name: name.into(),
            file: PathBuf::from("(checkpoint)"),
            expected: vec![heads],
            actual: raw.shape().to_vec(),
        });
    }
    check_float(name, &raw)?;
    Ok(raw.as_dtype(Dtype::Float32)?)
}

/// The input projections: q|k|v, z, b and a as one product when they fuse.
#[derive(Clone)]
enum InProj {
    Fused { all: Linear, sizes: [i32; 4] },
    Separate(Box<[Linear; 4]>),
}

#[derive(Clone)]
pub struct GatedDeltaNet {
    spec: DeltaNetSpec,
    in_proj: InProj,
    /// Tap `j` of the convolution for every channel, `[C]` each, oldest input first.
    conv_taps: Vec<Array>,
    /// `−exp(A_log)`, f32 `[Hv]`.
    neg_a: Array,
    /// f32 `[Hv]`.
    dt_bias: Array,
    /// The gated output norm (weights scale plainly in every layout).
    norm: RmsNorm,
    out_proj: Linear,
}

impl GatedDeltaNet {
    /// Loads the layer under `prefix` (`model.layers.0.linear_attn`); `conv` is its
    /// conv1d weight as [`read_conv_weight`] returned it.
    pub fn load(
        w: &mut dyn WeightSource,
        prefix: &str,
        spec: DeltaNetSpec,
        conv: &Array,
    ) -> Result<Self> {
        let s = &spec;
        let (h, hv) = (s.hidden, s.value_heads);
        let [qkv, z, b, a] = match s.projections {
            ProjectionLayout::Separate => [
                Linear::load(
                    w,
                    &format!("{prefix}.in_proj_qkv"),
                    h,
                    s.conv_channels(),
                    false,
                )?,
                Linear::load(w, &format!("{prefix}.in_proj_z"), h, s.value_width(), false)?,
                Linear::load(w, &format!("{prefix}.in_proj_b"), h, hv, false)?,
                Linear::load(w, &format!("{prefix}.in_proj_a"), h, hv, false)?,
            ],
            ProjectionLayout::GroupedByKeyHead => grouped_projections(w, prefix, s)?,
        };
        let sizes = [s.conv_channels(), s.value_width(), hv, hv];
        let in_proj = match Linear::fuse(&[&qkv, &z, &b, &a])? {
            Some(all) => InProj::Fused { all, sizes },
            None => InProj::Separate(Box::new([qkv, z, b, a])),
        };
        let conv_taps = (0..s.conv_kernel)
            .map(|j| Ok(slice_axis(conv, 0, j, j + 1)?.reshape(&[s.conv_channels()])?))
            .collect::<Result<Vec<_>>>()?;
        let a_log = read_a_log(w, &format!("{prefix}.A_log"), hv)?;
        let neg_a = mlx_rs::ops::exp(&a_log)?.negative()?;
        let dt_bias = w
            .tensor(&format!("{prefix}.dt_bias"), &[hv])?
            .as_dtype(Dtype::Float32)?;
        let norm = RmsNorm::load(
            w,
            &format!("{prefix}.norm.weight"),
            s.value_dim,
            s.norm_eps,
            NormWeight::Plain,
        )?;
        let out_proj = Linear::load(w, &format!("{prefix}.out_proj"), s.value_width(), h, false)?;
        Ok(Self {
            spec,
            in_proj,
            conv_taps,
            neg_a,
            dt_bias,
            norm,
            out_proj,
        })
    }

    pub fn quantized_bits(&self) -> Option<i32> {
        match &self.in_proj {
            InProj::Fused { all, .. } => all.quantized_bits(),
            InProj::Separate(parts) => parts[0].quantized_bits(),
        }
    }

    /// q|k|v, z, b and a of `x`.
    fn project(&self, x: &Array) -> Result<[Array; 4]> {
        let parts = match &self.in_proj {
            InProj::Fused { all, sizes } => split_last(&all.forward(x)?, sizes)?,
            InProj::Separate(parts) => parts
                .iter()
                .map(|p| p.forward(x))
                .collect::<Result<Vec<_>>>()?,
        };
        parts.try_into().map_err(|_| {
            ModelError::Unsupported("the input projections gave other than four parts".into())
        })
    }

    /// `x`: `[1, L, hidden]` after what `cache` holds, or the row layout `[L, 1, hidden]`
    /// (each position through the one-token kernels, as the other layers run it).
    pub fn forward(&self, x: &Array, cache: &mut RecurrentCache) -> Result<Array> {
        let rows = is_row_layout(x);
        let len = if rows { x.shape()[0] } else { x.shape()[1] };
        let as_sequence = |a: Array| -> Result<Array> {
            if rows {
                Ok(a.reshape(&[1, len, a.shape()[2]])?)
            } else {
                Ok(a)
            }
        };
        let [qkv, z, b, a] = self.project(x)?;
        let parts = [
            as_sequence(qkv)?,
            as_sequence(z)?,
            as_sequence(b)?,
            as_sequence(a)?,
        ];
        let gated = self.recur(parts, cache)?;
        let out = match rows {
            true => gated.reshape(&[len, 1, self.spec.value_width()])?,
            false => gated,
        };
        self.out_proj.forward(&out)
    }

    /// Several sequences packed one after another in `x` (`[1, T, hidden]`, `lens`
    /// positions each), each with its own state in `caches`: the projections take all
    /// `T` positions in one product each, the recurrence runs row by row.
    pub fn forward_packed(
        &self,
        x: &Array,
        caches: &mut [&mut RecurrentCache],
        lens: &[i32],
    ) -> Result<Array> {
        let parts = self.project(x)?;
        let mut outs = Vec::with_capacity(lens.len());
        let mut start = 0;
        for (cache, &len) in caches.iter_mut().zip(lens) {
            let piece = |a: &Array| slice_axis(a, 1, start, start + len);
            let row = [
                piece(&parts[0])?,
                piece(&parts[1])?,
                piece(&parts[2])?,
                piece(&parts[3])?,
            ];
            outs.push(self.recur(row, cache)?);
            start += len;
        }
        self.out_proj.forward(&concatenate(&outs, 1)?)
    }

    /// The layer between its projections: convolution, the gated delta rule over the
    /// state in `cache` (advanced past the `L` new positions) and the gated norm, from
    /// the projections `[qkv, z, b, a]` (`[1, L, ..]` each); `[1, L, value width]`.
    fn recur(&self, parts: [Array; 4], cache: &mut RecurrentCache) -> Result<Array> {
        let s = &self.spec;
        let [qkv, z, b, a] = parts;
        let len = qkv.shape()[1];
        let dtype = qkv.dtype();
        let (k_taps, channels) = (s.conv_kernel, s.conv_channels());
        let (window, state) = match cache.current() {
            [window, state] => (window.clone(), state.clone()),
            [] => (
                zeros_dtype(&[1, k_taps - 1, channels], dtype)?,
                mlx_rs::ops::zeros::<f32>(&[1, s.value_heads, s.value_dim, s.key_dim])?,
            ),
            other => {
                return Err(ModelError::Unsupported(format!(
                    "a Gated DeltaNet layer got a recurrent cache of {} arrays (2 expected): \
                     the cache was made for a different model",
                    other.len()
                )))
            }
        };

        // Causal depthwise convolution over the window and the new inputs.
        let inputs = concatenate(&[window, qkv], 1)?;
        let mut conv: Option<Array> = None;
        for (j, tap) in self.conv_taps.iter().enumerate() {
            let term = slice_axis(&inputs, 1, j as i32, j as i32 + len)?.multiply(tap)?;
            conv = Some(match conv {
                Some(sum) => sum.add(term)?,
                None => term,
            });
        }
        let conv =
            conv.ok_or_else(|| ModelError::Unsupported("a convolution of no taps".into()))?;
        let conv = conv.multiply(sigmoid(&conv)?)?;
        let (kw, hv) = (s.key_width(), s.value_heads);
        let f32_heads = |part: Array, heads: i32, dim: i32| -> Result<Array> {
            Ok(part
                .as_dtype(Dtype::Float32)?
                .reshape(&[1, len, heads, dim])?)
        };
        let q = f32_heads(slice_axis(&conv, 2, 0, kw)?, s.key_heads, s.key_dim)?;
        let k = f32_heads(slice_axis(&conv, 2, kw, 2 * kw)?, s.key_heads, s.key_dim)?;
        let v = f32_heads(slice_axis(&conv, 2, 2 * kw, channels)?, hv, s.value_dim)?;
        // L2 norms as RMS norms: x/‖x‖ = rms_norm(x, eps/D)/√D (eps added to the sum of
        // squares, as HF's l2norm does); q carries Dk^-½ more.
        let dk = s.key_dim as f32;
        let q = fast::rms_norm(&q, None, L2_EPS / dk)?.multiply(Array::from_f32(1.0 / dk))?;
        let k = fast::rms_norm(&k, None, L2_EPS / dk)?.multiply(Array::from_f32(dk.powf(-0.5)))?;
        let (q, k) = (self.per_value_head(q, len)?, self.per_value_head(k, len)?);
        let beta = sigmoid(b.as_dtype(Dtype::Float32)?)?;
        let softplus = logaddexp(
            a.as_dtype(Dtype::Float32)?.add(&self.dt_bias)?,
            Array::from_f32(0.0),
        )?;
        let g = softplus.multiply(&self.neg_a)?;

        // The last positions step (and their states are kept); a long head runs chunked.
        let window_kept = cache.window();
        let len_u = len as usize;
        let tail = if len_u <= window_kept.max(STEPWISE_MAX) {
            len_u
        } else {
            window_kept
        } as i32;
        let head = len - tail;
        let window_after = |p: i32| slice_axis(&inputs, 1, p, p + k_taps - 1);
        let part = |a: &Array, from: i32, to: i32| slice_axis(a, 1, from, to);
        let mut outputs = Vec::new();
        let mut states = Vec::new();
        let mut state = state;
        if head > 0 {
            let (y, end) = chunked(
                &part(&q, 0, head)?,
                &part(&k, 0, head)?,
                &part(&v, 0, head)?,
                &part(&g, 0, head)?,
                &part(&beta, 0, head)?,
                &state,
                CHUNK,
            )?;
            outputs.push(y);
            state = end;
            states.push(vec![window_after(head)?, state.clone()]);
        }
        for t in head..len {
            let (y, next) = step(
                &state,
                &part(&q, t, t + 1)?,
                &part(&k, t, t + 1)?,
                &part(&v, t, t + 1)?,
                &part(&g, t, t + 1)?,
                &part(&beta, t, t + 1)?,
            )?;
            outputs.push(y);
            state = next;
            states.push(vec![window_after(t + 1)?, state.clone()]);
        }
        let y = match outputs.len() {
            1 => outputs
                .pop()
                .ok_or_else(|| ModelError::Unsupported("no output".into()))?,
            _ => concatenate(&outputs, 1)?,
        };

        // Gated RMSNorm per value head, then the output projection.
        let y = self.norm.forward(&y.as_dtype(dtype)?)?;
        let z = z
            .as_dtype(Dtype::Float32)?
            .reshape(&[1, len, hv, s.value_dim])?;
        let gated = y
            .as_dtype(Dtype::Float32)?
            .multiply(z.multiply(sigmoid(&z)?)?)?
            .as_dtype(dtype)?
            .reshape(&[1, len, s.value_width()])?;
        cache.advance(len_u, states)?;
        Ok(gated)
    }

    /// `[1, L, Hk, Dk]` to `[1, L, Hv, Dk]`: value head `i` reads key head `i / (Hv/Hk)`.
    fn per_value_head(&self, x: Array, len: i32) -> Result<Array> {
        let s = &self.spec;
        let group = s.value_heads / s.key_heads;
        if group == 1 {
            return Ok(x);
        }
        let x = x.reshape(&[1, len, s.key_heads, 1, s.key_dim])?;
        Ok(
            broadcast_to(&x, &[1, len, s.key_heads, group, s.key_dim])?.reshape(&[
                1,
                len,
                s.value_heads,
                s.key_dim,
            ])?,
        )
    }
}

/// Qwen3-Next's `in_proj_qkvz` and `in_proj_ba` with their outputs reordered into the
/// q|k|v, z, b and a projections Qwen3.5 stores separately.
fn grouped_projections(
    w: &mut dyn WeightSource,
    prefix: &str,
    s: &DeltaNetSpec,
) -> Result<[Linear; 4]> {
    let (hk, dk, dv) = (s.key_heads, s.key_dim, s.value_dim);
    let per_key = s.value_heads / hk;
    let group = 2 * dk + 2 * per_key * dv;
    let qkvz_name = format!("{prefix}.in_proj_qkvz");
    let ba_name = format!("{prefix}.in_proj_ba");
    let qkvz = Linear::load(w, &qkvz_name, s.hidden, hk * group, false)?;
    let ba = Linear::load(w, &ba_name, s.hidden, hk * 2 * per_key, false)?;
    // Rows `[from, from + width)` of every key head's group, head after head.
    let rows = |stride: i32, from: i32, width: i32| -> Vec<i32> {
        (0..hk)
            .flat_map(|h| (0..width).map(move |i| h * stride + from + i))
            .collect()
    };
    let mut qkv = rows(group, 0, dk);
    qkv.extend(rows(group, dk, dk));
    qkv.extend(rows(group, 2 * dk, per_key * dv));
    Ok([
        qkvz.take_rows(&qkv, &qkvz_name)?,
        qkvz.take_rows(
            &rows(group, 2 * dk + per_key * dv, per_key * dv),
            &qkvz_name,
        )?,
        ba.take_rows(&rows(2 * per_key, 0, per_key), &ba_name)?,
        ba.take_rows(&rows(2 * per_key, per_key, per_key), &ba_name)?,
    ])
}

/// One position of the recurrence. `state` `[1, Hv, Dv, Dk]`; `q`, `k` `[1, 1, Hv, Dk]`;
/// `v` `[1, 1, Hv, Dv]`; `g`, `beta` `[1, 1, Hv]`, all f32. Returns the output
/// `[1, 1, Hv, Dv]` and the new state. A decode step and each position of a verify run
/// exactly these ops on arrays of these shapes, so their states agree bitwise given the
/// same inputs.
pub fn step(
    state: &Array,
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
) -> Result<(Array, Array)> {
    let (hv, dv, dk) = (state.shape()[1], state.shape()[2], state.shape()[3]);
    let decay = mlx_rs::ops::exp(g)?.reshape(&[1, hv, 1, 1])?;
    let state = state.multiply(&decay)?;
    let k_col = k.reshape(&[1, hv, dk, 1])?;
    let predicted = matmul(&state, &k_col)?;
    let delta = v
        .reshape(&[1, hv, dv, 1])?
        .subtract(&predicted)?
        .multiply(beta.reshape(&[1, hv, 1, 1])?)?;
    let state = state.add(matmul(&delta, k.reshape(&[1, hv, 1, dk])?)?)?;
    let y = matmul(&state, q.reshape(&[1, hv, dk, 1])?)?.reshape(&[1, 1, hv, dv])?;
    Ok((y, state))
}

/// The recurrence over `P` positions at once, in chunks of `chunk` positions: within a
/// chunk the delta rule's updates are solved together (the WY form: a unit
/// lower-triangular system per chunk), and only the state crosses from one chunk to the
/// next. Same arguments as [`step`] with `P` positions; returns `[1, P, Hv, Dv]` and the
/// state after the last position. No host round trip: the triangular system is
/// inverted with matrix products (its strictly lower part is nilpotent).
pub fn chunked(
    q: &Array,
    k: &Array,
    v: &Array,
    g: &Array,
    beta: &Array,
    state: &Array,
    chunk: i32,
) -> Result<(Array, Array)> {
    let (len, hv, dk, dv) = (q.shape()[1], q.shape()[2], q.shape()[3], v.shape()[3]);
    let chunks = (len + chunk - 1) / chunk;
    let pad = chunks * chunk - len;
    // `[1, L, Hv, D]` to `[1, Hv, n, C, D]`, padded with positions that change nothing
    // (no key, no value, β = 0, no decay).
    let blocks = |x: &Array, d: i32| -> Result<Array> {
        let x = x.transpose_axes(&[0, 2, 1, 3])?;
        let x = if pad > 0 {
            concatenate(&[x, mlx_rs::ops::zeros::<f32>(&[1, hv, pad, d])?], 2)?
        } else {
            x
        };
        Ok(x.reshape(&[1, hv, chunks, chunk, d])?)
    };
    let scalars = |x: &Array| -> Result<Array> {
        let x = x.transpose_axes(&[0, 2, 1])?;
        let x = if pad > 0 {
            concatenate(&[x, mlx_rs::ops::zeros::<f32>(&[1, hv, pad])?], 2)?
        } else {
            x
        };
        Ok(x.reshape(&[1, hv, chunks, chunk])?)
    };
    let (q, k, v) = (blocks(q, dk)?, blocks(k, dk)?, blocks(v, dv)?);
    let (g, beta) = (scalars(g)?, scalars(beta)?);
    let expand = |x: &Array| x.reshape(&[1, hv, chunks, chunk, 1]);
    let t = |x: &Array| x.swap_axes(-1, -2);

    // Log decay from each chunk's start; decay[t, i] = exp(G_t − G_i) for i ≤ t, else 0.
    let cum = g.cumsum(-1, None, None)?;
    let diff = cum
        .reshape(&[1, hv, chunks, chunk, 1])?
        .subtract(cum.reshape(&[1, hv, chunks, 1, chunk])?)?;
    let lower = tril(ones::<bool>(&[chunk, chunk])?, 0)?;
    let strictly_lower = tril(ones::<bool>(&[chunk, chunk])?, -1)?;
    let decay = mlx_rs::ops::exp(select(&lower, &diff, Array::from_f32(f32::NEG_INFINITY))?)?;
    // u_t = β_t (v_t − exp(g_t) S_{t−1} k_t), written out: (I + A) U = βV − (βΓ∘K) S₀ᵀ,
    // A[t, i] = β_t exp(G_t − G_i) k_t·k_i for i < t.
    let a = select(
        &strictly_lower,
        &matmul(&k, t(&k)?)?
            .multiply(&decay)?
            .multiply(expand(&beta)?)?,
        Array::from_f32(0.0),
    )?;
    let inverse = unit_lower_inverse(&a.negative()?, chunk)?;
    let gamma = mlx_rs::ops::exp(&cum)?;
    let new_values = matmul(&inverse, v.multiply(expand(&beta)?)?)?;
    let state_keys = matmul(&inverse, k.multiply(expand(&beta.multiply(&gamma)?)?)?)?;
    let decayed_q = q.multiply(expand(&gamma)?)?;
    let within = matmul(&q, t(&k)?)?.multiply(&decay)?;
    let last = slice_axis(&cum, 3, chunk - 1, chunk)?;
    let to_end = k.multiply(expand(&mlx_rs::ops::exp(last.subtract(&cum)?)?)?)?;
    let chunk_decay = mlx_rs::ops::exp(&last)?;

    let pick = |x: &Array, c: i32| -> Result<Array> {
        let s = x.shape().to_vec();
        let mut shape = s.clone();
        shape.remove(2);
        Ok(slice_axis(x, 2, c, c + 1)?.reshape(&shape)?)
    };
    let mut state = state.clone();
    let mut outputs = Vec::with_capacity(chunks as usize);
    for c in 0..chunks {
        let state_t = t(&state)?;
        let u = pick(&new_values, c)?.subtract(matmul(&pick(&state_keys, c)?, &state_t)?)?;
        outputs
            .push(matmul(&pick(&decayed_q, c)?, &state_t)?.add(matmul(&pick(&within, c)?, &u)?)?);
        state = state
            .multiply(pick(&chunk_decay, c)?.reshape(&[1, hv, 1, 1])?)?
            .add(matmul(&t(&u)?, &pick(&to_end, c)?)?)?;
    }
    let y = concatenate(&outputs, 2)?;
    let y = slice_axis(&y, 2, 0, len)?.transpose_axes(&[0, 2, 1, 3])?;
    Ok((y, state))
}

/// `(I − N)⁻¹` for `N` strictly lower triangular over `[.., n, n]`: `N` is nilpotent, so
/// the inverse is `Σ Nʲ = (I + N)(I + N²)(I + N⁴)…`, a few matrix products.
fn unit_lower_inverse(n: &Array, size: i32) -> Result<Array> {
    let identity = eye::<f32>(size, None, None)?;
    let mut power = n.clone();
    let mut inverse = identity.add(n)?;
    let mut reach = 2;
    while reach < size {
        power = matmul(&power, &power)?;
        inverse = inverse.add(matmul(&inverse, &power)?)?;
        reach *= 2;
    }
    Ok(inverse)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::random;

    fn normal(shape: &[i32], seed: u64) -> Array {
        random::normal::<f32>(shape, None, None, Some(&random::key(seed).unwrap())).unwrap()
    }

    /// Inputs of `len` positions as a layer makes them: unit keys, queries scaled down,
    /// decays below 1, rates in (0, 1).
    fn inputs(len: i32, hv: i32, dk: i32, dv: i32) -> [Array; 5] {
        let unit = |x: Array| {
            fast::rms_norm(&x, None, 1e-6)
                .unwrap()
                .multiply(Array::from_f32((dk as f32).powf(-0.5)))
                .unwrap()
        };
        let q = unit(normal(&[1, len, hv, dk], 1))
            .multiply(Array::from_f32((dk as f32).powf(-0.5)))
            .unwrap();
        let k = unit(normal(&[1, len, hv, dk], 2));
        let v = normal(&[1, len, hv, dv], 3);
        let g = mlx_rs::ops::abs(normal(&[1, len, hv], 4))
            .unwrap()
            .multiply(Array::from_f32(-0.3))
            .unwrap();
        let beta = sigmoid(normal(&[1, len, hv], 5)).unwrap();
        [q, k, v, g, beta]
    }

    fn max_diff(a: &Array, b: &Array) -> f32 {
        mlx_rs::ops::abs(a.subtract(b).unwrap())
            .unwrap()
            .max(None)
            .unwrap()
            .item_cast::<f32>()
    }

    /// The chunked recurrence computes what stepping position by position does, outputs
    /// and end state, from a non-zero state, with a last chunk only partly filled.
    #[test]
    fn chunks_compute_what_steps_do() {
        let (len, hv, dk, dv) = (11, 3, 8, 6);
        let [q, k, v, g, beta] = inputs(len, hv, dk, dv);
        let start = normal(&[1, hv, dv, dk], 6)
            .multiply(Array::from_f32(0.5))
            .unwrap();
        let part = |a: &Array, t: i32| slice_axis(a, 1, t, t + 1).unwrap();
        let mut state = start.clone();
        let mut ys = Vec::new();
        for t in 0..len {
            let (y, next) = step(
                &state,
                &part(&q, t),
                &part(&k, t),
                &part(&v, t),
                &part(&g, t),
                &part(&beta, t),
            )
            .unwrap();
            ys.push(y);
            state = next;
        }
        let stepped = concatenate(&ys, 1).unwrap();
        for chunk in [4, 16] {
            let (y, end) = chunked(&q, &k, &v, &g, &beta, &start, chunk).unwrap();
            assert_eq!(y.shape(), stepped.shape());
            let (dy, ds) = (max_diff(&y, &stepped), max_diff(&end, &state));
            assert!(
                dy < 1e-5 && ds < 1e-5,
                "chunk {chunk}: outputs differ by {dy}, states by {ds}"
            );
        }
    }

    /// Reordering Qwen3-Next's grouped projection gives, per key head, the q, k, v and z
    /// slices HF's `fix_query_key_value_ordering` cuts out of the grouped output.
    #[test]
    fn grouped_projections_are_reordered_as_hf_splits_them() {
        use crate::fixtures::RandomWeights;
        let spec = DeltaNetSpec {
            hidden: 8,
            key_heads: 2,
            value_heads: 4,
            key_dim: 3,
            value_dim: 2,
            conv_kernel: 4,
            norm_eps: 1e-6,
            projections: ProjectionLayout::GroupedByKeyHead,
        };
        let mut w = RandomWeights::new(1).unwrap();
        let [qkv, z, b, a] = grouped_projections(&mut w, "p", &spec).unwrap();
        let x = normal(&[1, 1, 8], 9);
        let grouped = Linear::load(&mut w, "p.in_proj_qkvz", 8, 2 * (6 + 8), false)
            .unwrap()
            .forward(&x)
            .unwrap();
        let ba = Linear::load(&mut w, "p.in_proj_ba", 8, 2 * 4, false)
            .unwrap()
            .forward(&x)
            .unwrap();
        // Per key head: q(3) k(3) v(2·2) z(2·2); b(2) a(2).
        let g = grouped.reshape(&[2, 14]).unwrap();
        let cut = |a: &Array, from: i32, to: i32| {
            slice_axis(a, 1, from, to).unwrap().reshape(&[-1]).unwrap()
        };
        let expected_qkv = concatenate(&[cut(&g, 0, 3), cut(&g, 3, 6), cut(&g, 6, 10)], 0).unwrap();
        let bag = ba.reshape(&[2, 4]).unwrap();
        for (name, got, want) in [
            ("qkv", qkv.forward(&x).unwrap(), expected_qkv),
            ("z", z.forward(&x).unwrap(), cut(&g, 10, 14)),
            ("b", b.forward(&x).unwrap(), cut(&bag, 0, 2)),
            ("a", a.forward(&x).unwrap(), cut(&bag, 2, 4)),
        ] {
            let got = got.reshape(&[-1]).unwrap();
            assert!(got.eq_values(&want).unwrap(), "{name}");
        }
    }
}

/// What keeping a state per position costs against snapshot-and-replay, on the CPU, for
/// one layer of the Qwen3.5-4B shape (docs/hybrid-cache.md records a run):
/// `cargo test -p dspec-adapters --lib gated_delta::cost -- --ignored --nocapture`.
#[cfg(test)]
mod cost {
    use std::time::Instant;

    use super::*;
    use crate::fixtures::RandomWeights;

    fn median(mut times: Vec<f64>) -> f64 {
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    }

    #[test]
    #[ignore = "a measurement, not a check"]
    fn keeping_states_against_replaying_them() {
        let spec = DeltaNetSpec {
            hidden: 2560,
            key_heads: 16,
            value_heads: 32,
            key_dim: 128,
            value_dim: 128,
            conv_kernel: 4,
            norm_eps: 1e-6,
            projections: ProjectionLayout::Separate,
        };
        let per_layer = spec.state_bytes(2);
        eprintln!(
            "state per position and layer: {per_layer} bytes (bf16 window); 24 layers: {:.1} MiB",
            24.0 * per_layer as f64 / (1 << 20) as f64
        );
        let mut w = RandomWeights::new(1).unwrap();
        let (conv, _) =
            read_conv_weight(&mut w, "l.conv1d.weight", spec.conv_channels(), 4).unwrap();
        let layer = GatedDeltaNet::load(&mut w, "l", spec, &conv).unwrap();
        let x = |len: i32, seed: u64| {
            mlx_rs::random::normal::<f32>(
                &[1, len, 2560],
                None,
                None,
                Some(&mlx_rs::random::key(seed).unwrap()),
            )
            .unwrap()
        };
        let runs = 15;
        for verify in [2, 4, 6, 9] {
            let mut report = Vec::new();
            for window in [0usize, 8] {
                let mut cache = RecurrentCache::new(window);
                let out = layer.forward(&x(64, 1), &mut cache).unwrap();
                mlx_rs::transforms::eval(std::iter::once(&out).chain(cache.state())).unwrap();
                let mut times = Vec::new();
                for r in 0..runs {
                    let input = x(verify, 10 + r);
                    input.eval().unwrap();
                    let t = Instant::now();
                    let out = layer.forward(&input, &mut cache).unwrap();
                    mlx_rs::transforms::eval(std::iter::once(&out).chain(cache.state())).unwrap();
                    times.push(t.elapsed().as_secs_f64() * 1e3);
                    if window > 0 {
                        cache.trim(verify as usize / 2).unwrap();
                    }
                }
                report.push(median(times));
            }
            // Replay: from a snapshot, the steps of the kept positions (half the verify).
            let state =
                mlx_rs::random::normal::<f32>(&[1, 32, 128, 128], None, None, None).unwrap();
            let pos =
                |d: i32| mlx_rs::random::normal::<f32>(&[1, 1, 32, d], None, None, None).unwrap();
            let (q, k, v) = (pos(128), pos(128), pos(128));
            let (g, beta) = (
                mlx_rs::random::uniform::<_, f32>(-0.5, 0.0, &[1, 1, 32], None).unwrap(),
                mlx_rs::random::uniform::<_, f32>(0.0, 1.0, &[1, 1, 32], None).unwrap(),
            );
            mlx_rs::transforms::eval([&state, &q, &k, &v, &g, &beta]).unwrap();
            let mut times = Vec::new();
            for _ in 0..runs {
                let t = Instant::now();
                let mut s = state.clone();
                for _ in 0..verify / 2 {
                    s = step(&s, &q, &k, &v, &g, &beta).unwrap().1;
                }
                s.eval().unwrap();
                times.push(t.elapsed().as_secs_f64() * 1e3);
            }
            eprintln!(
                "verify of {verify}: forward {:.2} ms keeping no states, {:.2} ms keeping them; \
                 replaying {} steps {:.2} ms",
                report[0],
                report[1],
                verify / 2,
                median(times)
            );
        }
    }
}
