//! Time of one MLX all-sum of a decode step's activations (`[1, 1, HIDDEN]` f32) and of
//! a verify's (`[1, 6, HIDDEN]`), what a tensor-parallel layer pays twice per forward.
//! Start it as the ranks of a group, e.g. two local ones over the ring backend:
//!
//! ```sh
//! cargo build --release -p dspec-runtime --example all_sum_latency
//! mlx.launch --backend ring -n 2 -- target/release/examples/all_sum_latency 896
//! ```

use std::time::Instant;

use mlx_rs::Array;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let hidden: i32 = std::env::args()
        .nth(1)
        .map(|a| a.parse())
        .transpose()?
        .unwrap_or(896);
    let group = dspec_runtime::distributed::init("any", true)?;
    for rows in [1, 6] {
        let x = Array::ones::<f32>(&[1, rows, hidden])?;
        // Warm-up: the first collectives set up buffers and threads.
        for _ in 0..20 {
            group.all_sum(&x)?.eval()?;
        }
        // Batches of calls, so that a machine busy with other work shows as a spread
        // between the fastest and the median batch instead of one skewed mean.
        let mut per_call: Vec<f64> = (0..10)
            .map(|_| -> Result<f64, Box<dyn std::error::Error>> {
                let start = Instant::now();
                for _ in 0..50 {
                    group.all_sum(&x)?.eval()?;
                }
                Ok(start.elapsed().as_secs_f64() * 1e6 / 50.0)
            })
            .collect::<Result<_, _>>()?;
        per_call.sort_by(f64::total_cmp);
        if group.rank() == 0 {
            println!(
                "{} ranks ({}), all_sum of [1, {rows}, {hidden}] f32: median {:.0} us, fastest batch {:.0} us",
                group.size(),
                group.backend(),
                per_call[per_call.len() / 2],
                per_call[0]
            );
        }
    }
    group.barrier()?;
    Ok(())
}
