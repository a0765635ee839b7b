//! Mixture-of-experts feed-forward blocks: a router picks `top_k` of the layer's experts
//! for each position, each picked expert runs its own gated MLP, and their outputs are
//! summed weighted by the router's probabilities; Qwen3-Next and Qwen3.5 add a shared
//! expert, scaled by a sigmoid gate, that every position runs.
//!
//! The experts' weights are stacked (`[experts, out, in]`) and multiplied through MLX's
//! gathered products, so a position reads only the experts it was routed to. When many
//! positions run at once (a prefill, a wide verify), their routes are sorted by expert
//! first, so each expert's weights are read once for all the positions that chose it.

use mlx_rs::ops::{
    argpartition_axis, argsort_axis, expand_dims_axes, flatten, gather_mm, gather_qmm, sigmoid,
    softmax_axis, squeeze_axes, stack, sum_axis, unflatten,
};
use mlx_rs::Array;

use dspec_plugin_api::error::Result;
use dspec_plugin_api::{Quantization, WeightSource};

use super::activation::Activation;
use super::linear::Linear;
use super::mlp::GatedMlp;
use super::quantized::{maybe_quantize, quantized_parts, Quantized};
use dspec_runtime::slicing::slice_axis;

/// The routed experts of one layer, as the config describes them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertsSpec {
    /// Experts in the layer (`num_experts`).
    pub experts: i32,
    /// Experts each position is routed to (`num_experts_per_tok`).
    pub top_k: i32,
    /// Hidden units of one expert (`moe_intermediate_size`).
    pub inner: i32,
    /// Rescale the chosen experts' probabilities to sum to 1 (`norm_topk_prob`).
    pub norm_topk_prob: bool,
    /// Hidden units of the shared expert every position runs, when the layer has one
    /// (`shared_expert_intermediate_size`).
    pub shared_inner: Option<i32>,
}

/// Routes of at least this many (position, expert) pairs are sorted by expert before the
/// gathered products: below it, reading a few experts twice costs less than the sort.
const SORT_FROM_ROUTES: usize = 64;

/// One projection of every expert, stacked: `[experts, out, in]`, dense or quantized.
#[derive(Clone)]
enum StackedWeight {
    Dense(Array),
    Quantized(Quantized),
}

/// One projection (gate, up or down) of all the experts of a layer.
#[derive(Clone)]
struct StackedLinear {
    weight: StackedWeight,
}

impl StackedLinear {
    /// A float stack, quantized here when the user asked for it (`--quantize`).
    fn dense(weight: Array, quantize_to: Option<Quantization>) -> Result<Self> {
        let weight = match maybe_quantize(weight, quantize_to)? {
            Ok(q) => StackedWeight::Quantized(q),
            Err(dense) => StackedWeight::Dense(dense),
        };
        Ok(Self { weight })
    }

    /// `x · W[e]ᵀ` for the expert `e` each row of `x` was routed to. `x`: `[..., 1, in]`
    /// broadcast against `experts` (`[...]`), giving `[..., 1, out]`.
    fn gathered(&self, x: &Array, experts: &Array, sorted: bool) -> Result<Array> {
        Ok(match &self.weight {
            StackedWeight::Dense(w) => {
                gather_mm(x, w.swap_axes(-1, -2)?, None, experts, Some(sorted))?
            }
            StackedWeight::Quantized(q) => gather_qmm(
                x,
                &q.weight,
                &q.scales,
                &q.biases,
                None,
                experts,
                true,
                q.group_size,
                q.bits,
                sorted,
            )?,
        })
    }
}

