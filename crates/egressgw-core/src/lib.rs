//! The pure heart of egressgw: a validated cluster snapshot in; per-node
//! dataplane state, allocations and object status out. No I/O, no clock, no
//! randomness: the same snapshot in any order gives the same plan.
//!
//! - [`model`]: the snapshot types.
//! - [`mod@plan`]: allocation (EIPs, tunnel identities, gateway nodes) and
//!   per-node state, with the precedence rules in `docs/precedence.md`.

pub mod failover;
pub mod model;
pub mod net;
pub mod plan;
pub mod precedence;
pub mod selector;
pub mod state;
pub mod status;

pub use model::Snapshot;
pub use plan::{
    LastChange, Plan, Planner, PodChange, PodScope, PolicyChange, Published, Publisher,
    gateways_selecting, plan, plan_node, plan_node_published, plan_published, plan_status,
    pod_scope, remember,
};

/// 64-bit FNV-1a of `bytes`: the same in every build and every release, for
/// what two versions of egressgw must compute alike (names, digests).
pub fn stable_hash(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
    })
}
