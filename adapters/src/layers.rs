//! Building blocks shared by every family: linear and embedding layers (dense or
//! MLX-quantized), RMSNorm, rotary embeddings with the HF scaling variants, gated MLPs.

mod lora_delta;

use std::cell::{Ref, RefCell};
use std::sync::OnceLock;

use mlx_rs::error::Exception;
use mlx_rs::ops::{broadcast_to, concatenate, dequantize, matmul, quantize, quantized_matmul};
use mlx_rs::transforms::compile::compile;
use mlx_rs::{fast, nn, Array};

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::{LoraUpdate, Part, Quantization, WeightSource};
use dspec_runtime::host_transpose::stacked_transposed_on_host;
use dspec_runtime::slicing::slice_axis;
use dspec_runtime::Backend;

use lora_delta::{merged_weight, LoraDelta};

use crate::tensor_parallel::TensorParallel;

/// Quantized weight parts, as MLX's affine quantization stores them.
struct Quantized {
    weight: Array,
    scales: Array,
    biases: Array,
    group_size: i32,
    bits: i32,
}

impl Quantized {
    /// `x Wᵀ` with the packed weight (linear layers and tied heads alike).
    fn matmul_t(&self, x: &Array) -> Result<Array> {
        Ok(quantized_matmul(
            x,
            &self.weight,
            &self.scales,
            &self.biases,
            true,
            self.group_size,
            self.bits,
        )?)
    }

    /// Dequantizes, merges a LoRA update and quantizes again with the same bits and
    /// group size (as mlx-lm's fuse does; the result carries one more rounding).
    fn merged(&self, update: &LoraUpdate) -> Result<Quantized> {
        let dense = dequantize(
            &self.weight,
            &self.scales,
            &self.biases,
            self.group_size,
            self.bits,
        )?;
        let (weight, scales, biases) =
            quantize(merged_weight(&dense, update)?, self.group_size, self.bits)?;
        Ok(Quantized {
            weight,
            scales,
            biases,
            group_size: self.group_size,
            bits: self.bits,
        })
    }
}

/// Finds `prefix.{weight,scales,biases}` of a quantized layer and infers bits and group
/// size from their shapes (a packed u32 row holds `32 / bits` values; one scale per group).
fn load_quantized(
    w: &mut dyn WeightSource,
    prefix: &str,
    rows: i32,
    cols: i32,
) -> Result<Quantized> {
    load_quantized_part(w, prefix, rows, cols, None)
}

/// [`load_quantized`] of a rank's `part` (`rows` and `cols` are the part's): packed
/// rows, scales and biases are cut alike, along the outputs or, by whole quantization
/// groups, along the inputs.
fn load_quantized_part(
    w: &mut dyn WeightSource,
    prefix: &str,
    rows: i32,
    cols: i32,
    part: Option<Part>,
) -> Result<Quantized> {
    let mut fetch = |what: &str| -> Result<Array> {
        let name = format!("{prefix}.{what}");
        match part {
            Some(part) => w.raw_part(&name, part),
            None => w.raw(&name),
        }
    };
    let weight = fetch("weight")?;
    let scales = fetch("scales")?;
    let biases = fetch("biases")?;
    let (ws, ss) = (weight.shape().to_vec(), scales.shape().to_vec());
    let bad = |expected: Vec<i32>, actual: Vec<i32>, part: &str| ModelError::ShapeMismatch {
        name: format!("{prefix}.{part}"),
        file: "(quantized checkpoint)".into(),
        expected,
        actual,
    };
    if ws.len() != 2
        || ws[0] != rows
        || ss.len() != 2
        || ss[0] != rows
        || ss[1] == 0
        || biases.shape() != ss
    {
        return Err(bad(vec![rows, -1], ws, "weight/scales/biases"));
    }
    let group_size = cols / ss[1];
    let bits = ws[1] * 32 / cols;
    if group_size * ss[1] != cols
        || bits * cols != ws[1] * 32
        || ![2, 3, 4, 5, 6, 8].contains(&bits)
    {
        return Err(bad(vec![rows, cols * 4 / 32], ws, "weight"));
    }
    let cast = |a: Array| -> Result<Array> {
        match w.options().dtype {
            Some(d) if d != a.dtype() => Ok(a.as_dtype(d)?),
            _ => Ok(a),
        }
    };
    let scales = cast(scales)?;
    let biases = cast(biases)?;
    Ok(Quantized {
        weight,
        scales,
        biases,
        group_size,
        bits,
    })
}

/// Quantizes a dense `[rows, cols]` weight when the user asked for it. Widths the
/// requested group size does not divide fall back to groups of 32; layers no group
/// size fits stay dense.
fn maybe_quantize(
    weight: Array,
    quantize_to: Option<Quantization>,
) -> Result<std::result::Result<Quantized, Array>> {
    let cols = weight.shape()[1];
    let group = quantize_to.and_then(|q| {
        [q.group_size, 32]
            .into_iter()
            .find(|g| cols % g == 0)
            .map(|g| (q.bits, g))
    });
    match group {
        Some((bits, group_size)) => {
            let (w, scales, biases) = quantize(&weight, group_size, bits)?;
            // Quantized while loading, as the weights are read: left lazy, the whole model
            // would be quantized inside its first forward (a drafter's first round), with
            // the full-precision weights held until then.
            mlx_rs::transforms::eval([&w, &scales, &biases])?;
            Ok(Ok(Quantized {
                weight: w,
                scales,
                biases,
                group_size,
                bits,
            }))
        }
        None => Ok(Err(weight)),
    }
}

enum LinearWeight {
    Dense(DenseProduct),
    Quantized(Quantized),
}

/// Whether `x` is in the row layout: `[R, 1, ..]` with R > 1, i.e. R consecutive
/// positions of one sequence laid out as R one-token batches. Models run it for short
/// continuations (speculative verify) so that each position is computed by exactly the
/// kernels a one-token decode step uses: on CUDA a matrix-vector product and a
/// matrix-matrix product round bf16 differently, and greedy speculative output would
/// drift from plain decoding at near-ties.
pub fn is_row_layout(x: &Array) -> bool {
    let shape = x.shape();
    shape.len() == 3 && shape[0] > 1 && shape[1] == 1
}

/// `x · wᵀ` for a dense `[out, in]` weight, read through its `[in, out]` view (a free
/// transpose) so a product is a plain matmul.
///
/// On the CPU, where the BLAS kernels read `[in, out]` faster, the view is replaced by an
/// `[in, out]` copy at the first product (see [`Layout`]). At the first product, not at
/// load: projections fused at load (q/k/v, gate/up) are copied once, from their parts
/// into the fused layout, and embedding tables that never serve as a head are never
/// copied.
///
/// The row layout (R positions as `[R, 1, in]`, the exact verify) must compute each
/// position exactly as a one-token step would: MLX rounds a matrix-matrix product
/// differently from a matrix-vector one. It issues R batched vector-matrix products over
/// the weight broadcast to `[R, in, out]`, with the rows laid out by [`rows_apart`]. The
/// broadcast is made once per R and kept: evaluated, it is a leaf of later graphs
/// instead of a node queued again in every layer of every verify.
struct DenseProduct {
    weight_t: RefCell<Array>,
    layout: Layout,
    /// The checkpoint's `[out, in]` blocks (one, or the parts of a fused layer), while
    /// they are still to be copied into `[in, out]`; empty once copied or if no copy is
    /// to be made.
    to_copy: RefCell<Vec<Array>>,
    row_weights: RefCell<Vec<(i32, Array)>>,
    /// Fewest rows each product is computed with, where fewer would go through another
    /// BLAS kernel than a verify's rows do (see [`rows_for_one_kernel`]).
    min_rows: Option<i32>,
    /// The `[out, in]` weight (a view of `weight_t`'s buffer) where the model runs short
    /// continuations through dspec's CUDA kernels ([`crate::cuda::product`]).
    for_kernels: Option<Array>,
}

