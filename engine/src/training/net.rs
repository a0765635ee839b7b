//! The block drafter's layers as training runs them: every anchor of a sequence at once,
//! as a function of a parameter map (so MLX's autograd differentiates it), by the
//! published checkpoints' tensor names.
//!
//! Inference runs one block at a time over a growing context cache
//! (`dspec_drafters::context`); here each sequence's whole context is projected once and
//! each anchor's block attends to the context positions before its anchor and to itself,
//! with no causal mask inside the block — what inference computes for that anchor.
//! Several sequences run at once, side by side on a leading axis. The
//! layers are Qwen3's (q/k norms, RoPE on both, grouped-query attention, SwiGLU), in f32.
//! `engine/tests/train_drafter.rs` holds the two paths equal, anchor by anchor.

use std::collections::HashMap;
use std::rc::Rc;

use mlx_rs::fast::rms_norm;
use mlx_rs::ops::{concatenate, matmul, sigmoid, softmax_axis};
use mlx_rs::Array;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::error::EngineError;

/// Parameters by tensor name, as mlx-rs's keyed autograd takes them.
pub type Params = HashMap<Rc<str>, Array>;

type Result<T> = std::result::Result<T, EngineError>;

/// What hides a key: finite, so no row of scores is all −∞ (a row always sees its block).
const HIDDEN: f32 = -1e9;

/// The drafter's shapes, from its config.
#[derive(Debug, Clone, PartialEq)]
pub struct NetShape {
    pub hidden: i32,
    pub intermediate: i32,
    pub layers: usize,
    pub heads: i32,
    pub kv_heads: i32,
    pub head_dim: i32,
    /// Width of the target's tap states (`taps × target hidden`), `fc`'s input.
    pub tap_width: i32,
    pub eps: f32,
    pub rope_theta: f32,
    /// Per layer: the sliding window, `None` for full attention.
    pub windows: Vec<Option<i32>>,
    /// DSpark's Markov head rank and confidence head (0: neither, as in DFlash).
    pub markov_rank: i32,
    pub vocab: i32,
}

impl NetShape {
    /// Every tensor the drafter's layers hold, with its shape (norm weights are 1-D).
    pub fn tensors(&self) -> Vec<(String, Vec<i32>)> {
        let (h, d) = (self.hidden, self.head_dim);
        let mut all = vec![
            ("fc.weight".to_string(), vec![h, self.tap_width]),
            ("hidden_norm.weight".to_string(), vec![h]),
        ];
        for i in 0..self.layers {
            let p = format!("layers.{i}");
            all.extend([
                (format!("{p}.input_layernorm.weight"), vec![h]),
                (
                    format!("{p}.self_attn.q_proj.weight"),
                    vec![self.heads * d, h],
                ),
                (
                    format!("{p}.self_attn.k_proj.weight"),
                    vec![self.kv_heads * d, h],
                ),
                (
                    format!("{p}.self_attn.v_proj.weight"),
                    vec![self.kv_heads * d, h],
                ),
                (
                    format!("{p}.self_attn.o_proj.weight"),
                    vec![h, self.heads * d],
                ),
                (format!("{p}.self_attn.q_norm.weight"), vec![d]),
                (format!("{p}.self_attn.k_norm.weight"), vec![d]),
                (format!("{p}.post_attention_layernorm.weight"), vec![h]),
                (
                    format!("{p}.mlp.gate_proj.weight"),
                    vec![self.intermediate, h],
                ),
                (
                    format!("{p}.mlp.up_proj.weight"),
                    vec![self.intermediate, h],
                ),
                (
                    format!("{p}.mlp.down_proj.weight"),
                    vec![h, self.intermediate],
                ),
            ]);
        }
        all.push(("norm.weight".to_string(), vec![h]));
        let r = self.markov_rank;
        if r > 0 {
            all.extend([
                (MARKOV_W1.to_string(), vec![self.vocab, r]),
                (MARKOV_W2.to_string(), vec![self.vocab, r]),
                (CONFIDENCE_WEIGHT.to_string(), vec![1, h + r]),
                (CONFIDENCE_BIAS.to_string(), vec![1]),
            ]);
        }
        all
    }
}

