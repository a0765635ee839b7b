//! Drafters propose the tokens the target then verifies in one forward pass.
//! Each kind lives in its own file and registers itself through `inventory`; `context`
//! holds the target-context injection DFlash and DSpark share.

mod context;
pub mod copy_alignment;
pub mod dflash;
pub mod draft_model;
pub mod draft_thread;
pub mod dspark;
mod match_index;
pub mod ngram;
pub mod none;
pub mod replay;

/// Forces the linker to keep this crate's drafter registrations.
pub fn link() {}