impl DenseProduct {
    fn new(weight: Array) -> Self {
        let layout = Layout::for_weight(&weight);
        Self::laid_out(weight, layout)
    }

    fn laid_out(weight: Array, layout: Layout) -> Self {
        Self::from_blocks(weight.clone(), vec![weight], layout)
    }

    /// The `[out, in]` blocks stacked along `out`, as one product. When a copy is to be
    /// made, it is made from the blocks themselves, so the stacked rows are never built.
    fn stacked(blocks: Vec<Array>, layout: Layout) -> Result<Self> {
        Ok(Self::from_blocks(concatenate(&blocks, 0)?, blocks, layout))
    }

    /// `weight` (`[out, in]`), made of `blocks` stacked along `out`.
    fn from_blocks(weight: Array, blocks: Vec<Array>, layout: Layout) -> Self {
        let to_copy = match layout {
            Layout::InputsByOutputs => blocks,
            Layout::Checkpoint => Vec::new(),
        };
        let s = weight.shape();
        let min_rows = products_on_blas(&weight)
            .then(|| rows_for_one_kernel(s[0] as i64, s[1] as i64))
            .flatten();
        Self {
            weight_t: RefCell::new(weight.t()),
            layout,
            to_copy: RefCell::new(to_copy),
            row_weights: RefCell::new(Vec::new()),
            min_rows,
            for_kernels: None,
        }
    }

    /// The view is evaluated here, on the loading thread: a model may move to a thread of
    /// its own (a draft model does), and MLX evaluates an array only on the thread whose
    /// stream made it.
    fn use_short_kernels(&mut self, on: bool) -> Result<()> {
        self.for_kernels = (on && crate::cuda::available(self.dtype())).then(|| self.weight());
        if let Some(weight) = &self.for_kernels {
            weight.eval()?;
        }
        Ok(())
    }

    fn copy_pending(&self) -> bool {
        !self.to_copy.borrow().is_empty()
    }

    fn dtype(&self) -> mlx_rs::Dtype {
        self.weight_t.borrow().dtype()
    }

    /// The `[out, in]` weight (a view when it is held as an `[in, out]` copy).
    fn weight(&self) -> Array {
        self.weight_t.borrow().t()
    }

    /// The `[in, out]` operand of products, borrowed rather than cloned: products run
    /// per layer per token.
    fn weight_t(&self) -> Result<Ref<'_, Array>> {
        if self.copy_pending() {
            let copy = stacked_transposed_on_host(&self.to_copy.borrow())?;
            *self.weight_t.borrow_mut() = copy;
            self.to_copy.borrow_mut().clear();
        }
        Ok(self.weight_t.borrow())
    }

    fn forward(&self, x: &Array) -> Result<Array> {
        if !is_row_layout(x) {
            let weight_t = self.weight_t()?;
            let inputs = weight_t.shape()[0];
            let rows = (x.size() as i32) / inputs;
            if let Some(weight) = &self.for_kernels {
                if crate::cuda::product::serves(x, rows, weight) {
                    return crate::cuda::product::product(x, weight);
                }
            }
            return match self.min_rows {
                Some(min) if rows < min => padded_product(x, &weight_t, rows, min),
                _ => Ok(matmul(x, &*weight_t)?),
            };
        }
        let rows = x.shape()[0];
        if let Some(min) = self.min_rows {
            // Each row padded as a one-row product is, so that it meets the same kernel.
            let padded = concatenate(&vec![x.clone(); min as usize], 1)?;
            let y = matmul(&padded, &self.broadcast(rows)?)?;
            return Ok(slice_axis(&y, 1, 0, 1)?);
        }
        let apart = rows_apart(x, Backend::current())?;
        Ok(matmul(&apart, &self.broadcast(rows)?)?)
    }

    /// The weight broadcast to `[rows, in, out]`.
    fn broadcast(&self, rows: i32) -> Result<Array> {
        let weight_t = self.weight_t()?;
        let mut made = self.row_weights.borrow_mut();
        if let Some((_, w)) = made.iter().find(|(r, _)| *r == rows) {
            return Ok(w.clone());
        }
        let shape = weight_t.shape();
        let w = broadcast_to(&*weight_t, &[rows, shape[0], shape[1]])?;
        made.push((rows, w.clone()));
        Ok(w)
    }
}

/// How a dense weight is held for its products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// The checkpoint's `[out, in]`, read through a transposed view.
    Checkpoint,
    /// Copied to `[in, out]` at the first product, so that products read it untransposed.
    /// The copy replaces the checkpoint's rows, so memory does not grow.
    InputsByOutputs,
}

impl Layout {
    /// On the CPU, MLX hands f32 products to BLAS `sgemm`, and which layout streams
    /// faster depends on the kernels OpenBLAS runs: some read `[in, out]` markedly faster
    /// at the row counts of decode steps and verifies, others `[out, in]`
    /// (`dspec_runtime::blas::reads_inputs_by_outputs_faster`; docs/benchmarks.md,
    /// "Weight layout on the CPU"). GPU backends, and other dtypes (MLX's own kernels),
    /// keep the checkpoint's `[out, in]`: their matrix-vector kernels (and mlx-lm's) are
    /// built for it.
    fn for_weight(weight: &Array) -> Layout {
        static KERNELS_READ_INPUTS_BY_OUTPUTS_FASTER: OnceLock<bool> = OnceLock::new();
        let faster = *KERNELS_READ_INPUTS_BY_OUTPUTS_FASTER.get_or_init(|| {
            dspec_runtime::blas::loaded_kernels()
                .is_some_and(|k| dspec_runtime::blas::reads_inputs_by_outputs_faster(&k))
        });
        match products_on_blas(weight) && faster {
            true => Layout::InputsByOutputs,
            false => Layout::Checkpoint,
        }
    }
}

/// Whether MLX computes this weight's products with BLAS: f32 on the CPU.
fn products_on_blas(weight: &Array) -> bool {
    Backend::current() == Backend::Cpu && weight.dtype() == mlx_rs::Dtype::Float32
}

/// OpenBLAS runs an f32 product of at most this many multiply-adds through a small-matrix
/// kernel on its SkylakeX-class cores (Intel Xeon Scalable, and AVX-512 AMD EPYC, which it
/// can run as Cooperlake), and that kernel rounds differently from its general one
/// (OpenBLAS 0.3.21, `kernel/x86_64/sgemm_small_kernel_permit_skylakex.c`).
const BLAS_SMALL_PRODUCT: i64 = 1_000_000;

/// Products of one weight with up to this many rows all go through one BLAS kernel
/// ([`rows_for_one_kernel`]): a decode step and a verify of up to this many positions.
const ALIKE_ROWS: i64 = 64;

