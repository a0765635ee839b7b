//! Drafters propose the tokens the target then verifies in one forward pass.
//! Each kind lives in its own file; so far: n-gram prompt lookup.

pub mod dflash;
pub mod ngram;
