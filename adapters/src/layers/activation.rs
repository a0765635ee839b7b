//! The MLP's gated nonlinearities (`act(gate) · up`, compiled into one kernel) and the
//! logit soft-cap: elementwise functions with no weights of their own.

use std::cell::RefCell;

use mlx_rs::error::Exception;
use mlx_rs::transforms::compile::compile;
use mlx_rs::{nn, Array};

use dspec_plugin_api::error::{ModelError, Result};

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

    /// `act(gate) · up` as one kernel: SiLU's in f32 on the CPU is dspec's own
    /// (`dspec_runtime::cpu_kernels`, whose exponential is vectorized), the rest one
    /// compiled (fused) MLX function. The compiled function is built
    /// once per thread and kept: mlx-rs gives every `compile` call a new function id,
    /// so compiling per call would trace and fuse the graph again on every layer of every
    /// step: host work on the path of every token.
    pub(super) fn gated(self, gate: &Array, up: &Array) -> Result<Array> {
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
        if self == Activation::Silu {
            if let Some(product) = dspec_runtime::cpu_kernels::silu_product(gate, up)? {
                return Ok(product);
            }
        }
        let compiled = match self {
            Activation::Silu => &SILU,
            Activation::GeluTanh => &GELU,
        };
        Ok(compiled.with(|f| (f.borrow_mut())((gate, up)))?)
    }
}

/// `tanh(x / cap) · cap`: bounds logits smoothly (gemma2 attention and output).
pub fn softcap(x: &Array, cap: f32) -> Result<Array> {
    let c = Array::from_f32(cap).as_dtype(x.dtype())?;
    Ok(mlx_rs::ops::tanh(x.divide(&c)?)?.multiply(&c)?)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
