//! A 2-D f32 transpose done on the host, into a new row-major array.
//!
//! MLX's CPU backend copies a transposed view element by element in the output's order,
//! reading the source a whole row apart at every step: for the weights of a model that
//! is tens of seconds (docs/benchmarks.md, "Weight layout on the CPU"). Copying block by
//! block keeps both sides in cache, and the machine's threads share the blocks.

use std::thread;

use mlx_rs::error::Exception;
use mlx_rs::{Array, Dtype};

/// Blocks of `BLOCK × BLOCK` elements go through registers; tiles of `TILE × TILE`
/// elements of the source and of the destination stay in cache together.
const BLOCK: usize = 8;
const TILE: usize = 64;

/// Below this many elements the copy runs on the calling thread.
const THREADED_FROM: usize = 1 << 20;

/// `blocks` (`[rows_i, cols]` each, f32) stacked along their rows and transposed, into a
/// new row-major `[cols, Σ rows_i]` array, without making the stacked array first. The
/// blocks are evaluated; the result is evaluated and is not a node of any graph.
pub fn stacked_transposed_on_host(blocks: &[Array]) -> Result<Array, Exception> {
    let cols = match blocks.first().map(|b| b.shape()) {
        Some(&[_, cols]) => cols,
        _ => return Err(not_a_matrix(blocks)),
    };
    if blocks
        .iter()
        .any(|b| b.ndim() != 2 || b.shape()[1] != cols || b.dtype() != Dtype::Float32)
    {
        return Err(not_a_matrix(blocks));
    }
    let contiguous = blocks
        .iter()
        .map(|b| match b.try_as_slice::<f32>() {
            Ok(_) => Ok(b.clone()),
            Err(_) => b.contiguous(),
        })
        .collect::<Result<Vec<Array>, Exception>>()?;
    let sources = contiguous
        .iter()
        .map(|b| {
            Ok((
                b.try_as_slice::<f32>().map_err(not_readable)?,
                b.shape()[0] as usize,
            ))
        })
        .collect::<Result<Vec<(&[f32], usize)>, Exception>>()?;
    let rows: usize = sources.iter().map(|(_, rows)| rows).sum();
    let cols = cols as usize;
    // The destination is a buffer MLX allocates and owns like any other: an array made
    // from host memory would be copied once more, since MLX's CPU allocator cannot adopt
    // a foreign buffer.
    let out = Array::zeros::<f32>(&[cols as i32, rows as i32])?;
    out.try_as_slice::<f32>().map_err(not_readable)?;
    // SAFETY: `out` is evaluated, row-contiguous (checked just above) and holds
    // rows × cols f32s; it was made here and nothing else refers to it, so writing
    // through its data pointer is seen by no one before it is returned.
    let dst = unsafe {
        let data = mlx_sys::mlx_array_data_float32(out.as_ptr()).cast_mut();
        std::slice::from_raw_parts_mut(data, rows * cols)
    };
    transpose_into(&sources, cols, dst);
    Ok(out)
}

fn not_a_matrix(blocks: &[Array]) -> Exception {
    let found: Vec<String> = blocks
        .iter()
        .map(|b| format!("{:?} {:?}", b.dtype(), b.shape()))
        .collect();
    Exception::custom(format!(
        "a host transpose takes f32 matrices with the same number of columns, not [{}]",
        found.join(", ")
    ))
}

fn not_readable(e: mlx_rs::error::AsSliceError) -> Exception {
    Exception::custom(format!("reading an array to transpose on the host: {e}"))
}

/// Writes the transpose of the row-major blocks in `sources` (data, rows; `cols` columns
/// each), stacked along their rows, into `dst` (`[cols, Σ rows]`).
fn transpose_into(sources: &[(&[f32], usize)], cols: usize, dst: &mut [f32]) {
    let rows: usize = sources.iter().map(|(_, rows)| rows).sum();
    let threads = match dst.len() >= THREADED_FROM {
        true => thread::available_parallelism().map_or(1, |n| n.get()),
        false => 1,
    };
    // Each thread owns a band of destination rows (source columns), whole tiles wide.
    let band = cols.div_ceil(threads).div_ceil(TILE) * TILE;
    if band == 0 || rows == 0 {
        return;
    }
    thread::scope(|scope| {
        for (i, out) in dst.chunks_mut(band * rows).enumerate() {
            scope.spawn(move || {
                let mut offset = 0;
                for &(src, block_rows) in sources {
                    let band = Band {
                        first: i * band,
                        stride: rows,
                        offset,
                    };
                    transpose_band(src, block_rows, cols, band, out);
                    offset += block_rows;
                }
            });
        }
    });
}

