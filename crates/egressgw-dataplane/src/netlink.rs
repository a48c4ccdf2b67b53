//! The routing side through rtnetlink: [`Netlink`] and its real backend
//! [`Rtnetlink`]. Requests are built from netlink-packet-route messages so
//! that adding and deleting an object use the very same description of it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use egressgw_core::model::Mac;
use futures_util::{StreamExt, TryStreamExt};
use ipnet::IpNet;
use netlink_packet_core::{
    NLM_F_ACK, NLM_F_CREATE, NLM_F_DUMP, NLM_F_EXCL, NLM_F_REPLACE, NLM_F_REQUEST, NetlinkMessage,
    NetlinkPayload,
};
use netlink_packet_route::address::{AddressAttribute, AddressFlags, AddressMessage};
use netlink_packet_route::link::{
    InfoData, InfoKind, InfoVxlan, LinkAttribute, LinkFlags, LinkInfo, LinkMessage,
};
use netlink_packet_route::neighbour::{
    NeighbourAddress, NeighbourAttribute, NeighbourFlags, NeighbourMessage, NeighbourState,
};
use netlink_packet_route::route::{
    RouteAddress, RouteAttribute, RouteFlags, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use netlink_packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use netlink_packet_route::{AddressFamily, RouteNetlinkMessage};
use rtnetlink::{Handle, LinkDummy, LinkIfb, LinkUnspec, LinkVxlan, RouteMessageBuilder};

use crate::kernel::{
    KernelOp, KernelState, Parent, Rule, Scope, VxlanIdentity, VxlanLink, VxlanSettings,
};
use crate::{Error, Report, Result};

/// Links, addresses, neighbours, FDB entries, rules and routes.
#[expect(
    async_fn_in_trait,
    reason = "used through generics; the concrete future's Send-ness is visible to callers"
)]
pub trait Netlink {
    /// The interface holding `local` (the node's underlay address).
    async fn parent(&mut self, local: IpAddr) -> Result<Option<Parent>>;
    /// Reads back every object inside `scope`.
    async fn observe(&mut self, scope: &Scope) -> Result<KernelState>;
    /// Carries out one operation; announcements and other side notes go to
    /// `report`.
    async fn apply(&mut self, op: &KernelOp, report: &mut Report) -> Result<()>;
    /// The interfaces traffic from these pod addresses enters the node by
    /// (see [`Rtnetlink::pod_interfaces`]).
    async fn pod_interfaces(
        &mut self,
        pods: &[IpAddr],
    ) -> Result<BTreeMap<String, BTreeSet<IpAddr>>>;
}

/// The real backend: one rtnetlink socket in the caller's network namespace.
#[derive(Debug, Clone)]
pub struct Rtnetlink {
    handle: Handle,
    /// The tunnel device's name, from the last observed scope.
    vxlan_name: Option<String>,
    /// Device indexes seen by the last observe, so that applying hundreds of
    /// neighbour and route ops does not look the device up for each one.
    indexes: BTreeMap<String, u32>,
    /// Where the network sysctls are: `/proc/sys/net`, or a writable mount
    /// of it in a container, whose own `/proc/sys` is read-only.
    sysctl_net: PathBuf,
}

/// The network sysctls' directory unless [`Rtnetlink::with_sysctl_dir`]
/// says otherwise.
pub const SYSCTL_NET: &str = "/proc/sys/net";

fn nl(what: impl Into<String>) -> impl FnOnce(rtnetlink::Error) -> Error {
    let what = what.into();
    move |source| Error::Netlink { what, source }
}

/// Whether a netlink error is `errno` (positive, e.g. `libc`'s ENODEV = 19).
fn is_errno(e: &rtnetlink::Error, errno: i32) -> bool {
    matches!(e, rtnetlink::Error::NetlinkError(m) if m.raw_code() == -errno)
}

const ENOENT: i32 = 2;
const ESRCH: i32 = 3;
const ENODEV: i32 = 19;
const EEXIST: i32 = 17;
const EADDRNOTAVAIL: i32 = 99;
const EOPNOTSUPP: i32 = 95;
const EAFNOSUPPORT: i32 = 97;

/// What [`Rtnetlink::pod_interfaces`] needs to know of a link.
#[derive(Debug)]
struct LinkSummary {
    index: u32,
    name: String,
    kind: Option<InfoKind>,
    /// The bridge (or bond, ...) it is a port of.
    controller: Option<u32>,
}

impl Rtnetlink {
    /// Opens a socket; must run inside a tokio runtime, which drives it.
    pub fn connect() -> Result<Self> {
        let (conn, handle, _) = rtnetlink::new_connection()
            .map_err(|e| Error::Host(format!("open an rtnetlink socket: {e}")))?;
        tokio::spawn(conn);
        Ok(Rtnetlink {
            handle,
            vxlan_name: None,
            indexes: BTreeMap::new(),
            sysctl_net: PathBuf::from(SYSCTL_NET),
        })
    }

    /// The interfaces traffic from each of `pods` enters the node by, and
    /// so where the eBPF classifier attaches, found from the kernel's
    /// route to each pod, so no CNI needs to be known: a routed CNI
    /// (Calico and the like) gives each pod's own veth; a bridge CNI gives
    /// its bridge, and then the bridge's veth ports stand for it (each
    /// listed with all the bridge's pods), so that the classifier sees a
    /// pod's packets before the bridge does (with `br_netfilter`, before
    /// the node's netfilter). A bridge with no veth port stands for itself.
    /// Addresses that are the node's own (a host-network pod) or have no
    /// route are left out.
    pub async fn pod_interfaces(
        &self,
        pods: &[IpAddr],
    ) -> Result<BTreeMap<String, BTreeSet<IpAddr>>> {
        let mut by_index: BTreeMap<u32, BTreeSet<IpAddr>> = BTreeMap::new();
        for pod in pods {
            let prefix = if pod.is_ipv4() { 32 } else { 128 };
            let Ok(query) = RouteMessageBuilder::<IpAddr>::new().destination_prefix(*pod, prefix)
            else {
                continue;
            };
            let mut answers = self.handle.route().get(query.build()).execute();
            let answer = match answers.try_next().await {
                Ok(answer) => answer,
                // No route (ENETUNREACH and the like): not reachable here.
                Err(rtnetlink::Error::NetlinkError(_)) => None,
                Err(e) => return Err(nl(format!("route to pod {pod}: get"))(e)),
            };
            let Some(route) = answer else { continue };
            if route.header.kind == RouteType::Local {
                continue;
            }
            let oif = route.attributes.iter().find_map(|a| match a {
                RouteAttribute::Oif(index) => Some(*index),
                _ => None,
            });
            if let Some(index) = oif {
                by_index.entry(index).or_default().insert(*pod);
            }
        }
        if by_index.is_empty() {
            return Ok(BTreeMap::new());
        }
        let links = self.links().await?;
        let mut out: BTreeMap<String, BTreeSet<IpAddr>> = BTreeMap::new();
        for (index, pods) in by_index {
            let Some(link) = links.iter().find(|l| l.index == index) else {
                continue;
            };
            let ports: Vec<&LinkSummary> = if link.kind == Some(InfoKind::Bridge) {
                links
                    .iter()
                    .filter(|l| l.controller == Some(index) && l.kind == Some(InfoKind::Veth))
                    .collect()
            } else {
                Vec::new()
            };
            let names: Vec<&str> = if ports.is_empty() {
                vec![link.name.as_str()]
            } else {
                ports.iter().map(|l| l.name.as_str()).collect()
            };
            for name in names.into_iter().filter(|n| *n != "lo") {
                out.entry(name.to_owned()).or_default().extend(&pods);
            }
        }
        Ok(out)
    }

