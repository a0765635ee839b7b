//! How a decoder lays out a short continuation of a cached sequence (a speculative
//! verify): in the row layout, or over the whole cache buffer padded to one width. The
//! plain and the hybrid decoder both decide by this one rule, so that they verify alike.

use mlx_rs::ops::indexing::TryIndexOp;
use mlx_rs::ops::{broadcast_to, concatenate};
use mlx_rs::Array;

use dspec_plugin_api::error::Result;

use crate::attention::{is_short_continuation, WHOLE_BUFFER_MAX_TOKENS};

/// Longest continuation run in the row layout; longer ones (a second chat turn, say)
/// take the batched path, whose per-token cost is far lower.
pub const MAX_ROWWISE_TOKENS: i32 = 32;

/// How one forward lays out the positions it was asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContinuationLayout {
    /// Positions run in the row layout, each through the one-token kernels (see
    /// [`crate::layers::is_row_layout`]).
    pub rows: bool,
    /// Attention spans the whole cache buffer (see [`crate::attention::whole_buffer_pays`]).
    pub over_whole_buffer: bool,
    /// Repeats of the last token appended to reach [`WHOLE_BUFFER_MAX_TOKENS`]. They come
    /// after the real positions, so they change nothing before them; the caller cuts
    /// their outputs and trims their cache positions.
    pub pad: i32,
}

impl ContinuationLayout {
    /// The layout of `asked` positions after `offset` cached ones. `rowwise`: the model
    /// runs verifies in the row layout (`LoadOptions::rowwise_verify`); `whole_buffer`:
    /// attention over the whole cache buffer pays for this forward.
    pub fn choose(offset: i32, asked: i32, rowwise: bool, whole_buffer: bool) -> Self {
        let rows = rowwise && offset > 0 && asked > 1 && asked <= MAX_ROWWISE_TOKENS;
        let over_whole_buffer = !rows && whole_buffer && is_short_continuation(offset, asked);
        let pad = match over_whole_buffer {
            true => WHOLE_BUFFER_MAX_TOKENS - asked,
            false => 0,
        };
        Self {
            rows,
            over_whole_buffer,
            pad,
        }
    }

    /// `tokens` (`[1, asked]`) followed by the padding.
    pub fn padded(&self, tokens: &Array) -> Result<Array> {
        if self.pad == 0 {
            return Ok(tokens.clone());
        }
        let asked = tokens.shape()[1];
        let last = tokens.try_index((.., asked - 1..))?;
        Ok(concatenate(
            &[tokens.clone(), broadcast_to(&last, &[1, self.pad])?],
            1,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A verify runs in the row layout when the model asks for it, else over the whole
    /// buffer where that pays, padded to one width; a prompt (nothing cached) and one
    /// token take neither.
    #[test]
    fn short_continuations_take_one_layout() {
        let rows = ContinuationLayout::choose(10, 4, true, true);
        assert!(rows.rows && !rows.over_whole_buffer && rows.pad == 0);
        let whole = ContinuationLayout::choose(10, 4, false, true);
        assert!(!whole.rows && whole.over_whole_buffer);
        assert_eq!(whole.pad, WHOLE_BUFFER_MAX_TOKENS - 4);
        let tokens = Array::from_slice(&[1, 2, 3, 4], &[1, 4]);
        let padded = whole.padded(&tokens).unwrap();
        assert_eq!(padded.shape(), &[1, WHOLE_BUFFER_MAX_TOKENS]);
        assert_eq!(padded.as_slice::<i32>()[..6], [1, 2, 3, 4, 4, 4]);
        for (offset, asked) in [(0, 4), (10, 1)] {
            let plain = ContinuationLayout::choose(offset, asked, true, true);
            assert!(!plain.rows && !plain.over_whole_buffer && plain.pad == 0);
        }
        let plain = ContinuationLayout::choose(10, 4, false, false);
        assert_eq!(plain.padded(&tokens).unwrap().shape(), &[1, 4]);
    }
}
