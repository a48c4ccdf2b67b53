//! egressgw's Kubernetes API: the CRDs, their validation, and the
//! conversions between Kubernetes objects and the planner's model.
//!
//! - [`gateway`], [`policy`], [`tunnel`]: the four kinds of group
//!   `egressgw.io`, version `v1alpha1`. Each spec has a `validate()` that
//!   returns every problem, each named by its field path; the same checks
//!   run at admission as CEL rules (see `docs/api.md`).
//! - [`endpoints`]: the Pods of each gateway, as the controller publishes
//!   them for the agents of its nodes.
//! - [`snapshot`]: watched objects into an [`egressgw_core::Snapshot`].
//! - [`watched`]: a Pod as the daemons keep it, with what the planner reads.
//! - [`status`]: the planner's status output into the CRDs' status types.
//! - [`load`]: objects from a multi-document YAML file, with the
//!   apiserver's strict check for unknown fields.
//! - [`crd`]: the CRDs as objects and as the YAML files in `deploy/crds/`.
//! - [`config`]: the daemons' config file (the chart's `feature` values).
//! - [`fuzz`]: the fuzz targets' entry points.

pub mod config;
pub mod crd;
pub mod endpoints;
mod error;
pub mod fuzz;
pub mod gateway;
mod label;
pub mod load;
pub mod policy;
mod schema;
pub mod selector;
pub mod snapshot;
pub mod status;
mod strict;
pub mod tunnel;
mod validation;
pub mod watched;

pub use endpoints::{EgressEndpointSlice, EgressEndpointSliceSpec, EndpointPod};
pub use error::{Error, LoadError, Location};
pub use gateway::{EgressGateway, EgressGatewaySpec, EgressGatewayStatus};
pub use load::{Objects, Skipped, UnknownFields, objects_from_yaml};
pub use policy::{
    EgressClusterPolicy, EgressClusterPolicySpec, EgressPolicy, EgressPolicySpec,
    EgressPolicyStatus,
};
pub use snapshot::SnapshotBuilder;
pub use tunnel::{
    EgressTunnel, EgressTunnelSpec, EgressTunnelStatus, TunnelEip, TunnelEipState, TunnelPhase,
    TunnelUnreachable,
};
pub use validation::{FieldError, ValidationErrors};
pub use watched::WatchedPod;

/// The API group of every egressgw kind.
pub const GROUP: &str = "egressgw.io";
/// The API version of every egressgw kind.
pub const VERSION: &str = "v1alpha1";