/// Where a block's columns land in a thread's share of the destination.
#[derive(Clone, Copy)]
struct Band {
    /// The first source column of the share.
    first: usize,
    /// The destination's row length (all blocks' rows).
    stride: usize,
    /// The block's first row within a destination row.
    offset: usize,
}

/// Source columns `band.first..` of `src` (`[rows, cols]`), written into the rows of
/// `out` at `band.offset`: in blocks of `BLOCK × BLOCK` elements read a row at a time and
/// written a row at a time through a block on the stack, the blocks walked tile by tile.
fn transpose_band(src: &[f32], rows: usize, cols: usize, band: Band, out: &mut [f32]) {
    let Band {
        first,
        stride,
        offset,
    } = band;
    let width = out.len() / stride;
    let (whole_rows, whole_cols) = (rows / BLOCK * BLOCK, width / BLOCK * BLOCK);
    for r_tile in (0..whole_rows).step_by(TILE) {
        for c_tile in (0..whole_cols).step_by(TILE) {
            for r0 in (r_tile..(r_tile + TILE).min(whole_rows)).step_by(BLOCK) {
                for c0 in (c_tile..(c_tile + TILE).min(whole_cols)).step_by(BLOCK) {
                    let mut block = [[0f32; BLOCK]; BLOCK];
                    for (i, row) in src[r0 * cols + first + c0..]
                        .chunks(cols)
                        .take(BLOCK)
                        .enumerate()
                    {
                        for (j, &v) in row[..BLOCK].iter().enumerate() {
                            block[j][i] = v;
                        }
                    }
                    for (j, line) in block.iter().enumerate() {
                        let at = (c0 + j) * stride + offset + r0;
                        out[at..at + BLOCK].copy_from_slice(line);
                    }
                }
            }
        }
    }
    // The edges that are no whole block.
    for c in 0..width {
        let start = if c < whole_cols { whole_rows } else { 0 };
        for r in start..rows {
            out[c * stride + offset + r] = src[r * cols + first + c];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mlx_rs::random;

    fn transposed(a: &Array) -> Result<Array, Exception> {
        stacked_transposed_on_host(std::slice::from_ref(a))
    }

    /// Against MLX's own transpose, for shapes that are and are not whole tiles, small
    /// (one thread) and large (threaded, with a band that is not a whole tile multiple
    /// of the columns), and from a source that is itself a transposed view.
    #[test]
    fn equals_mlx_transpose() {
        for (rows, cols) in [(1, 1), (3, 5), (32, 64), (33, 65), (1000, 1100), (7, 2048)] {
            let a = random::normal::<f32>(&[rows, cols], None, None, None).unwrap();
            let t = transposed(&a).unwrap();
            assert_eq!(t.shape(), &[cols, rows]);
            let want = a.t().contiguous().unwrap();
            assert!(t.eq_values(&want).unwrap(), "{rows}x{cols}");
            // Used as an operand like any array, and transposed back.
            let back = transposed(&a.t()).unwrap();
            assert!(back.eq_values(&a).unwrap(), "{rows}x{cols} from a view");
            let doubled = t.add(&want).unwrap();
            assert!(doubled
                .eq_values(want.multiply(Array::from(2f32)).unwrap())
                .unwrap());
        }
    }

    /// Blocks stacked and transposed in one copy equal MLX's concatenation transposed,
    /// threaded or not, with blocks that are and are not whole tiles.
    #[test]
    fn stacked_blocks_equal_their_concatenation_transposed() {
        for (cols, heights) in [(5, vec![1, 3]), (1100, vec![700, 64, 300]), (64, vec![33])] {
            let blocks: Vec<Array> = heights
                .iter()
                .map(|&h| random::normal::<f32>(&[h, cols], None, None, None).unwrap())
                .collect();
            let t = stacked_transposed_on_host(&blocks).unwrap();
            let want = mlx_rs::ops::concatenate(&blocks, 0).unwrap().t();
            assert!(
                t.eq_values(&want).unwrap(),
                "{cols} columns, rows {heights:?}"
            );
        }
    }

    #[test]
    fn other_shapes_and_dtypes_are_refused() {
        let three = Array::zeros::<f32>(&[2, 2, 2]).unwrap();
        assert!(transposed(&three).is_err());
        let ints = Array::zeros::<i32>(&[2, 2]).unwrap();
        assert!(transposed(&ints).is_err());
        let (two, three) = (
            Array::zeros::<f32>(&[2, 2]).unwrap(),
            Array::zeros::<f32>(&[2, 3]).unwrap(),
        );
        assert!(
            stacked_transposed_on_host(&[two, three]).is_err(),
            "unequal columns"
        );
        assert!(stacked_transposed_on_host(&[]).is_err());
    }
}
