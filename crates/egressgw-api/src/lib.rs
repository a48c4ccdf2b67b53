//! egressgw API types.