    /// Every link of the namespace: index, name, kind and controller.
    async fn links(&self) -> Result<Vec<LinkSummary>> {
        let mut found = Vec::new();
        let mut links = self.handle.link().get().execute();
        while let Some(link) = links.try_next().await.map_err(nl("links: dump"))? {
            let mut summary = LinkSummary {
                index: link.header.index,
                name: String::new(),
                kind: None,
                controller: None,
            };
            for a in link.attributes {
                match a {
                    LinkAttribute::IfName(name) => summary.name = name,
                    LinkAttribute::Controller(index) => summary.controller = Some(index),
                    LinkAttribute::LinkInfo(infos) => {
                        summary.kind = infos.into_iter().find_map(|i| match i {
                            LinkInfo::Kind(kind) => Some(kind),
                            _ => None,
                        });
                    }
                    _ => {}
                }
            }
            found.push(summary);
        }
        Ok(found)
    }

    /// Reads and writes network sysctls under `dir` (the `/proc/sys/net` of
    /// this network namespace, mounted elsewhere) instead of [`SYSCTL_NET`].
    #[must_use]
    pub fn with_sysctl_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.sysctl_net = dir.into();
        self
    }

    /// Sends one request and waits for its acknowledgement.
    async fn ack(&self, msg: RouteNetlinkMessage, flags: u16) -> Result<(), rtnetlink::Error> {
        let mut req = NetlinkMessage::from(msg);
        req.header.flags = NLM_F_REQUEST | NLM_F_ACK | flags;
        let mut response = self.handle.clone().request(req)?;
        while let Some(m) = response.next().await {
            if let NetlinkPayload::Error(e) = m.payload {
                return Err(rtnetlink::Error::NetlinkError(e));
            }
        }
        Ok(())
    }

    /// Sends a dump request and collects the answers.
    async fn dump(
        &self,
        msg: RouteNetlinkMessage,
    ) -> Result<Vec<RouteNetlinkMessage>, rtnetlink::Error> {
        let mut req = NetlinkMessage::from(msg);
        req.header.flags = NLM_F_REQUEST | NLM_F_DUMP;
        let mut response = self.handle.clone().request(req)?;
        let mut out = Vec::new();
        while let Some(m) = response.next().await {
            match m.payload {
                NetlinkPayload::InnerMessage(inner) => out.push(inner),
                // A family the kernel lacks (IPv6 disabled) holds nothing.
                NetlinkPayload::Error(e) if e.raw_code() == -EAFNOSUPPORT => return Ok(Vec::new()),
                NetlinkPayload::Error(e) => return Err(rtnetlink::Error::NetlinkError(e)),
                _ => {}
            }
        }
        Ok(out)
    }

    /// A link by name, `None` when there is none.
    async fn link(&self, name: &str) -> Result<Option<LinkMessage>> {
        let mut links = self
            .handle
            .link()
            .get()
            .match_name(name.to_owned())
            .execute();
        match links.try_next().await {
            Ok(link) => Ok(link),
            Err(e) if is_errno(&e, ENODEV) => Ok(None),
            Err(e) => Err(nl(format!("link {name}: get"))(e)),
        }
    }

    async fn index(&self, name: &str) -> Result<u32> {
        if let Some(index) = self.indexes.get(name) {
            return Ok(*index);
        }
        self.link(name)
            .await?
            .map(|l| l.header.index)
            .ok_or_else(|| Error::Host(format!("link {name}: does not exist")))
    }

    async fn addresses(&self, index: u32) -> Result<Vec<IpNet>> {
        let mut out = Vec::new();
        let mut addrs = self
            .handle
            .address()
            .get()
            .set_link_index_filter(index)
            .execute();
        while let Some(a) = addrs
            .try_next()
            .await
            .map_err(nl(format!("addresses of link #{index}: get")))?
        {
            if let Some(ip) = address_of(&a)
                && let Ok(net) = IpNet::new(ip, a.header.prefix_len)
            {
                out.push(net);
            }
        }
        Ok(out)
    }

    async fn observe_vxlan(&self, scope: &Scope, state: &mut KernelState) -> Result<Option<u32>> {
        let Some(link) = self.link(&scope.vxlan).await? else {
            return Ok(None);
        };
        let index = link.header.index;
        state.vxlan = vxlan_of(&scope.vxlan, &link);
        state.vxlan_addrs = self
            .addresses(index)
            .await?
            .into_iter()
            .filter(|n| !is_link_local(n.addr()))
            .collect();
        match read_rp_filter(&self.sysctl_net, &scope.vxlan) {
            Ok(v) => state.rp_filter = Some(v),
            Err(e) => state
                .unreadable
                .push(format!("{e}; rp_filter is left as it is")),
        }
        match crate::ethtool::read_offloads(&scope.vxlan).await {
            Ok(offloads) => {
                state.tx_checksum = Some(offloads.tx_checksum);
                state.offloads = Some(offloads.summary());
            }
            Err(e) => state
                .unreadable
                .push(format!("{e}; checksum offload is left as it is")),
        }
        Ok(Some(index))
    }

    async fn observe_neighbours(&self, vx: u32, state: &mut KernelState) -> Result<()> {
        for family in [
            AddressFamily::Inet,
            AddressFamily::Inet6,
            AddressFamily::Bridge,
        ] {
            let mut msg = NeighbourMessage::default();
            msg.header.family = family;
            msg.header.ifindex = vx;
            let dump = self
                .dump(RouteNetlinkMessage::GetNeighbour(msg))
                .await
                .map_err(nl("neighbours: dump"))?;
            for m in dump {
                let RouteNetlinkMessage::NewNeighbour(n) = m else {
                    continue;
                };
                if n.header.ifindex != vx {
                    continue;
                }
                let (ip, mac) = neighbour_of(&n);
                match (family, ip, mac) {
                    (AddressFamily::Bridge, Some(ip), Some(mac)) => {
                        state.fdb.insert(mac, ip);
                    }
                    (AddressFamily::Inet | AddressFamily::Inet6, Some(ip), Some(mac))
                        if n.header.state == NeighbourState::Permanent =>
                    {
                        state.neighbours.insert(ip, mac);
                    }
                    _ => {}
                }
            }
        }
        Ok(())
    }

    /// Every policy-routing rule of both families.
    async fn dump_rules(&self) -> Result<Vec<RuleMessage>> {
        let mut out = Vec::new();
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            let mut msg = RuleMessage::default();
            msg.header.family = family;
            let dump = self
                .dump(RouteNetlinkMessage::GetRule(msg))
                .await
                .map_err(nl("rules: dump"))?;
            out.extend(dump.into_iter().filter_map(|m| match m {
                RouteNetlinkMessage::NewRule(r) => Some(r),
                _ => None,
            }));
        }
        Ok(out)
    }

    async fn observe_rules(&self, scope: &Scope, state: &mut KernelState) -> Result<()> {
        for r in self.dump_rules().await? {
            if let Some(rule) = rule_of(&r)
                && scope.owns_rule(&rule)
            {
                state.rules.insert(rule);
            }
        }
        Ok(())
    }

    /// Every policy-routing rule of both families that is not egressgw's.
    pub async fn other_rules(&self, scope: &Scope) -> Result<Vec<OtherRule>> {
        Ok(self
            .dump_rules()
            .await?
            .iter()
            .filter(|r| !rule_of(r).is_some_and(|rule| scope.owns_rule(&rule)))
            .map(other_rule_of)
            .collect())
    }

    async fn observe_routes(&self, scope: &Scope, state: &mut KernelState) -> Result<()> {
        for family in [AddressFamily::Inet, AddressFamily::Inet6] {
            let mut msg = RouteMessage::default();
            msg.header.address_family = family;
            let dump = self
                .dump(RouteNetlinkMessage::GetRoute(msg))
                .await
                .map_err(nl("routes: dump"))?;
            for m in dump {
                let RouteNetlinkMessage::NewRoute(r) = m else {
                    continue;
                };
                let table = table_of(&r);
                if !scope.tables.contains(&table) {
                    continue;
                }
                if let Some((dst, via)) = route_of(&r) {
                    state.routes.insert((table, dst), via);
                }
            }
        }
        Ok(())
    }

    async fn apply_op(&self, op: &KernelOp, report: &mut Report) -> Result<()> {
        use KernelOp::*;
        let what = op.to_string();
        match op {
            AddAddr { .. }
            | DelAddr { .. }
            | SetNeighbour { .. }
            | DelNeighbour { .. }
            | SetFdb { .. }
            | DelFdb { .. }
            | SetRoute { .. }
            | DelRoute { .. }
            | AddRule(_)
            | DelRule(_) => self.send(op).await,
            CreateVxlan(l) => self.create_vxlan(l).await.map_err(nl(what)),
            DeleteVxlan { name } | DeleteEipDevice { name } => {
                let index = self.index(name).await?;
                if matches!(op, DeleteEipDevice { .. }) {
                    for net in self.addresses(index).await? {
                        self.unproxy(net.addr()).await?;
                    }
                }
                self.handle
                    .link()
                    .del(index)
                    .execute()
                    .await
                    .map_err(nl(what))
            }
            SetVxlan { name, settings } => {
                let mut b = LinkUnspec::new_with_name(name)
                    .address(settings.mac.0.to_vec())
                    .mtu(settings.mtu);
                b = if settings.up { b.up() } else { b.down() };
                self.set_link(b.build()).await.map_err(nl(what))
            }
            SetEipDeviceUp { name } => {
                let msg = LinkUnspec::new_with_name(name).up().build();
                self.set_link(msg).await.map_err(nl(what))
            }
            SetRpFilter { name, value } => write_rp_filter(&self.sysctl_net, name, *value),
            SetTxChecksum { name, on } => {
                let offloads = crate::ethtool::set_tx_checksum(name, *on).await?;
                report
                    .facts
                    .insert(format!("{name} offloads"), offloads.summary());
                Ok(())
            }
            CreateEipDevice { name } => {
                self.create_eip_device(name, report).await.map_err(nl(what))
            }
            AddEip { dev, ip } => {
                let msg = address_msg(self.index(dev).await?, IpNet::from(*ip));
                self.ack(
                    RouteNetlinkMessage::NewAddress(msg),
                    NLM_F_CREATE | NLM_F_REPLACE,
                )
                .await
                .map_err(nl(what))?;
                self.proxy(*ip, report).await?;
                announce(*ip, report);
                Ok(())
            }
            ProxyEip { ip } => self.proxy(*ip, report).await,
            DelEip { dev, ip } => {
                self.unproxy(*ip).await?;
                let msg = address_msg(self.index(dev).await?, IpNet::from(*ip));
                self.ack(RouteNetlinkMessage::DelAddress(msg), 0)
                    .await
                    .or_else(|e| ignore(e, EADDRNOTAVAIL))
                    .map_err(nl(what))
            }
        }
    }

    /// Sends the one rtnetlink request `op` is ([`Self::message_of`]); an
    /// errno that means it was done already is success.
    async fn send(&self, op: &KernelOp) -> Result<()> {
        let Some((message, flags, tolerated)) = self.message_of(op).await? else {
            return Ok(());
        };
        self.ack(message, flags)
            .await
            .or_else(|e| match tolerated {
                Some(errno) => ignore(e, errno),
                None => Err(e),
            })
            .map_err(nl(op.to_string()))
    }

    /// The one rtnetlink request an address, neighbour, FDB, route or rule
    /// op is, with its flags and the errno that means it was done already
    /// (a deletion of what is gone, a rule that exists); `None` for the
    /// other ops.
    async fn message_of(
        &self,
        op: &KernelOp,
    ) -> Result<Option<(RouteNetlinkMessage, u16, Option<i32>)>> {
        use KernelOp::*;
        use RouteNetlinkMessage as M;
        const SET: u16 = NLM_F_CREATE | NLM_F_REPLACE;
        Ok(Some(match op {
            AddAddr { dev, net } => (
                M::NewAddress(address_msg(self.index(dev).await?, *net)),
                NLM_F_CREATE | NLM_F_EXCL,
                None,
            ),
            DelAddr { dev, net } => (
                M::DelAddress(address_msg(self.index(dev).await?, *net)),
                0,
                Some(EADDRNOTAVAIL),
            ),
            SetNeighbour { ip, mac } => (
                M::NewNeighbour(neighbour_msg(self.vxlan_index().await?, Some(*ip), *mac)),
                SET,
                None,
            ),
            DelNeighbour { ip, mac } => (
                M::DelNeighbour(neighbour_msg(self.vxlan_index().await?, Some(*ip), *mac)),
                0,
                Some(ENOENT),
            ),
            SetFdb { mac, dst } => (
                M::NewNeighbour(fdb_msg(self.vxlan_index().await?, *mac, *dst)),
                SET,
                None,
            ),
            DelFdb { mac, dst } => (
                M::DelNeighbour(fdb_msg(self.vxlan_index().await?, *mac, *dst)),
                0,
                Some(ENOENT),
            ),
            SetRoute { table, dst, via } => (
                M::NewRoute(route_msg(*table, *dst, *via, self.vxlan_index().await?)),
                SET,
                None,
            ),
            DelRoute { table, dst, via } => (
                M::DelRoute(route_del_msg(*table, *dst, *via)),
                0,
                Some(ESRCH),
            ),
            AddRule(r) => (
                M::NewRule(rule_msg(r)),
                NLM_F_CREATE | NLM_F_EXCL,
                Some(EEXIST),
            ),
            DelRule(r) => (M::DelRule(rule_msg(r)), 0, Some(ENOENT)),
            _ => return Ok(None),
        }))
    }

    async fn create_vxlan(&self, l: &VxlanLink) -> Result<(), rtnetlink::Error> {
        let mut b = LinkVxlan::new(&l.name, l.identity.vni)
            .dev(l.identity.parent)
            .port(l.identity.port)
            .learning(false)
            .address(l.settings.mac.0.to_vec())
            .mtu(l.settings.mtu);
        b = match l.identity.local {
            IpAddr::V4(ip) => b.local(ip),
            IpAddr::V6(ip) => b.local6(ip),
        };
        if l.settings.up {
            b = b.up();
        }
        self.handle.link().add(b.build()).execute().await
    }

    /// A dummy device to hold the EIPs, or an IFB device on kernels built
    /// without the dummy driver (just as inert an address holder).
    async fn create_eip_device(
        &self,
        name: &str,
        report: &mut Report,
    ) -> Result<(), rtnetlink::Error> {
        let dummy = LinkDummy::new(name).up().build();
        match self.handle.link().add(dummy).execute().await {
            Err(e) if is_errno(&e, EOPNOTSUPP) => {
                let ifb = LinkIfb::new(name).up().build();
                self.handle.link().add(ifb).execute().await?;
                report.facts.insert(
                    format!("{name} kind"),
                    "ifb (this kernel has no dummy driver)".into(),
                );
                Ok(())
            }
            other => other,
        }
    }

    async fn set_link(&self, msg: LinkMessage) -> Result<(), rtnetlink::Error> {
        self.handle.link().set(msg).execute().await
    }

    /// Proxy neighbour entries (IPv6 only): (interface index, address).
    async fn proxies(&self) -> Result<BTreeSet<(u32, IpAddr)>> {
        let mut msg = NeighbourMessage::default();
        msg.header.family = AddressFamily::Inet6;
        msg.header.flags = NeighbourFlags::Proxy;
        let dump = self
            .dump(RouteNetlinkMessage::GetNeighbour(msg))
            .await
            .map_err(nl("proxy neighbours: dump"))?;
        Ok(dump
            .into_iter()
            .filter_map(|m| match m {
                RouteNetlinkMessage::NewNeighbour(n)
                    if n.header.flags.contains(NeighbourFlags::Proxy) =>
                {
                    neighbour_of(&n).0.map(|ip| (n.header.ifindex, ip))
                }
                _ => None,
            })
            .collect())
    }

    /// Makes the segment's interfaces answer neighbour solicitations for an
    /// IPv6 EIP: a proxy entry on each, and `proxy_ndp` on (it answers only
    /// for proxy entries). IPv4 needs nothing: Linux answers ARP for any
    /// local address on any interface.
    async fn proxy(&self, ip: IpAddr, report: &mut Report) -> Result<()> {
        if ip.is_ipv4() {
            return Ok(());
        }
        for (ifname, index) in crate::announce::segment_interfaces(ip) {
            let path = self
                .sysctl_net
                .join(format!("ipv6/conf/{ifname}/proxy_ndp"));
            std::fs::write(&path, "1").map_err(|source| Error::Sysctl {
                path: path.display().to_string(),
                source,
            })?;
            let msg = proxy_msg(index, ip);
            self.ack(
                RouteNetlinkMessage::NewNeighbour(msg),
                NLM_F_CREATE | NLM_F_REPLACE,
            )
            .await
            .map_err(nl(format!("proxy neighbour {ip} dev {ifname}: add")))?;
            report
                .facts
                .insert(format!("eip {ip} answered on"), ifname.clone());
        }
        Ok(())
    }

    /// Removes every proxy entry for `ip`, and turns `proxy_ndp` off again
    /// on each interface of its subnet (up or down) and each it had an
    /// entry on, once that interface is left without any proxy entry: it
    /// answers only for proxy entries, so with none it does nothing, and
    /// the interface is as it was before its first IPv6 EIP. A link that
    /// went down lost its proxy entries with it (the kernel flushes them),
    /// so an EIP given up then has no entry left to find.
    async fn unproxy(&self, ip: IpAddr) -> Result<()> {
        if ip.is_ipv4() {
            return Ok(());
        }
        let proxies = self.proxies().await?;
        let mut touched: BTreeSet<u32> = crate::announce::subnet_interfaces(ip)
            .into_iter()
            .map(|(_, index)| index)
            .collect();
        for (index, _) in proxies.iter().filter(|(_, p)| *p == ip) {
            let index = *index;
            self.ack(RouteNetlinkMessage::DelNeighbour(proxy_msg(index, ip)), 0)
                .await
                .or_else(|e| ignore(e, ENOENT))
                .map_err(nl(format!("proxy neighbour {ip} dev #{index}: delete")))?;
            touched.insert(index);
        }
        touched.retain(|index| !proxies.iter().any(|(i, p)| i == index && *p != ip));
        if touched.is_empty() {
            return Ok(());
        }
        for iface in pnet_datalink::interfaces() {
            if touched.contains(&iface.index) {
                let path = self
                    .sysctl_net
                    .join(format!("ipv6/conf/{}/proxy_ndp", iface.name));
                std::fs::write(&path, "0").map_err(|source| Error::Sysctl {
                    path: path.display().to_string(),
                    source,
                })?;
            }
        }
        Ok(())
    }

    /// `egress.vxlan`'s index; ops on its neighbours and routes name it by
    /// the kernel's device, which the scope names.
    async fn vxlan_index(&self) -> Result<u32> {
        let name = self.vxlan_name.clone().ok_or_else(|| {
            Error::Host("the tunnel device's name is unknown until the kernel is read".into())
        })?;
        self.index(&name).await
    }
}