/// DSpark's Markov head (`w2(w1[previous token])`, added to the logits) and confidence
/// head (a sigmoid of the hidden state beside `w1[previous token]`).
pub const MARKOV_W1: &str = "markov_head.markov_w1.weight";
pub const MARKOV_W2: &str = "markov_head.markov_w2.weight";
pub const CONFIDENCE_WEIGHT: &str = "confidence_head.proj.weight";
pub const CONFIDENCE_BIAS: &str = "confidence_head.proj.bias";

/// Fresh parameters: norms at one, biases at zero, each product uniform in ±1/√inputs
/// (the usual fan-in scale, which keeps activations' size through the layers), and the
/// Markov head's output at zero, so it starts as no correction; from `seed` alone.
pub fn initial_params(tensors: &[(String, Vec<i32>)], seed: u64) -> Params {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    tensors
        .iter()
        .map(|(name, shape)| {
            let count: i32 = shape.iter().product();
            let values: Vec<f32> = if name.ends_with(".bias") || name == MARKOV_W2 {
                vec![0.0; count as usize]
            } else if shape.len() == 1 {
                vec![1.0; count as usize]
            } else {
                let bound = 1.0 / (shape[shape.len() - 1] as f32).sqrt();
                (0..count)
                    .map(|_| rng.random_range(-bound..bound))
                    .collect()
            };
            (Rc::from(name.as_str()), Array::from_slice(&values, shape))
        })
        .collect()
}

/// Several sequences' inputs to the drafter's layers, each with the same number of
/// blocks (a shorter sequence's padded with blocks whose predictions weigh nothing).
pub struct BlockInputs {
    /// The target's tap states of each sequence, `[S, T, tap_width]` f32; a shorter
    /// sequence's padded after its end, where no anchor looks.
    pub context: Array,
    /// The blocks `[anchor token, mask, …]` through the target's embedding,
    /// `[S, N, B, hidden]` f32.
    pub blocks: Array,
    /// Per sequence, each block's anchor position (`N` each): it sees the context before it.
    pub anchors: Vec<Vec<i32>>,
}

pub fn param<'a>(params: &'a Params, name: &str) -> Result<&'a Array> {
    params
        .get(name)
        .ok_or_else(|| EngineError::Invalid(format!("drafter parameter `{name}` is missing")))
}

/// `x · wᵀ`.
fn linear(params: &Params, name: &str, x: &Array) -> Result<Array> {
    Ok(matmul(x, param(params, name)?.t())?)
}

fn norm(params: &Params, name: &str, x: &Array, eps: f32) -> Result<Array> {
    Ok(rms_norm(x, Some(param(params, name)?), eps)?)
}

/// Non-interleaved RoPE at given positions: pairs `(i, i + D/2)` of each head rotated by
/// `position · θ^(−2i/D)`. The angles' tables are made once per forward and shared by
/// every layer.
struct Rotation {
    /// `[..positions' shape, 1, D/2]` each: one table row per position, broadcast over heads.
    cos: Array,
    sin: Array,
}