/// Reads the stacked projection `name` (`gate_proj`, `up_proj` or `down_proj`) of the
/// experts under `prefix`: stacked by an MLX conversion, or one tensor per expert.
fn load_projection(
    w: &mut dyn WeightSource,
    prefix: &str,
    name: &str,
    spec: &ExpertsSpec,
    (out_dim, in_dim): (i32, i32),
) -> Result<StackedLinear> {
    let e = spec.experts;
    let quantize_to = w.options().quantize;
    // MLX conversions: `switch_mlp.{name}`, stacked, dense or quantized.
    let stacked = format!("{prefix}.switch_mlp.{name}");
    if w.contains(&format!("{stacked}.scales")) {
        return load_quantized_stack(w, &stacked, e, out_dim, in_dim);
    }
    if w.contains(&format!("{stacked}.weight")) {
        let weight = w.tensor(&format!("{stacked}.weight"), &[e, out_dim, in_dim])?;
        return StackedLinear::dense(weight, quantize_to);
    }
    // One tensor per expert (Hugging Face; quantized too): stacked here.
    let per_expert = |w: &mut dyn WeightSource, part: &str| -> Result<Array> {
        let parts = (0..e)
            .map(|i| w.raw(&format!("{prefix}.experts.{i}.{name}.{part}")))
            .collect::<Result<Vec<_>>>()?;
        Ok(stack(&parts, 0)?)
    };
    if w.contains(&format!("{prefix}.experts.0.{name}.scales")) {
        let parts = [
            per_expert(w, "weight")?,
            per_expert(w, "scales")?,
            per_expert(w, "biases")?,
        ];
        let stem = format!("{prefix}.experts.*.{name}");
        return quantized_stack(w, &stem, parts, e, out_dim, in_dim);
    }
    let experts = (0..e)
        .map(|i| {
            w.tensor(
                &format!("{prefix}.experts.{i}.{name}.weight"),
                &[out_dim, in_dim],
            )
        })
        .collect::<Result<Vec<_>>>()?;
    StackedLinear::dense(stack(&experts, 0)?, quantize_to)
}

/// The experts' gate, up and down projections, from Hugging Face's fused layout (as
/// Qwen3.5-MoE ships it: `experts.gate_up_proj` `[E, 2·inner, hidden]`, gate first, and
/// `experts.down_proj` `[E, hidden, inner]`) when the checkpoint has it, else from
/// [`load_projection`]'s layouts.
fn load_experts(
    w: &mut dyn WeightSource,
    prefix: &str,
    spec: &ExpertsSpec,
    hidden: i32,
) -> Result<[StackedLinear; 3]> {
    let (e, inner) = (spec.experts, spec.inner);
    let fused = |part: &str| format!("{prefix}.experts.{part}");
    if w.contains(&fused("gate_up_proj")) {
        let quantize_to = w.options().quantize;
        let both = w.tensor(&fused("gate_up_proj"), &[e, 2 * inner, hidden])?;
        let [gate, up] = split_axis1(&both, inner)?;
        let down = w.tensor(&fused("down_proj"), &[e, hidden, inner])?;
        return Ok([
            StackedLinear::dense(gate, quantize_to)?,
            StackedLinear::dense(up, quantize_to)?,
            StackedLinear::dense(down, quantize_to)?,
        ]);
    }
    Ok([
        load_projection(w, prefix, "gate_proj", spec, (inner, hidden))?,
        load_projection(w, prefix, "up_proj", spec, (inner, hidden))?,
        load_projection(w, prefix, "down_proj", spec, (hidden, inner))?,
    ])
}

/// Splits `[E, 2n, in]` into its two `[E, n, in]` halves.
fn split_axis1(both: &Array, n: i32) -> Result<[Array; 2]> {
    Ok([slice_axis(both, 1, 0, n)?, slice_axis(both, 1, n, 2 * n)?])
}

/// `prefix.{weight,scales,biases}` of a stacked quantized projection.
fn load_quantized_stack(
    w: &mut dyn WeightSource,
    prefix: &str,
    experts: i32,
    rows: i32,
    cols: i32,
) -> Result<StackedLinear> {
    let parts = [
        w.raw(&format!("{prefix}.weight"))?,
        w.raw(&format!("{prefix}.scales"))?,
        w.raw(&format!("{prefix}.biases"))?,
    ];
    quantized_stack(w, prefix, parts, experts, rows, cols)
}

fn quantized_stack(
    w: &dyn WeightSource,
    prefix: &str,
    parts: [Array; 3],
    experts: i32,
    rows: i32,
    cols: i32,
) -> Result<StackedLinear> {
    Ok(StackedLinear {
        weight: StackedWeight::Quantized(quantized_parts(
            w,
            prefix,
            parts,
            &[experts, rows],
            cols,
        )?),
    })
}

/// The shared expert and the sigmoid gate that scales its output per position.
#[derive(Clone)]
struct SharedExpert {
    mlp: GatedMlp,
    gate: Linear,
}

/// A mixture-of-experts MLP: `Σ_k p_k · expert_k(x)` over the `top_k` experts the router
/// picks, plus `σ(gate · x) · shared(x)` where the layer has a shared expert.
#[derive(Clone)]
pub struct SparseMoe {
    router: Linear,
    gate_proj: StackedLinear,
    up_proj: StackedLinear,
    down_proj: StackedLinear,
    act: Activation,
    spec: ExpertsSpec,
    shared: Option<SharedExpert>,
}

