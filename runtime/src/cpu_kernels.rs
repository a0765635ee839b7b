//! Softmax and `silu(gate) · up` on the CPU backend through dspec's own MLX primitives
//! (`mlx-sys/kernels/cpu_exp_ops.cpp`), whose exponential the compiler vectorizes.
//!
//! MLX's CPU build for Linux computes each exponential alone, through libm calls: in
//! attention's softmax and the MLP's SiLU that cost more than the products around them
//! (docs/benchmarks.md, "Where a CPU step's time goes"). Elsewhere (GPUs, and Apple's CPU
//! build, whose kernels are vectorized) and for other dtypes, MLX's own ops run.

use std::ffi::CStr;
use std::os::raw::c_char;

use mlx_rs::error::Exception;
use mlx_rs::ops::softmax_axis;
use mlx_rs::{Array, Dtype, Stream};

use crate::Backend;

/// Whether dspec's kernels compute with these arrays here: f32 on the CPU backend, off
/// Apple's platforms (whose MLX build vectorizes its own, and where mlx-sys does not
/// build these).
pub fn apply_to(arrays: &[&Array]) -> bool {
    !cfg!(target_vendor = "apple")
        && Backend::current() == Backend::Cpu
        && arrays.iter().all(|a| a.dtype() == Dtype::Float32)
}

/// Runs one of the kernels' constructors, which report failure as text.
#[cfg(not(target_vendor = "apple"))]
fn call(
    op: impl FnOnce(*mut mlx_sys::mlx_array, mlx_sys::mlx_stream, *mut c_char, usize) -> i32,
) -> Result<Array, Exception> {
    let stream = Stream::new();
    let mut error = [0 as c_char; 512];
    // SAFETY: a fresh handle for the kernel to set; Array takes ownership of it.
    let mut res = unsafe { mlx_sys::mlx_array_new() };
    let status = op(&mut res, stream.as_ptr(), error.as_mut_ptr(), error.len());
    // SAFETY: `res` is a valid (possibly empty) handle either way.
    let array = unsafe { Array::from_ptr(res) };
    if status != 0 {
        // SAFETY: the kernel wrote a NUL-terminated message within the buffer.
        let what = unsafe { CStr::from_ptr(error.as_ptr()) };
        return Err(Exception::custom(what.to_string_lossy().into_owned()));
    }
    Ok(array)
}

/// Softmax over the last axis (f32 in f32; other dtypes accumulate in f32, as MLX's
/// precise softmax does).
pub fn softmax_last_axis(x: &Array) -> Result<Array, Exception> {
    #[cfg(not(target_vendor = "apple"))]
    if apply_to(&[x]) {
        return call(|res, stream, error, len| {
            // SAFETY: `x` outlives the call; the kernel only reads it.
            unsafe {
                mlx_sys::dspec_kernels::dspec_softmax_f32(res, x.as_ptr(), stream, error, len)
            }
        });
    }
    softmax_axis(x, -1, true)
}