/// Tells the segment the EIP is here now; a missing interface is a warning,
/// not a failure: the address is owned either way.
fn announce(ip: IpAddr, report: &mut Report) {
    match crate::announce::announce(ip) {
        Ok(ifaces) if ifaces.is_empty() => report.warn(format!(
            "eip {ip}: no interface has a prefix containing it; not announced"
        )),
        Ok(ifaces) => {
            report
                .facts
                .insert(format!("eip {ip} announced on"), ifaces.join(", "));
        }
        Err(e) => report.warn(format!("eip {ip}: {e}")),
    }
}

fn ignore(e: rtnetlink::Error, errno: i32) -> Result<(), rtnetlink::Error> {
    if is_errno(&e, errno) { Ok(()) } else { Err(e) }
}

fn family(ip: IpAddr) -> AddressFamily {
    match ip {
        IpAddr::V4(_) => AddressFamily::Inet,
        IpAddr::V6(_) => AddressFamily::Inet6,
    }
}

fn is_link_local(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => v4.is_link_local(),
        IpAddr::V6(v6) => v6.segments()[0] & 0xffc0 == 0xfe80,
    }
}

pub(crate) fn address_of(a: &AddressMessage) -> Option<IpAddr> {
    let local = a.attributes.iter().find_map(|x| match x {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    local.or_else(|| {
        a.attributes.iter().find_map(|x| match x {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        })
    })
}

fn address_msg(index: u32, net: IpNet) -> AddressMessage {
    let mut m = AddressMessage::default();
    m.header.family = family(net.addr());
    m.header.prefix_len = net.prefix_len();
    m.header.index = index;
    m.attributes.push(AddressAttribute::Local(net.addr()));
    m.attributes.push(AddressAttribute::Address(net.addr()));
    if net.addr().is_ipv6() {
        // No duplicate address detection: the address is usable at once.
        m.attributes
            .push(AddressAttribute::Flags(AddressFlags::Nodad));
    }
    m
}

fn mac_of(bytes: &[u8]) -> Option<Mac> {
    <[u8; 6]>::try_from(bytes).ok().map(Mac)
}

pub(crate) fn neighbour_of(n: &NeighbourMessage) -> (Option<IpAddr>, Option<Mac>) {
    let mut ip = None;
    let mut mac = None;
    for a in &n.attributes {
        match a {
            NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => ip = Some((*v4).into()),
            NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => {
                ip = Some((*v6).into());
            }
            // FDB entries carry their destination as raw bytes.
            NeighbourAttribute::Destination(NeighbourAddress::Other(b)) => {
                ip = <[u8; 4]>::try_from(b.as_slice())
                    .map(IpAddr::from)
                    .or_else(|_| <[u8; 16]>::try_from(b.as_slice()).map(IpAddr::from))
                    .ok();
            }
            NeighbourAttribute::LinkLayerAddress(b) => mac = mac_of(b),
            _ => {}
        }
    }
    (ip, mac)
}

fn neighbour_msg(index: u32, ip: Option<IpAddr>, mac: Mac) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.ifindex = index;
    m.header.state = NeighbourState::Permanent;
    if let Some(ip) = ip {
        m.header.family = family(ip);
        m.attributes.push(NeighbourAttribute::Destination(match ip {
            IpAddr::V4(v4) => NeighbourAddress::Inet(v4),
            IpAddr::V6(v6) => NeighbourAddress::Inet6(v6),
        }));
    }
    m.attributes
        .push(NeighbourAttribute::LinkLayerAddress(mac.0.to_vec()));
    m
}

/// `ip -6 neigh add proxy <ip> dev #<index>`.
fn proxy_msg(index: u32, ip: IpAddr) -> NeighbourMessage {
    let mut m = NeighbourMessage::default();
    m.header.family = family(ip);
    m.header.ifindex = index;
    m.header.flags = NeighbourFlags::Proxy;
    m.header.state = NeighbourState::Permanent;
    m.attributes.push(NeighbourAttribute::Destination(match ip {
        IpAddr::V4(v4) => NeighbourAddress::Inet(v4),
        IpAddr::V6(v6) => NeighbourAddress::Inet6(v6),
    }));
    m
}

/// `bridge fdb replace <mac> dev egress.vxlan dst <ip> self permanent`.
fn fdb_msg(index: u32, mac: Mac, dst: IpAddr) -> NeighbourMessage {
    let mut m = neighbour_msg(index, None, mac);
    m.header.family = AddressFamily::Bridge;
    m.header.flags = NeighbourFlags::Own;
    m.attributes
        .push(NeighbourAttribute::Destination(match dst {
            IpAddr::V4(v4) => NeighbourAddress::Inet(v4),
            IpAddr::V6(v6) => NeighbourAddress::Inet6(v6),
        }));
    m
}

pub(crate) fn rule_of(r: &RuleMessage) -> Option<Rule> {
    let mut rule = Rule {
        ipv6: r.header.family == AddressFamily::Inet6,
        priority: 0,
        mark: 0,
        mask: u32::MAX,
        table: u32::from(r.header.table),
    };
    let mut has_mark = false;
    for a in &r.attributes {
        match a {
            RuleAttribute::Priority(p) => rule.priority = *p,
            RuleAttribute::FwMark(m) => {
                rule.mark = *m;
                has_mark = true;
            }
            RuleAttribute::FwMask(m) => rule.mask = *m,
            RuleAttribute::Table(t) => rule.table = *t,
            // A rule with another selector is not one of egressgw's.
            RuleAttribute::Source(_)
            | RuleAttribute::Destination(_)
            | RuleAttribute::Iifname(_)
            | RuleAttribute::Oifname(_) => return None,
            _ => {}
        }
    }
    let plain = r.header.src_len == 0 && r.header.dst_len == 0 && r.header.tos == 0;
    (plain && has_mark && r.header.action == RuleAction::ToTable).then_some(rule)
}

/// A policy-routing rule that is not egressgw's, as far as a check of
/// what could take egressgw's traffic needs it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct OtherRule {
    /// IPv6 (`ip -6 rule`).
    pub ipv6: bool,
    /// Its priority (lower runs first).
    pub priority: u32,
    /// The table it looks up; `None` for another action (blackhole, goto, ...).
    pub table: Option<u32>,
    /// `fwmark` and mask, when it matches on the mark.
    pub mark: Option<(u32, u32)>,
    /// Whether it also matches on something else (source, destination,
    /// interface, TOS, ...), so that it takes only part of the traffic.
    pub selective: bool,
}

