//! The controller's tests: simulated rounds (`simulation.rs`) of drafts kept at chosen
//! rates and verifies at chosen costs, and a few observations made by hand.

use super::simulation::{
    most_common, simulate, simulate_agreement_apart, simulate_ahead, simulate_with_agreement,
    uniform_stream,
};
use super::*;

#[test]
fn good_drafts_and_a_flat_verify_draft_the_maximum() {
    let ks = simulate(6, 60, 1.0, 0.0005, |_| 0.01);
    assert_eq!(most_common(&ks[20..]), 6, "{ks:?}");
}

#[test]
fn drafts_that_are_never_kept_stop_being_drafted() {
    // Each draft costs half a verify and is never kept: plain steps (k = 0) win,
    // with the occasional probe of one draft.
    let ks = simulate(6, 80, 0.0, 0.005, |w| 0.01 + 0.0001 * w as f64);
    let tail = &ks[30..];
    assert_eq!(most_common(tail), 0, "{ks:?}");
    assert!(tail.iter().all(|&k| k <= 1), "{ks:?}");
    assert!(
        tail.contains(&1),
        "probes keep measuring acceptance: {ks:?}"
    );
}

/// Plain steps choose the next round before their own is observed: never-kept
/// drafts still stop being drafted, and the probes still come, further and further
/// apart while they keep finding that drafts do not pay.
#[test]
fn choosing_one_round_ahead_keeps_the_plain_steps_and_the_probes() {
    let ks = simulate_ahead(6, 400, 0.0, 0.005, |w| 0.01 + 0.0001 * w as f64, true);
    let tail = &ks[30..];
    assert_eq!(most_common(tail), 0, "{ks:?}");
    assert!(tail.iter().all(|&k| k <= 1), "{ks:?}");
    let probes: Vec<usize> = (30..ks.len()).filter(|&i| ks[i] == 1).collect();
    assert!(probes.len() >= 3, "{ks:?}");
    let gaps: Vec<usize> = probes.windows(2).map(|p| p[1] - p[0]).collect();
    assert!(
        gaps.windows(2).all(|g| g[1] >= g[0]),
        "probes spread out: {gaps:?}"
    );
    assert!(gaps.last() > gaps.first(), "probes spread out: {gaps:?}");
    assert!(
        probes.len() <= 8,
        "{} probes in {} rounds",
        probes.len(),
        tail.len()
    );
}

/// Where a verify costs several plain steps (a GPU bound by the host's per-operation
/// work), drafting is weighed against the plain step: a draft model as slow per token
/// as the target stops drafting even though its drafts are kept, while free drafts
/// that are kept often still pay.
#[test]
fn drafting_is_weighed_against_the_plain_step() {
    let verify = |w: usize| if w == 1 { 1.0 } else { 3.0 + 0.1 * w as f64 };
    let dear_drafts = simulate_ahead(8, 200, 0.95, 1.0, verify, true);
    assert_eq!(most_common(&dear_drafts[50..]), 0, "{dear_drafts:?}");
    let free_drafts = simulate_ahead(8, 200, 0.95, 0.0, verify, true);
    assert_eq!(most_common(&free_drafts[50..]), 8, "{free_drafts:?}");
}

#[test]
fn a_verify_that_grows_with_width_shortens_the_drafts() {
    // Free drafts kept 70% of the time. A flat verify (a GPU's) makes every extra
    // draft free: the maximum. A verify costing 5× more per position than its fixed
    // part (a CPU's) makes a long block cost more than its expected gain.
    let flat = simulate(8, 120, 0.7, 0.0, |_| 0.01);
    let steep = simulate(8, 120, 0.7, 0.0, |w| 0.002 + 0.01 * w as f64);
    assert_eq!(most_common(&flat[40..]), 8, "{flat:?}");
    assert!(most_common(&steep[40..]) <= 2, "{steep:?}");
}

