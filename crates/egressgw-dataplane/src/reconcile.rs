//! One node's reconcile: observe, plan, apply — for the routing side and the
//! firewall — and cleanup.

use egressgw_core::model::Config;
use egressgw_core::state::NodeState;

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use egressgw_common::Counter;
use egressgw_core::model::PolicyRef;
use tracing::Instrument as _;

use crate::classify::{Classification, Datapath, NftClassifier, PodClassifier};
use crate::{Op, OpKind, Report};

use crate::kernel::{self, Desired, KernelOp, KernelPlan, Parent, Scope};
use crate::netlink::Netlink;
use crate::nft::{self, ElemChange, ElemKey, Firewall, FirewallSpec, FwOp, Verdict};

/// A node's dataplane: the routing side and the firewall, reconciled
/// together.
#[derive(Debug)]
pub struct Dataplane<N, F> {
    netlink: N,
    firewall: F,
    config: Config,
    scope: Scope,
    /// The tunnel's parent interface as the last reconcile found it.
    parent: Option<Parent>,
    /// Whether the last reconcile could tell where the parent is (found,
    /// or no tunnel): a failed lookup leaves what is on it as it is.
    parent_known: bool,
    /// Where the eBPF classifier pins its maps and attachments, for
    /// [`Self::cleanup`]; `None`: no eBPF state to remove.
    ebpf_pins: Option<std::path::PathBuf>,
    /// What classifies pod traffic: the table's maps unless
    /// [`Self::with_classifier`] says otherwise.
    classifier: Box<dyn PodClassifier>,
    /// On the nftables datapath: whether an eBPF classifier a predecessor
    /// pinned has been looked for (and removed) yet.
    pins_checked: bool,
}

impl<N: Netlink, F: Firewall> Dataplane<N, F> {
    /// A dataplane for `config` over the given backends.
    pub fn new(netlink: N, firewall: F, config: Config) -> Self {
        let scope = Scope::new(&config);
        Dataplane {
            netlink,
            firewall,
            config,
            scope,
            parent: None,
            parent_known: false,
            ebpf_pins: None,
            classifier: Box::new(NftClassifier::default()),
            pins_checked: false,
        }
    }

    /// Puts `classifier` in charge of classifying (the eBPF classifier:
    /// [`Datapath::Ebpf`]).
    #[must_use]
    pub fn with_classifier(mut self, classifier: Box<dyn PodClassifier>) -> Self {
        self.classifier = classifier;
        self
    }

    /// What classifies pod traffic.
    pub fn datapath(&self) -> Datapath {
        self.classifier.datapath()
    }

    /// Packets and bytes sent through a gateway (or dropped failing
    /// closed), per policy with traffic to classify on this node, as the
    /// classifier counted them.
    pub fn policy_counters(&self) -> Result<BTreeMap<PolicyRef, Counter>, String> {
        let table = || self.firewall.counters().map_err(|e| e.to_string());
        blocking(|| self.classifier.policy_counters(&table))
    }

    /// While the gateway's eBPF fast path is on: what it learned since the
    /// start, and how many connections it holds now.
    pub fn gateway_learning(&self) -> Option<crate::ebpf::Learning> {
        self.classifier.gateway_learning()
    }

    /// While the eBPF tunnel's end on the underlay is on: what it took out
    /// of the tunnel.
    pub fn tunnel_end(&self) -> Option<Result<crate::ebpf::TunnelEnd, String>> {
        self.classifier.tunnel_end()
    }

    /// Makes [`Self::cleanup`] also detach the eBPF classifier and remove
    /// what it pinned in `dir` (a host's `ebpf::PIN_DIR`); on the nftables
    /// datapath the first reconcile does so too, so that a classifier left
    /// by an agent that ran the eBPF datapath stops marking.
    #[must_use]
    pub fn with_ebpf_pins(mut self, dir: impl Into<std::path::PathBuf>) -> Self {
        self.ebpf_pins = Some(dir.into());
        self
    }

    /// The tunnel's parent interface as the last reconcile found it (`None`
    /// before, or when the node has no tunnel or no interface holds its
    /// underlay address).
    pub fn parent(&self) -> Option<&Parent> {
        self.parent.as_ref()
    }

    /// The EIPs this node holds now (the addresses on the EIP device).
    pub async fn held_eips(&mut self) -> crate::Result<BTreeSet<IpAddr>> {
        Ok(self.netlink.observe(&self.scope).await?.eips)
    }

    /// The backends, for tests that look inside fakes.
    pub fn backends(&self) -> (&N, &F) {
        (&self.netlink, &self.firewall)
    }