impl SparseMoe {
    /// Loads the block under `prefix` (`model.layers.3.mlp`): its router `gate`, its
    /// experts in any of the layouts [`load_projection`] reads, and its shared expert.
    pub fn load(
        w: &mut dyn WeightSource,
        prefix: &str,
        hidden: i32,
        spec: ExpertsSpec,
        act: Activation,
    ) -> Result<Self> {
        let router = Linear::load(w, &format!("{prefix}.gate"), hidden, spec.experts, false)?;
        let [gate_proj, up_proj, down_proj] = load_experts(w, prefix, &spec, hidden)?;
        let shared = match spec.shared_inner {
            Some(shared_inner) => Some(SharedExpert {
                mlp: GatedMlp::load_parallel(
                    w,
                    &format!("{prefix}.shared_expert"),
                    hidden,
                    shared_inner,
                    false,
                    act,
                    None,
                )?,
                gate: Linear::load(w, &format!("{prefix}.shared_expert_gate"), hidden, 1, false)?,
            }),
            None => None,
        };
        Ok(Self {
            router,
            gate_proj,
            up_proj,
            down_proj,
            act,
            spec,
            shared,
        })
    }

    /// `x`: `[..., hidden]` (any leading shape), the same shape out.
    pub fn forward(&self, x: &Array) -> Result<Array> {
        let k = self.spec.top_k;
        let probs = softmax_axis(self.router.forward(x)?, -1, true)?;
        // The k largest probabilities, in no particular order (their sum does not care).
        let chosen = first_on_last_axis(&argpartition_axis(&probs.negative()?, k - 1, -1)?, k)?;
        let mut weights = probs.take_along_axis(&chosen, -1)?;
        if self.spec.norm_topk_prob {
            weights = weights.divide(sum_axis(&weights, -1, true)?)?;
        }
        let routed = self.experts(x, &chosen)?;
        let mut y = sum_axis(
            routed.multiply(expand_dims_axes(&weights, &[-1])?)?,
            -2,
            false,
        )?;
        if let Some(shared) = &self.shared {
            let scale = sigmoid(shared.gate.forward(x)?)?;
            y = y.add(shared.mlp.forward(x)?.multiply(scale)?)?;
        }
        Ok(y)
    }

    /// Each position's chosen experts' outputs: `x` `[..., hidden]`, `chosen` `[..., k]`,
    /// giving `[..., k, hidden]`.
    fn experts(&self, x: &Array, chosen: &Array) -> Result<Array> {
        // Every position a one-row matrix, broadcast over its k experts.
        let rows = expand_dims_axes(x, &[-2, -3])?;
        let routes = chosen.size();
        if routes < SORT_FROM_ROUTES {
            let y = self.glu(&rows, chosen, false)?;
            return Ok(squeeze_axes(&y, &[-2])?);
        }
        // Sorted by expert: row r of the sorted routes is position order[r] / k.
        let k = self.spec.top_k;
        let flat = flatten(chosen, None, None)?;
        let order = argsort_axis(&flat, 0)?;
        let unsort = argsort_axis(&order, 0)?;
        let positions = order.floor_divide(Array::from_int(k))?;
        let per_row = flatten(&rows, 0, rows.ndim() as i32 - 3)?.take_axis(&positions, 0)?;
        let y = self.glu(&per_row, &flat.take_axis(&order, 0)?, true)?;
        let y = y.take_axis(&unsort, 0)?;
        let y = unflatten(&y, 0, chosen.shape())?;
        Ok(squeeze_axes(&y, &[-2])?)
    }

    /// `down(act(gate(x)) · up(x))` through each row's expert.
    fn glu(&self, x: &Array, experts: &Array, sorted: bool) -> Result<Array> {
        let gate = self.gate_proj.gathered(x, experts, sorted)?;
        let up = self.up_proj.gathered(x, experts, sorted)?;
        self.down_proj
            .gathered(&self.act.gated(&gate, &up)?, experts, sorted)
    }
}

/// The first `k` entries of the last axis of `a`.
fn first_on_last_axis(a: &Array, k: i32) -> Result<Array> {
    Ok(slice_axis(a, a.ndim() - 1, 0, k)?)
}

#[cfg(test)]
mod tests {
    use mlx_rs::ops::{concatenate, quantize};
    use mlx_rs::{random, Array};

    use dspec_plugin_api::LoadOptions;

    use super::*;
    use crate::weights::Weights;

    const HIDDEN: i32 = 32;
    const SPEC: ExpertsSpec = ExpertsSpec {
        experts: 4,
        top_k: 2,
        inner: 32,
        norm_topk_prob: true,
        shared_inner: Some(32),
    };

