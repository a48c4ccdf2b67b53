//! Stage 3: each policy's gateway and EIPs.
//!
//! Rules, in the order they are applied:
//! 1. The gateway is the named one, or the cluster default when none is named.
//! 2. `useNodeIP` takes no EIP.
//! 3. A pinned EIP must lie in the gateway's pool of its family.
//! 4. `default` shares the gateway's default EIP.
//! 5. `rr` takes an EIP of its own: its previous one while still free, else
//!    the first pool address that no pinned or `rr` policy holds and that is
//!    not the default EIP. Pinned policies are served first, then `rr`
//!    policies keeping their EIP, then new `rr` policies oldest first.

use std::collections::HashSet;
use std::net::IpAddr;

use crate::model::{Allocator, Policy, Snapshot};
use crate::net::Family;
use crate::status::Reason;

use super::gateways::Gateways;
use super::{Work, fi};

/// Resolves gateways and allocates EIPs for every valid policy; the result
/// is sorted oldest first.
pub(super) fn allocate<'a>(snapshot: &'a Snapshot, gateways: &Gateways<'a>) -> Vec<Work<'a>> {
    let mut by_age: Vec<&Policy> = snapshot.policies.iter().collect();
    by_age.sort_by(|a, b| (&a.age, &a.id).cmp(&(&b.age, &b.id)));
    by_age.dedup_by(|a, b| a.id == b.id);
    let mut works: Vec<Work<'a>> = by_age
        .into_iter()
        .map(|p| resolve_gateway(p, gateways))
        .collect();

    let cfg = &snapshot.config;
    let families: Vec<Family> = Family::ALL
        .into_iter()
        .filter(|f| cfg.family_enabled(*f))
        .collect();
    for w in works.iter_mut().filter(|w| w.failure.is_none()) {
        let gw = gateways.by_name[w.gateway.expect("resolved")].gateway;
        w.failure = check_pools(w, gw, &families);
    }

    // `held` tracks, per gateway, the addresses a pinned or rr policy owns.
    let mut held: HashSet<(&str, IpAddr)> = HashSet::new();
    for w in works.iter_mut().filter(|w| w.failure.is_none()) {
        let gw = gateways.by_name[w.gateway.expect("resolved")].gateway;
        for family in &families {
            if w.policy.egress_ip.use_node_ip {
                w.node_ip[fi(*family)] = true;
            } else if let Some(ip) = pinned(w.policy, *family) {
                held.insert((gw.name.as_str(), ip));
                w.eips[fi(*family)] = Some(ip);
            } else if w.policy.egress_ip.allocator == Allocator::Default {
                w.eips[fi(*family)] = gw.default_eip(*family);
            }
        }
    }
    for keep_previous in [true, false] {
        for w in works.iter_mut().filter(|w| w.failure.is_none()) {
            let gw = gateways.by_name[w.gateway.expect("resolved")].gateway;
            if w.policy.egress_ip.use_node_ip
                || w.policy.egress_ip.allocator != Allocator::RoundRobin
            {
                continue;
            }
            for family in &families {
                let slot = fi(*family);
                if w.eips[slot].is_some()
                    || pinned(w.policy, *family).is_some()
                    || gw.pool(*family).is_empty()
                {
                    continue;
                }
                let default = gw.default_eip(*family);
                let free =
                    |ip: &IpAddr| Some(*ip) != default && !held.contains(&(gw.name.as_str(), *ip));
                let choice = if keep_previous {
                    w.policy
                        .previous_eips
                        .iter()
                        .find(|ip| {
                            Family::of(**ip) == *family
                                && gw.pool(*family).contains(**ip)
                                && free(ip)
                        })
                        .copied()
                } else {
                    gw.pool(*family).iter().find(free)
                };
                if let Some(ip) = choice {
                    held.insert((gw.name.as_str(), ip));
                    w.eips[slot] = Some(ip);
                } else if !keep_previous {
                    w.failure = Some((
                        Reason::PoolExhausted,
                        format!(
                            "spec.egressIP.allocatorPolicy: rr needs an {family} EIP of its own, \
                             but every address of gateway {}'s pool is taken; add addresses to \
                             spec.ippools.{family} or use allocatorPolicy default",
                            gw.name
                        ),
                    ));
                }
            }
        }
    }
    for w in &mut works {
        if w.failure.is_some() {
            w.eips = [None, None];
            w.node_ip = [false, false];
        }
    }
    works
}

fn resolve_gateway<'a>(policy: &'a Policy, gateways: &Gateways<'a>) -> Work<'a> {
    let mut work = Work {
        policy,
        gateway: None,
        failure: None,
        eips: [None, None],
        node_ip: [false, false],
        nodes: [None, None],
    };
    let name = match (&policy.gateway, gateways.default) {
        (Some(name), _) => name.as_str(),
        (None, Some(default)) => default,
        (None, None) => {
            work.failure = Some((
                Reason::NoDefaultGateway,
                "spec.egressGatewayName is empty and no EgressGateway has clusterDefault: true; \
                 name a gateway or mark one as the cluster default"
                    .into(),
            ));
            return work;
        }
    };
    match gateways.by_name.get_key_value(name) {
        None => {
            work.failure = Some((
                Reason::GatewayNotFound,
                format!("spec.egressGatewayName: EgressGateway {name:?} does not exist"),
            ));
        }
        Some((key, info)) => {
            work.gateway = Some(key);
            if let Some((_, why)) = &info.problem {
                work.failure = Some((
                    Reason::GatewayInvalid,
                    format!("EgressGateway {name} is not usable: {why}"),
                ));
            }
        }
    }
    work
}

/// Checks pinned EIPs against the pools and that the gateway can serve the policy at all.
fn check_pools(
    w: &Work<'_>,
    gw: &crate::model::Gateway,
    families: &[Family],
) -> Option<(Reason, String)> {
    for family in Family::ALL {
        if let Some(ip) = pinned(w.policy, family)
            && !gw.pool(family).contains(ip)
        {
            return Some((
                Reason::EipNotInPool,
                format!(
                    "spec.egressIP.{family}: {ip} is not in EgressGateway {}'s pool spec.ippools.{family}",
                    gw.name
                ),
            ));
        }
    }
    let usable = w.policy.egress_ip.use_node_ip || families.iter().any(|f| !gw.pool(*f).is_empty());
    (!usable).then(|| {
        let enabled = families
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ");
        (
            Reason::NoPool,
            format!(
                "EgressGateway {} has no EIP pool for the enabled families ({enabled})",
                gw.name
            ),
        )
    })
}

fn pinned(policy: &Policy, family: Family) -> Option<IpAddr> {
    match family {
        Family::Ipv4 => policy.egress_ip.ipv4.map(IpAddr::V4),
        Family::Ipv6 => policy.egress_ip.ipv6.map(IpAddr::V6),
    }
}