impl fmt::Display for OtherRule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rule{} priority {}",
            if self.ipv6 { " -6" } else { "" },
            self.priority
        )?;
        if let Some((mark, mask)) = self.mark {
            write!(f, " fwmark {mark:#010x}/{mask:#010x}")?;
        }
        if self.selective {
            f.write_str(" (with other selectors)")?;
        }
        match self.table {
            Some(t) => write!(f, " lookup {t}"),
            None => f.write_str(" (not a table lookup)"),
        }
    }
}

pub(crate) fn other_rule_of(r: &RuleMessage) -> OtherRule {
    let mut rule = OtherRule {
        ipv6: r.header.family == AddressFamily::Inet6,
        priority: 0,
        table: (r.header.action == RuleAction::ToTable).then_some(u32::from(r.header.table)),
        mark: None,
        selective: r.header.src_len != 0 || r.header.dst_len != 0 || r.header.tos != 0,
    };
    let (mut mark, mut mask) = (None, u32::MAX);
    for a in &r.attributes {
        match a {
            RuleAttribute::Priority(p) => rule.priority = *p,
            RuleAttribute::FwMark(m) => mark = Some(*m),
            RuleAttribute::FwMask(m) => mask = *m,
            RuleAttribute::Table(t) if rule.table.is_some() => rule.table = Some(*t),
            RuleAttribute::Iifname(_)
            | RuleAttribute::Oifname(_)
            | RuleAttribute::UidRange(_)
            | RuleAttribute::IpProtocol(_)
            | RuleAttribute::SourcePortRange(_)
            | RuleAttribute::DestinationPortRange(_) => rule.selective = true,
            _ => {}
        }
    }
    rule.mark = mark.map(|m| (m, mask));
    rule
}

