//! One node's reconcile: observe, plan, apply — for the routing side and the
//! firewall — and cleanup.

use egressgw_core::model::Config;
use egressgw_core::state::NodeState;

use crate::Report;
use crate::kernel::{self, Desired, KernelOp, Scope};
use crate::netlink::Netlink;
use crate::nft::{self, Firewall, FirewallSpec};

/// A node's dataplane: the routing side and the firewall, reconciled
/// together.
#[derive(Debug)]
pub struct Dataplane<N, F> {
    netlink: N,
    firewall: F,
    config: Config,
    scope: Scope,
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
        }
    }

    /// The backends, for tests that look inside fakes.
    pub fn backends(&self) -> (&N, &F) {
        (&self.netlink, &self.firewall)
    }

    /// Makes the kernel match `state`.
    ///
    /// Order: devices first (observed again once they exist), then every
    /// addition and change of the routing side, then the firewall (one
    /// transaction), then removals — so new paths exist before traffic is
    /// classified onto them and old paths go only after classification has
    /// left them. A failed operation is in the report and the others still
    /// run. Nothing is flushed: an unchanged state plans no operation.
    pub async fn reconcile(&mut self, state: &NodeState) -> Report {
        let span = tracing::info_span!("reconcile", node = %state.node);
        let _enter = span.enter();
        let mut report = Report::default();
        let parent = match &state.vxlan {
            None => None,
            Some(v) => match self.netlink.parent(v.local).await {
                Ok(Some(p)) => Some(p),
                Ok(None) => {
                    report.record(
                        format!("create link {}", v.name),
                        Err(format!(
                            "no interface holds the node's underlay address {}",
                            v.local
                        )),
                    );
                    None
                }
                Err(e) => {
                    report.record(format!("find the parent of {}", v.name), Err(e));
                    None
                }
            },
        };
        let desired = Desired::new(state, &self.config, parent.as_ref());

        let Some(mut ops) = self.plan_kernel(&desired, &mut report).await else {
            return report;
        };
        let leading = ops.iter().take_while(|op| op.is_device_op()).count();
        if leading > 0 {
            for op in ops.drain(..leading) {
                self.apply(&op, &mut report).await;
            }
            match self.plan_kernel(&desired, &mut report).await {
                // A device op that failed shows up again: it was tried once.
                Some(again) => {
                    ops = again;
                    let retried = ops.iter().take_while(|op| op.is_device_op()).count();
                    ops.drain(..retried);
                }
                None => return report,
            }
        }
        let (removals, additions): (Vec<KernelOp>, Vec<KernelOp>) =
            ops.into_iter().partition(KernelOp::is_removal);
        for op in &additions {
            self.apply(op, &mut report).await;
        }
        self.reconcile_firewall(state, &mut report);
        for op in &removals {
            self.apply(op, &mut report).await;
        }
        report
    }

    async fn plan_kernel(&mut self, desired: &Desired, report: &mut Report) -> Option<Vec<KernelOp>> {
        match self.netlink.observe(&self.scope).await {
            Ok(observed) => {
                if let Some(offloads) = &observed.offloads {
                    report
                        .facts
                        .insert(format!("{} offloads", self.scope.vxlan), offloads.clone());
                }
                if observed.tx_checksum == Some(true)
                    && crate::ethtool::kernel_has_vxlan_snat_checksum_bug()
                {
                    report.warn(format!(
                        "{}: tx checksum offload is on and this kernel is older than 5.7, \
                         where VXLAN with SNAT can send bad checksums; set \
                         vxlan.disableChecksumOffload=true",
                        self.scope.vxlan
                    ));
                }
                Some(kernel::plan(desired, &observed, &self.scope))
            }
            Err(e) => {
                report.record("read the kernel's state", Err(e));
                None
            }
        }
    }

    async fn apply(&mut self, op: &KernelOp, report: &mut Report) {
        let result = self.netlink.apply(op, report).await;
        report.record(op, result);
    }

    fn reconcile_firewall(&mut self, state: &NodeState, report: &mut Report) {
        let spec = FirewallSpec::new(state, &self.config);
        match self.firewall.observe() {
            Ok(observed) => {
                let ops = nft::plan(&spec, observed.as_ref());
                if !ops.is_empty() {
                    report.merge(self.firewall.apply(&ops));
                }
            }
            Err(e) => report.record("read the nftables table", Err(e)),
        }
    }

    /// Removes everything egressgw created — the firewall table, rules,
    /// routes and both devices — and nothing else. Keeps going past
    /// failures and reports each.
    pub async fn cleanup(&mut self) -> Report {
        let mut report = Report::default();
        match self.firewall.remove() {
            Ok(true) => report.applied.push(format!("delete table {}", nft::TABLE)),
            Ok(false) => {}
            Err(e) => report.record(format!("delete table {}", nft::TABLE), Err(e)),
        }
        match self.netlink.observe(&self.scope).await {
            Ok(observed) => {
                for op in kernel::plan(&Desired::default(), &observed, &self.scope) {
                    self.apply(&op, &mut report).await;
                }
            }
            Err(e) => report.record("read the kernel's state", Err(e)),
        }
        report
    }
}