/// The fewest rows a CPU f32 product with an `[out, in]` weight is computed with (zero
/// rows added and their outputs dropped), where one row would fall under
/// [`BLAS_SMALL_PRODUCT`] and [`ALIKE_ROWS`] rows would not: otherwise a one-row decode
/// step and a verify's rows would meet different kernels and could round differently,
/// and speculative greedy decoding would no longer be plain greedy decoding token for
/// token. `None` when one kernel serves every row count up to [`ALIKE_ROWS`] already
/// (weights of real models are mostly past the limit in one row; toy ones stay under it).
fn rows_for_one_kernel(outputs: i64, inputs: i64) -> Option<i32> {
    let min = BLAS_SMALL_PRODUCT / (outputs * inputs).max(1) + 1;
    (min > 1 && min <= ALIKE_ROWS).then_some(min as i32)
}

/// `x` (`[.., in]`, `rows` rows in all) times `weight_t` (`[in, out]`), computed with at
/// least `min` rows: `x`'s, then repeats of them whose outputs are dropped (each output
/// row depends on its own input row only).
fn padded_product(x: &Array, weight_t: &Array, rows: i32, min: i32) -> Result<Array> {
    let (inputs, outputs) = (weight_t.shape()[0], weight_t.shape()[1]);
    let flat = x.reshape(&[rows, inputs])?;
    let copies = (min + rows - 1) / rows;
    let y = matmul(&concatenate(&vec![flat; copies as usize], 0)?, weight_t)?;
    let mut shape = x.shape().to_vec();
    if let Some(last) = shape.last_mut() {
        *last = outputs;
    }
    Ok(slice_axis(&y, 0, 0, rows)?.reshape(&shape)?)
}

/// The rows of `x` (`[R, 1, in]`) laid out so that MLX multiplies each by itself with
/// its one-row kernel instead of folding them into one matrix-matrix product (which it
/// does when rows lie a row's width apart and are not flagged transposed):
/// - on CUDA, the view `[R, in, 1]` swapped to `[R, 1, in]` (strides `[in, 1, 1]`, the
///   same memory): MLX reads transposed one-row matrices, which its CUDA matrix-vector
///   kernel takes as they are (no fold, no copy; bitwise equal to one-row products on an
///   H100, scripts/gpu_rowwise_check.py);
/// - elsewhere, two rows apart (`x` doubled, every other row): the CPU's BLAS computes a
///   transposed one-row product differently from the one-token call.
fn rows_apart(x: &Array, backend: Backend) -> Result<Array> {
    let (rows, k) = (x.shape()[0], x.shape()[2]);
    match backend {
        Backend::Cuda => Ok(x.reshape(&[rows, k, 1])?.swap_axes(1, 2)?),
        Backend::Cpu | Backend::Metal => Ok(slice_axis(&concatenate(&[x, x], 1)?, 1, 0, 1)?),
    }
}

impl LinearWeight {
    /// The dtype activations meet this weight in.
    fn dtype(&self) -> mlx_rs::Dtype {
        match self {
            LinearWeight::Dense(d) => d.dtype(),
            LinearWeight::Quantized(q) => q.scales.dtype(),
        }
    }
}

/// `y = x Wᵀ + b`, plus a LoRA update when the weight source carries an adapter for it.
pub struct Linear {
    weight: LinearWeight,
    bias: Option<Array>,
    lora: Option<LoraDelta>,
    /// Row-parallel (a rank's share of the inputs): the partial products of every rank
    /// are summed across the group before the bias, which every rank holds whole.
    reduce: Option<TensorParallel>,
}