    fn normal(shape: &[i32], seed: u64) -> Array {
        let key = random::key(seed).unwrap();
        let x = random::normal::<f32>(shape, None, None, Some(&key)).unwrap();
        x.multiply(Array::from_f32(
            1.0 / (*shape.last().unwrap() as f32).sqrt(),
        ))
        .unwrap()
    }

    /// One layer's tensors with the experts one per tensor (Hugging Face's layout).
    fn per_expert_tensors() -> Vec<(String, Array)> {
        let mut t = vec![
            (
                "mlp.gate.weight".to_string(),
                normal(&[SPEC.experts, HIDDEN], 1),
            ),
            (
                "mlp.shared_expert_gate.weight".into(),
                normal(&[1, HIDDEN], 2),
            ),
        ];
        for (i, name) in ["gate_proj", "up_proj", "down_proj"].iter().enumerate() {
            let shape = match *name {
                "down_proj" => [HIDDEN, SPEC.inner],
                _ => [SPEC.inner, HIDDEN],
            };
            for e in 0..SPEC.experts {
                let seed = 10 + (i as u64) * 10 + e as u64;
                t.push((
                    format!("mlp.experts.{e}.{name}.weight"),
                    normal(&shape, seed),
                ));
            }
            t.push((
                format!("mlp.shared_expert.{name}.weight"),
                normal(&shape, 90 + i as u64),
            ));
        }
        t
    }

    fn stacked(tensors: &[(String, Array)], name: &str) -> Array {
        let parts: Vec<Array> = (0..SPEC.experts)
            .map(|e| {
                let key = format!("mlp.experts.{e}.{name}.weight");
                tensors.iter().find(|(n, _)| *n == key).unwrap().1.clone()
            })
            .collect();
        stack(&parts, 0).unwrap()
    }

    /// The same layer in another layout: `fused` (gate_up_proj/down_proj) or `mlx`
    /// (switch_mlp, quantized to `bits` when given).
    fn relaid(
        tensors: &[(String, Array)],
        layout: &str,
        bits: Option<i32>,
    ) -> Vec<(String, Array)> {
        let mut out: Vec<(String, Array)> = tensors
            .iter()
            .filter(|(n, _)| !n.starts_with("mlp.experts."))
            .cloned()
            .collect();
        let (gate, up, down) = (
            stacked(tensors, "gate_proj"),
            stacked(tensors, "up_proj"),
            stacked(tensors, "down_proj"),
        );
        match layout {
            "fused" => {
                out.push((
                    "mlp.experts.gate_up_proj".into(),
                    concatenate(&[gate, up], 1).unwrap(),
                ));
                out.push(("mlp.experts.down_proj".into(), down));
            }
            _ => {
                for (name, w) in [("gate_proj", gate), ("up_proj", up), ("down_proj", down)] {
                    let stem = format!("mlp.switch_mlp.{name}");
                    match bits {
                        None => out.push((format!("{stem}.weight"), w)),
                        Some(bits) => {
                            let (q, scales, biases) = quantize(&w, 32, bits).unwrap();
                            out.push((format!("{stem}.weight"), q));
                            out.push((format!("{stem}.scales"), scales));
                            out.push((format!("{stem}.biases"), biases));
                        }
                    }
                }
            }
        }
        out
    }

    fn load(tensors: &[(String, Array)], options: &LoadOptions) -> SparseMoe {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("layer.safetensors");
        Array::save_safetensors(tensors.iter().map(|(n, a)| (n.as_str(), a)), None, &path).unwrap();
        let mut w = Weights::open_file(&path, options).unwrap();
        SparseMoe::load(&mut w, "mlp", HIDDEN, SPEC, Activation::Silu).unwrap()
    }

    fn host(a: &Array) -> Vec<f32> {
        a.as_dtype(mlx_rs::Dtype::Float32)
            .unwrap()
            .as_slice::<f32>()
            .to_vec()
    }