/// A mixture-of-experts target: a verify of w positions reads every expert any of
/// them was routed to, so its cost grows with width, steeply and then less so
/// (Qwen3-30B-A3B's shape: 8 of 128 experts a position, experts most of a step's
/// weight). Drafts kept half the time do not pay for that: plain steps. Drafts kept
/// 90% of the time pay for a few positions, not for the maximum. Either way the
/// rounds chosen run at least 0.95× the better of plain decoding and the best
/// fixed length.
#[test]
fn a_mixture_of_experts_verify_is_paid_for_only_where_drafts_earn_it() {
    let experts_read = |w: usize| 128.0 * (1.0 - (1.0 - 8.0 / 128.0f64).powi(w as i32));
    // In plain steps: the dense part, then the experts read.
    let verify = |w: usize| 0.3 + 0.7 * experts_read(w) / 8.0;
    let expected_tokens = |k: usize, alpha: f64| (0..=k).map(|i| alpha.powi(i as i32)).sum::<f64>();
    let cost = |k: usize| verify(k + 1);
    for (alpha, most_drafted) in [(0.5, 0), (0.9, 4)] {
        let ks = simulate(8, 400, alpha, 0.0, verify);
        let tail = &ks[100..];
        let rate = tail.iter().map(|&k| expected_tokens(k, alpha)).sum::<f64>()
            / tail.iter().map(|&k| cost(k)).sum::<f64>();
        let best = (0..=8)
            .map(|k| expected_tokens(k, alpha) / cost(k))
            .fold(0.0, f64::max);
        assert!(
            rate >= 0.95 * best,
            "α {alpha}: {rate:.3} against {best:.3}: {ks:?}"
        );
        assert!(
            most_common(tail) <= most_drafted,
            "α {alpha}: drafts {}: {ks:?}",
            most_common(tail)
        );
    }
}

/// Drafts that are never kept, from a drafter that measures its agreement: one
/// warm-up round that keeps nothing, then plain steps without a single probe for as
/// long as probes are spaced at most (α is known without them).
#[test]
fn measured_agreement_replaces_the_probes() {
    let verify = |w: usize| 0.01 + 0.0001 * w as f64;
    let ks = simulate_with_agreement(PROBE_EVERY_MAX, |_| 0.0, 0.005, verify, 0.004);
    assert_eq!(ks[0], 1, "a warm-up round drafts one token: {ks:?}");
    assert!(ks[1..].iter().all(|&k| k == 0), "{ks:?}");
    // Without agreement the same drafter is probed again and again.
    let probed = simulate(8, PROBE_EVERY_MAX, 0.0, 0.005, verify);
    assert!(
        probed[1..].iter().filter(|&&k| k > 0).count() >= 3,
        "{probed:?}"
    );
    // Probes still come at the longest spacing, to refresh the cost fits.
    let long = simulate_with_agreement(3 * PROBE_EVERY_MAX, |_| 0.0, 0.005, verify, 0.004);
    let probes = long[1..].iter().filter(|&&k| k > 0).count();
    assert!((1..=3).contains(&probes), "{probes} probes: {long:?}");
}

/// Good drafts from a drafter that measures its agreement: a short warm-up (one round
/// of one draft, which times a draft and a verify), then the maximum.
#[test]
fn measured_agreement_warms_up_short_then_drafts_what_pays() {
    let ks = simulate_with_agreement(60, |_| 0.95, 0.0001, |_| 0.005, 0.004);
    assert_eq!(ks[0], 1, "{ks:?}");
    assert_ne!(ks[1], 1, "one warm-up round: {ks:?}");
    assert_eq!(most_common(&ks[10..]), 8, "{ks:?}");
}

