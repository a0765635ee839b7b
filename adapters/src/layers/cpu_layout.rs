//! How f32 products on the CPU are held and padded for BLAS: the weight layout its
//! kernels read faster, and the fewest rows that keep every row count on one kernel.

use std::sync::OnceLock;

use mlx_rs::ops::{concatenate, matmul};
use mlx_rs::Array;

use dspec_plugin_api::error::Result;
use dspec_runtime::slicing::slice_axis;
use dspec_runtime::Backend;

/// How a dense weight is held for its products.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Layout {
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
    pub(super) fn for_weight(weight: &Array) -> Layout {
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
pub(super) fn products_on_blas(weight: &Array) -> bool {
    Backend::current() == Backend::Cpu && weight.dtype() == mlx_rs::Dtype::Float32
}

/// OpenBLAS runs an f32 product of at most this many multiply-adds through a small-matrix
/// kernel on its SkylakeX-class cores (Intel Xeon Scalable, and AVX-512 AMD EPYC, which it
/// can run as Cooperlake), and that kernel rounds differently from its general one
/// (OpenBLAS's `kernel/x86_64/sgemm_small_kernel_permit_skylakex.c`).
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
pub(super) fn rows_for_one_kernel(outputs: i64, inputs: i64) -> Option<i32> {
    let min = BLAS_SMALL_PRODUCT / (outputs * inputs).max(1) + 1;
    (min > 1 && min <= ALIKE_ROWS).then_some(min as i32)
}

/// `x` (`[.., in]`, `rows` rows in all) times `weight_t` (`[in, out]`), computed with at
/// least `min` rows: `x`'s, then repeats of them whose outputs are dropped (each output
/// row depends on its own input row only).
pub(super) fn padded_product(x: &Array, weight_t: &Array, rows: i32, min: i32) -> Result<Array> {
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::rows_summed_alike_here;
    use crate::layers::dense::DenseProduct;
    use crate::layers::linear::LinearWeight;
    use mlx_rs::ops::indexing::TryIndexOp;
    use mlx_rs::random;

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
}