    /// Makes the kernel match `state`.
    ///
    /// Order: devices first (observed again once they exist), then every
    /// addition and change of the routing side, then the firewall (one
    /// transaction, the classifier's part of the table in it), then the
    /// classifier's own state (the eBPF program's attachments and maps),
    /// then removals — so new paths exist before traffic is classified
    /// onto them and old paths go only after classification has left them.
    /// A failed operation is in the report and the others still run.
    /// Nothing is flushed: an unchanged state plans no operation.
    pub async fn reconcile(&mut self, state: &NodeState) -> Report {
        let span = tracing::info_span!("reconcile", node = %state.node);
        self.reconcile_in_span(state).instrument(span).await
    }

    async fn reconcile_in_span(&mut self, state: &NodeState) -> Report {
        let mut report = Report::default();
        // Without a desired state or a readable kernel, the routing side is
        // left exactly as it is; the firewall is reconciled regardless.
        let (additions, removals) = match self.desired(state, &mut report).await {
            Some(desired) => self.routing_ops(&desired, &mut report).await,
            None => (Vec::new(), Vec::new()),
        };
        for op in &additions {
            self.apply(op, &mut report).await;
        }
        if self.datapath() == Datapath::Nftables {
            self.remove_predecessors_classifier(&mut report);
        }
        let classifying = self.classifier.table(state);
        debug_assert_eq!(
            classifying.datapath,
            self.datapath(),
            "{:?}",
            self.classifier
        );
        blocking(|| self.reconcile_firewall(state, classifying, &mut report));
        self.sync_classifier(state, &mut report).await;
        for op in &removals {
            self.apply(op, &mut report).await;
        }
        report
    }

    /// The kernel objects `state` asks for; `None` when the tunnel's parent
    /// cannot be found, so that a transient lookup failure (an underlay
    /// address being moved, a netlink hiccup) never tears the tunnel down.
    async fn desired(&mut self, state: &NodeState, report: &mut Report) -> Option<Desired> {
        self.parent = None;
        self.parent_known = state.vxlan.is_none();
        let Some(v) = &state.vxlan else {
            return Some(Desired::new(state, &self.config, None));
        };
        let op = Op::new(
            OpKind::Read,
            v.name.clone(),
            format!("find the parent interface of {}", v.name),
        );
        match self.netlink.parent(v.local).await {
            Ok(Some(parent)) => {
                let desired = Desired::new(state, &self.config, Some(&parent));
                self.parent = Some(parent);
                self.parent_known = true;
                Some(desired)
            }
            Ok(None) => {
                report.record(
                    op,
                    Err(format!(
                        "no interface holds the node's underlay address {}; \
                         the tunnel, rules and routes are left as they are",
                        v.local
                    )),
                );
                None
            }
            Err(e) => {
                report.record(op, Err(e));
                None
            }
        }
    }

    /// The routing side's additions and removals, after carrying out device
    /// creations (and observing again, since the other objects refer to the
    /// devices).
    async fn routing_ops(
        &mut self,
        desired: &Desired,
        report: &mut Report,
    ) -> (Vec<KernelOp>, Vec<KernelOp>) {
        if desired.tx_checksum
            && desired.vxlan.is_some()
            && crate::ethtool::kernel_has_vxlan_snat_checksum_bug()
        {
            report.warn(format!(
                "{}: tx checksum offload is on and this kernel is older than 5.7, \
                 where VXLAN with SNAT can send bad checksums; set \
                 vxlan.disableChecksumOffload=true",
                self.scope.vxlan
            ));
        }
        let Some(mut plan) = self.plan_kernel(desired, report).await else {
            return (Vec::new(), Vec::new());
        };
        if !plan.devices.is_empty() {
            for op in &plan.devices {
                self.apply(op, report).await;
            }
            let Some(again) = self.plan_kernel(desired, report).await else {
                return (Vec::new(), Vec::new());
            };
            // A device op that failed shows up again: it was tried once.
            plan = again;
        }
        plan.rest.into_iter().partition(|op| !op.is_removal())
    }

    async fn plan_kernel(&mut self, desired: &Desired, report: &mut Report) -> Option<KernelPlan> {
        match self.netlink.observe(&self.scope).await {
            Ok(observed) => {
                if let Some(offloads) = &observed.offloads {
                    report
                        .facts
                        .insert(format!("{} offloads", self.scope.vxlan), offloads.clone());
                }
                for note in &observed.unreadable {
                    report.warn(note.clone());
                }
                Some(kernel::plan(desired, &observed, &self.scope))
            }
            Err(e) => {
                report.record(read_routing(), Err(e));
                None
            }
        }
    }

    async fn apply(&mut self, op: &KernelOp, report: &mut Report) {
        let result = self.netlink.apply(op, report).await;
        report.record(op, result);
    }

    /// On the nftables datapath, once: removes an eBPF classifier an agent
    /// on the eBPF datapath pinned. Done before the table changes: the
    /// table of the eBPF datapath classifies by itself too.
    fn remove_predecessors_classifier(&mut self, report: &mut Report) {
        if self.pins_checked {
            return;
        }
        let Some(pins) = &self.ebpf_pins else {
            return;
        };
        let what = Op::new(
            OpKind::Program,
            pins.display().to_string(),
            format!(
                "detach the eBPF classifier and remove {} (this node runs the nftables datapath)",
                pins.display()
            ),
        );
        match crate::ebpf::Classifier::remove_pins(pins) {
            Ok(true) => report.done(what),
            Ok(false) => {}
            Err(e) => {
                report.record(what, Err(e));
                return;
            }
        }
        self.pins_checked = true;
    }