/// How a layer's weight is split across a tensor-parallel group.
#[derive(Clone, Copy)]
pub enum Split<'a> {
    /// Column-parallel: each rank computes its share of the outputs (q/k/v, gate/up).
    Outputs(&'a TensorParallel),
    /// Row-parallel: each rank multiplies its share of the inputs and the group sums
    /// the results (o_proj, down_proj): one all-sum per layer.
    Inputs(&'a TensorParallel),
}

impl Linear {
    /// Whether products of a few rows go through dspec's CUDA kernel ([`crate::cuda`]);
    /// off until the model turns it on.
    pub fn use_short_kernels(&mut self, on: bool) -> Result<()> {
        match &mut self.weight {
            LinearWeight::Dense(d) => d.use_short_kernels(on),
            _ => Ok(()),
        }
    }

    /// Loads `prefix.weight` (`[out, in]`), quantized or not, and `prefix.bias` when `bias`.
    /// A LoRA update the source offers for `prefix` is kept beside the weight or merged
    /// into it, as the update says.
    pub fn load(
        w: &mut dyn WeightSource,
        prefix: &str,
        in_dim: i32,
        out_dim: i32,
        bias: bool,
    ) -> Result<Self> {
        Self::load_split(w, prefix, in_dim, out_dim, bias, None)
    }

    /// [`Linear::load`] of this rank's share under `split` (`in_dim` and `out_dim` are
    /// the whole layer's); `None` loads the whole layer.
    pub fn load_split(
        w: &mut dyn WeightSource,
        prefix: &str,
        in_dim: i32,
        out_dim: i32,
        bias: bool,
        split: Option<Split>,
    ) -> Result<Self> {
        if let Some(split) = split {
            return Self::load_share(w, prefix, in_dim, out_dim, bias, split);
        }
        let update = w.lora_update(prefix, in_dim, out_dim)?;
        let to_merge = update.as_ref().filter(|u| u.switch.is_none());
        let weight = if w.contains(&format!("{prefix}.scales")) {
            let q = load_quantized(w, prefix, out_dim, in_dim)?;
            match to_merge {
                Some(u) => LinearWeight::Quantized(q.merged(u)?),
                None => LinearWeight::Quantized(q),
            }
        } else {
            let mut dense = w.tensor(&format!("{prefix}.weight"), &[out_dim, in_dim])?;
            if let Some(u) = to_merge {
                // Merged before any quantize-on-load, so the update is quantized once.
                dense = merged_weight(&dense, u)?;
            }
            match maybe_quantize(dense, w.options().quantize)? {
                Ok(q) => LinearWeight::Quantized(q),
                Err(dense) => LinearWeight::Dense(DenseProduct::new(dense)),
            }
        };
        let bias = if bias {
            Some(w.tensor(&format!("{prefix}.bias"), &[out_dim])?)
        } else {
            None
        };
        let lora = match &update {
            Some(u) => LoraDelta::new(u, weight.dtype())?,
            None => None,
        };
        Ok(Self {
            weight,
            bias,
            lora,
            reduce: None,
        })
    }

    /// This rank's share of the layer under `split`, read as a part of each tensor.
    fn load_share(
        w: &mut dyn WeightSource,
        prefix: &str,
        in_dim: i32,
        out_dim: i32,
        bias: bool,
        split: Split,
    ) -> Result<Self> {
        if w.lora_update(prefix, in_dim, out_dim)?.is_some() {
            return Err(ModelError::Unsupported(format!(
                "a LoRA adapter on `{prefix}` under tensor parallelism is not supported; \
                 run on one process to use the adapter"
            )));
        }
        let (tp, axis) = match split {
            Split::Outputs(tp) => (tp, 0),
            Split::Inputs(tp) => (tp, 1),
        };
        let part = tp.part(axis);
        let whole = [out_dim, in_dim][axis];
        let (start, end) = part.range(&format!("{prefix}.weight"), whole)?;
        let (rows, cols) = match split {
            Split::Outputs(_) => (end - start, in_dim),
            Split::Inputs(_) => (out_dim, end - start),
        };
        let weight = if w.contains(&format!("{prefix}.scales")) {
            LinearWeight::Quantized(load_quantized_part(w, prefix, rows, cols, Some(part))?)
        } else {
            let dense = w.tensor_part(&format!("{prefix}.weight"), &[out_dim, in_dim], part)?;
            // The group size the whole layer would get, so that a rank's share is
            // quantized exactly as that part of the whole layer would be.
            let quantize = w.options().quantize.and_then(|q| {
                [q.group_size, 32]
                    .into_iter()
                    .find(|g| in_dim % g == 0)
                    .map(|group_size| Quantization { group_size, ..q })
            });
            if let Some(q) = quantize.filter(|q| cols % q.group_size != 0) {
                return Err(ModelError::Unsupported(format!(
                    "--quantize: `{prefix}` would be quantized in groups of {} inputs, but a \
                     rank's share of its {in_dim} inputs is {cols}, which is no whole number \
                     of groups; run on fewer ranks or without --quantize",
                    q.group_size
                )));
            }
            match maybe_quantize(dense, quantize)? {
                Ok(q) => LinearWeight::Quantized(q),
                Err(dense) => LinearWeight::Dense(DenseProduct::new(dense)),
            }
        };
        let name = format!("{prefix}.bias");
        let (bias, reduce) = match (bias, split) {
            (true, Split::Outputs(_)) => (Some(w.tensor_part(&name, &[out_dim], part)?), None),
            (true, Split::Inputs(tp)) => (Some(w.tensor(&name, &[out_dim])?), Some(tp.clone())),
            (false, Split::Outputs(_)) => (None, None),
            (false, Split::Inputs(tp)) => (None, Some(tp.clone())),
        };
        Ok(Self {
            weight,
            bias,
            lora: None,
            reduce,
        })
    }

    /// `x`: `[B, L, in]`; in the row layout (`[R, 1, in]`, see [`is_row_layout`]) every
    /// row goes through the one-token kernel.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let y = match &self.weight {
            LinearWeight::Dense(d) => d.forward(x)?,
            LinearWeight::Quantized(q) => q.matmul_t(x)?,
        };
        let y = match &self.lora {
            Some(delta) => delta.add_to(x, y)?,
            None => y,
        };
        let y = match &self.reduce {
            Some(tp) => tp.all_sum(&y)?,
            None => y,
        };
        match &self.bias {
            Some(b) => Ok(y.add(b)?),
            None => Ok(y),
        }
    }

    pub fn quantized_bits(&self) -> Option<i32> {
        match &self.weight {
            LinearWeight::Quantized(q) => Some(q.bits),
            LinearWeight::Dense(_) => None,
        }
    }

    /// The same layer with its outputs reordered: output `i` of the result is output
    /// `rows[i]` of this one. Rows are independent (quantization groups run along the
    /// input), so quantized weights are reordered exactly. A checkpoint that stores
    /// projections grouped differently from how they are used (Qwen3-Next's per-key-head
    /// `in_proj_qkvz`) is reordered once at load instead of at every step.
    pub fn take_rows(&self, rows: &[i32], prefix: &str) -> Result<Linear> {
        if self.lora.is_some() {
            return Err(ModelError::Unsupported(format!(
                "a LoRA adapter on `{prefix}` is not supported: dspec reorders that \
                 projection's outputs at load"
            )));
        }
        let index = Array::from_slice(rows, &[rows.len() as i32]);
        let take = |a: &Array| a.take_axis(&index, 0);
        let weight = match &self.weight {
            LinearWeight::Dense(d) => LinearWeight::Dense(DenseProduct::new(take(&d.weight())?)),
            LinearWeight::Quantized(q) => LinearWeight::Quantized(Quantized {
                weight: take(&q.weight)?,
                scales: take(&q.scales)?,
                biases: take(&q.biases)?,
                group_size: q.group_size,
                bits: q.bits,
            }),
        };
        let bias = self.bias.as_ref().map(take).transpose()?;
        Ok(Linear {
            weight,
            bias,
            lora: None,
            reduce: self.reduce.clone(),
        })
    }

    /// One layer computing `parts`' outputs side by side, when all are dense with the
    /// same bias layout and no switchable LoRA update; `None` leaves them apart. Fusing projections that read the same
    /// input (q/k/v, gate/up) saves kernel launches per token, which is what decoding
    /// costs on a GPU. Each output element is the same dot product as before.
    pub fn fuse(parts: &[&Linear]) -> Result<Option<Linear>> {
        let mut biases = Vec::with_capacity(parts.len());
        for part in parts {
            // A switchable LoRA update belongs to one projection, and a row-parallel
            // layer's sum to its own outputs: keep those apart.
            if part.lora.is_some() || part.reduce.is_some() {
                return Ok(None);
            }
            biases.extend(part.bias.clone());
        }
        if parts.is_empty() || (!biases.is_empty() && biases.len() != parts.len()) {
            return Ok(None);
        }
        let Some(weight) = LinearWeight::stacked(parts.iter().map(|p| &p.weight))? else {
            return Ok(None);
        };
        let bias = match biases.is_empty() {
            true => None,
            false => Some(concatenate(&biases, 0)?),
        };
        Ok(Some(Linear {
            weight,
            bias,
            lora: None,
            reduce: None,
        }))
    }
}

impl LinearWeight {
    /// The weights' `[out, in]` blocks stacked along `out`, when all are dense, or all
    /// quantized alike (same bits and group size: quantization groups run along `in`,
    /// so stacking the packed rows, scales and biases quantizes nothing again);
    /// `None` for a mix.
    fn stacked<'a>(
        weights: impl Iterator<Item = &'a LinearWeight>,
    ) -> Result<Option<LinearWeight>> {
        let weights: Vec<&LinearWeight> = weights.collect();
        // One array of each weight, or `None` where one has none.
        let parts = |pick: &dyn Fn(&LinearWeight) -> Option<Array>| -> Option<Vec<Array>> {
            weights.iter().map(|w| pick(w)).collect()
        };
        let stack = |pick: &dyn Fn(&LinearWeight) -> Option<Array>| -> Result<Option<Array>> {
            Ok(parts(pick).map(|p| concatenate(&p, 0)).transpose()?)
        };
        match weights.first() {
            // `[out, in]` blocks stacked, like every dense weight, so products see the
            // same layout (and MLX's CUDA backend the same kernels).
            // The parts' layout: a fused product is held as its parts would be.
            Some(LinearWeight::Dense(first)) => {
                let layout = first.layout;
                let blocks = parts(&|w| match w {
                    LinearWeight::Dense(d) => Some(d.weight()),
                    LinearWeight::Quantized(_) => None,
                });
                Ok(blocks
                    .map(|blocks| DenseProduct::stacked(blocks, layout))
                    .transpose()?
                    .map(LinearWeight::Dense))
            }
            Some(LinearWeight::Quantized(first)) => {
                let (bits, group_size) = (first.bits, first.group_size);
                let part = |w: &LinearWeight, which: fn(&Quantized) -> &Array| match w {
                    LinearWeight::Quantized(q) if q.bits == bits && q.group_size == group_size => {
                        Some(which(q).clone())
                    }
                    _ => None,
                };
                let (Some(weight), Some(scales), Some(biases)) = (
                    stack(&|w| part(w, |q| &q.weight))?,
                    stack(&|w| part(w, |q| &q.scales))?,
                    stack(&|w| part(w, |q| &q.biases))?,
                ) else {
                    return Ok(None);
                };
                Ok(Some(LinearWeight::Quantized(Quantized {
                    weight,
                    scales,
                    biases,
                    group_size,
                    bits,
                })))
            }
            None => Ok(None),
        }
    }
}

