//! An in-memory [`Netlink`] for tests of the reconcile loop without root.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use crate::kernel::{KernelOp, KernelState, Parent, Scope};
use crate::netlink::Netlink;
use crate::{Error, OpKind, Operation, Report, Result};

/// A kernel in memory: applying an op changes [`FakeNetlink::state`] the
/// way the real kernel would, including what deleting a device takes with
/// it. Ops whose kind and object are in [`FakeNetlink::fail`] fail.
#[derive(Debug, Clone, Default)]
pub struct FakeNetlink {
    /// The kernel's objects, including ones outside egressgw's scope.
    pub state: KernelState,
    /// Interfaces by address, for [`Netlink::parent`].
    pub parents: BTreeMap<IpAddr, Parent>,
    /// The interface each pod address is reached by, for
    /// [`Netlink::pod_interfaces`].
    pub pod_links: BTreeMap<IpAddr, String>,
    /// The ops that fail, by kind and object.
    pub fail: Vec<(OpKind, String)>,
    /// Every op applied, as text.
    pub log: Vec<String>,
}

impl Netlink for FakeNetlink {
    async fn parent(&mut self, local: IpAddr) -> Result<Option<Parent>> {
        Ok(self.parents.get(&local).cloned())
    }

    async fn pod_interfaces(
        &mut self,
        pods: &[IpAddr],
    ) -> Result<BTreeMap<String, BTreeSet<IpAddr>>> {
        if self
            .fail
            .iter()
            .any(|(kind, object)| *kind == OpKind::Read && object == "pod interfaces")
        {
            return Err(Error::Host("injected failure".into()));
        }
        let mut out: BTreeMap<String, BTreeSet<IpAddr>> = BTreeMap::new();
        for pod in pods {
            if let Some(link) = self.pod_links.get(pod) {
                out.entry(link.clone()).or_default().insert(*pod);
            }
        }
        Ok(out)
    }

    async fn observe(&mut self, scope: &Scope) -> Result<KernelState> {
        let mut seen = self.state.clone();
        seen.rules.retain(|r| scope.owns_rule(r));
        seen.routes
            .retain(|(table, _), _| scope.tables.contains(table));
        Ok(seen)
    }

    async fn apply(&mut self, op: &KernelOp, _report: &mut Report) -> Result<()> {
        let described = op.op();
        if self
            .fail
            .iter()
            .any(|(kind, object)| *kind == described.kind && *object == described.object)
        {
            return Err(Error::Host("injected failure".into()));
        }
        self.log.push(described.text);
        let s = &mut self.state;
        match op {
            KernelOp::CreateVxlan(l) => {
                s.vxlan = Some(l.clone());
                s.rp_filter = Some(0);
                s.tx_checksum = Some(true);
            }
            KernelOp::DeleteVxlan { .. } => {
                s.vxlan = None;
                s.vxlan_addrs.clear();
                s.rp_filter = None;
                s.tx_checksum = None;
                s.neighbours.clear();
                s.fdb.clear();
                // Routes through the device go with it.
                s.routes.clear();
            }
            KernelOp::SetVxlan { settings, .. } => {
                if let Some(v) = &mut s.vxlan {
                    v.settings = settings.clone();
                }
            }
            KernelOp::SetRpFilter { value, .. } => s.rp_filter = Some(*value),
            KernelOp::SetTxChecksum { on, .. } => s.tx_checksum = Some(*on),
            KernelOp::AddAddr { net, .. } => {
                s.vxlan_addrs.insert(*net);
            }
            KernelOp::DelAddr { net, .. } => {
                s.vxlan_addrs.remove(net);
            }
            KernelOp::SetNeighbour { ip, mac } => {
                s.neighbours.insert(*ip, *mac);
            }
            KernelOp::DelNeighbour { ip, .. } => {
                s.neighbours.remove(ip);
            }
            KernelOp::SetFdb { mac, dst } => {
                s.fdb.insert(*mac, *dst);
            }
            KernelOp::DelFdb { mac, dst } => {
                if s.fdb.get(mac) == Some(dst) {
                    s.fdb.remove(mac);
                }
            }
            KernelOp::SetRoute { table, dst, via } => {
                s.routes.insert((*table, *dst), *via);
            }
            KernelOp::DelRoute { table, dst, .. } => {
                s.routes.remove(&(*table, *dst));
            }
            KernelOp::AddRule(r) => {
                s.rules.insert(*r);
            }
            KernelOp::DelRule(r) => {
                s.rules.remove(r);
            }
            KernelOp::CreateEipDevice { .. } => s.eip_device = Some(true),
            KernelOp::SetEipDeviceUp { .. } => s.eip_device = Some(true),
            KernelOp::DeleteEipDevice { .. } => {
                s.eip_device = None;
                s.eips.clear();
            }
            KernelOp::AddEip { ip, .. } => {
                s.eips.insert(*ip);
            }
            KernelOp::ProxyEip { ip } => {
                s.unproxied.remove(ip);
            }
            KernelOp::DelEip { ip, .. } => {
                s.eips.remove(ip);
                s.unproxied.remove(ip);
            }
        }
        Ok(())
    }
}
