//! Dense `x · wᵀ` products: the weight held as the backend reads it best, products of a
//! few rows through dspec's CUDA kernels, and the row layout computed row by row.

use std::cell::{Ref, RefCell};

use mlx_rs::ops::{broadcast_to, concatenate, matmul};
use mlx_rs::Array;

use dspec_plugin_api::error::Result;
use dspec_runtime::host_transpose::stacked_transposed_on_host;
use dspec_runtime::slicing::slice_axis;
use dspec_runtime::Backend;

use super::cpu_layout::{padded_product, products_on_blas, rows_for_one_kernel, Layout};
use super::row_layout::{is_row_layout, rows_apart};

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
pub(super) struct DenseProduct {
    weight_t: RefCell<Array>,
    pub(super) layout: Layout,
    /// The checkpoint's `[out, in]` blocks (one, or the parts of a fused layer), while
    /// they are still to be copied into `[in, out]`; empty once copied or if no copy is
    /// to be made.
    to_copy: RefCell<Vec<Array>>,
    row_weights: RefCell<Vec<(i32, Array)>>,
    /// Fewest rows each product is computed with, where fewer would go through another
    /// BLAS kernel than a verify's rows do (see [`rows_for_one_kernel`]).
    pub(super) min_rows: Option<i32>,
    /// The `[out, in]` weight (a view of `weight_t`'s buffer) where the model runs short
    /// continuations through dspec's CUDA kernels ([`crate::cuda::product`]).
    for_kernels: Option<Array>,
}

/// A clone shares the weight's buffers (MLX arrays are handles). A copy still pending
/// is made first, so that clones share it rather than each making its own; where it
/// cannot be made now, the clone keeps it pending and meets the error at its first product.
impl Clone for DenseProduct {
    fn clone(&self) -> Self {
        let _ = self.weight_t();
        Self {
            weight_t: RefCell::new(self.weight_t.borrow().clone()),
            layout: self.layout,
            to_copy: RefCell::new(self.to_copy.borrow().clone()),
            row_weights: RefCell::new(self.row_weights.borrow().clone()),
            min_rows: self.min_rows,
            for_kernels: self.for_kernels.clone(),
        }
    }
}

impl DenseProduct {
    pub(super) fn new(weight: Array) -> Self {
        let layout = Layout::for_weight(&weight);
        Self::laid_out(weight, layout)
    }

    pub(super) fn laid_out(weight: Array, layout: Layout) -> Self {
        Self::from_blocks(weight.clone(), vec![weight], layout)
    }

    /// The `[out, in]` blocks stacked along `out`, as one product. When a copy is to be
    /// made, it is made from the blocks themselves, so the stacked rows are never built.
    pub(super) fn stacked(blocks: Vec<Array>, layout: Layout) -> Result<Self> {
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
    pub(super) fn use_short_kernels(&mut self, on: bool) -> Result<()> {
        self.for_kernels = (on && crate::cuda::available(self.dtype())).then(|| self.weight());
        if let Some(weight) = &self.for_kernels {
            weight.eval()?;
        }
        Ok(())
    }

    pub(super) fn copy_pending(&self) -> bool {
        !self.to_copy.borrow().is_empty()
    }

    pub(super) fn dtype(&self) -> mlx_rs::Dtype {
        self.weight_t.borrow().dtype()
    }

    /// The `[out, in]` weight (a view when it is held as an `[in, out]` copy).
    pub(super) fn weight(&self) -> Array {
        self.weight_t.borrow().t()
    }

    /// The `[in, out]` operand of products, borrowed rather than cloned: products run
    /// per layer per token.
    pub(super) fn weight_t(&self) -> Result<Ref<'_, Array>> {
        if self.copy_pending() {
            let copy = stacked_transposed_on_host(&self.to_copy.borrow())?;
            *self.weight_t.borrow_mut() = copy;
            self.to_copy.borrow_mut().clear();
        }
        Ok(self.weight_t.borrow())
    }

    pub(super) fn forward(&self, x: &Array) -> Result<Array> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::indexing::TryIndexOp;
    use mlx_rs::random;

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