/// Splits the last axis of `y` into consecutive pieces of the given sizes (views).
pub fn split_last(y: &Array, sizes: &[i32]) -> Result<Vec<Array>> {
    let axis = y.ndim() - 1;
    let mut start = 0;
    let mut out = Vec::with_capacity(sizes.len());
    for &size in sizes {
        out.push(slice_axis(y, axis, start, start + size)?);
        start += size;
    }
    Ok(out)
}

/// Token embedding table, usable as the output head when embeddings are tied.
pub struct Embedding {
    table: Table,
}

enum Table {
    /// The `[vocab, hidden]` table: rows to gather, and a tied head's weight.
    Dense(DenseProduct),
    Quantized(Quantized),
}

impl Embedding {
    /// Whether a tied head's products of a few rows go through dspec's CUDA kernel.
    pub fn use_short_kernels(&mut self, on: bool) -> Result<()> {
        match &mut self.table {
            Table::Dense(d) => d.use_short_kernels(on),
            _ => Ok(()),
        }
    }

    pub fn load(w: &mut dyn WeightSource, prefix: &str, vocab: i32, hidden: i32) -> Result<Self> {
        if w.contains(&format!("{prefix}.scales")) {
            return Ok(Embedding {
                table: Table::Quantized(load_quantized(w, prefix, vocab, hidden)?),
            });
        }
        let dense = w.tensor(&format!("{prefix}.weight"), &[vocab, hidden])?;
        let table = match maybe_quantize(dense, w.options().quantize)? {
            Ok(q) => Table::Quantized(q),
            Err(table) => Table::Dense(DenseProduct::new(table)),
        };
        Ok(Embedding { table })
    }

    /// `[..] ids -> [.., hidden]`.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        match &self.table {
            Table::Dense(d) => Ok(d.weight().take_axis(ids, 0)?),
            Table::Quantized(q) => {
                let rows = |a: &Array| a.take_axis(ids, 0);
                Ok(dequantize(
                    rows(&q.weight)?,
                    rows(&q.scales)?,
                    &rows(&q.biases)?,
                    q.group_size,
                    q.bits,
                )?)
            }
        }
    }

    /// `x Eᵀ`: logits through the embedding table (tied heads).
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        match &self.table {
            Table::Dense(d) => d.forward(x),
            Table::Quantized(q) => q.matmul_t(x),
        }
    }

    pub fn dtype(&self) -> mlx_rs::Dtype {
        match &self.table {
            Table::Dense(d) => d.dtype(),
            Table::Quantized(q) => q.scales.dtype(),
        }
    }
}

/// How a family stores its RMSNorm scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormWeight {
    /// `x̂ · w` (llama, qwen, mistral).
    Plain,
    /// `x̂ · (1 + w)` (gemma family); folded into the weight once at load.
    OffsetByOne,
}

pub struct RmsNorm {
    weight: Array,
    eps: f32,
}

impl RmsNorm {
    pub fn load(
        w: &mut dyn WeightSource,
        name: &str,
        dim: i32,
        eps: f32,
        style: NormWeight,
    ) -> Result<Self> {
        let weight = w.tensor(name, &[dim])?;
        let weight = match style {
            NormWeight::Plain => weight,
            NormWeight::OffsetByOne => {
                weight.add(Array::from_f32(1.0).as_dtype(weight.dtype())?)?
            }
        };
        Ok(Self { weight, eps })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        Ok(fast::rms_norm(x, Some(&self.weight), self.eps)?)
    }
}

/// RMS normalisation with no learned scale (gemma4's `v_norm`).
pub fn rms_norm_unscaled(x: &Array, eps: f32) -> Result<Array> {
    Ok(fast::rms_norm(x, None, eps)?)
}

/// Rotary position embedding of one attention layer (HF's non-interleaved layout).
#[derive(Clone)]
pub struct Rope {
    dims: i32,
    base: Option<f32>,
    scale: f32,
    /// Per-pair periods when a scaling scheme reshapes the spectrum (llama3, yarn).
    freqs: Option<Array>,
    /// Yarn's attention temperature, applied to the rotated part of q and k.
    mscale: f32,
}

