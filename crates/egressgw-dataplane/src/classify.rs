//! What decides which gateway a pod's packet goes to: the classifier.
//!
//! Two classifiers implement [`PodClassifier`]. [`NftClassifier`]
//! ([`Datapath::Nftables`]) is a part of egressgw's nftables table: the
//! `classify4`/`classify6` maps, walked by every packet in netfilter's
//! prerouting hook, and a counter object per policy (`docs/dataplane.md`).
//! The eBPF classifier, [`Classifier`] ([`Datapath::Ebpf`]), is a TC
//! program on the interfaces pod traffic enters the node by: it marks each
//! packet after one longest-prefix lookup and counts it per policy
//! (`docs/ebpf.md`); its part of the table keeps what needs the
//! connection (a decision that sticks for the connection's life, the pod's
//! source address against a CNI's masquerade, replies, failing closed) and
//! the classification as a backstop.
//!
//! A reconcile asks the classifier for its part of the table
//! ([`PodClassifier::table`]), lands it in the table's one transaction
//! with SNAT and steering, then lets the classifier bring what it keeps
//! outside the table in line ([`PodClassifier::sync`]). [`FakeClassifier`]
//! stands in for the program in tests without root.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use egressgw_common::Counter;
use egressgw_core::model::{Config, PolicyRef};
use egressgw_core::state::{ClassifyEntry, NodeState};

use crate::ebpf::{Classifier, Desired, Learning, TunnelEnd};
use crate::nft::Classifying;
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

/// Reads the table's counter objects, by name.
pub type TableCounters<'a> = &'a dyn Fn() -> Result<BTreeMap<String, Counter>, String>;

/// What a classifier is to hold after a reconcile.
#[derive(Debug, Clone, Copy)]
pub struct Classification<'a> {
    /// The node's plan: its classification entries (`classify`) and
    /// in-cluster prefixes, with what the eBPF fast path also needs (the
    /// tunnel, its peers, the EIPs held).
    pub state: &'a NodeState,
    /// Marks and switches.
    pub config: &'a Config,
    /// For a classifier on interfaces ([`PodClassifier::on_interfaces`]):
    /// the interfaces this node's pods send by, as found now; `None` when
    /// they could not be found (the attachments stay as they are).
    pub interfaces: Option<&'a BTreeSet<String>>,
    /// The tunnel's parent (underlay) interface, as found now:
    /// `Some(None)` when the node has no tunnel, `None` when it could not
    /// be found (what is on it stays as it is).
    pub parent: Option<Option<&'a str>>,
}

/// The interface the eBPF tunnel's end is to be on: the tunnel's parent
/// while it is `wanted` (the fast path is on), none otherwise; when the
/// parent could not be found this time, the one it is on `now`, so that a
/// lookup failing for a moment does not take it off.
pub fn underlay_to_follow(
    parent: Option<Option<&str>>,
    wanted: bool,
    now: Option<&str>,
) -> Option<String> {
    if !wanted {
        return None;
    }
    match parent {
        Some(parent) => parent.map(str::to_owned),
        None => now.map(str::to_owned),
    }
}

/// What classifies pod traffic on a node: the planner's classification in,
/// per-policy counters out.
pub trait PodClassifier: fmt::Debug + Send {
    /// Which datapath this is.
    fn datapath(&self) -> Datapath;

    /// Whether it runs on the interfaces pod traffic enters the node by
    /// (the eBPF classifier does): then each [`Self::sync`] is told which
    /// they are.
    fn on_interfaces(&self) -> bool {
        self.datapath() == Datapath::Ebpf
    }

    /// Its part of egressgw's nftables table for `state` (by default its
    /// datapath's). It lands in the table's one transaction with SNAT and
    /// steering, before [`Self::sync`].
    fn table(&mut self, state: &NodeState) -> Classifying {
        Classifying::for_datapath(state, self.datapath())
    }

    /// After the table: makes what it keeps outside the table hold `c`,
    /// touching only what differs. Returns each change made or tried.
    fn sync(&mut self, c: &Classification<'_>) -> Vec<(Op, Result<(), String>)>;

    /// Packets and bytes classified (sent through a gateway, or dropped
    /// failing closed), per policy with traffic to classify on this node.
    /// `table` reads the table's counter objects, by name, for a
    /// classifier that counts there.
    fn policy_counters(
        &self,
        table: TableCounters<'_>,
    ) -> Result<BTreeMap<PolicyRef, Counter>, String>;

    /// While the gateway's eBPF fast path is on: what it learned since the
    /// start, and the connections it holds.
    fn gateway_learning(&self) -> Option<Learning> {
        None
    }

    /// While the eBPF tunnel's end on the underlay is on: what it took out
    /// of the tunnel.
    fn tunnel_end(&self) -> Option<Result<TunnelEnd, String>> {
        None
    }
}

/// The nftables table classifies and counts: egressgw's table is all
/// there is to it.
#[derive(Debug, Clone, Default)]
pub struct NftClassifier {
    /// The policy each of the table's counter objects counts, as last
    /// given to the table.
    counted: BTreeMap<String, PolicyRef>,
}

impl PodClassifier for NftClassifier {
    fn datapath(&self) -> Datapath {
        Datapath::Nftables
    }