fn rule_msg(r: &Rule) -> RuleMessage {
    let mut m = RuleMessage::default();
    m.header.family = if r.ipv6 {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    };
    m.header.action = RuleAction::ToTable;
    m.header.table = u8::try_from(r.table).unwrap_or(0);
    m.attributes.push(RuleAttribute::Priority(r.priority));
    m.attributes.push(RuleAttribute::FwMark(r.mark));
    m.attributes.push(RuleAttribute::FwMask(r.mask));
    m.attributes.push(RuleAttribute::Table(r.table));
    m
}

pub(crate) fn table_of(r: &RouteMessage) -> u32 {
    r.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(r.header.table))
}

fn route_addr(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some((*v4).into()),
        RouteAddress::Inet6(v6) => Some((*v6).into()),
        _ => None,
    }
}

pub(crate) fn route_of(r: &RouteMessage) -> Option<(IpNet, IpAddr)> {
    let unspecified: IpAddr = match r.header.address_family {
        AddressFamily::Inet6 => std::net::Ipv6Addr::UNSPECIFIED.into(),
        _ => std::net::Ipv4Addr::UNSPECIFIED.into(),
    };
    let mut dst = unspecified;
    let mut via = None;
    for a in &r.attributes {
        match a {
            RouteAttribute::Destination(d) => dst = route_addr(d)?,
            RouteAttribute::Gateway(g) => via = route_addr(g),
            _ => {}
        }
    }
    let net = IpNet::new(dst, r.header.destination_prefix_length).ok()?;
    Some((net, via.unwrap_or(unspecified)))
}