impl Rope {
    /// Builds the rotary embedding from `rope_theta` and an HF `rope_scaling` object
    /// (`null`, or `{"rope_type"|"type": "default"|"linear"|"llama3"|"yarn"|"proportional", ...}`).
    pub fn from_config(
        dims: i32,
        base: f32,
        scaling: &serde_json::Value,
        config_path: &std::path::Path,
    ) -> Result<Self> {
        let plain = Rope {
            dims,
            base: Some(base),
            scale: 1.0,
            freqs: None,
            mscale: 1.0,
        };
        if scaling.is_null() {
            return Ok(plain);
        }
        let kind = scaling["rope_type"]
            .as_str()
            .or(scaling["type"].as_str())
            .unwrap_or("default");
        let num = |key: &str| scaling[key].as_f64();
        let need = |key: &str| {
            num(key).ok_or_else(|| {
                ModelError::config(config_path, format!("rope_scaling ({kind}) needs `{key}`"))
            })
        };
        let half = (dims / 2) as usize;
        // Period of pair i in the unscaled embedding: base^(2i/dims) (MLX's `freqs` are periods).
        let periods: Vec<f64> = (0..half)
            .map(|i| (base as f64).powf(2.0 * i as f64 / dims as f64))
            .collect();
        match kind {
            "default" => Ok(plain),
            "proportional" => {
                // Gemma 4 full-attention layers: the first `partial_rotary_factor` share
                // of each half-head rotates, with frequencies spaced over the *whole* head
                // (exponent 2i/dims, not 2i/rotated); the other pairs keep period ∞, i.e.
                // stay unrotated. HF: `_compute_proportional_rope_parameters`.
                let partial = num("partial_rotary_factor").unwrap_or(1.0);
                let factor = num("factor").unwrap_or(1.0);
                let angles = ((partial * dims as f64) / 2.0).floor().max(0.0) as usize;
                let adjusted: Vec<f32> = periods
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| if i < angles { (p * factor) as f32 } else { f32::INFINITY })
                    .collect();
                Ok(Rope { base: None, freqs: Some(Array::from_slice(&adjusted, &[half as i32])), ..plain })
            }
            "linear" => Ok(Rope { scale: 1.0 / need("factor")? as f32, ..plain }),
            "llama3" => {
                let factor = need("factor")?;
                let low = num("low_freq_factor").unwrap_or(1.0);
                let high = num("high_freq_factor").unwrap_or(4.0);
                let original = need("original_max_position_embeddings")?;
                let low_wavelen = original / low;
                let high_wavelen = original / high;
                let adjusted: Vec<f32> = periods
                    .iter()
                    .map(|&p| {
                        let wavelen = 2.0 * std::f64::consts::PI * p;
                        if wavelen < high_wavelen {
                            p
                        } else if wavelen > low_wavelen {
                            p * factor
                        } else {
                            // Interpolate the inverse frequency between scaled and unscaled.
                            let smooth = (original / wavelen - low) / (high - low);
                            1.0 / ((1.0 - smooth) / (factor * p) + smooth / p)
                        }
                    })
                    .map(|p| p as f32)
                    .collect();
                Ok(Rope { base: None, freqs: Some(Array::from_slice(&adjusted, &[half as i32])), ..plain })
            }
            "yarn" => {
                let factor = need("factor")?;
                let original = num("original_max_position_embeddings").unwrap_or(4096.0);
                let beta_fast = num("beta_fast").unwrap_or(32.0);
                let beta_slow = num("beta_slow").unwrap_or(1.0);
                let get_mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
                let mscale = match num("attention_factor") {
                    Some(f) => f,
                    None => match (num("mscale"), num("mscale_all_dim")) {
                        (Some(m), Some(all)) => get_mscale(factor, m) / get_mscale(factor, all),
                        (Some(m), None) => get_mscale(factor, m),
                        _ => get_mscale(factor, 1.0),
                    },
                };
                // Pair index at which a given number of rotations fits the original context.
                let correction = |rotations: f64| {
                    dims as f64 * (original / (rotations * 2.0 * std::f64::consts::PI)).ln() / (2.0 * (base as f64).ln())
                };
                let low = correction(beta_fast).floor().max(0.0);
                let high = correction(beta_slow).ceil().min(dims as f64 - 1.0);
                let span = if high == low { 0.001 } else { high - low };
                let adjusted: Vec<f32> = periods
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| {
                        // 1 → keep the original frequency (extrapolate), 0 → interpolate.
                        let extrapolate = 1.0 - ((i as f64 - low) / span).clamp(0.0, 1.0);
                        let inv = (1.0 / p) * extrapolate + (1.0 / (p * factor)) * (1.0 - extrapolate);
                        (1.0 / inv) as f32
                    })
                    .collect();
                Ok(Rope {
                    base: None,
                    freqs: Some(Array::from_slice(&adjusted, &[half as i32])),
                    mscale: mscale as f32,
                    ..plain
                })
            }
            other => Err(ModelError::config(
                config_path,
                format!("rope_scaling type `{other}` is not supported (supported: default, linear, llama3, yarn, proportional)"),
            )),
        }
    }

    /// Rotates `x` (`[B, H, L, D]`) for positions `offset..offset+L`.
    pub fn forward(&self, x: &Array, offset: i32) -> Result<Array> {
        let x = if self.mscale != 1.0 {
            x.multiply(Array::from_f32(self.mscale).as_dtype(x.dtype())?)?
        } else {
            x.clone()
        };
        Ok(fast::rope(
            &x,
            self.dims,
            false,
            self.base,
            self.scale,
            offset,
            self.freqs.as_ref(),
        )?)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// GELU with the tanh approximation (HF `gelu_pytorch_tanh`).
    GeluTanh,
}

impl Activation {
    pub fn from_name(name: &str, config_path: &std::path::Path) -> Result<Self> {
        match name {
            "silu" | "swish" => Ok(Activation::Silu),
            "gelu_pytorch_tanh" | "gelu_new" | "gelu_fast" | "gelu" => Ok(Activation::GeluTanh),
            other => Err(ModelError::config(
                config_path,
                format!(
                    "activation `{other}` is not supported (supported: silu, gelu_pytorch_tanh)"
                ),
            )),
        }
    }

    /// `act(gate) · up` as one compiled (fused) kernel. The compiled function is built
    /// once per thread and kept: mlx-rs gives every `compile` call a new function id,
    /// so compiling per call would trace and fuse the graph again on every layer of every
    /// step: host work on the path of every token.
    fn gated(self, gate: &Array, up: &Array) -> Result<Array> {
        type Gated =
            Box<dyn for<'a> FnMut((&'a Array, &'a Array)) -> std::result::Result<Array, Exception>>;
        fn silu((g, u): (&Array, &Array)) -> std::result::Result<Array, Exception> {
            g.multiply(mlx_rs::ops::sigmoid(g)?)?.multiply(u)
        }
        // mlx-rs's tanh GELU multiplies by f32 constants, which promote 16-bit inputs to
        // f32; the cast keeps the activations (and every later product) in the model's
        // dtype, as PyTorch's GELU returns its input's dtype.
        fn gelu((g, u): (&Array, &Array)) -> std::result::Result<Array, Exception> {
            nn::gelu_approximate(g)?.as_dtype(g.dtype())?.multiply(u)
        }
        thread_local! {
            static SILU: RefCell<Gated> = RefCell::new(Box::new(compile(silu, true)));
            static GELU: RefCell<Gated> = RefCell::new(Box::new(compile(gelu, true)));
        }
        let compiled = match self {
            Activation::Silu => &SILU,
            Activation::GeluTanh => &GELU,
        };
        Ok(compiled.with(|f| (f.borrow_mut())((gate, up)))?)
    }
}

/// `down(act(gate(x)) · up(x))`.
pub struct GatedMlp {
    /// Gate and up, fused into one product (outputs side by side) when both are dense or
    /// quantized alike.
    gate_up: GateUp,
    down: Linear,
    act: Activation,
}

enum GateUp {
    Separate { gate: Linear, up: Linear },
    Fused { both: Linear, inner: i32 },
}

impl GatedMlp {
    /// Whether products of a few rows go through dspec's CUDA kernel ([`crate::cuda`]);
    /// off until the model turns it on.
    pub fn use_short_kernels(&mut self, on: bool) -> Result<()> {
        match &mut self.gate_up {
            GateUp::Separate { gate, up } => {
                gate.use_short_kernels(on)?;
                up.use_short_kernels(on)?;
            }
            GateUp::Fused { both, .. } => both.use_short_kernels(on)?,
        }
        self.down.use_short_kernels(on)
    }

    pub fn load(
        w: &mut dyn WeightSource,
        prefix: &str,
        hidden: i32,
        inner: i32,
        bias: bool,
        act: Activation,
    ) -> Result<Self> {
        Self::load_parallel(w, prefix, hidden, inner, bias, act, None)
    }

    /// [`GatedMlp::load`] of this rank's share of the hidden units under `tp`: gate and
    /// up column-parallel, down row-parallel (one all-sum).
    pub fn load_parallel(
        w: &mut dyn WeightSource,
        prefix: &str,
        hidden: i32,
        inner: i32,
        bias: bool,
        act: Activation,
        tp: Option<&TensorParallel>,
    ) -> Result<Self> {
        let (outputs, inputs) = (tp.map(Split::Outputs), tp.map(Split::Inputs));
        let load = |w: &mut dyn WeightSource, name: &str, i: i32, o: i32, split| {
            Linear::load_split(w, &format!("{prefix}.{name}"), i, o, bias, split)
        };
        let gate = load(w, "gate_proj", hidden, inner, outputs)?;
        let up = load(w, "up_proj", hidden, inner, outputs)?;
        let local = inner / tp.map_or(1, TensorParallel::size);
        let gate_up = match Linear::fuse(&[&gate, &up])? {
            Some(both) => GateUp::Fused { both, inner: local },
            None => GateUp::Separate { gate, up },
        };
        Ok(Self {
            gate_up,
            down: load(w, "down_proj", inner, hidden, inputs)?,
            act,
        })
    }