/// Plain steps agree with the drafter nine times in ten, but verifies keep one draft
/// in ten (random weights in bf16 on a GPU: the verify rounds near-ties its own way),
/// and a verify costs several plain steps (a mixture of experts). Taking the agreement
/// for the acceptance would keep drafting at a loss; the rounds' own count discounts
/// it, and decoding runs at plain speed but for the rare probe.
#[test]
fn agreement_that_verifies_do_not_bear_out_stops_drafting() {
    let verify = |w: usize| {
        if w <= 1 {
            0.0075
        } else {
            0.025 + 0.002 * w as f64
        }
    };
    let plain_s = 0.0075;
    let ks = simulate_agreement_apart(400, &|_| 0.9, &|_| 0.1, 0.0, verify, plain_s);
    let tail = &ks[20..];
    assert_eq!(most_common(tail), 0, "{ks:?}");
    let seconds: f64 = tail
        .iter()
        .map(|&k| if k == 0 { plain_s } else { verify(k + 1) })
        .sum();
    let tokens: f64 = tail.iter().map(|&k| 1.0 + 0.1 * (k.min(1) as f64)).sum();
    let rate = tokens / seconds / (1.0 / plain_s);
    assert!(rate >= 0.95, "{rate:.3} of plain: {ks:?}");
}

/// Warm-up rounds whose lookups found nothing time no round with drafts, so the
/// costs that weigh drafting are unknown: once the agreement says drafts would be
/// kept, one round of one draft times them, instead of waiting for a probe.
#[test]
fn untimed_drafting_is_tried_once_the_agreement_is_high() {
    let mut control = DraftLength::new(16, true);
    control.set_agreement_measured();
    for _ in 0..4 {
        control.observe(0, 0, 0.0, 0.003);
    }
    control.observe_agreement(0, 20);
    assert_eq!(control.next(16), 0, "agreement low: plain steps");
    control.observe_agreement(40, 40);
    assert_eq!(
        control.next(16),
        1,
        "agreement high: one draft to time drafting"
    );
    control.observe(1, 1, 1e-5, 0.005);
    assert!(control.next(16) > 1, "timed: weighed by the costs");
}

/// A text that turns predictable while decoding plainly: the agreement the drafter
/// measures brings drafting back within a few commits, long before a probe is due.
#[test]
fn rising_agreement_brings_drafting_back_without_a_probe() {
    let verify = |_| 0.005;
    let ks = simulate_with_agreement(
        200,
        |i| if i < 60 { 0.0 } else { 0.95 },
        0.0001,
        verify,
        0.004,
    );
    // (Right after the warm-up, with free drafts and a verify barely dearer than a
    // plain step, one short round can still look worth it.)
    assert!(ks[5..60].iter().all(|&k| k == 0), "{ks:?}");
    let back = ks[60..].iter().position(|&k| k > 0).map(|i| i + 60);
    assert!(
        back.is_some_and(|i| i < 80),
        "drafting resumed at {back:?}: {ks:?}"
    );
    assert_eq!(most_common(&ks[100..]), 8, "{ks:?}");
}

/// A lookup that finds no match proposes nothing: such a round costs a verify of
/// width 1 waited on at once, and must not pass for a plain step (which would then
/// look as dear, and keep rounds asking for drafts that do not come): the plain
/// step's cost stays what plain steps cost, and the round counts as a rejection.
#[test]
fn a_round_that_gets_no_drafts_is_not_a_plain_step() {
    let mut control = DraftLength::new(16, true);
    for _ in 0..4 {
        control.observe(0, 0, 0.0, 0.003);
    }
    let alpha = control.acceptance();
    for _ in 0..20 {
        control.observe_empty(0.008);
    }
    let plain = control.plain.predict(1.0, false).expect("plain steps seen");
    assert!((plain - 0.003).abs() < 1e-9, "plain step {plain}");
    let verify = control.verify.predict(1.0, false).expect("verifies seen");
    assert!((verify - 0.008).abs() < 1e-9, "verify {verify}");
    assert!(
        control.acceptance() < alpha / 4.0,
        "{alpha} -> {}",
        control.acceptance()
    );
    assert_eq!(control.next(usize::MAX), 0);
}