impl Rotation {
    /// `positions` laid out as `shape` (its product is their count).
    fn new(positions: &[i32], shape: &[i32], theta: f32, head_dim: i32) -> Self {
        let half = head_dim / 2;
        let inv: Vec<f64> = (0..half)
            .map(|i| (theta as f64).powf(-2.0 * i as f64 / head_dim as f64))
            .collect();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for &p in positions {
            for &f in &inv {
                let angle = p as f64 * f;
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        let mut table = shape.to_vec();
        table.extend([1, half]);
        Self {
            cos: Array::from_slice(&cos, &table),
            sin: Array::from_slice(&sin, &table),
        }
    }

    /// `x`: `[.., positions, heads, D]`, positions laid out as the table's.
    fn apply(&self, x: &Array) -> Result<Array> {
        let halves = x.split_equal(2, -1)?;
        let (x1, x2) = (&halves[0], &halves[1]);
        Ok(concatenate(
            &[
                x1.multiply(&self.cos)?.subtract(x2.multiply(&self.sin)?)?,
                x2.multiply(&self.cos)?.add(x1.multiply(&self.sin)?)?,
            ],
            -1,
        )?)
    }
}

/// The additive mask of each sequence's block queries (`[S, N·B]`) over its
/// `[context (T) ; blocks (N·B)]`, `[S, N·B, T + N·B]`: a block sees the context before
/// its anchor (within `window` positions of the query) and the whole of itself. Built on
/// the device from the anchors alone.
fn block_mask(
    anchors: &[Vec<i32>],
    block: i32,
    context: i32,
    window: Option<i32>,
) -> Result<Array> {
    let s = anchors.len() as i32;
    let queries = anchors.first().map_or(0, |a| a.len() as i32) * block;
    let anchor_of: Vec<i32> = anchors
        .iter()
        .flatten()
        .flat_map(|&a| std::iter::repeat_n(a, block as usize))
        .collect();
    let anchor_of = Array::from_slice(&anchor_of, &[s, queries, 1]);
    let keys = mlx_rs::ops::arange::<_, i32>(0, context, None)?.reshape(&[1, 1, context])?;
    let mut seen = keys.lt(&anchor_of)?;
    if let Some(w) = window {
        let within = |n: i32| (0..block).map(move |j| n + j);
        let position_of: Vec<i32> = anchors.iter().flatten().flat_map(|&a| within(a)).collect();
        let distance = Array::from_slice(&position_of, &[s, queries, 1]).subtract(&keys)?;
        seen = seen.logical_and(distance.lt(Array::from_int(w))?)?;
    }
    let block_of: Vec<i32> = (0..queries).map(|q| q / block).collect();
    let block_of = Array::from_slice(&block_of, &[queries]);
    let same_block = block_of
        .reshape(&[queries, 1])?
        .eq(block_of.reshape(&[1, queries])?)?;
    let same_block = mlx_rs::ops::broadcast_to(&same_block, &[s, queries, queries])?;
    let visible = concatenate(&[seen, same_block], -1)?;
    Ok(mlx_rs::ops::select(
        &visible,
        Array::from_f32(0.0),
        Array::from_f32(HIDDEN),
    )?)
}

/// Scaled dot-product attention of `q` (`[S, Lq, heads, D]`) over `k`, `v`
/// (`[S, Lk, kv_heads, D]`) under the additive `mask` (`[S, Lq, Lk]`); `[S, Lq, heads·D]`.
fn attend(q: &Array, k: &Array, v: &Array, mask: &Array, shape: &NetShape) -> Result<Array> {
    let (s, lq, lk, d) = (q.shape()[0], q.shape()[1], k.shape()[1], shape.head_dim);
    let group = shape.heads / shape.kv_heads;
    let q = q
        .transpose_axes(&[0, 2, 1, 3])?
        .reshape(&[s, shape.kv_heads, group, lq, d])?;
    let k = k
        .transpose_axes(&[0, 2, 3, 1])?
        .reshape(&[s, shape.kv_heads, 1, d, lk])?;
    let v = v
        .transpose_axes(&[0, 2, 1, 3])?
        .reshape(&[s, shape.kv_heads, 1, lk, d])?;
    let scale = Array::from_f32(1.0 / (d as f32).sqrt());
    let mask = mask.reshape(&[s, 1, 1, lq, lk])?;
    let scores = matmul(&q, &k)?.multiply(&scale)?.add(&mask)?;
    let out = matmul(&softmax_axis(&scores, -1, true)?, &v)?;
    Ok(out
        .reshape(&[s, shape.heads, lq, d])?
        .transpose_axes(&[0, 2, 1, 3])?
        .reshape(&[s, lq, shape.heads * d])?)
}

/// `[.., L, n·d]` as `[.., L, n, d]`.
fn heads(x: &Array, n: i32, d: i32) -> Result<Array> {
    let mut shape = x.shape().to_vec();
    shape.pop();
    shape.extend([n, d]);
    Ok(x.reshape(&shape)?)
}

/// The blocks through every layer and the final norm: `[S, N, B, hidden]`.
pub fn block_hidden(params: &Params, shape: &NetShape, inputs: &BlockInputs) -> Result<Array> {
    let blocks = inputs.blocks.shape();
    let (s, n, block) = (blocks[0], blocks[1], blocks[2]);
    let t = inputs.context.shape()[1];
    let (d, eps) = (shape.head_dim, shape.eps);
    let fused = norm(
        params,
        "hidden_norm.weight",
        &linear(params, "fc.weight", &inputs.context)?,
        eps,
    )?;
    let context_positions: Vec<i32> = (0..t).collect();
    let block_positions: Vec<i32> = inputs
        .anchors
        .iter()
        .flatten()
        .flat_map(|&a| (0..block).map(move |j| a + j))
        .collect();
    let context_rotation = Rotation::new(&context_positions, &[t], shape.rope_theta, d);
    let block_rotation = Rotation::new(&block_positions, &[s, n * block], shape.rope_theta, d);
    let mut masks: Vec<(Option<i32>, Array)> = Vec::new();
    let mut x = inputs.blocks.reshape(&[s, n * block, shape.hidden])?;
    for (i, &window) in shape.windows.iter().enumerate() {
        let p = |name: &str| format!("layers.{i}.{name}");
        let mask = match masks.iter().find(|(w, _)| *w == window) {
            Some((_, m)) => m.clone(),
            None => {
                let m = block_mask(&inputs.anchors, block, t, window)?;
                masks.push((window, m.clone()));
                m
            }
        };
        let h = norm(params, &p("input_layernorm.weight"), &x, eps)?;
        let keys_of = |source: &Array, rotation: &Rotation| -> Result<(Array, Array)> {
            let k = heads(
                &linear(params, &p("self_attn.k_proj.weight"), source)?,
                shape.kv_heads,
                d,
            )?;
            let k = norm(params, &p("self_attn.k_norm.weight"), &k, eps)?;
            let v = heads(
                &linear(params, &p("self_attn.v_proj.weight"), source)?,
                shape.kv_heads,
                d,
            )?;
            Ok((rotation.apply(&k)?, v))
        };
        let (context_k, context_v) = keys_of(&fused, &context_rotation)?;
        let (block_k, block_v) = keys_of(&h, &block_rotation)?;
        let q = heads(
            &linear(params, &p("self_attn.q_proj.weight"), &h)?,
            shape.heads,
            d,
        )?;
        let q = block_rotation.apply(&norm(params, &p("self_attn.q_norm.weight"), &q, eps)?)?;
        let k = concatenate(&[context_k, block_k], 1)?;
        let v = concatenate(&[context_v, block_v], 1)?;
        let attended = attend(&q, &k, &v, &mask, shape)?;
        x = x.add(linear(params, &p("self_attn.o_proj.weight"), &attended)?)?;
        let h = norm(params, &p("post_attention_layernorm.weight"), &x, eps)?;
        let gate = linear(params, &p("mlp.gate_proj.weight"), &h)?;
        let up = linear(params, &p("mlp.up_proj.weight"), &h)?;
        let act = gate.multiply(sigmoid(&gate)?)?.multiply(&up)?;
        x = x.add(linear(params, &p("mlp.down_proj.weight"), &act)?)?;
    }
    let out = norm(params, "norm.weight", &x, eps)?;
    Ok(out.reshape(&[s, n, block, shape.hidden])?)
}
