//! (placeholder until the nftables backend lands)
use egressgw_core::model::Config;
use egressgw_core::state::NodeState;

use crate::{Report, Result};

/// Table.
pub const TABLE: &str = "inet egressgw";

/// Spec.
#[derive(Debug)]
pub struct FirewallSpec;
impl FirewallSpec {
    /// New.
    pub fn new(_state: &NodeState, _cfg: &Config) -> Self {
        FirewallSpec
    }
}
/// Observed.
#[derive(Debug)]
pub struct Observed;
/// Op.
#[derive(Debug)]
pub struct FwOp;
/// Plan.
pub fn plan(_d: &FirewallSpec, _o: Option<&Observed>) -> Vec<FwOp> {
    Vec::new()
}
/// Firewall.
pub trait Firewall {
    /// Observe.
    fn observe(&mut self) -> Result<Option<Observed>>;
    /// Apply.
    fn apply(&mut self, ops: &[FwOp]) -> Report;
    /// Remove.
    fn remove(&mut self) -> Result<bool>;
}
/// Nft.
#[derive(Debug, Default)]
pub struct Nft;
impl Nft {
    /// New.
    pub fn new() -> Self {
        Nft
    }
}
impl Firewall for Nft {
    fn observe(&mut self) -> Result<Option<Observed>> {
        Ok(None)
    }
    fn apply(&mut self, _ops: &[FwOp]) -> Report {
        Report::default()
    }
    fn remove(&mut self) -> Result<bool> {
        Ok(false)
    }
}
