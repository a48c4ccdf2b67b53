//! Tests of the egressgw API through its public interface.

mod cel;
mod crds;
mod fixtures;
mod load;
mod snapshot;
mod status;
mod validation;
