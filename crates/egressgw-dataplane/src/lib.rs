//! Linux side of egressgw: turns one node's desired state
//! ([`egressgw_core::NodeState`]) into kernel state and reads the kernel back
//! to know what to change.
//!
//! Everything goes through netlink (rtnetlink for links, addresses, routes,
//! rules, neighbours and FDB entries; the ethtool generic-netlink family for
//! offloads) and one nftables table of egressgw's own. Each kind of kernel
//! object sits behind a narrow trait with an in-memory fake beside the real
//! implementation, so the reconcile loop is tested without root and the real
//! backends are tested in network namespaces.
//!
//! A reconcile observes, plans add/change/remove operations and applies them;
//! a failed operation is reported with its object and the others still run.
//! Nothing is flushed on start: a restart with the same desired state plans
//! no operation at all.

pub mod announce;
pub mod classify;
pub mod conntrack;
pub mod decode;
pub mod ebpf;
mod error;
pub mod ethtool;
pub mod fake;
pub mod kernel;
pub mod netlink;
pub mod nft;
pub mod ops;
pub mod probe;
pub mod ranges;
pub mod reconcile;
#[cfg(test)]
mod testns;

pub use error::{Error, Result};
pub use ops::{Cause, Failed, Failure, Op, OpKind, Operation, Report};
