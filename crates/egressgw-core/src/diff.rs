//! Diff (in progress).
