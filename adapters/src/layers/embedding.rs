//! Token embeddings, dense or quantized, which serve as the output head when a model
//! ties its embeddings.

use mlx_rs::ops::dequantize;
use mlx_rs::Array;

use dspec_plugin_api::error::Result;
use dspec_plugin_api::WeightSource;

use super::dense::DenseProduct;
use super::quantized::{load_quantized, maybe_quantize, Quantized};

/// Token embedding table, usable as the output head when embeddings are tied.
#[derive(Clone)]
pub struct Embedding {
    table: Table,
}

#[derive(Clone)]
enum Table {
    /// The `[vocab, hidden]` table: rows to gather, and a tied head's weight.
    Dense(DenseProduct),
    Quantized(Quantized),
}

impl Embedding {
    /// Whether a tied head's products of a few rows go through dspec's CUDA kernel.
    pub fn use_short_kernels(&mut self, on: bool) -> Result<()> {
        match &mut self.table {
            Table::Dense(d) => d.use_short_kernels(on),
            _ => Ok(()),
        }
    }

    pub fn load(w: &mut dyn WeightSource, prefix: &str, vocab: i32, hidden: i32) -> Result<Self> {
        if w.contains(&format!("{prefix}.scales")) {
            return Ok(Embedding {
                table: Table::Quantized(load_quantized(w, prefix, vocab, hidden)?),
            });
        }
        let dense = w.tensor(&format!("{prefix}.weight"), &[vocab, hidden])?;
        let table = match maybe_quantize(dense, w.options().quantize)? {
            Ok(q) => Table::Quantized(q),
            Err(table) => Table::Dense(DenseProduct::new(table)),
        };
        Ok(Embedding { table })
    }

    /// `[..] ids -> [.., hidden]`.
    pub fn forward(&self, ids: &Array) -> Result<Array> {
        match &self.table {
            Table::Dense(d) => Ok(d.weight().take_axis(ids, 0)?),
            Table::Quantized(q) => {
                let rows = |a: &Array| a.take_axis(ids, 0);
                Ok(dequantize(
                    rows(&q.weight)?,
                    rows(&q.scales)?,
                    &rows(&q.biases)?,
                    q.group_size,
                    q.bits,
                )?)
            }
        }
    }

    /// `x Eᵀ`: logits through the embedding table (tied heads).
    pub fn as_linear(&self, x: &Array) -> Result<Array> {
        match &self.table {
            Table::Dense(d) => d.forward(x),
            Table::Quantized(q) => q.matmul_t(x),
        }
    }

    pub fn dtype(&self) -> mlx_rs::Dtype {
        match &self.table {
            Table::Dense(d) => d.dtype(),
            Table::Quantized(q) => q.scales.dtype(),
        }
    }
}
