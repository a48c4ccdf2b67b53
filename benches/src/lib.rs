//! Synthetic clusters for the benches.
