//! The nftables backend: classification, identity SNAT, gateway SNAT and
//! mark hygiene in one table of egressgw's own, `inet egressgw`.
//!
//! [`FirewallSpec`] is what the table should hold, computed from a node's
//! [`NodeState`]; [`Firewall::observe`] reads what it holds; [`plan`] turns
//! the difference into [`FwOp`]s; [`Firewall::apply`] runs them as one
//! atomic `nft -f -` transaction. Nothing is flushed on start: when the
//! kernel already holds the desired table, the plan is empty.
//!
//! The table (see [`FirewallSpec::render`] for the exact text):
//! - `classify4`/`classify6`: `src . dst-range : jump <chain>` — per tunnel
//!   mark a chain `mark_<8 hex>` that sets the mark (keeping bits outside the
//!   mask), and `local` for traffic this node SNATs itself. Bypassed
//!   destinations are holes: no element.
//! - `snat4`/`snat6` (`src . dst-range : eip`), `masq4`/`masq6` (`src .
//!   dst-range`, for `useNodeIP`), `cluster4`/`cluster6` (in-cluster
//!   prefixes: never classified, never SNATed).
//! - `count4`/`count6` (`src . dst-range : counter`) and one named counter
//!   object per policy (`policy_<fingerprint>`): every selected packet
//!   counts in its policy's counter (on the nftables datapath; the eBPF
//!   program counts itself).
//! - `prerouting` (filter, mangle priority): saves the reply mark on
//!   connections that come out of the tunnel, puts it on their replies,
//!   counts and classifies original-direction traffic.
//! - `postrouting_nat` (nat, priority 90 = srcnat - 10, before iptables'
//!   srcnat): identity SNAT for packets entering the tunnel, so a CNI's later
//!   MASQUERADE cannot rewrite the pod source (the first NAT binding of a
//!   connection wins); `gateway_nat` SNATs what came out of the tunnel or was
//!   classified `local`.
//! - `postrouting_mark` (filter, priority 110): clears egressgw's mark bits
//!   on packets leaving through the tunnel, because the VXLAN driver routes
//!   the outer packet with the inner packet's mark.
//!
//! Every rule carries a comment holding a fingerprint of its text, so that
//! [`plan`] can tell a changed chain from an unchanged one without parsing
//! nft's rewritten form of the rules back (nft 1.0.6 prints
//! `meta mark & 0x00ffffff | 0x01000000` as `meta mark & 0x01ffffff |
//! 0x01000000`, and `ct mark & 0xff000000 == 0xff000000` as
//! `ct mark 0xff000000/8`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use egressgw_common::Counter;
use egressgw_core::model::{Config, PolicyRef};
use egressgw_core::net::IpRange;
use egressgw_core::state::{Action, NodeState, SnatTo};
use ipnet::IpNet;
use serde_json::Value;

use crate::classify::Datapath;
use crate::ops::{Change, Op, OpKind, Operation, Report, diff};
use crate::ranges::disjoint;
use crate::{Error, Result};

/// The table's family.
pub const FAMILY: &str = "inet";
/// The table's name.
pub const TABLE: &str = "egressgw";

/// Priority of `prerouting` (`mangle`).
const PRIO_MANGLE: i32 = -150;
/// Priority of `postrouting_nat`: `srcnat - 10`, before iptables' srcnat.
const PRIO_NAT: i32 = 90;
/// Priority of `postrouting_mark`: `srcnat + 10`, after every NAT decision.
const PRIO_MARK: i32 = 110;

mod backend;
mod fake;
mod generation;
mod listing;
mod plan;
mod spec;
#[cfg(test)]
mod tests;

pub use backend::*;
pub use fake::*;
pub use generation::generation;
pub use listing::{parse_counters, parse_table};
pub use plan::*;
pub use spec::*;