fn route_msg(table: u32, dst: IpNet, via: IpAddr, oif: u32) -> RouteMessage {
    let mut m = RouteMessage::default();
    m.header.address_family = family(dst.addr());
    m.header.destination_prefix_length = dst.prefix_len();
    m.header.table = u8::try_from(table).unwrap_or(0);
    m.header.protocol = RouteProtocol::Static;
    m.header.scope = RouteScope::Universe;
    m.header.kind = RouteType::Unicast;
    if dst.prefix_len() > 0 {
        m.attributes
            .push(RouteAttribute::Destination(RouteAddress::from(dst.addr())));
    }
    m.attributes.push(RouteAttribute::Table(table));
    m.attributes
        .push(RouteAttribute::Gateway(RouteAddress::from(via)));
    m.header.flags = RouteFlags::Onlink;
    m.attributes.push(RouteAttribute::Oif(oif));
    m
}

/// A delete request that matches whatever route sits at (`table`, `dst`),
/// whoever made it: any protocol, scope and type, and the gateway only when
/// the route has one.
fn route_del_msg(table: u32, dst: IpNet, via: IpAddr) -> RouteMessage {
    let mut m = RouteMessage::default();
    m.header.address_family = family(dst.addr());
    m.header.destination_prefix_length = dst.prefix_len();
    m.header.table = u8::try_from(table).unwrap_or(0);
    m.header.protocol = RouteProtocol::Unspec;
    m.header.scope = RouteScope::NoWhere;
    m.header.kind = RouteType::Unspec;
    if dst.prefix_len() > 0 {
        m.attributes
            .push(RouteAttribute::Destination(RouteAddress::from(dst.addr())));
    }
    m.attributes.push(RouteAttribute::Table(table));
    if !via.is_unspecified() {
        m.attributes
            .push(RouteAttribute::Gateway(RouteAddress::from(via)));
    }
    m
}

pub(crate) fn vxlan_of(name: &str, link: &LinkMessage) -> Option<VxlanLink> {
    let mut mac = None;
    let mut mtu = 0;
    let mut info = None;
    for a in &link.attributes {
        match a {
            LinkAttribute::Address(b) => mac = mac_of(b),
            LinkAttribute::Mtu(m) => mtu = *m,
            LinkAttribute::LinkInfo(infos) => {
                info = infos.iter().find_map(|i| match i {
                    LinkInfo::Data(InfoData::Vxlan(v)) => Some(v.clone()),
                    _ => None,
                });
            }
            _ => {}
        }
    }
    // A device of that name that is not a VXLAN gets an identity that never
    // matches, so the plan recreates it.
    let info = info.unwrap_or_default();
    let mut identity = VxlanIdentity {
        vni: 0,
        port: 0,
        parent: 0,
        local: std::net::Ipv4Addr::UNSPECIFIED.into(),
        learning: true,
    };
    for v in info {
        match v {
            InfoVxlan::Id(id) => identity.vni = id,
            InfoVxlan::Port(p) => identity.port = p,
            InfoVxlan::Link(l) => identity.parent = l,
            InfoVxlan::Local(ip) => identity.local = ip.into(),
            InfoVxlan::Local6(ip) => identity.local = ip.into(),
            InfoVxlan::Learning(l) => identity.learning = l,
            _ => {}
        }
    }
    Some(VxlanLink {
        name: name.to_owned(),
        identity,
        settings: VxlanSettings {
            mac: mac.unwrap_or(Mac([0; 6])),
            mtu,
            up: link.header.flags.contains(LinkFlags::Up),
        },
    })
}

