//! `dspec train-drafter`: a DFlash or DSpark drafter trained for any target dspec loads.
//!
//! The target is frozen: per step it reads each sequence once (its tap states, and its
//! own distributions where the labels are text), and the drafter learns to draft the
//! target's continuations from random anchors, every anchor's block at once
//! ([`net`]). Autograd and AdamW are mlx-rs's, so training runs on every MLX backend.
//!
//! Laid out by step: [`data`] (lines to token sequences, answers written by the target),
//! [`answers`] (the target's answers, cached), [`spec`] (the drafter's config from the
//! target's), [`batch`] (anchors, the target's states), [`net`] (the drafter's layers as a
//! function of its parameters), [`objective`] (the loss), [`schedule`] (what a step trains
//! on and at which rate), [`checkpoint`] (the drafter directory and the state `--resume`
//! continues from), [`eval`] (acceptance by real speculative decoding), [`trainer`] (the
//! loop).

pub mod answers;
pub mod batch;
pub mod checkpoint;
pub mod data;
pub mod eval;
pub mod net;
pub mod objective;
pub mod schedule;
pub mod spec;
pub mod trainer;