    /// The classifier, after the table (so that a mark the eBPF program
    /// sets has its chain there): told, when it runs on interfaces, which
    /// ones this node's pods send by.
    async fn sync_classifier(&mut self, state: &NodeState, report: &mut Report) {
        let interfaces = if self.classifier.on_interfaces() {
            let pods: Vec<IpAddr> = state
                .classify
                .iter()
                .map(|e| e.src)
                .collect::<BTreeSet<_>>()
                .into_iter()
                .collect();
            match self.netlink.pod_interfaces(&pods).await {
                Ok(found) => Some(found.into_keys().collect::<BTreeSet<String>>()),
                Err(e) => {
                    report.record(
                        Op::new(
                            OpKind::Read,
                            "pod interfaces",
                            format!("find the interfaces of {} pod address(es)", pods.len()),
                        ),
                        Err(e),
                    );
                    None
                }
            }
        } else {
            None
        };
        let c = Classification {
            state,
            config: &self.config,
            interfaces: interfaces.as_ref(),
            parent: self
                .parent_known
                .then(|| self.parent.as_ref().map(|p| p.name.as_str())),
        };
        let classifier = &mut self.classifier;
        for (op, result) in blocking(|| classifier.sync(&c)) {
            report.record(op, result);
        }
    }

    fn reconcile_firewall(
        &mut self,
        state: &NodeState,
        classifying: nft::Classifying,
        report: &mut Report,
    ) {
        let spec = FirewallSpec::with(state, &self.config, classifying);
        match self.firewall.observe() {
            Ok(observed) => {
                let ops = nft::plan(&spec, observed.as_deref());
                // The backend keeps what it read: without this reading's
                // share, it carries the ops out in place.
                drop(observed);
                if !ops.is_empty() {
                    report.merge(self.firewall.apply(&ops));
                    self.forget_unanswered(&ops, report);
                }
            }
            Err(e) => report.record(
                Op::new(
                    OpKind::Read,
                    format!("{} {}", nft::FAMILY, nft::TABLE),
                    "read the nftables table",
                ),
                Err(e),
            ),
        }
    }

    /// Sources classified anew (or sent elsewhere) by `ops` start afresh:
    /// their connection attempts that never saw an answer are forgotten,
    /// so that the next packet follows the classification instead of the
    /// NAT binding of the way it left before (see [`crate::conntrack`]).
    fn forget_unanswered(&mut self, ops: &[FwOp], report: &mut Report) {
        let keys: Vec<ElemKey> = ops
            .iter()
            .filter_map(|op| match op {
                FwOp::Classify(ElemChange::Add, key, Verdict::Mark(_) | Verdict::Local) => {
                    Some(*key)
                }
                _ => None,
            })
            .collect();
        if keys.is_empty() {
            return;
        }
        match self.firewall.forget_unanswered(&keys) {
            Ok(0) => {}
            Ok(n) => report.done(Op::new(
                OpKind::Conntrack,
                "newly classified sources",
                format!("forget {n} unanswered connection(s) of newly classified sources"),
            )),
            Err(e) => report.warn(format!(
                "cannot forget the unanswered connections of newly classified sources \
                 (their next attempt may stall): {e}"
            )),
        }
    }

    /// Removes everything egressgw created — the routing side (tunnel,
    /// EIPs, rules, routes), the firewall table and (see
    /// [`Self::with_ebpf_pins`]) the eBPF classifier's pinned attachments
    /// and maps — and nothing else. Keeps going past failures and reports
    /// each.
    ///
    /// The routing side goes first, the tunnel with it: on a gateway the
    /// table's guard is what keeps traffic arriving through the tunnel from
    /// leaving untranslated (a CNI's masquerade would give it the node's
    /// address). The table is therefore removed only once no tunnel is
    /// left; while one is (its removal failed, or the routing side could
    /// not be read), the table stays and that is reported as a failure.
    pub async fn cleanup(&mut self) -> Report {
        let mut report = Report::default();
        let tunnel_gone = match self.netlink.observe(&self.scope).await {
            Ok(observed) => {
                let plan = kernel::plan(&Desired::default(), &observed, &self.scope);
                for op in plan.ops() {
                    self.apply(op, &mut report).await;
                }
                match self.netlink.observe(&self.scope).await {
                    Ok(after) => after.vxlan.is_none(),
                    Err(e) => {
                        report.record(read_routing(), Err(e));
                        false
                    }
                }
            }
            Err(e) => {
                report.record(read_routing(), Err(e));
                false
            }
        };
        if let Some(pins) = &self.ebpf_pins {
            let what = Op::new(
                OpKind::Program,
                pins.display().to_string(),
                format!("detach the eBPF classifier and remove {}", pins.display()),
            );
            match crate::ebpf::Classifier::remove_pins(pins) {
                Ok(true) => report.done(what),
                Ok(false) => {}
                Err(e) => report.record(what, Err(e)),
            }
        }
        let table = format!("{} {}", nft::FAMILY, nft::TABLE);
        let what = Op::new(
            OpKind::Table,
            table.clone(),
            format!("delete table {table}"),
        );
        if !tunnel_gone {
            report.record(
                what,
                Err(format!(
                    "kept while {} may still exist: without the table, traffic arriving \
                     through the tunnel would leave untranslated",
                    self.scope.vxlan
                )),
            );
            return report;
        }
        match blocking(|| self.firewall.remove()) {
            Ok(true) => report.done(what),
            Ok(false) => {}
            Err(e) => report.record(what, Err(e)),
        }
        report
    }
}

