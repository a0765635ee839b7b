//! Simulated rounds for the controller's tests: drafts kept at a chosen rate, drafting
//! and verifies at chosen costs, from a fixed pseudo-random stream.

use super::DraftLength;

/// A fixed pseudo-random stream (xorshift) of numbers in [0, 1).
pub(super) fn uniform_stream(mut state: u64) -> impl FnMut() -> f64 {
    move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Feeds `rounds` simulated rounds in which each draft is kept with chance `alpha`
/// (given the one before was; a fixed pseudo-random stream), drafting costs `draft_s`
/// a token and a verify of width w costs `verify(w)`; returns the lengths chosen.
pub(super) fn simulate(
    max: usize,
    rounds: usize,
    alpha: f64,
    draft_s: f64,
    verify: impl Fn(usize) -> f64,
) -> Vec<usize> {
    simulate_ahead(max, rounds, alpha, draft_s, verify, false)
}

/// As [`simulate`]; `ahead`: while rounds draft nothing, the next round's length is
/// chosen before the round in flight is observed, as the engine's plain steps do.
pub(super) fn simulate_ahead(
    max: usize,
    rounds: usize,
    alpha: f64,
    draft_s: f64,
    verify: impl Fn(usize) -> f64,
    ahead: bool,
) -> Vec<usize> {
    let mut control = DraftLength::new(max, true);
    let mut uniform = uniform_stream(0x2545_f491_4f6c_dd1du64);
    let mut chosen = Vec::new();
    let mut planned = None;
    for _ in 0..rounds {
        let k = planned.take().unwrap_or_else(|| control.next(usize::MAX));
        chosen.push(k);
        if ahead && k == 0 {
            planned = Some(control.next(usize::MAX));
        }
        let kept = (0..k).take_while(|_| uniform() < alpha).count();
        control.observe(k, kept, draft_s * k as f64, verify(k + 1));
    }
    chosen
}

pub(super) fn most_common(ks: &[usize]) -> usize {
    let mut counts = std::collections::BTreeMap::new();
    for &k in ks {
        *counts.entry(k).or_insert(0) += 1;
    }
    counts
        .into_iter()
        .max_by_key(|&(_, c)| c)
        .map_or(0, |(k, _)| k)
}

/// Rounds of a drafter that reports its agreement on plain steps' tokens: `agree(i)`
/// is the chance its guess is right at round `i`, and drafts are kept at that chance.
/// Drafting costs `draft_s` a token, a verify `verify(w)`, a plain step `plain_s`.
pub(super) fn simulate_with_agreement(
    rounds: usize,
    agree: impl Fn(usize) -> f64,
    draft_s: f64,
    verify: impl Fn(usize) -> f64,
    plain_s: f64,
) -> Vec<usize> {
    simulate_agreement_apart(rounds, &agree, &agree, draft_s, verify, plain_s)
}

/// As [`simulate_with_agreement`], but drafts are kept at `keep(i)`, which may differ
/// from the agreement plain steps measure (a verify rounding near-ties its own way).
pub(super) fn simulate_agreement_apart(
    rounds: usize,
    agree: &dyn Fn(usize) -> f64,
    keep: &dyn Fn(usize) -> f64,
    draft_s: f64,
    verify: impl Fn(usize) -> f64,
    plain_s: f64,
) -> Vec<usize> {
    let mut control = DraftLength::new(8, true);
    control.set_agreement_measured();
    let mut uniform = uniform_stream(0x9e37_79b9_7f4a_7c15u64);
    let mut chosen = Vec::new();
    for i in 0..rounds {
        let k = control.next(usize::MAX);
        chosen.push(k);
        if k == 0 {
            control.observe(0, 0, 0.0, plain_s);
            control.observe_agreement(usize::from(uniform() < agree(i)), 1);
        } else {
            let kept = (0..k).take_while(|_| uniform() < keep(i)).count();
            control.observe(k, kept, draft_s * k as f64, verify(k + 1));
        }
    }
    chosen
}