    fn table(&mut self, state: &NodeState) -> Classifying {
        let part = Classifying::by_table(state);
        part.counters.clone_into(&mut self.counted);
        part
    }

    fn sync(&mut self, _: &Classification<'_>) -> Vec<(Op, Result<(), String>)> {
        Vec::new()
    }

    fn policy_counters(
        &self,
        table: TableCounters<'_>,
    ) -> Result<BTreeMap<PolicyRef, Counter>, String> {
        let counters = table()?;
        Ok(self
            .counted
            .iter()
            .map(|(name, policy)| {
                let counted = counters.get(name).copied().unwrap_or_default();
                (policy.clone(), counted)
            })
            .collect())
    }
}

impl PodClassifier for Classifier {
    fn datapath(&self) -> Datapath {
        Datapath::Ebpf
    }

    fn sync(&mut self, c: &Classification<'_>) -> Vec<(Op, Result<(), String>)> {
        let desired = Desired::new(c.state, c.config);
        let mut done = Vec::new();
        // Without the interfaces the attachments stay as they are; the
        // table classifies what the program does not see.
        if let Some(pods) = c.interfaces {
            let tunnel = c.state.vxlan.as_ref().map(|v| v.name.as_str());
            // The gateway's fast path sits where the EIPs' traffic leaves
            // and their replies arrive: the interfaces on their segments.
            let external: BTreeSet<String> = desired
                .eips
                .iter()
                .flat_map(|eip| crate::announce::segment_interfaces(*eip))
                .map(|(name, _)| name)
                .collect();
            // The tunnel's end sits where the tunnel's packets arrive.
            let now = self.underlay_now();
            let underlay = underlay_to_follow(c.parent, desired.underlay.is_some(), now.as_deref());
            done.extend(
                self.follow(pods, tunnel, &external, underlay.as_deref())
                    .into_iter()
                    .map(|(op, result)| (op, result.map_err(|e| e.to_string()))),
            );
        }
        let maps = |text: &str| Op::new(OpKind::Map, "classifier maps", text);
        match Classifier::sync(self, &desired) {
            Ok(synced) if synced.is_empty() => {}
            Ok(synced) => done.push((
                maps(&format!(
                    "eBPF classifier maps: {} added, {} changed, {} removed",
                    synced.added, synced.changed, synced.removed
                )),
                Ok(()),
            )),
            Err(e) => done.push((maps("fill the eBPF classifier's maps"), Err(e.to_string()))),
        }
        done
    }

    fn policy_counters(
        &self,
        _: TableCounters<'_>,
    ) -> Result<BTreeMap<PolicyRef, Counter>, String> {
        Classifier::policy_counters(self).map_err(|e| e.to_string())
    }

    fn gateway_learning(&self) -> Option<Learning> {
        Classifier::gateway_learning(self)
    }

    fn tunnel_end(&self) -> Option<Result<TunnelEnd, String>> {
        Classifier::tunnel_end(self).map(|r| r.map_err(|e| e.to_string()))
    }
}

/// A classifier on interfaces, in memory, for tests without root: what it
/// is attached to and the entries it holds. Its part of the table is the
/// eBPF datapath's.
#[derive(Debug, Clone, Default)]
pub struct FakeClassifier {
    /// Interfaces attached to.
    pub attached: BTreeSet<String>,
    /// The interface its tunnel's end would be on (as the eBPF
    /// classifier's, with the fast path on).
    pub underlay: Option<String>,
    /// The classification entries it holds.
    pub entries: Vec<ClassifyEntry>,
    /// Counters to report.
    pub counters: BTreeMap<PolicyRef, Counter>,
    /// Interfaces whose attachment fails.
    pub fail_attach: BTreeSet<String>,
}

impl PodClassifier for FakeClassifier {
    fn datapath(&self) -> Datapath {
        Datapath::Ebpf
    }

    fn sync(&mut self, c: &Classification<'_>) -> Vec<(Op, Result<(), String>)> {
        let mut done = Vec::new();
        if let Some(wanted) = c.interfaces {
            self.underlay = underlay_to_follow(c.parent, true, self.underlay.as_deref());
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
        }
        if self.entries != c.state.classify {
            let text = format!("hold {} classification entries", c.state.classify.len());
            done.push((Op::new(OpKind::Map, "classifier maps", text), Ok(())));
            c.state.classify.clone_into(&mut self.entries);
        }
        done
    }

