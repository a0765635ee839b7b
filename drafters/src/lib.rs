//! Drafters propose the tokens the target then verifies in one forward pass.
//! Each kind lives in its own file: DSpark, n-gram prompt lookup.

pub mod dspark;
pub mod ngram;
