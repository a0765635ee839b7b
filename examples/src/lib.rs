//! Examples of dspec as a library live in `examples/` of this crate:
//! `generate` (load a model dir and stream a greedy generation),
//! `write_tiny_model` (the demo model used by scripts/demo.sh), and `write_tiny_phi3`
//! (a model for the example adapter plugin in `adapter-plugin/`).