/// Reading the routing side back, as a report names it.
fn read_routing() -> Op {
    Op::new(OpKind::Read, "routing", "read the kernel's routing state")
}

/// Runs `f`, which blocks (the `nft` subprocess, a map read of many
/// entries, ctnetlink), so that it holds up no other task: on a
/// multi-threaded runtime (the agent's) the worker hands its tasks to
/// another first; elsewhere it simply runs.
fn blocking<T>(f: impl FnOnce() -> T) -> T {
    use tokio::runtime::{Handle, RuntimeFlavor};
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => tokio::task::block_in_place(f),
        _ => f(),
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;

    use super::*;
    use crate::fake::FakeNetlink;
    use crate::kernel::{self, Parent};
    use crate::nft::FakeFirewall;
    use crate::testns::node_state;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn dataplane() -> Dataplane<FakeNetlink, FakeFirewall> {
        let mut netlink = FakeNetlink::default();
        netlink.parents.insert(
            ip("172.18.0.11"),
            Parent {
                name: "eth0".into(),
                index: 2,
                mtu: 1500,
            },
        );
        Dataplane::new(netlink, FakeFirewall::default(), Config::default())
    }

    fn run<T>(f: impl Future<Output = T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(f)
    }

    #[test]
    fn first_reconcile_builds_everything_and_the_second_plans_nothing() {
        run(async {
            let mut dp = dataplane();
            let first = dp.reconcile(&node_state(true)).await;
            assert!(first.is_ok(), "{:?}", first.failed);
            let k = &dp.backends().0.state;
            let v = k.vxlan.as_ref().unwrap();
            assert_eq!(v.identity.parent, 2);
            assert_eq!(v.settings.mtu, 1450, "parent MTU minus 50");
            assert!(!v.identity.learning);
            assert_eq!(k.rp_filter, Some(kernel::RP_FILTER_LOOSE));
            assert_eq!(k.neighbours.len(), 1);
            assert_eq!(k.fdb.values().next(), Some(&ip("172.18.0.12")));
            assert_eq!(k.routes.len(), 2, "one default route, one reply route");
            assert_eq!(k.rules.len(), 2);
            assert!(k.eips.contains(&ip("198.51.100.200")));

            let second = dp.reconcile(&node_state(true)).await;
            assert_eq!(second.ops(), 0, "{:?}", second.applied);
        });
    }

    fn pods_state() -> NodeState {
        use egressgw_core::state::{Action, ClassifyEntry};
        let mut state = node_state(true);
        let entry = |src: &str, dst: &str, action: Action| ClassifyEntry {
            src: ip(src),
            dst: dst.parse().unwrap(),
            action,
            policy: Some(PolicyRef::namespaced("team-a", "web").into()),
            group: None,
        };
        let tunnel = Action::Tunnel {
            gateway: "b".into(),
            mark: Config::default().mark(1),
        };
        state.classify = vec![
            entry("10.244.1.2", "198.51.100.0/24", tunnel.clone()),
            entry("10.244.1.2", "198.51.100.9/32", Action::Bypass),
            entry("10.244.1.3", "198.51.100.0/24", tunnel),
            entry("10.244.1.4", "203.0.113.0/24", Action::Drop),
        ];
        state
    }

    fn ebpf_dataplane() -> (
        Dataplane<FakeNetlink, FakeFirewall>,
        std::sync::Arc<std::sync::Mutex<crate::classify::FakeClassifier>>,
    ) {
        let fake = std::sync::Arc::default();
        let mut dp = dataplane().with_classifier(Box::new(std::sync::Arc::clone(&fake)));
        for (pod, link) in [
            ("10.244.1.2", "cali-a"),
            ("10.244.1.3", "cali-b"),
            ("10.244.1.4", "cali-c"),
        ] {
            dp.netlink.pod_links.insert(ip(pod), link.into());
        }
        (dp, fake)
    }

    #[test]
    fn the_ebpf_datapath_attaches_where_pods_send_and_keeps_the_table_as_a_backstop() {
        run(async {
            let (mut dp, fake) = ebpf_dataplane();
            assert_eq!(dp.datapath(), Datapath::Ebpf);
            let state = pods_state();
            let first = dp.reconcile(&state).await;
            assert!(first.is_ok(), "{:?}", first.failed);
            {
                let fake = fake.lock().unwrap();
                let links: Vec<&str> = fake.attached.iter().map(String::as_str).collect();
                assert_eq!(links, ["cali-a", "cali-b", "cali-c"]);
                assert_eq!(fake.entries, state.classify);
            }
            // The table still classifies (for an interface the program is
            // not on yet) and fails closed; its prerouting chain is the
            // eBPF datapath's: the program's mark decides first.
            let spec = FirewallSpec::for_datapath(&state, &Config::default(), Datapath::Ebpf);
            assert_eq!(
                spec.classify,
                FirewallSpec::new(&state, &Config::default()).classify
            );
            let observed = dp.firewall.observe().unwrap().unwrap();
            assert!(
                nft::plan(&spec, Some(&observed)).is_empty(),
                "the table is the eBPF datapath's"
            );
            let prerouting = spec
                .chains()
                .into_iter()
                .find(|c| c.name == "prerouting")
                .unwrap();
            assert!(
                prerouting
                    .rules
                    .iter()
                    .any(|r| r.starts_with("meta mark & 0xff000000 vmap")
                        && r.contains(": goto mark_")),
                "{:?}",
                prerouting.rules
            );

            let second = dp.reconcile(&state).await;
            assert_eq!(second.ops(), 0, "{:?}", second.applied);

            // A pod goes: its interface is let go, its entries removed.
            let mut fewer = state.clone();
            fewer.classify.retain(|e| e.src != ip("10.244.1.3"));
            let third = dp.reconcile(&fewer).await;
            assert!(
                third
                    .applied
                    .iter()
                    .any(|op| op.text == "detach the eBPF classifier on cali-b"),
                "{:?}",
                third.applied
            );
            let fake = fake.lock().unwrap();
            assert!(!fake.attached.contains("cali-b"));
            assert_eq!(fake.entries, fewer.classify);
        });
    }

    #[test]
    fn the_classifiers_part_lands_with_the_table_in_one_transaction_and_it_syncs_after() {
        run(async {
            let (mut dp, fake) = ebpf_dataplane();
            let state = pods_state();
            let report = dp.reconcile(&state).await;
            assert!(report.is_ok(), "{:?}", report.failed);
            assert_eq!(dp.firewall.transactions, 1, "one transaction for the table");
            let observed = dp.firewall.observe().unwrap().unwrap();
            let spec = FirewallSpec::for_datapath(&state, &Config::default(), Datapath::Ebpf);
            assert!(!spec.classify.is_empty());
            assert!(nft::plan(&spec, Some(&observed)).is_empty());
            // Every change of the classifier after every change of the
            // table: a mark the program sets has its chain by then.
            let kinds: Vec<OpKind> = report.applied.iter().map(|op| op.kind).collect();
            let last_table = kinds
                .iter()
                .rposition(|k| matches!(k, OpKind::Table | OpKind::Chain | OpKind::Element));
            let first_classifier = kinds
                .iter()
                .position(|k| matches!(k, OpKind::Program | OpKind::Map));
            assert!(
                last_table.unwrap() < first_classifier.unwrap(),
                "{:?}",
                report.applied
            );
            assert_eq!(fake.lock().unwrap().entries, state.classify);
        });
    }

    #[test]
    fn pod_interfaces_not_found_keep_the_attachments_and_the_entries_still_land() {
        run(async {
            let (mut dp, fake) = ebpf_dataplane();
            let state = pods_state();
            assert!(dp.reconcile(&state).await.is_ok());
            dp.netlink
                .fail
                .push((OpKind::Read, "pod interfaces".into()));
            let mut fewer = state.clone();
            fewer.classify.retain(|e| e.src != ip("10.244.1.3"));
            let report = dp.reconcile(&fewer).await;
            assert_eq!(report.failed.len(), 1, "{:?}", report.failed);
            assert_eq!(report.failed[0].op.object, "pod interfaces");
            let fake = fake.lock().unwrap();
            assert!(fake.attached.contains("cali-b"), "attachments as they were");
            assert_eq!(fake.entries, fewer.classify);
        });
    }

    #[test]
    fn the_nftables_classifier_is_the_table_and_looks_for_no_interfaces() {
        run(async {
            let mut dp = dataplane();
            dp.netlink
                .fail
                .push((OpKind::Read, "pod interfaces".into()));
            let state = pods_state();
            let report = dp.reconcile(&state).await;
            assert!(report.is_ok(), "{:?}", report.failed);
            assert!(
                report
                    .applied
                    .iter()
                    .all(|op| !matches!(op.kind, OpKind::Program | OpKind::Map)),
                "{:?}",
                report.applied
            );
            assert_eq!(dp.firewall.transactions, 1);
        });
    }

    #[test]
    fn a_parent_not_found_keeps_the_tunnels_end_where_it_is() {
        run(async {
            let (mut dp, fake) = ebpf_dataplane();
            let state = pods_state();
            assert!(dp.reconcile(&state).await.is_ok());
            assert_eq!(fake.lock().unwrap().underlay.as_deref(), Some("eth0"));
            // The underlay address is being moved: the routing side and
            // the tunnel's end stay as they are.
            dp.netlink.parents.clear();
            let report = dp.reconcile(&state).await;
            assert_eq!(report.failed.len(), 1, "{:?}", report.failed);
            assert_eq!(fake.lock().unwrap().underlay.as_deref(), Some("eth0"));
            // A node without a tunnel has nothing for it to be on.
            let mut no_tunnel = state.clone();
            no_tunnel.vxlan = None;
            dp.reconcile(&no_tunnel).await;
            assert_eq!(fake.lock().unwrap().underlay, None);
        });
    }

    #[test]
    fn an_unreadable_table_is_reported_and_the_classifier_still_follows_the_plan() {
        use egressgw_core::state::Action;
        run(async {
            let other = |state: &NodeState| {
                let mut other = state.clone();
                for e in &mut other.classify {
                    if e.action != Action::Bypass {
                        e.policy = Some(PolicyRef::namespaced("team-a", "db").into());
                    }
                }
                other
            };
            let db = PolicyRef::namespaced("team-a", "db");
            // The nftables classifier counts the plan's policies.
            let mut dp = dataplane();
            let state = pods_state();
            assert!(dp.reconcile(&state).await.is_ok());
            dp.firewall.fail_observe = true;
            let report = dp.reconcile(&other(&state)).await;
            assert_eq!(report.failed.len(), 1, "{:?}", report.failed);
            assert_eq!(report.failed[0].op.text, "read the nftables table");
            let counted = dp.policy_counters().unwrap();
            assert_eq!(counted.keys().collect::<Vec<_>>(), [&db]);
            assert_eq!(counted[&db].packets, 0, "no counter object yet");
            // The eBPF classifier's maps follow the plan.
            let (mut dp, fake) = ebpf_dataplane();
            assert!(dp.reconcile(&state).await.is_ok());
            dp.firewall.fail_observe = true;
            let report = dp.reconcile(&other(&state)).await;
            assert_eq!(report.failed.len(), 1, "{:?}", report.failed);
            assert_eq!(fake.lock().unwrap().entries, other(&state).classify);
        });
    }

    #[test]
    fn the_nftables_datapath_removes_what_an_ebpf_predecessor_pinned_and_the_ebpf_keeps_it() {
        let dir = std::env::temp_dir().join(format!("egressgw-pins-{}", std::process::id()));
        let pinned = |dir: &std::path::Path| {
            std::fs::create_dir_all(dir).unwrap();
            for file in ["link-ingress-7-cali-a", "EGRESSGW_CLASSIFY4"] {
                std::fs::write(dir.join(file), b"").unwrap();
            }
        };
        run(async {
            let (dp, _) = ebpf_dataplane();
            let mut dp = dp.with_ebpf_pins(&dir);
            pinned(&dir);
            assert!(dp.reconcile(&pods_state()).await.is_ok());
            assert!(
                dir.join("link-ingress-7-cali-a").exists(),
                "the eBPF datapath's own"
            );

            let mut dp = dataplane().with_ebpf_pins(&dir);
            let report = dp.reconcile(&pods_state()).await;
            let removed = std::fs::exists(&dir).unwrap();
            std::fs::remove_dir_all(&dir).ok();
            assert!(report.is_ok(), "{:?}", report.failed);
            assert!(!removed, "removed by the nftables datapath");
            assert!(
                report
                    .applied
                    .iter()
                    .any(|op| op.text.contains("this node runs the nftables datapath")),
                "{:?}",
                report.applied
            );
        });
    }

    #[test]
    fn an_interface_the_classifier_cannot_attach_to_is_reported_and_the_rest_lands() {
        run(async {
            let (mut dp, fake) = ebpf_dataplane();
            fake.lock().unwrap().fail_attach.insert("cali-b".into());
            let report = dp.reconcile(&pods_state()).await;
            assert_eq!(report.failed.len(), 1, "{:?}", report.failed);
            assert!(
                report.failed[0].op.text.contains("cali-b"),
                "{:?}",
                report.failed
            );
            let fake = fake.lock().unwrap();
            assert!(fake.attached.contains("cali-a") && fake.attached.contains("cali-c"));
            assert!(!fake.entries.is_empty(), "the maps are filled all the same");
        });
    }

    #[test]
    fn the_nftables_datapath_keeps_its_own_table() {
        run(async {
            let mut dp = dataplane();
            assert_eq!(dp.datapath(), Datapath::Nftables);
            let state = pods_state();
            assert!(dp.reconcile(&state).await.is_ok());
            let observed = dp.firewall.observe().unwrap().unwrap();
            let spec = FirewallSpec::new(&state, &Config::default());
            assert!(nft::plan(&spec, Some(&observed)).is_empty());
            assert_ne!(
                spec.chains(),
                FirewallSpec::for_datapath(&state, &Config::default(), Datapath::Ebpf).chains(),
                "the datapaths' chains differ"
            );
            // Every packet of a selected source counts in its policy's
            // counter object; the reconcile knows which object is whose.
            let web = PolicyRef::namespaced("team-a", "web");
            let name = nft::counter_name(&web);
            assert_eq!(spec.counters.keys().collect::<Vec<_>>(), [&name]);
            assert!(observed.counters.contains(&name));
            assert!(spec.count.values().all(|c| *c == name));
            dp.firewall.counted.insert(
                name,
                Counter {
                    packets: 3,
                    bytes: 180,
                },
            );
            let counters = dp.policy_counters().unwrap();
            assert_eq!(counters[&web].packets, 3);
            assert_eq!(counters[&web].bytes, 180);
            // Beside the eBPF program the table counts nothing.
            let ebpf = FirewallSpec::for_datapath(&state, &Config::default(), Datapath::Ebpf);
            assert!(ebpf.count.is_empty() && ebpf.counters.is_empty());
        });
    }

    #[test]
    fn sources_classified_anew_have_their_unanswered_connections_forgotten() {
        run(async {
            use egressgw_core::state::{Action, ClassifyEntry};
            let mut dp = dataplane();
            let mut state = node_state(true);
            let entry = |src: &str, action: Action| ClassifyEntry {
                src: ip(src),
                dst: "198.51.100.0/24".parse().unwrap(),
                action,
                policy: None,
                group: None,
            };
            state.classify = vec![
                entry(
                    "10.244.1.2",
                    Action::Tunnel {
                        gateway: "b".into(),
                        mark: Config::default().mark(1),
                    },
                ),
                entry("10.244.1.3", Action::Local),
                entry("10.244.1.4", Action::Drop),
                entry("10.244.1.5", Action::Bypass),
            ];
            let first = dp.reconcile(&state).await;
            assert!(first.is_ok(), "{:?}", first.failed);
            // Dropped traffic never leaves, bypassed traffic stays on the
            // way it took: only sources sent somewhere new start afresh.
            let forgotten: Vec<IpAddr> = dp.firewall.forgotten.iter().map(|k| k.src).collect();
            assert_eq!(forgotten, vec![ip("10.244.1.2"), ip("10.244.1.3")]);
            assert!(
                first
                    .applied
                    .iter()
                    .any(|op| op.text.starts_with("forget "))
            );
            // Nothing classified anew: nothing forgotten.
            dp.firewall.forgotten.clear();
            dp.reconcile(&state).await;
            assert!(dp.firewall.forgotten.is_empty());
        });
    }

    #[test]
    fn a_failed_op_is_reported_with_its_object_and_the_others_still_run() {
        run(async {
            let mut healthy = dataplane();
            healthy.reconcile(&node_state(false)).await;
            let rule = healthy.netlink.state.rules.iter().find(|r| r.table == 3000);
            let mut dp = dataplane();
            dp.netlink
                .fail
                .push((OpKind::Rule, rule.expect("a rule to table 3000").object()));
            let report = dp.reconcile(&node_state(false)).await;
            assert_eq!(report.failed.len(), 1);
            assert_eq!(report.failed[0].op.kind, OpKind::Rule);
            assert!(
                report.failed[0]
                    .op
                    .text
                    .contains("fwmark 0x01000000/0xff000000 lookup 3000")
            );
            assert!(
                report
                    .applied
                    .iter()
                    .any(|op| op.text.contains("lookup 3254"))
            );
            assert!(
                report
                    .applied
                    .iter()
                    .any(|op| op.text.contains("neighbour"))
            );
            // Once the kernel accepts it, only the missing rule is planned.
            dp.netlink.fail.clear();
            let again = dp.reconcile(&node_state(false)).await;
            assert_eq!(again.applied.len(), 1, "{:?}", again.applied);
        });
    }

    #[test]
    fn identity_drift_recreates_the_device_and_everything_on_it() {
        run(async {
            let mut dp = dataplane();
            dp.reconcile(&node_state(false)).await;
            let mut changed = node_state(false);
            changed.vxlan.as_mut().unwrap().vni = 200;
            let report = dp.reconcile(&changed).await;
            assert!(
                report.applied[0]
                    .text
                    .starts_with("delete link egress.vxlan")
            );
            assert!(report.applied[1].text.contains("id 200"));
            assert!(
                report
                    .applied
                    .iter()
                    .any(|op| op.text.contains("neighbour"))
            );
            assert_eq!(dp.reconcile(&changed).await.ops(), 0);
        });
    }

    #[test]
    fn settings_drift_is_corrected_in_place() {
        run(async {
            let mut dp = dataplane();
            dp.reconcile(&node_state(false)).await;
            dp.netlink.state.vxlan.as_mut().unwrap().settings.mtu = 9000;
            dp.netlink.state.rp_filter = Some(1);
            let report = dp.reconcile(&node_state(false)).await;
            assert_eq!(report.applied.len(), 2, "{:?}", report.applied);
            assert!(report.applied[0].text.contains("mtu 1450"));
            assert!(report.applied[1].text.contains("rp_filter=2"));
        });
    }

    #[test]
    fn disabling_checksum_offload_turns_tx_checksumming_off() {
        run(async {
            let mut dp = dataplane();
            let mut s = node_state(false);
            s.vxlan.as_mut().unwrap().disable_checksum_offload = true;
            dp.reconcile(&s).await;
            assert_eq!(dp.netlink.state.tx_checksum, Some(false));
        });
    }

    #[test]
    fn stale_peers_routes_rules_and_eips_are_removed() {
        run(async {
            let mut dp = dataplane();
            dp.reconcile(&node_state(true)).await;
            let mut fewer = node_state(false);
            fewer.peers.clear();
            fewer.routes.clear();
            fewer.replies = Default::default();
            fewer.rules.clear();
            let report = dp.reconcile(&fewer).await;
            assert!(report.is_ok());
            let k = &dp.netlink.state;
            assert!(k.neighbours.is_empty() && k.fdb.is_empty());
            assert!(k.routes.is_empty() && k.rules.is_empty());
            assert_eq!(k.eip_device, None, "no EIP left: the device goes");
            assert!(k.vxlan.is_some());
        });
    }

    #[test]
    fn a_missing_underlay_interface_is_reported_by_address() {
        run(async {
            let mut dp = dataplane();
            dp.netlink.parents.clear();
            let report = dp.reconcile(&node_state(false)).await;
            assert!(report.failed[0].error.contains("172.18.0.11"));
            assert!(dp.netlink.state.vxlan.is_none());
            assert!(
                dp.netlink.state.rules.is_empty(),
                "no rules without the tunnel"
            );
        });
    }

    #[test]
    fn cleanup_removes_what_egressgw_owns_and_nothing_else() {
        run(async {
            let mut dp = dataplane();
            let foreign = kernel::Rule {
                ipv6: false,
                priority: 100,
                mark: 0x10,
                mask: 0xff,
                table: 100,
            };
            dp.netlink.state.rules.insert(foreign);
            dp.reconcile(&node_state(true)).await;
            let report = dp.cleanup().await;
            assert!(report.is_ok());
            let k = &dp.netlink.state;
            assert!(k.vxlan.is_none() && k.eip_device.is_none() && k.routes.is_empty());
            assert_eq!(k.rules.iter().collect::<Vec<_>>(), vec![&foreign]);
            assert_eq!(dp.cleanup().await.ops(), 0, "cleanup twice changes nothing");
        });
    }

    /// On a gateway the table's guard drops what arrives through the tunnel
    /// untranslated: the tunnel goes before the table, and while it cannot
    /// go the table stays.
    #[test]
    fn cleanup_removes_the_tunnel_before_the_table_and_keeps_the_table_while_the_tunnel_stays() {
        run(async {
            let mut dp = dataplane();
            dp.reconcile(&node_state(true)).await;
            let report = dp.cleanup().await;
            assert!(report.is_ok(), "{:?}", report.failed);
            let at = |kind: OpKind| {
                report
                    .applied
                    .iter()
                    .position(|op| {
                        op.kind == kind && (kind == OpKind::Table || op.object == "egress.vxlan")
                    })
                    .unwrap_or_else(|| panic!("no {kind:?} op in {:?}", report.applied))
            };
            assert!(at(OpKind::Link) < at(OpKind::Table), "{:?}", report.applied);

            let mut stuck = dataplane();
            stuck.reconcile(&node_state(true)).await;
            stuck
                .netlink
                .fail
                .push((OpKind::Link, "egress.vxlan".to_owned()));
            let report = stuck.cleanup().await;
            assert!(stuck.netlink.state.vxlan.is_some());
            assert!(
                stuck.firewall.table.is_some(),
                "the table went with the tunnel still up"
            );
            assert!(
                report
                    .failed
                    .iter()
                    .any(|f| f.op.kind == OpKind::Table && f.error.contains("egress.vxlan")),
                "{:?}",
                report.failed
            );
            stuck.netlink.fail.clear();
            assert!(stuck.cleanup().await.is_ok());
            assert!(stuck.netlink.state.vxlan.is_none() && stuck.firewall.table.is_none());
        });
    }
}