/// The start of an edit on a GPU: two rounds whose lookup found nothing (verifies of
/// width 1), a warm-up round of one draft that was rejected (a verify of width 2, a
/// little dearer by noise), then plain steps whose tokens the drafter would have
/// guessed nine times in ten. A verify costs the same at every width. Drafting must
/// come back, and wide: a slope fitted on widths 1 and 2 must not price a verify of
/// 17 out of reach before one is measured.
#[test]
fn a_verify_wider_than_any_seen_is_tried_before_it_is_ruled_out() {
    let verify = |w: usize| if w == 2 { 0.0085 } else { 0.007 };
    let mut control = DraftLength::new(16, true);
    control.set_agreement_measured();
    control.observe_empty(verify(1));
    control.observe_empty(verify(1));
    assert_eq!(control.next(usize::MAX), MEASURED_WARMUP_DRAFTS);
    control.observe(1, 0, 0.0, verify(2));
    let mut uniform = uniform_stream(0x5151_7e2f_00d1_a5edu64);
    let mut chosen = Vec::new();
    for _ in 0..64 {
        let k = control.next(usize::MAX);
        chosen.push(k);
        if k == 0 {
            control.observe(0, 0, 0.0, 0.003);
            control.observe_agreement(usize::from(uniform() < 0.9), 1);
        } else {
            let kept = (0..k).take_while(|_| uniform() < 0.9).count();
            control.observe(k, kept, 0.0, verify(k + 1));
        }
    }
    let first = chosen.iter().position(|&k| k > 0);
    assert!(first.is_some_and(|i| i < 16), "{chosen:?}");
    assert!(most_common(&chosen[32..]) >= 8, "{chosen:?}");
}

#[test]
fn fixed_length_is_the_maximum_within_the_limit() {
    let mut control = DraftLength::new(5, false);
    control.observe(5, 0, 1.0, 1.0);
    assert_eq!(control.next(usize::MAX), 5);
    assert_eq!(control.next(3), 3);
    assert_eq!(control.next(0), 0);
}

#[test]
fn the_line_fit_recovers_a_line_and_falls_back_sensibly() {
    let mut fit = LineFit::default();
    for w in 1..=6 {
        fit.observe(w as f64, 2.0 + 3.0 * w as f64);
    }
    assert!((fit.predict(5.0, false).unwrap() - 17.0).abs() < 1e-6);
    assert!((fit.predict(10.0, true).unwrap() - 32.0).abs() < 1e-6);
    // A verify past the widest seen is priced at the widest.
    assert!((fit.predict(10.0, false).unwrap() - 20.0).abs() < 1e-6);
    let mut one_width = LineFit::default();
    one_width.observe(4.0, 8.0);
    assert!((one_width.predict(2.0, true).unwrap() - 4.0).abs() < 1e-9);
    assert!((one_width.predict(2.0, false).unwrap() - 8.0).abs() < 1e-9);
    assert!(LineFit::default().predict(1.0, false).is_none());
}

/// A lookup drafter that always finds one token (the match of a repeated token) and is
/// always right, on a target whose verify costs 4.3 plain steps at every width (a
/// mixture of experts on a GPU): asking for more never gets more, so once the rounds that
/// learn it are spent, plain steps win. Priced as if all 8 asked for came, every round
/// would draft.
#[test]
fn drafts_that_never_come_are_not_priced_as_if_they_would() {
    let (plain, verify) = (0.0098, 0.042);
    let run = |learns_what_is_given: bool| {
        let mut control = DraftLength::new(8, true);
        control.set_agreement_measured();
        let mut drafted = 0;
        for _ in 0..64 {
            let k = control.next(usize::MAX);
            if k == 0 {
                control.observe(0, 0, 0.0, plain);
                control.observe_agreement(1, 1);
            } else {
                drafted += 1;
                if learns_what_is_given {
                    control.observe_offered(k, 1);
                }
                control.observe(1, 1, 1e-6, verify);
            }
        }
        drafted
    };
    assert!(run(true) <= 3, "{} rounds of 64 drafted", run(true));
    assert!(run(false) > 16, "the case needs the offers: {}", run(false));
}
