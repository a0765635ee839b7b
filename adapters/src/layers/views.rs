//! Views into a layer's outputs: a fused projection's pieces, and a span of positions.

use mlx_rs::Array;

use dspec_plugin_api::error::Result;
use dspec_runtime::slicing::slice_axis;

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

/// Positions `[start, end)` of the sequence axis (axis 2 of `[B, H, L, D]`).
pub fn seq_slice(x: &Array, start: i32, end: i32) -> Result<Array> {
    Ok(slice_axis(x, 2, start, end)?)
}