/// `silu(gate) · up` elementwise, where dspec's kernel computes it (f32 arrays of one
/// shape on the CPU); `None` elsewhere, for the caller's own graph.
pub fn silu_product(gate: &Array, up: &Array) -> Result<Option<Array>, Exception> {
    if !apply_to(&[gate, up]) || gate.shape() != up.shape() {
        return Ok(None);
    }
    #[cfg(target_vendor = "apple")]
    return Ok(None);
    #[cfg(not(target_vendor = "apple"))]
    call(|res, stream, error, len| {
        // SAFETY: both arrays outlive the call; the kernel only reads them.
        unsafe {
            mlx_sys::dspec_kernels::dspec_silu_product_f32(
                res,
                gate.as_ptr(),
                up.as_ptr(),
                stream,
                error,
                len,
            )
        }
    })
    .map(Some)
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::ops::{concatenate, full, sigmoid};
    use mlx_rs::random;

    fn normal(shape: &[i32], scale: f32, seed: u64) -> Array {
        let key = random::key(seed).unwrap();
        random::normal::<f32>(shape, None, None, Some(&key))
            .unwrap()
            .multiply(Array::from_f32(scale))
            .unwrap()
    }

    /// In row-major order whatever the layout (flattening copies a strided view).
    fn values(a: &Array) -> Vec<f32> {
        let flat = a.flatten(None, None).unwrap();
        flat.eval().unwrap();
        flat.as_slice::<f32>().to_vec()
    }

    /// Against a softmax in f64 of the same differences from the row's maximum (each
    /// rounded to f32 first, as any f32 softmax rounds them): rows of every width around
    /// the kernel's lane count, wide ranges, and masked keys (f32's lowest and -inf).
    #[test]
    fn softmax_matches_f64_within_f32_rounding() {
        for (width, scale) in [(1, 1.0), (7, 3.0), (16, 10.0), (33, 30.0), (1000, 8.0)] {
            let x = normal(&[3, width], scale, width as u64);
            let got = values(&softmax_last_axis(&x).unwrap());
            let x = values(&x);
            for (row, chunk) in x.chunks(width as usize).enumerate() {
                let top = chunk.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let exps: Vec<f64> = chunk.iter().map(|&v| ((v - top) as f64).exp()).collect();
                let sum: f64 = exps.iter().sum();
                for (k, e) in exps.iter().enumerate() {
                    let want = e / sum;
                    let have = got[row * width as usize + k] as f64;
                    assert!(
                        (have - want).abs() <= 4e-7 * want.max(1e-30) + 1e-38,
                        "width {width} row {row} key {k}: {have} vs {want}"
                    );
                }
            }
        }
        let masked = Array::from_slice(&[0.5f32, f32::MIN, 1.5, f32::NEG_INFINITY], &[1, 4]);
        let got = values(&softmax_last_axis(&masked).unwrap());
        assert_eq!(
            (got[1], got[3]),
            (0.0, 0.0),
            "masked keys weigh exactly nothing"
        );
        assert!((got[0] + got[2] - 1.0).abs() < 1e-6, "{got:?}");
    }

    /// A row's result depends on its values alone: the same row alone, among others,
    /// and padded with masked keys gives the same bits (what keeps a verify's queries
    /// equal to one-token decoding).
    #[test]
    fn a_row_rounds_the_same_alone_among_others_and_padded() {
        let row = normal(&[1, 37], 4.0, 1);
        let alone = values(&softmax_last_axis(&row).unwrap());
        let others = concatenate(&[normal(&[2, 37], 4.0, 2), row.clone()], 0).unwrap();
        let among = values(&softmax_last_axis(&others).unwrap());
        assert_eq!(alone[..], among[74..], "one row among three");
        let pad = full::<f32>(&[1, 27], Array::from_f32(f32::MIN)).unwrap();
        let padded = concatenate(&[row, pad], 1).unwrap();
        let padded = values(&softmax_last_axis(&padded).unwrap());
        assert_eq!(alone[..], padded[..37], "padded with masked keys");
        assert!(padded[37..].iter().all(|&p| p == 0.0));
    }

    /// Against MLX's own `g · sigmoid(g) · u`, from deep negative to large gates, and
    /// on views that are not contiguous.
    #[test]
    fn silu_product_matches_mlx() {
        let gate = normal(&[4, 300], 12.0, 3);
        let up = normal(&[4, 300], 2.0, 4);
        let want = gate
            .multiply(sigmoid(&gate).unwrap())
            .unwrap()
            .multiply(&up)
            .unwrap();
        let Some(got) = silu_product(&gate, &up).unwrap() else {
            panic!("the CPU backend computes f32 SiLU products with dspec's kernel");
        };
        for (have, want) in values(&got).iter().zip(values(&want)) {
            assert!(
                (have - want).abs() <= 2e-6 * want.abs() + 1e-30,
                "{have} vs {want}"
            );
        }
        let strided = silu_product(&gate.t(), &up.t()).unwrap().unwrap();
        let (a, b) = (values(&strided), values(&want.t()));
        assert!(a
            .iter()
            .zip(&b)
            .all(|(x, y)| (x - y).abs() <= 2e-6 * y.abs() + 1e-30));
    }

    /// The gradients training takes through both kernels: those of MLX's own ops.
    #[test]
    fn gradients_match_mlx_ops() {
        use mlx_rs::transforms::grad;
        let x = normal(&[2, 9], 2.0, 5);
        let w = normal(&[2, 9], 1.0, 6);
        let ours = |x: &Array| -> Result<Array, Exception> {
            softmax_last_axis(x)?.multiply(&w)?.sum(None)
        };
        let theirs = |x: &Array| -> Result<Array, Exception> {
            softmax_axis(x, -1, true)?.multiply(&w)?.sum(None)
        };
        let (a, b) = (grad(ours)(&x).unwrap(), grad(theirs)(&x).unwrap());
        let diff = a.subtract(&b).unwrap().abs().unwrap().max(None).unwrap();
        assert!(diff.item_exact::<f32>() < 1e-6, "softmax: {diff:?}");

        let up = normal(&[2, 9], 1.0, 7);
        let ours = |g: &Array| -> Result<Array, Exception> {
            silu_product(g, &up)?.expect("on the CPU").sum(None)
        };
        let theirs = |g: &Array| -> Result<Array, Exception> {
            g.multiply(sigmoid(g)?)?.multiply(&up)?.sum(None)
        };
        let (a, b) = (grad(ours)(&x).unwrap(), grad(theirs)(&x).unwrap());
        let diff = a.subtract(&b).unwrap().abs().unwrap().max(None).unwrap();
        assert!(
            diff.item_exact::<f32>() < 1e-5,
            "silu, by the gate: {diff:?}"
        );

        let gate = normal(&[2, 9], 3.0, 8);
        let ours = |u: &Array| -> Result<Array, Exception> {
            silu_product(&gate, u)?.expect("on the CPU").sum(None)
        };
        let theirs = |u: &Array| -> Result<Array, Exception> {
            gate.multiply(sigmoid(&gate)?)?.multiply(u)?.sum(None)
        };
        let (a, b) = (grad(ours)(&up).unwrap(), grad(theirs)(&up).unwrap());
        let diff = a.subtract(&b).unwrap().abs().unwrap().max(None).unwrap();
        assert!(diff.item_exact::<f32>() < 1e-5, "silu, by up: {diff:?}");
    }
}
