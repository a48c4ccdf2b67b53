//! What decides which gateway a pod's packet goes to: the datapath.
//!
//! Two datapaths classify pod traffic. With [`Datapath::Nftables`] the
//! classification is a map of egressgw's nftables table, walked by every
//! packet in netfilter's prerouting hook (`docs/dataplane.md`). With
//! [`Datapath::Ebpf`] a TC program on the interfaces pod traffic enters the
//! node by marks each packet after one longest-prefix lookup and counts it
//! per policy (`docs/ebpf.md`); the nftables table keeps what needs the
//! connection: making a decision stick for the connection's life, the
//! pod's source address against a CNI's masquerade, replies, and failing
//! closed. The table's shape follows the datapath
//! ([`crate::nft::FirewallSpec::for_datapath`]); the program sits behind
//! [`PodClassifier`], with [`FakeClassifier`] for tests without root.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use egressgw_common::Counter;
use egressgw_core::model::PolicyRef;

use crate::ebpf::{Classifier, Desired, Learning, Synced, TunnelEnd};
use crate::ops::{Op, OpKind};

/// What classifies pod traffic on a node.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, serde::Serialize, serde::Deserialize,
)]
#[serde(rename_all = "lowercase")]
pub enum Datapath {
    /// The `classify4`/`classify6` maps of the nftables table.
    Nftables,
    /// The eBPF TC classifier.
    Ebpf,
}

impl fmt::Display for Datapath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Datapath::Nftables => "nftables",
            Datapath::Ebpf => "ebpf",
        })
    }
}

/// The eBPF classifier as a reconcile drives it.
pub trait PodClassifier: fmt::Debug {
    /// Attaches the classifier to exactly the interfaces in `pods`, the
    /// reply path to `tunnel`, the gateway's fast path to `external` and
    /// the tunnel's end to `underlay`; returns each change made or tried.
    fn follow(
        &mut self,
        pods: &BTreeSet<String>,
        tunnel: Option<&str>,
        external: &BTreeSet<String>,
        underlay: Option<&str>,
    ) -> Vec<(Op, Result<(), String>)>;
    /// Makes the maps hold `desired`, touching only what differs.
    fn sync(&mut self, desired: &Desired) -> Result<Synced, String>;
    /// Packets and bytes classified, per policy.
    fn policy_counters(&self) -> Result<BTreeMap<PolicyRef, Counter>, String>;
    /// While the gateway's fast path is on: what it learned since the
    /// start, and the connections it holds.
    fn gateway_learning(&self) -> Option<Learning> {
        None
    }
    /// While the tunnel's end on the underlay is on: what it took out of
    /// the tunnel.
    fn tunnel_end(&self) -> Option<Result<TunnelEnd, String>> {
        None
    }
}

impl PodClassifier for Classifier {
    fn follow(
        &mut self,
        pods: &BTreeSet<String>,
        tunnel: Option<&str>,
        external: &BTreeSet<String>,
        underlay: Option<&str>,
    ) -> Vec<(Op, Result<(), String>)> {
        Classifier::follow(self, pods, tunnel, external, underlay)
            .into_iter()
            .map(|(op, result)| (op, result.map_err(|e| e.to_string())))
            .collect()
    }

    fn sync(&mut self, desired: &Desired) -> Result<Synced, String> {
        Classifier::sync(self, desired).map_err(|e| e.to_string())
    }

    fn policy_counters(&self) -> Result<BTreeMap<PolicyRef, Counter>, String> {
        Classifier::policy_counters(self).map_err(|e| e.to_string())
    }

    fn gateway_learning(&self) -> Option<Learning> {
        Classifier::gateway_learning(self)
    }

    fn tunnel_end(&self) -> Option<Result<TunnelEnd, String>> {
        Classifier::tunnel_end(self).map(|r| r.map_err(|e| e.to_string()))
    }
}

/// A classifier in memory: what it is attached to and the maps' entries.
#[derive(Debug, Clone, Default)]
pub struct FakeClassifier {
    /// Interfaces attached to.
    pub attached: BTreeSet<String>,
    /// The tunnel device the reply path is on.
    pub tunnel: Option<String>,
    /// The interfaces the gateway's fast path is on.
    pub external: BTreeSet<String>,
    /// The underlay interface the tunnel's end is on.
    pub underlay: Option<String>,
    /// The maps' contents.
    pub maps: Desired,
    /// Counters to report.
    pub counters: BTreeMap<PolicyRef, Counter>,
    /// Interfaces whose attachment fails.
    pub fail_attach: BTreeSet<String>,
}

impl PodClassifier for FakeClassifier {
    fn follow(
        &mut self,
        wanted: &BTreeSet<String>,
        tunnel: Option<&str>,
        external: &BTreeSet<String>,
        underlay: Option<&str>,
    ) -> Vec<(Op, Result<(), String>)> {
        self.tunnel = tunnel.map(str::to_owned);
        self.underlay = underlay.map(str::to_owned);
        external.clone_into(&mut self.external);
        let mut done = Vec::new();
        for gone in self.attached.difference(wanted) {
            let text = format!("detach the eBPF classifier on {gone}");
            done.push((Op::new(OpKind::Program, gone.clone(), text), Ok(())));
        }
        self.attached.retain(|i| wanted.contains(i));
        for iface in wanted {
            if self.attached.contains(iface) {
                continue;
            }
            let result = if self.fail_attach.contains(iface) {
                Err(format!(
                    "attaching to the ingress of {iface}: no such interface"
                ))
            } else {
                self.attached.insert(iface.clone());
                Ok(())
            };
            let text = format!("attach the eBPF classifier on {iface}");
            done.push((Op::new(OpKind::Program, iface.clone(), text), result));
        }
        done
    }

    fn sync(&mut self, desired: &Desired) -> Result<Synced, String> {
        let mut synced = Synced::default();
        for (key, value) in &desired.classify {
            match self.maps.classify.get(key) {
                Some(v) if v == value => {}
                Some(_) => synced.changed += 1,
                None => synced.added += 1,
            }
        }
        synced.removed = self
            .maps
            .classify
            .keys()
            .filter(|k| !desired.classify.contains_key(k))
            .count();
        synced.added += desired.cluster.difference(&self.maps.cluster).count();
        synced.removed += self.maps.cluster.difference(&desired.cluster).count();
        self.maps = desired.clone();
        Ok(synced)
    }

    fn policy_counters(&self) -> Result<BTreeMap<PolicyRef, Counter>, String> {
        Ok(self.counters.clone())
    }
}

/// A [`FakeClassifier`] a test keeps a handle on while a dataplane owns it.
impl PodClassifier for std::sync::Arc<std::sync::Mutex<FakeClassifier>> {
    fn follow(
        &mut self,
        pods: &BTreeSet<String>,
        tunnel: Option<&str>,
        external: &BTreeSet<String>,
        underlay: Option<&str>,
    ) -> Vec<(Op, Result<(), String>)> {
        self.lock()
            .expect("not poisoned")
            .follow(pods, tunnel, external, underlay)
    }

    fn sync(&mut self, desired: &Desired) -> Result<Synced, String> {
        self.lock().expect("not poisoned").sync(desired)
    }

    fn policy_counters(&self) -> Result<BTreeMap<PolicyRef, Counter>, String> {
        self.lock().expect("not poisoned").policy_counters()
    }
}