fn rp_filter_path(sysctl_net: &Path, dev: &str) -> String {
    sysctl_net
        .join(format!("ipv4/conf/{dev}/rp_filter"))
        .display()
        .to_string()
}

fn read_rp_filter(sysctl_net: &Path, dev: &str) -> Result<u8> {
    let path = rp_filter_path(sysctl_net, dev);
    let text = std::fs::read_to_string(&path).map_err(|source| Error::Sysctl {
        path: path.clone(),
        source,
    })?;
    text.trim().parse().map_err(|_| Error::Sysctl {
        path,
        source: std::io::Error::other(format!("unexpected value {:?}", text.trim())),
    })
}

fn write_rp_filter(sysctl_net: &Path, dev: &str, value: u8) -> Result<()> {
    let path = rp_filter_path(sysctl_net, dev);
    std::fs::write(&path, value.to_string()).map_err(|source| Error::Sysctl { path, source })
}

impl Netlink for Rtnetlink {
    async fn pod_interfaces(
        &mut self,
        pods: &[IpAddr],
    ) -> Result<BTreeMap<String, BTreeSet<IpAddr>>> {
        Rtnetlink::pod_interfaces(self, pods).await
    }

    async fn parent(&mut self, local: IpAddr) -> Result<Option<Parent>> {
        let mut addrs = self
            .handle
            .address()
            .get()
            .set_address_filter(local)
            .execute();
        let mut index = None;
        while let Some(a) = addrs
            .try_next()
            .await
            .map_err(nl(format!("address {local}: get")))?
        {
            if address_of(&a) == Some(local) {
                index = Some(a.header.index);
            }
        }
        let Some(index) = index else {
            return Ok(None);
        };
        let mut links = self.handle.link().get().match_index(index).execute();
        let Some(link) = links
            .try_next()
            .await
            .map_err(nl(format!("link #{index}: get")))?
        else {
            return Ok(None);
        };
        let mut parent = Parent {
            name: String::new(),
            index,
            mtu: 1500,
        };
        for a in &link.attributes {
            match a {
                LinkAttribute::IfName(n) => parent.name.clone_from(n),
                LinkAttribute::Mtu(m) => parent.mtu = *m,
                _ => {}
            }
        }
        Ok(Some(parent))
    }

    async fn observe(&mut self, scope: &Scope) -> Result<KernelState> {
        let mut state = KernelState::default();
        self.vxlan_name = Some(scope.vxlan.clone());
        self.indexes.clear();
        if let Some(vx) = self.observe_vxlan(scope, &mut state).await? {
            self.indexes.insert(scope.vxlan.clone(), vx);
            self.observe_neighbours(vx, &mut state).await?;
        }
        self.observe_rules(scope, &mut state).await?;
        self.observe_routes(scope, &mut state).await?;
        if let Some(link) = self.link(&scope.eip_device).await? {
            self.indexes
                .insert(scope.eip_device.clone(), link.header.index);
            state.eip_device = Some(link.header.flags.contains(LinkFlags::Up));
            state.eips = self
                .addresses(link.header.index)
                .await?
                .into_iter()
                .map(|n| n.addr())
                .filter(|ip| !is_link_local(*ip))
                .collect();
            if state.eips.iter().any(IpAddr::is_ipv6) {
                let proxies = self.proxies().await?;
                state.unproxied = state
                    .eips
                    .iter()
                    .filter(|ip| ip.is_ipv6())
                    .filter(|ip| {
                        crate::announce::segment_interfaces(**ip)
                            .iter()
                            .any(|(_, index)| !proxies.contains(&(*index, **ip)))
                    })
                    .copied()
                    .collect();
            }
        }
        Ok(state)
    }

