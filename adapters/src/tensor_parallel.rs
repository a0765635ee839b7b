//! Tensor parallelism of the shared decoder over an MLX distributed group (Megatron-LM's
//! layout, as mlx-lm shards its models): in every layer q/k/v and gate/up are split by
//! output (whole attention heads, MLP hidden units), o_proj and down_proj by input, each
//! followed by one all-sum, so the residual stream is whole and equal on every rank.
//!
//! The embedding, the norms and the head are whole on every rank (tied embeddings
//! included): every rank then computes the same logits from the same residual stream
//! with no collective of its own, and a drafter that borrows the target's embedding and
//! head (DFlash) sees a whole one. Each rank reads only its part of the split tensors
//! from the checkpoint ([`WeightSource::tensor_part`]).

use std::path::Path;

use mlx_rs::Array;

use dspec_plugin_api::error::{ModelError, Result};
use dspec_plugin_api::{LoadRequest, Part, TargetModel};
use dspec_runtime::distributed::Group;

use crate::config::DecoderFamily;
use crate::transformer::{Decoder, DecoderSpec};
use crate::weights::ProgressWeights;

/// This process's place in a tensor-parallel group.
#[derive(Debug, Clone)]
pub struct TensorParallel {
    group: Group,
}

impl TensorParallel {
    pub fn new(group: Group) -> Self {
        Self { group }
    }

    pub fn rank(&self) -> i32 {
        self.group.rank()
    }

    pub fn size(&self) -> i32 {
        self.group.size()
    }

    pub fn group(&self) -> &Group {
        &self.group
    }

    /// This rank's part of a tensor split along `axis`.
    pub fn part(&self, axis: usize) -> Part {
        Part {
            axis,
            index: self.rank(),
            count: self.size(),
        }
    }

    /// The sum of every rank's `x`: the same bits on every rank (see
    /// [`Group::all_sum`]), which is what keeps the ranks' logits, and so their
    /// sampling and acceptance decisions, identical.
    pub fn all_sum(&self, x: &Array) -> Result<Array> {
        Ok(self.group.all_sum(x)?)
    }
}

/// Refuses a model whose layers do not split evenly over `size` ranks, naming what does
/// not divide and the group sizes that would work.
pub fn check_divisible(spec: &DecoderSpec, dir: &Path, size: i32) -> Result<()> {
    let mut counts = Vec::new();
    for layer in &spec.layers {
        counts.push(("num_attention_heads", layer.heads));
        counts.push(("num_key_value_heads", layer.kv_heads));
    }
    counts.push(("intermediate_size", spec.intermediate_size));
    let Some((name, value)) = counts.iter().find(|(_, v)| v % size != 0) else {
        return Ok(());
    };
    let fits: Vec<String> = (2..=64)
        .filter(|n| counts.iter().all(|(_, v)| v % n == 0))
        .map(|n| n.to_string())
        .collect();
    Err(ModelError::config(
        dir.join("config.json"),
        format!(
            "{} cannot be split over {size} ranks: tensor parallelism gives each rank whole \
             attention heads and an equal share of the MLP, but {name} is {value}, which {size} \
             does not divide; {}",
            spec.model_type,
            match fits.is_empty() {
                true =>
                    "no group size from 2 to 64 divides every layer's heads; run it on one process"
                        .into(),
                false => format!("run it on {} ranks instead", fits.join(", ")),
            }
        ),
    ))
}

/// Loads this rank's share of the model `req` describes, through adapter `adapter`'s
/// decoder mapping. Families that are not the shared decoder (the hybrid
/// linear-attention ones) and plugins are refused with what to do instead.
pub fn load(req: &LoadRequest, adapter: &str, tp: &TensorParallel) -> Result<Box<dyn TargetModel>> {
    let family = inventory::iter::<DecoderFamily>
        .into_iter()
        .find(|f| f.model_type == adapter)
        .ok_or_else(|| {
            let supported: Vec<&str> = inventory::iter::<DecoderFamily>
                .into_iter()
                .map(|f| f.model_type)
                .collect();
            ModelError::Unsupported(format!(
                "`{adapter}` models ({}) cannot be split across a distributed group: tensor \
                 parallelism covers the decoder families {}; run this model on one process",
                req.dir.display(),
                supported.join(", ")
            ))
        })?;
    let spec = (family.spec)(req.config, req.dir)?;
    check_divisible(&spec, req.dir, tp.size())?;
    let mut weights = ProgressWeights::open(req)?;
    Ok(Box::new(Decoder::load_parallel(
        spec,
        &mut weights,
        Some(tp),
    )?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fixtures::{with, TINY_LLAMA};

    fn spec(overrides: &str) -> DecoderSpec {
        let config: serde_json::Value =
            serde_json::from_str(&with(TINY_LLAMA, overrides)).expect("config");
        crate::llama::llama_spec(&config, Path::new("."), "llama", None).expect("spec")
    }

    #[test]
    fn heads_that_do_not_divide_are_refused_with_the_sizes_that_work() {
        let six = spec(
            r#"{"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 8, "intermediate_size": 96}"#,
        );
        for size in [1, 3] {
            check_divisible(&six, Path::new("m"), size).expect("divides");
        }
        let err = check_divisible(&six, Path::new("m"), 2).expect_err("3 KV heads over 2 ranks");
        let text = err.to_string();
        assert!(text.contains("num_key_value_heads is 3"), "{text}");
        assert!(
            text.contains("over 2 ranks") && text.contains("run it on 3 ranks"),
            "{text}"
        );
        assert!(text.contains("m/config.json"), "{text}");
    }
}