    fn policy_counters(
        &self,
        _: TableCounters<'_>,
    ) -> Result<BTreeMap<PolicyRef, Counter>, String> {
        Ok(self.counters.clone())
    }
}

/// A [`FakeClassifier`] a test keeps a handle on while a dataplane owns it.
impl PodClassifier for std::sync::Arc<std::sync::Mutex<FakeClassifier>> {
    fn datapath(&self) -> Datapath {
        self.lock().expect("not poisoned").datapath()
    }

    fn on_interfaces(&self) -> bool {
        self.lock().expect("not poisoned").on_interfaces()
    }

    fn table(&mut self, state: &NodeState) -> Classifying {
        self.lock().expect("not poisoned").table(state)
    }

    fn sync(&mut self, c: &Classification<'_>) -> Vec<(Op, Result<(), String>)> {
        self.lock().expect("not poisoned").sync(c)
    }

    fn policy_counters(
        &self,
        table: TableCounters<'_>,
    ) -> Result<BTreeMap<PolicyRef, Counter>, String> {
        self.lock().expect("not poisoned").policy_counters(table)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use egressgw_core::state::Action;

    fn state(policies: &[(&str, &str)]) -> NodeState {
        let mut state = crate::testns::node_state(true);
        state.classify = policies
            .iter()
            .map(|(policy, dst)| ClassifyEntry {
                src: "10.244.1.2".parse().unwrap(),
                dst: dst.parse().unwrap(),
                action: Action::Tunnel {
                    gateway: "b".into(),
                    mark: Config::default().mark(1),
                },
                policy: Some(PolicyRef::namespaced("team-a", *policy).into()),
                group: None,
            })
            .collect();
        state
    }

    #[test]
    fn the_nftables_classifier_counts_in_the_counter_objects_it_gave_the_table() {
        let mut nft = NftClassifier::default();
        let two = state(&[("web", "198.51.100.0/24"), ("db", "203.0.113.0/24")]);
        let part = nft.table(&two);
        assert_eq!(part.datapath, Datapath::Nftables);
        assert_eq!(part.classify, Classifying::beside_program(&two).classify);
        assert_eq!(part.counters.len(), 2);
        assert!(!nft.on_interfaces());
        let c = Classification {
            state: &two,
            config: &Config::default(),
            interfaces: None,
            parent: Some(None),
        };
        assert!(nft.sync(&c).is_empty(), "nothing outside the table");

        let web = PolicyRef::namespaced("team-a", "web");
        let db = PolicyRef::namespaced("team-a", "db");
        let read = || {
            Ok(BTreeMap::from([
                (
                    crate::nft::counter_name(&web),
                    Counter {
                        packets: 3,
                        bytes: 180,
                    },
                ),
                // Another table's leftover, or a policy gone: not shown.
                ("policy_00000000".to_owned(), Counter::default()),
            ]))
        };
        let counted = nft.policy_counters(&read).unwrap();
        assert_eq!(counted.keys().collect::<Vec<_>>(), [&db, &web]);
        assert_eq!(counted[&web].bytes, 180);
        assert_eq!(counted[&db].packets, 0, "a counter not read back is 0");

        // A policy gone from the node is no longer counted.
        nft.table(&state(&[("web", "198.51.100.0/24")]));
        let counted = nft.policy_counters(&read).unwrap();
        assert_eq!(counted.keys().collect::<Vec<_>>(), [&web]);

        let broken = || Err("nft: no such file".to_owned());
        assert_eq!(
            nft.policy_counters(&broken).unwrap_err(),
            "nft: no such file"
        );
    }

    #[test]
    fn the_tunnels_end_follows_the_parent_and_stays_where_it_is_when_that_is_not_found() {
        assert_eq!(
            underlay_to_follow(Some(Some("eth0")), true, None).as_deref(),
            Some("eth0")
        );
        assert_eq!(
            underlay_to_follow(Some(Some("eth1")), true, Some("eth0")).as_deref(),
            Some("eth1"),
            "moves with the parent"
        );
        assert_eq!(
            underlay_to_follow(None, true, Some("eth0")).as_deref(),
            Some("eth0"),
            "a failed lookup keeps it"
        );
        assert_eq!(underlay_to_follow(None, true, None), None);
        assert_eq!(
            underlay_to_follow(Some(None), true, Some("eth0")),
            None,
            "no tunnel"
        );
        assert_eq!(
            underlay_to_follow(Some(Some("eth0")), false, Some("eth0")),
            None,
            "fast path off"
        );
        assert_eq!(underlay_to_follow(None, false, Some("eth0")), None);
    }

    #[test]
    fn beside_the_program_the_table_holds_the_classification_and_counts_nothing() {
        let s = state(&[("web", "198.51.100.0/24")]);
        let part = FakeClassifier::default().table(&s);
        assert_eq!(part.datapath, Datapath::Ebpf);
        assert_eq!(part.classify, Classifying::by_table(&s).classify);
        assert!(part.count.is_empty() && part.counters.is_empty());
    }
}