    async fn apply(&mut self, op: &KernelOp, report: &mut Report) -> Result<()> {
        let result = self.apply_op(op, report).await;
        // A device made or removed has a new index, or none.
        if let KernelOp::CreateVxlan(_)
        | KernelOp::DeleteVxlan { .. }
        | KernelOp::CreateEipDevice { .. }
        | KernelOp::DeleteEipDevice { .. } = op
        {
            self.indexes.clear();
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nft::FakeFirewall;
    use crate::reconcile::Dataplane;
    use crate::testns::{block_on_in_new_netns, node_state, root_or_skip, sh};
    use egressgw_core::model::Config;

    /// An underlay link holding node A's address (172.18.0.11, MTU 1500).
    fn underlay() {
        sh("ip link add name ul0 type veth peer name ul1 \
            && ip addr add 172.18.0.11/24 dev ul0 && ip link set ul0 up && ip link set ul1 up");
    }

    fn dataplane() -> Dataplane<Rtnetlink, FakeFirewall> {
        Dataplane::new(
            Rtnetlink::connect().unwrap(),
            FakeFirewall::default(),
            Config::default(),
        )
    }

    fn ifindex(name: &str) -> String {
        sh(&format!("ip -o link show {name} | cut -d: -f1"))
    }

    #[test]
    fn pod_interfaces_come_from_the_routes_to_the_pods_whatever_the_cni() {
        if !root_or_skip("pod_interfaces_come_from_the_routes_to_the_pods_whatever_the_cni") {
            return;
        }
        block_on_in_new_netns(async || {
            underlay();
            // A bridge CNI: the pods are on the bridge's subnet, each behind
            // a veth port of the bridge.
            sh(
                "ip link add cni0 type bridge && ip addr add 10.244.1.1/24 dev cni0 \
                && ip link set cni0 up \
                && ip link add vethp1 type veth peer name vethp1c && ip link set vethp1 master cni0 \
                && ip link add vethp2 type veth peer name vethp2c && ip link set vethp2 master cni0",
            );
            // A bridge with no veth port (here: none at all) stands for itself.
            sh(
                "ip link add br1 type bridge && ip addr add 10.244.2.1/24 dev br1 \
                && ip link set br1 up",
            );
            // A routed CNI: one /32 route per pod over the pod's own veth.
            sh(
                "ip link add cali1 type veth peer name cali1p && ip link set cali1 up \
                && ip link set cali1p up && ip route add 10.244.9.77/32 dev cali1 scope link",
            );
            let ip = |s: &str| s.parse::<IpAddr>().unwrap();
            let found = Rtnetlink::connect()
                .unwrap()
                .pod_interfaces(&[
                    ip("10.244.1.5"),
                    ip("10.244.1.6"),
                    ip("10.244.9.77"),
                    ip("10.244.2.8"),
                    // A host-network pod has the node's own address.
                    ip("172.18.0.11"),
                    // No route at all.
                    ip("192.0.2.9"),
                ])
                .await
                .unwrap();
            let on_cni0 = BTreeSet::from([ip("10.244.1.5"), ip("10.244.1.6")]);
            let want = BTreeMap::from([
                ("br1".to_owned(), BTreeSet::from([ip("10.244.2.8")])),
                ("cali1".to_owned(), BTreeSet::from([ip("10.244.9.77")])),
                ("vethp1".to_owned(), on_cni0.clone()),
                ("vethp2".to_owned(), on_cni0),
            ]);
            assert_eq!(found, want);
        });
    }

    #[test]
    fn the_kernel_gets_the_tunnel_its_peers_rules_routes_and_eips() {
        if !root_or_skip("the_kernel_gets_the_tunnel_its_peers_rules_routes_and_eips") {
            return;
        }
        block_on_in_new_netns(async || {
            underlay();
            let mut dp = dataplane();
            let report = dp.reconcile(&node_state(true)).await;
            assert!(report.is_ok(), "{:?}", report.failed);

            let link = sh("ip -d link show egress.vxlan");
            for want in [
                "mtu 1450",
                "link/ether 02:00:00:00:00:01",
                "vxlan id 100 local 172.18.0.11 dev ul0",
                "dstport 7789 nolearning",
                "state UNKNOWN",
            ] {
                assert!(link.contains(want), "{want:?} not in {link}");
            }
            assert!(sh("ip addr show egress.vxlan").contains("inet 172.31.0.1/16"));
            assert_eq!(
                sh("cat /proc/sys/net/ipv4/conf/egress.vxlan/rp_filter").trim(),
                "2"
            );
            assert!(
                sh("ip neigh show dev egress.vxlan")
                    .contains("172.31.0.2 lladdr 02:00:00:00:00:02 PERMANENT")
            );
            let fdb = sh("bridge fdb show dev egress.vxlan");
            assert!(
                fdb.contains("02:00:00:00:00:02 dst 172.18.0.12 self permanent"),
                "{fdb}"
            );
            assert!(
                !fdb.contains("00:00:00:00:00:00"),
                "no flooding entry: {fdb}"
            );
            let rules = sh("ip rule");
            assert!(rules.contains("3000:\tfrom all fwmark 0x1000000/0xff000000 lookup 3000"));
            assert!(rules.contains("3000:\tfrom all fwmark 0xff000000/0xff000000 lookup 3254"));
            assert!(
                sh("ip route show table 3000")
                    .contains("default via 172.31.0.2 dev egress.vxlan proto static onlink")
            );
            assert!(
                sh("ip route show table 3254")
                    .contains("10.244.2.10 via 172.31.0.2 dev egress.vxlan proto static onlink")
            );
            assert!(sh("ip addr show egress.eip").contains("inet 198.51.100.200/32"));

            let again = dp.reconcile(&node_state(true)).await;
            assert_eq!(again.ops(), 0, "{:?}", again.applied);
        });
    }

    #[test]
    fn drift_is_corrected_in_place_and_identity_changes_recreate_the_tunnel() {
        if !root_or_skip("drift_is_corrected_in_place_and_identity_changes_recreate_the_tunnel") {
            return;
        }
        block_on_in_new_netns(async || {
            underlay();
            let mut dp = dataplane();
            dp.reconcile(&node_state(false)).await;
            let index = ifindex("egress.vxlan");

            sh(
                "ip link set egress.vxlan mtu 1300 && ip neigh del 172.31.0.2 dev egress.vxlan \
                && ip rule del priority 3000 fwmark 0x1000000/0xff000000 lookup 3000 \
                && ip route add blackhole 10.0.0.0/8 table 3000",
            );
            let report = dp.reconcile(&node_state(false)).await;
            assert!(report.is_ok(), "{:?}", report.failed);
            let mut applied = report.applied.clone();
            applied.sort_by(|a, b| a.text.cmp(&b.text));
            assert_eq!(applied.len(), 4, "{applied:?}");
            assert!(
                applied[0]
                    .text
                    .starts_with("add rule priority 3000 fwmark 0x01000000")
            );
            assert!(applied[1].text.starts_with("delete route 10.0.0.0/8"));
            assert!(applied[2].text.starts_with("replace neighbour 172.31.0.2"));
            assert!(applied[3].text.contains("mtu 1450"));
            assert_eq!(ifindex("egress.vxlan"), index, "corrected in place");
            assert!(!sh("ip route show table 3000").contains("blackhole"));

            let mut other = node_state(false);
            other.vxlan.as_mut().unwrap().vni = 200;
            let report = dp.reconcile(&other).await;
            assert!(report.is_ok(), "{:?}", report.failed);
            assert_ne!(ifindex("egress.vxlan"), index, "recreated");
            assert!(sh("ip -d link show egress.vxlan").contains("vxlan id 200"));
            assert!(sh("ip neigh show dev egress.vxlan").contains("172.31.0.2"));
            assert!(sh("ip route show table 3000").contains("default via 172.31.0.2"));
            assert_eq!(dp.reconcile(&other).await.ops(), 0);
        });
    }

    #[test]
    fn a_vanished_underlay_address_leaves_the_tunnel_alone() {
        if !root_or_skip("a_vanished_underlay_address_leaves_the_tunnel_alone") {
            return;
        }
        block_on_in_new_netns(async || {
            underlay();
            let mut dp = dataplane();
            dp.reconcile(&node_state(false)).await;
            sh("ip addr del 172.18.0.11/24 dev ul0");
            let report = dp.reconcile(&node_state(false)).await;
            assert_eq!(report.failed.len(), 1, "{:?}", report.failed);
            assert!(report.failed[0].error.contains("172.18.0.11"));
            assert!(report.applied.is_empty(), "{:?}", report.applied);
            assert!(sh("ip rule").contains("lookup 3000"));
            assert!(sh("ip route show table 3000").contains("default via 172.31.0.2"));
        });
    }

    #[test]
    fn cleanup_takes_only_what_is_egressgws() {
        if !root_or_skip("cleanup_takes_only_what_is_egressgws") {
            return;
        }
        block_on_in_new_netns(async || {
            underlay();
            // Neighbours of egressgw's: a rule at its priority with another
            // mask, one with a selector, a route in a table of someone else's.
            sh("ip rule add priority 3000 fwmark 0x10/0xff lookup 3000 \
                && ip rule add priority 3000 from 10.1.0.0/16 fwmark 0x1000000/0xff000000 lookup 3000 \
                && ip route add 10.9.0.0/16 dev ul0 table 100");
            let before = (
                sh("ip rule"),
                sh("ip route show table all"),
                sh("ip -br link"),
            );
            let mut dp = dataplane();
            dp.reconcile(&node_state(true)).await;
            let report = dp.cleanup().await;
            assert!(report.is_ok(), "{:?}", report.failed);
            let after = (
                sh("ip rule"),
                sh("ip route show table all"),
                sh("ip -br link"),
            );
            assert_eq!(before, after);
        });
    }
}