    pub fn forward(&self, x: &Array) -> Result<Array> {
        let (gate, up) = match &self.gate_up {
            GateUp::Separate { gate, up } => (gate.forward(x)?, up.forward(x)?),
            GateUp::Fused { both, inner } => {
                let mut parts = split_last(&both.forward(x)?, &[*inner, *inner])?.into_iter();
                let (Some(gate), Some(up)) = (parts.next(), parts.next()) else {
                    unreachable!("two sizes give two parts");
                };
                (gate, up)
            }
        };
        self.down.forward(&self.act.gated(&gate, &up)?)
    }
}

/// `tanh(x / cap) · cap`: bounds logits smoothly (gemma2 attention and output).
pub fn softcap(x: &Array, cap: f32) -> Result<Array> {
    let c = Array::from_f32(cap).as_dtype(x.dtype())?;
    Ok(mlx_rs::ops::tanh(x.divide(&c)?)?.multiply(&c)?)
}

/// Positions `[start, end)` of the sequence axis (axis 2 of `[B, H, L, D]`).
pub fn seq_slice(x: &Array, start: i32, end: i32) -> Result<Array> {
    Ok(slice_axis(x, 2, start, end)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::rows_summed_alike_here;
    use mlx_rs::ops::indexing::TryIndexOp;
    use mlx_rs::random;

    /// The gated activations keep 16-bit activations in their dtype (a promotion to f32
    /// would carry f32 through every later layer and product), and compute tanh GELU as
    /// its formula does, within bf16 rounding.
    #[test]
    fn gated_activations_keep_the_activations_dtype() {
        use mlx_rs::Dtype;
        let gate = [-3.0f32, -0.7, 0.0, 0.4, 1.3, 2.9];
        let up = [0.5f32, -1.5, 2.0, 1.0, -0.25, 3.0];
        let g = Array::from_slice(&gate, &[1, 6])
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        let u = Array::from_slice(&up, &[1, 6])
            .as_dtype(Dtype::Bfloat16)
            .unwrap();
        for act in [Activation::Silu, Activation::GeluTanh] {
            let y = act.gated(&g, &u).unwrap();
            assert_eq!(y.dtype(), Dtype::Bfloat16, "{act:?}");
        }
        let y = Activation::GeluTanh
            .gated(&g, &u)
            .unwrap()
            .as_dtype(Dtype::Float32)
            .unwrap();
        for (i, (&x, &v)) in gate.iter().zip(&up).enumerate() {
            let inner = (2.0f32 / std::f32::consts::PI).sqrt() * (x + 0.044715 * x * x * x);
            let want = 0.5 * x * (1.0 + inner.tanh()) * v;
            let got = y.as_slice::<f32>()[i];
            assert!(
                (got - want).abs() <= 0.02 * want.abs().max(0.05),
                "x {x}: {got} vs {want}"
            );
        }
    }

    /// Quantized projections fuse like dense ones: the fused product's outputs are the
    /// separate products' side by side; a mix of dense and quantized, or of bit widths,
    /// stays apart.
    #[test]
    fn quantized_projections_fuse_exactly() {
        let normal = |shape: &[i32], seed: u64| {
            random::normal::<f32>(shape, None, None, Some(&random::key(seed).unwrap())).unwrap()
        };
        let linear = |seed: u64, out: i32, bits: Option<i32>| {
            let dense = normal(&[out, 64], seed);
            let weight = match bits {
                Some(bits) => {
                    let q = Quantization {
                        bits,
                        group_size: 32,
                    };
                    match maybe_quantize(dense, Some(q)).unwrap() {
                        Ok(q) => LinearWeight::Quantized(q),
                        Err(_) => unreachable!("64 columns take group size 32"),
                    }
                }
                None => LinearWeight::Dense(DenseProduct::new(dense)),
            };
            Linear {
                weight,
                bias: Some(normal(&[out], seed + 100)),
                lora: None,
                reduce: None,
            }
        };
        let (a, b) = (linear(1, 48, Some(4)), linear(2, 16, Some(4)));
        let fused = Linear::fuse(&[&a, &b])
            .unwrap()
            .expect("alike quantized weights fuse");
        assert_eq!(fused.quantized_bits(), Some(4));
        let x = normal(&[1, 3, 64], 9);
        let both = concatenate(&[a.forward(&x).unwrap(), b.forward(&x).unwrap()], -1).unwrap();
        let y = fused.forward(&x).unwrap();
        assert_eq!(y.shape(), &[1, 3, 64]);
        assert!(y.all_close(&both, 1e-5, 1e-5, None).unwrap());
        let (dense, eight) = (linear(3, 16, None), linear(4, 16, Some(8)));
        assert!(
            Linear::fuse(&[&a, &dense]).unwrap().is_none(),
            "dense with quantized"
        );
        assert!(
            Linear::fuse(&[&a, &eight]).unwrap().is_none(),
            "4-bit with 8-bit"
        );
    }

    /// On the CPU an f32 weight is copied to `[in, out]` where the BLAS kernels this
    /// process runs read that layout faster, and only then; other dtypes keep the
    /// checkpoint's rows.
    #[test]
    fn f32_weights_on_the_cpu_take_the_layout_their_blas_kernels_read_faster() {
        assert_eq!(Backend::current(), Backend::Cpu, "the tests run on the CPU");
        let w = random::normal::<f32>(&[256, 1536], None, None, Some(&random::key(5).unwrap()))
            .unwrap();
        let faster = dspec_runtime::blas::loaded_kernels()
            .is_some_and(|k| dspec_runtime::blas::reads_inputs_by_outputs_faster(&k));
        let product = DenseProduct::new(w.clone());
        assert_eq!(product.copy_pending(), faster);
        let fused = LinearWeight::stacked([LinearWeight::Dense(product)].iter())
            .unwrap()
            .unwrap();
        let LinearWeight::Dense(fused) = fused else {
            panic!("dense parts fuse");
        };
        assert_eq!(
            fused.copy_pending(),
            faster,
            "a fused layer keeps the layout"
        );
        let half = DenseProduct::new(w.as_dtype(mlx_rs::Dtype::Bfloat16).unwrap());
        assert!(!half.copy_pending(), "only f32 products go to BLAS");
    }

    /// An f32 weight held as `[in, out]` is copied at its first product, not before (a
    /// fused layer's parts are never copied), and the copy computes the same products.
    /// One-row and many-row products of the copy agree bitwise (exact speculative
    /// decoding relies on it): at this size one row falls under OpenBLAS's small-matrix
    /// kernel where the CPU has one, and is padded past it.
    #[test]
    fn f32_weights_held_as_inputs_by_outputs_are_copied_at_their_first_product() {
        assert_eq!(Backend::current(), Backend::Cpu, "the tests run on the CPU");
        let w = random::normal::<f32>(&[256, 1536], None, None, Some(&random::key(5).unwrap()))
            .unwrap();
        let x = random::normal::<f32>(&[1, 5, 1536], None, None, Some(&random::key(6).unwrap()))
            .unwrap();
        let want = matmul(&x, w.t()).unwrap();

        let (top, bottom) = (w.try_index(..64).unwrap(), w.try_index(64..).unwrap());
        let parts = [
            LinearWeight::Dense(DenseProduct::laid_out(top, Layout::InputsByOutputs)),
            LinearWeight::Dense(DenseProduct::laid_out(bottom, Layout::InputsByOutputs)),
        ];
        let Some(LinearWeight::Dense(fused)) = LinearWeight::stacked(parts.iter()).unwrap() else {
            panic!("dense parts fuse");
        };
        for part in &parts {
            let LinearWeight::Dense(d) = part else {
                unreachable!()
            };
            assert!(d.copy_pending(), "a part is copied only if it is used");
        }
        assert!(fused.copy_pending(), "nothing is copied before a product");

        let y = fused.forward(&x).unwrap();
        assert!(!fused.copy_pending());
        let copy = fused.weight_t().unwrap();
        assert_eq!(copy.shape(), &[1536, 256]);
        assert!(
            copy.try_as_slice::<f32>().is_ok(),
            "a row-major [in, out] array"
        );
        assert!(copy.eq_values(w.t()).unwrap());
        assert!(fused.weight().eq_values(&w).unwrap());
        assert!(y.all_close(&want, 1e-5, 1e-5, None).unwrap());
        let rows = 5.min(rows_summed_alike_here());
        let y = fused.forward(&x.try_index((.., ..rows)).unwrap()).unwrap();
        for r in 0..rows {
            let one = fused
                .forward(&x.try_index((.., r..r + 1)).unwrap())
                .unwrap();
            let row = y.try_index((.., r..r + 1)).unwrap();
            assert!(
                row.eq_values(&one).unwrap(),
                "row {r} of {rows} differs from one row"
            );
        }
    }

    /// A weight held in the checkpoint's layout is never copied: its products read a
    /// view of the rows.
    #[test]
    fn weights_in_the_checkpoint_layout_are_read_through_a_view() {
        let w = random::normal::<f32>(&[256, 1536], None, None, Some(&random::key(5).unwrap()))
            .unwrap();
        let x = random::normal::<f32>(&[1, 5, 1536], None, None, Some(&random::key(6).unwrap()))
            .unwrap();
        for w in [w.clone(), w.as_dtype(mlx_rs::Dtype::Bfloat16).unwrap()] {
            let product = DenseProduct::laid_out(w.clone(), Layout::Checkpoint);
            product.forward(&x.as_dtype(w.dtype()).unwrap()).unwrap();
            assert!(!product.copy_pending());
            let rows = product.weight_t().unwrap();
            rows.eval().unwrap();
            assert_eq!(rows.strides(), &[1, 1536], "a view of the rows");
        }
    }

    /// Weights whose one-row products OpenBLAS would run through its small-matrix kernel
    /// and a verify's rows through its general one (on SkylakeX-class cores): products
    /// of every row count up to a verify's (up to [`rows_summed_alike_here`]'s), in the
    /// sequence and the row layouts, equal the one-row products bitwise, with the weight
    /// held in either layout. Shapes of SmolLM2-135M's layers (fused q/k/v, output,
    /// down); a toy weight and a real model's need no padding.
    #[test]
    fn f32_products_meet_one_blas_kernel_at_every_row_count() {
        assert_eq!(rows_for_one_kernel(960, 576), Some(2));
        assert_eq!(rows_for_one_kernel(576, 576), Some(4));
        assert_eq!(rows_for_one_kernel(1536, 1536), None);
        assert_eq!(rows_for_one_kernel(64, 32), None);
        let shapes = [(960, 576), (576, 576), (576, 1536)]
            .into_iter()
            .enumerate();
        let layouts = [Layout::InputsByOutputs, Layout::Checkpoint];
        for ((seed, (outputs, inputs)), layout) in shapes.flat_map(|s| layouts.map(|l| (s, l))) {
            let key = |k: u64| Some(random::key(10 * seed as u64 + k).unwrap());
            let w = random::normal::<f32>(&[outputs, inputs], None, None, key(1).as_ref()).unwrap();
            let product = DenseProduct::laid_out(w, layout);
            assert!(product.min_rows.is_some(), "{outputs}x{inputs} is padded");
            let x = random::normal::<f32>(&[1, 33, inputs], None, None, key(2).as_ref()).unwrap();
            let one: Vec<Array> = (0..33)
                .map(|r| {
                    product
                        .forward(&x.try_index((.., r..r + 1)).unwrap())
                        .unwrap()
                })
                .collect();
            let alike = rows_summed_alike_here();
            for rows in [2, 3, 4, 5, 8, 17, 33].into_iter().filter(|&r| r <= alike) {
                let many = product
                    .forward(&x.try_index((.., ..rows)).unwrap())
                    .unwrap();
                assert_eq!(many.shape(), &[1, rows, outputs]);
                let as_rows = x
                    .try_index((0, ..rows))
                    .unwrap()
                    .reshape(&[rows, 1, inputs])
                    .unwrap();
                let row_layout = product.forward(&as_rows).unwrap();
                assert_eq!(row_layout.shape(), &[rows, 1, outputs]);
                for (r, one) in one.iter().enumerate().take(rows as usize) {
                    let r = r as i32;
                    assert!(
                        many.try_index((.., r..r + 1))
                            .unwrap()
                            .eq_values(one)
                            .unwrap(),
                        "{outputs}x{inputs} {layout:?}: row {r} of {rows} differs from one row"
                    );
                    assert!(
                        row_layout
                            .try_index(r..r + 1)
                            .unwrap()
                            .reshape(&[1, 1, outputs])
                            .unwrap()
                            .eq_values(one)
                            .unwrap(),
                        "{outputs}x{inputs} {layout:?}: row layout, row {r} of {rows}"
                    );
                }
            }
        }
    }

    /// The row layout's products equal one-row products, bitwise, on whichever backend
    /// runs the test, and the layout keeps one broadcast weight per row count.
    #[test]
    fn row_products_equal_one_row_products() {
        let key = random::key(3).unwrap();
        let x = random::normal::<f32>(&[4, 1, 64], None, None, Some(&key)).unwrap();
        let w =
            random::normal::<f32>(&[48, 64], None, None, Some(&random::key(4).unwrap())).unwrap();
        let product = DenseProduct::new(w);
        let rows = product.forward(&x).unwrap();
        assert_eq!(rows.shape(), &[4, 1, 48]);
        for r in 0..4 {
            let one = product.forward(&x.try_index(r..r + 1).unwrap()).unwrap();
            let row = rows.try_index(r..r + 1).unwrap();
            assert!(
                row.eq_values(&one).unwrap(),
                "row {r} differs from its one-row product"
            );
        }
        // Both layouts hold the rows of `x`: their products equal one-row products in
        // value on any backend (bitwise is each backend's own claim, checked above for
        // the one running the test).
        for backend in [Backend::Cuda, Backend::Cpu] {
            let apart = rows_apart(&x, backend).unwrap();
            let rows = matmul(&apart, product.broadcast(4).unwrap()).unwrap();
            for r in 0..4 {
                let one = matmul(
                    x.try_index(r..r + 1).unwrap(),
                    &*product.weight_t().unwrap(),
                )
                .unwrap();
                let row = rows.try_index(r..r + 1).unwrap();
                assert!(
                    row.all_close(&one, 1e-5, 1e-5, None).unwrap(),
                    "{backend:?}: row {r}"
                );
            }
        }
        product.forward(&x.try_index(0..2).unwrap()).unwrap();
        product.forward(&x).unwrap();
        let counts: Vec<i32> = product
            .row_weights
            .borrow()
            .iter()
            .map(|(r, _)| *r)
            .collect();
        assert_eq!(counts, [4, 2]);
    }
}
