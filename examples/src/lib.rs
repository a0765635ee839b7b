//! Examples of dspec as a library live in `examples/` of this crate:
//! `generate` (load a model dir and stream a greedy generation) and
//! `write_tiny_model` (the demo model used by scripts/demo.sh).