    /// The block computed on the host, position by position, from the per-expert
    /// tensors: softmax over the router, the top k by a full sort, their renormalised
    /// probabilities weighting each expert's SiLU-gated MLP, plus the gated shared expert.
    fn reference(tensors: &[(String, Array)], x: &[f32]) -> Vec<f32> {
        let get = |name: &str| host(&tensors.iter().find(|(n, _)| n == name).unwrap().1);
        let matvec = |w: &[f32], rows: usize, v: &[f32]| -> Vec<f64> {
            (0..rows)
                .map(|r| {
                    (0..v.len())
                        .map(|c| w[r * v.len() + c] as f64 * v[c] as f64)
                        .sum()
                })
                .collect()
        };
        let silu = |g: f64| g / (1.0 + (-g).exp());
        let mlp = |stem: &str, v: &[f32], inner: usize| -> Vec<f64> {
            let g = matvec(&get(&format!("{stem}.gate_proj.weight")), inner, v);
            let u = matvec(&get(&format!("{stem}.up_proj.weight")), inner, v);
            let act: Vec<f32> = g
                .iter()
                .zip(&u)
                .map(|(g, u)| (silu(*g) * u) as f32)
                .collect();
            matvec(
                &get(&format!("{stem}.down_proj.weight")),
                HIDDEN as usize,
                &act,
            )
        };
        let h = HIDDEN as usize;
        let mut out = Vec::new();
        for v in x.chunks(h) {
            let logits = matvec(&get("mlp.gate.weight"), SPEC.experts as usize, v);
            let top = logits.iter().cloned().fold(f64::MIN, f64::max);
            let exp: Vec<f64> = logits.iter().map(|l| (l - top).exp()).collect();
            let total: f64 = exp.iter().sum();
            let mut ranked: Vec<(usize, f64)> = exp.iter().map(|e| e / total).enumerate().collect();
            ranked.sort_by(|a, b| b.1.total_cmp(&a.1));
            let chosen = &ranked[..SPEC.top_k as usize];
            let norm: f64 = chosen.iter().map(|c| c.1).sum();
            let mut y = vec![0.0f64; h];
            for &(e, p) in chosen {
                let expert = mlp(&format!("mlp.experts.{e}"), v, SPEC.inner as usize);
                for (yi, ei) in y.iter_mut().zip(expert) {
                    *yi += p / norm * ei;
                }
            }
            let gate = matvec(&get("mlp.shared_expert_gate.weight"), 1, v)[0];
            let shared = mlp("mlp.shared_expert", v, 32);
            for (yi, si) in y.iter_mut().zip(shared) {
                *yi += si / (1.0 + (-gate).exp());
            }
            out.extend(y.iter().map(|&v| v as f32));
        }
        out
    }

    fn max_difference(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f32::max)
    }

    /// Few positions (routes gathered as they come) and many (routes sorted by expert)
    /// both compute what the host computes expert by expert.
    #[test]
    fn routed_experts_match_a_host_computation() {
        let tensors = per_expert_tensors();
        let moe = load(&tensors, &LoadOptions::default());
        for positions in [3, 40] {
            let x = normal(&[1, positions, HIDDEN], 500 + positions as u64)
                .multiply(Array::from_f32((HIDDEN as f32).sqrt()))
                .unwrap();
            let y = moe.forward(&x).unwrap();
            assert_eq!(y.shape(), &[1, positions, HIDDEN]);
            let diff = max_difference(&host(&y), &reference(&tensors, &host(&x)));
            assert!(diff < 1e-4, "{positions} positions: max difference {diff}");
        }
    }

    /// Experts one per tensor, fused as Qwen3.5-MoE ships them, and stacked as mlx-lm
    /// writes them load to the same block; quantized stacks and quantized per-expert
    /// tensors too.
    #[test]
    fn every_checkpoint_layout_loads_the_same_experts() {
        let tensors = per_expert_tensors();
        let x = normal(&[1, 40, HIDDEN], 7)
            .multiply(Array::from_f32((HIDDEN as f32).sqrt()))
            .unwrap();
        let options = LoadOptions::default();
        let out = |t: &[(String, Array)]| host(&load(t, &options).forward(&x).unwrap());
        let reference = out(&tensors);
        assert_eq!(out(&relaid(&tensors, "fused", None)), reference);
        assert_eq!(out(&relaid(&tensors, "mlx", None)), reference);
        let quantized = out(&relaid(&tensors, "mlx", Some(4)));
        let on_load = host(
            &load(
                &tensors,
                &LoadOptions {
                    quantize: Some(Quantization {
                        bits: 4,
                        group_size: 32,
                    }),
                    ..LoadOptions::default()
                },
            )
            .forward(&x)
            .unwrap(),
        );
        // The router and the shared expert stay f32 in the stored 4-bit layer.
        let diff = max_difference(&quantized, &reference);
        assert!(diff > 0.0 && diff < 0.5, "4-bit experts: {diff}");
        assert!(max_difference(&on_load, &reference) < 0.5);
    }
}
