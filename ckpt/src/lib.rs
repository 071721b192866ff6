//! The ckpt CLI and the facade over the other crates.
