//! The gated MLP, `down(act(gate(x)) · up(x))`, with gate and up fused into one product
//! where they allow it, and split across a tensor-parallel group when asked.

use mlx_rs::Array;

use dspec_plugin_api::error::Result;
use dspec_plugin_api::WeightSource;

use super::activation::Activation;
use super::linear::Linear;
use super::parallel::Split;
use super::views::split_last;
use crate::tensor_parallel::TensorParallel;

/// `down(act(gate(x)) · up(x))`.
#[derive(Clone)]
pub struct GatedMlp {
    /// Gate and up, fused into one product (outputs side by side) when both are dense or
    /// quantized alike.
    gate_up: GateUp,
    down: Linear,
    act: Activation,
}

#[derive(Clone)]
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

    /// Loads `prefix.{gate,up,down}_proj`, or under `tp` this rank's share of the hidden
    /// units: gate and up column-parallel, down row-parallel (one all-sum).
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
