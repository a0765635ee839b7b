//! What each step trains on and at which rate, from the seed and the step alone: a run
//! resumed at step s trains on what an uninterrupted one would have.

use rand::seq::SliceRandom;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

/// Linear warm-up to `peak`, then cosine decay to zero at `total`.
#[derive(Debug, Clone, Copy)]
pub struct LearningRate {
    pub peak: f32,
    pub warmup: usize,
    pub total: usize,
}

impl LearningRate {
    pub fn at(&self, step: usize) -> f32 {
        if step < self.warmup {
            return self.peak * (step + 1) as f32 / self.warmup as f32;
        }
        let span = self.total.saturating_sub(self.warmup).max(1) as f32;
        let done = ((step - self.warmup) as f32 / span).min(1.0);
        self.peak * 0.5 * (1.0 + (std::f32::consts::PI * done).cos())
    }
}

/// Streams of the run's random generator: each epoch's order, and each step's anchors.
fn rng(seed: u64, stream: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream);
    rng
}

/// The generator of step `step`'s anchors.
pub fn anchor_rng(seed: u64, step: usize) -> ChaCha8Rng {
    rng(seed, 2 * step as u64 + 1)
}

/// Epochs of the examples in a shuffled order, cut into steps of about `batch_tokens`
/// tokens (at least one example each).
pub struct Plan {
    lengths: Vec<usize>,
    batch_tokens: usize,
    seed: u64,
    /// The steps of each epoch made so far.
    epochs: Vec<Vec<Vec<usize>>>,
}

impl Plan {
    pub fn new(lengths: Vec<usize>, batch_tokens: usize, seed: u64) -> Self {
        Self {
            lengths,
            batch_tokens: batch_tokens.max(1),
            seed,
            epochs: Vec::new(),
        }
    }

    fn epoch(&mut self, e: usize) -> &[Vec<usize>] {
        while self.epochs.len() <= e {
            let at = self.epochs.len();
            let mut order: Vec<usize> = (0..self.lengths.len()).collect();
            order.shuffle(&mut rng(self.seed, 2 * at as u64));
            let mut steps: Vec<Vec<usize>> = Vec::new();
            let mut tokens = 0;
            for i in order {
                if steps.is_empty() || tokens >= self.batch_tokens {
                    steps.push(Vec::new());
                    tokens = 0;
                }
                if let Some(last) = steps.last_mut() {
                    last.push(i);
                }
                tokens += self.lengths[i];
            }
            self.epochs.push(steps);
        }
        &self.epochs[e]
    }

    /// Steps in the first `epochs` epochs.
    pub fn steps_in(&mut self, epochs: usize) -> usize {
        (0..epochs).map(|e| self.epoch(e).len()).sum()
    }

    /// The examples of step `step` (counted from the first epoch's first step), and its epoch.
    pub fn batch(&mut self, step: usize) -> (Vec<usize>, usize) {
        let mut left = step;
        let mut e = 0;
        loop {
            let steps = self.epoch(e);
            if steps.is_empty() {
                return (Vec::new(), e);
            }
            if left < steps.len() {
                return (steps[left].clone(), e);
            }
            left -= steps.len();
            e += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_rate_warms_up_then_decays_to_zero() {
        let lr = LearningRate {
            peak: 1.0,
            warmup: 4,
            total: 20,
        };
        assert_eq!(lr.at(0), 0.25);
        assert_eq!(lr.at(3), 1.0);
        assert_eq!(lr.at(4), 1.0);
        assert!((lr.at(12) - 0.5).abs() < 1e-6);
        assert!(lr.at(19) < 0.05 && lr.at(19) > 0.0);
        assert_eq!(lr.at(25), 0.0);
    }

    #[test]
    fn every_epoch_covers_every_example_once_in_its_own_order() {
        let mut plan = Plan::new(vec![10, 20, 30, 40, 50, 60], 45, 7);
        let steps = plan.steps_in(2);
        let mut epochs: Vec<Vec<usize>> = vec![Vec::new(), Vec::new()];
        for s in 0..steps {
            let (batch, e) = plan.batch(s);
            assert!(!batch.is_empty());
            epochs[e].extend(batch);
        }
        for epoch in &epochs {
            let mut sorted = epoch.clone();
            sorted.sort();
            assert_eq!(sorted, vec![0, 1, 2, 3, 4, 5]);
        }
        assert_ne!(epochs[0], epochs[1], "each epoch is shuffled anew");
        // The same seed plans the same steps.
        let mut again = Plan::new(vec![10, 20, 30, 40, 50, 60], 45, 7);
        assert_eq!(again.batch(steps - 1), plan.batch(steps - 1));
    }
}
