//! Slicing along one axis straight through mlx-c, for the hot path of decoding.
//!
//! mlx-rs's general indexing (`try_index`, `try_index_mut`) parses index expressions and
//! adds reshapes around them; a decode step slices a few hundred times (KV cache
//! writes and reads, fused projections split apart), and on a GPU the host's cost of
//! building those nodes is what bounds the token rate. These build exactly one node.

use mlx_rs::error::Exception;
use mlx_rs::{Array, Stream};

/// Runs one mlx-c op that writes its result into `res`.
pub(crate) fn op(
    what: &str,
    f: impl FnOnce(*mut mlx_sys::mlx_array) -> i32,
) -> Result<Array, Exception> {
    // SAFETY: a fresh empty mlx_array handle is what mlx-c ops expect as output; on
    // success it holds the result and is owned by the returned Array, on failure it is
    // freed here.
    unsafe {
        let mut res = mlx_sys::mlx_array_new();
        if f(&mut res) != 0 {
            mlx_sys::mlx_array_free(res);
            return Err(Exception::custom(format!(
                "{what} failed (arguments out of range)"
            )));
        }
        Ok(Array::from_ptr(res))
    }
}

/// Start and stop of the whole of `shape`, except `[start, end)` on `axis`.
fn bounds(shape: &[i32], axis: usize, start: i32, end: i32) -> (Vec<i32>, Vec<i32>) {
    let mut starts = vec![0; shape.len()];
    let mut stops = shape.to_vec();
    starts[axis] = start;
    stops[axis] = end;
    (starts, stops)
}

/// `x[.., start..end, ..]` on `axis` (a view).
pub fn slice_axis(x: &Array, axis: usize, start: i32, end: i32) -> Result<Array, Exception> {
    let (starts, stops) = bounds(x.shape(), axis, start, end);
    slice_region(x, &starts, &stops)
}

/// `x[starts[0]..stops[0], starts[1]..stops[1], …]` (a view).
pub fn slice_region(x: &Array, starts: &[i32], stops: &[i32]) -> Result<Array, Exception> {
    let strides = vec![1; starts.len()];
    let stream = Stream::thread_local_or_default();
    op("slice", |res| unsafe {
        mlx_sys::mlx_slice(
            res,
            x.as_ptr(),
            starts.as_ptr(),
            starts.len(),
            stops.as_ptr(),
            stops.len(),
            strides.as_ptr(),
            strides.len(),
            stream.as_ref().as_ptr(),
        )
    })
}

/// `dst` with `update` written at `start..start + len` on `axis` (in place when MLX
/// holds the only reference to `dst`).
pub fn write_axis(
    dst: &Array,
    update: &Array,
    axis: usize,
    start: i32,
) -> Result<Array, Exception> {
    let mut starts = vec![0; dst.ndim()];
    starts[axis] = start;
    write_region(dst, update, &starts)
}

/// `dst` with `update` written from `starts` on (each axis), in place when MLX holds the
/// only reference to `dst`.
pub fn write_region(dst: &Array, update: &Array, starts: &[i32]) -> Result<Array, Exception> {
    let stops: Vec<i32> = starts
        .iter()
        .zip(update.shape())
        .map(|(s, len)| s + len)
        .collect();
    let strides = vec![1; starts.len()];
    let stream = Stream::thread_local_or_default();
    op("slice update", |res| unsafe {
        mlx_sys::mlx_slice_update(
            res,
            dst.as_ptr(),
            update.as_ptr(),
            starts.as_ptr(),
            starts.len(),
            stops.as_ptr(),
            stops.len(),
            strides.as_ptr(),
            strides.len(),
            stream.as_ref().as_ptr(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_and_writes_match_indexing() {
        let x = Array::from_iter(0..24i32, &[2, 3, 4]);
        let s = slice_axis(&x, 1, 1, 3).unwrap();
        assert_eq!(s.shape(), &[2, 2, 4]);
        let expected: Vec<i32> = [4, 5, 6, 7, 8, 9, 10, 11, 16, 17, 18, 19, 20, 21, 22, 23].into();
        assert_eq!(
            s.contiguous().unwrap().as_slice::<i32>(),
            expected.as_slice()
        );

        let upd = Array::from_iter(100..108i32, &[2, 1, 4]);
        let w = write_axis(&x, &upd, 1, 2).unwrap();
        let w = w.contiguous().unwrap().as_slice::<i32>().to_vec();
        assert_eq!(&w[8..12], &[100, 101, 102, 103]);
        assert_eq!(&w[20..24], &[104, 105, 106, 107]);
        assert_eq!(&w[..8], &(0..8).collect::<Vec<_>>()[..]);

        let r = slice_region(&x, &[1, 0, 2], &[2, 2, 4]).unwrap();
        assert_eq!(r.contiguous().unwrap().as_slice::<i32>(), &[14, 15, 18, 19]);
        let upd = Array::from_iter(200..202i32, &[1, 1, 2]);
        let w = write_region(&x, &upd, &[1, 2, 1]).unwrap();
        let w = w.contiguous().unwrap().as_slice::<i32>().to_vec();
        assert_eq!(&w[20..24], &[20, 200, 201, 23]);
        assert_eq!(&w[..20], &(0..20).collect::<Vec<_>>()[..]);
    }
}
