//! The row layout: R positions of one sequence run as R one-token batches (`[R, 1, ..]`),
//! so that a verify computes each position with exactly the kernels a decode step uses.

use mlx_rs::ops::concatenate;
use mlx_rs::Array;

use dspec_plugin_api::error::Result;
use dspec_runtime::slicing::slice_axis;
use dspec_runtime::Backend;

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

/// The rows of `x` (`[R, 1, in]`) laid out so that MLX multiplies each by itself with
/// its one-row kernel instead of folding them into one matrix-matrix product (which it
/// does when rows lie a row's width apart and are not flagged transposed):
/// - on CUDA, the view `[R, in, 1]` swapped to `[R, 1, in]` (strides `[in, 1, 1]`, the
///   same memory): MLX reads transposed one-row matrices, which its CUDA matrix-vector
///   kernel takes as they are (no fold, no copy; bitwise equal to one-row products,
///   docs/verify-numerics.md);
/// - elsewhere, two rows apart (`x` doubled, every other row): the CPU's BLAS computes a
///   transposed one-row product differently from the one-token call.
pub(super) fn rows_apart(x: &Array, backend: Backend) -> Result<Array> {
    let (rows, k) = (x.shape()[0], x.shape()[2]);
    match backend {
        Backend::Cuda => Ok(x.reshape(&[rows, k, 1])?.swap_axes(1, 2)?),
        Backend::Cpu | Backend::Metal => Ok(slice_axis(&concatenate(&[x, x], 1)?, 1, 0, 1)?),
    }
}
