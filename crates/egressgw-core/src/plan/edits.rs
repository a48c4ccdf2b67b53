//! Policies edited in what the cluster-wide stages do not read.
//!
//! The stages (gateways, tunnels, EIPs, placement) and the status read a
//! policy's identity, gateway, `egressIP`, age and last placement, never
//! its selectors, destinations, exclusions or priority. A change to the
//! cluster that edits only those of some policies leaves everything the
//! stages decided as it was: a planner kept between changes takes it
//! without running them again ([`super::Planner`], [`super::Publisher`]).

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::sync::Arc;

use crate::model::{Gateway, Policy, PolicyRef, Snapshot};

/// Past this many policies edited at once, a planner runs the stages
/// again: finding each one's place costs a pass over the policies.
const MAX_EDITS: usize = 64;

/// The indexes in `new.policies` of the policies edited since `old` (the
/// same policies in the same order, their Pods not read), when nothing
/// else changed and every edit leaves the cluster-wide stages' outcome as
/// it was; `None` otherwise.
pub(super) fn edited_policies(old: &Snapshot, new: &Snapshot) -> Option<Vec<usize>> {
    let policies = &new.policies;
    let others_same =
        new.namespaces == old.namespaces && same_but_namespaces_and_policies(old, new);
    if !others_same || policies.len() != old.policies.len() {
        return None;
    }
    let mut edited = Vec::new();
    for (k, (new, old)) in policies.iter().zip(&old.policies).enumerate() {
        if new == old {
            continue;
        }
        if edited.len() == MAX_EDITS || !same_allocation(old, new) {
            return None;
        }
        edited.push(k);
    }
    // Of two policies of one identity the stages keep the older: which
    // one is kept is theirs to say.
    let unique = |k: &usize| policies.iter().filter(|p| p.id == policies[*k].id).count() == 1;
    edited.iter().all(unique).then_some(edited)
}

/// Whether only the namespaces changed from `old` to `new` (labelled,
/// added or deleted) and no gateway admits namespaces by their labels: the
/// cluster-wide stages read a namespace's labels only for a gateway's
/// `namespaceSelector`, so their outcome stays as it was.
pub(super) fn namespaces_only(old: &Snapshot, new: &Snapshot) -> bool {
    new.namespaces != old.namespaces
        && new.gateways.iter().all(|g| g.namespace_selector.is_none())
        && same_but_namespaces_and_policies(old, new)
        && new.policies == old.policies
}

/// The EIPs (by gateway) whose node the gateways' last status names
/// otherwise in `new`, when that is all that changed but for the Pods:
/// what the controller writes when it places an EIP.
pub(super) fn published_only(old: &Snapshot, new: &Snapshot) -> Option<Vec<(String, IpAddr)>> {
    let same = new.namespaces == old.namespaces
        && new.gateways.len() == old.gateways.len()
        && new.gateways != old.gateways
        && new.config == old.config
        && new.invalid == old.invalid
        && new.eips_in_use == old.eips_in_use
        && new.nodes == old.nodes
        && new.tunnels == old.tunnels
        && new.policies == old.policies;
    if !same {
        return None;
    }
    let mut moved = Vec::new();
    for (a, b) in old.gateways.iter().zip(&new.gateways) {
        let unpublished = |g: &Gateway| Gateway {
            previous_nodes: BTreeMap::new(),
            ..g.clone()
        };
        if a.name != b.name || unpublished(a) != unpublished(b) {
            return None;
        }
        let ips = a.previous_nodes.keys().chain(b.previous_nodes.keys());
        for ip in ips {
            if a.previous_nodes.get(ip) != b.previous_nodes.get(ip) {
                moved.push((b.name.clone(), *ip));
            }
        }
    }
    moved.sort();
    moved.dedup();
    Some(moved)
}

/// Whether `old` and `new` hold the same objects but for their
/// namespaces, policies and Pods.
fn same_but_namespaces_and_policies(old: &Snapshot, new: &Snapshot) -> bool {
    // Every field named, so that a new one is not left out of the check.
    let Snapshot {
        config,
        nodes,
        namespaces: _,
        pods: _,
        gateways,
        policies: _,
        tunnels,
        invalid,
        eips_in_use,
    } = new;
    *config == old.config
        && *gateways == old.gateways
        && *invalid == old.invalid
        && *eips_in_use == old.eips_in_use
        && *nodes == old.nodes
        && *tunnels == old.tunnels
}

/// A change to one policy, for [`super::Planner::change_policies`] and
/// [`super::Publisher::change_policies`].
#[derive(Debug, Clone, PartialEq)]
pub enum PolicyChange {
    /// A policy added, or replacing the policies of its identity; shared
    /// with whoever converted it.
    Set(Arc<Policy>),
    /// The policies of this identity deleted.
    Removed(PolicyRef),
}

impl PolicyChange {
    /// The identity of the policy changed.
    pub fn id(&self) -> &PolicyRef {
        match self {
            Self::Set(policy) => &policy.id,
            Self::Removed(id) => id,
        }
    }
}

/// What [`apply`] made of a batch of changes.
#[derive(Debug, Default)]
pub(super) struct Applied {
    /// The policies edited in what the stages do not read, as they are
    /// now, in the order of the changes.
    pub edited: Vec<Arc<Policy>>,
    /// Whether the stages must run again: a policy added or deleted, or
    /// edited in what they read.
    pub restage: bool,
    /// Per change that makes the stages run again: the policy it took out
    /// and the one it put in; (`None`, `None`) when it took out or put in
    /// more than one (policies of one identity).
    pub swaps: Vec<Swap>,
}

/// A policy taken out, put in, or both (replaced).
pub(super) type Swap = (Option<Arc<Policy>>, Option<Arc<Policy>>);

impl Applied {
    /// The one policy the changes took out, put in or replaced, when that
    /// is all they did.
    pub fn swap(&self) -> Option<&Swap> {
        match &self.swaps[..] {
            [swap] if self.edited.is_empty() && *swap != (None, None) => Some(swap),
            _ => None,
        }
    }
}

/// Carries `changes` out on `cluster`'s policies, in order. A policy added
/// goes where it keeps policies sorted by identity, when they are.
pub(super) fn apply(
    cluster: &mut Snapshot,
    changes: impl IntoIterator<Item = PolicyChange>,
) -> Applied {
    let mut applied = Applied::default();
    let policies = &mut cluster.policies;
    for change in changes {
        let mut of_id = policies
            .iter()
            .enumerate()
            .filter(|(_, p)| p.id == *change.id());
        let (first, second) = (of_id.next().map(|(k, _)| k), of_id.next().is_some());
        match (change, first) {
            (PolicyChange::Set(policy), Some(k)) if !second => {
                if policies[k] == policy {
                    continue;
                }
                if same_allocation(&policies[k], &policy) {
                    applied.edited.push(Arc::clone(&policy));
                } else {
                    applied.restage = true;
                    let out = Arc::clone(&policies[k]);
                    applied.swaps.push((Some(out), Some(Arc::clone(&policy))));
                }
                policies[k] = policy;
            }
            (PolicyChange::Set(policy), first) => {
                policies.retain(|p| p.id != policy.id);
                let at = policies.partition_point(|p| p.id < policy.id);
                applied.swaps.push(match first {
                    None => (None, Some(Arc::clone(&policy))),
                    Some(_) => (None, None),
                });
                policies.insert(at, policy);
                applied.restage = true;
            }
            (PolicyChange::Removed(id), Some(k)) => {
                applied.swaps.push(match second {
                    false => (Some(Arc::clone(&policies[k])), None),
                    true => (None, None),
                });
                policies.retain(|p| p.id != id);
                applied.restage = true;
            }
            (PolicyChange::Removed(_), None) => {}
        }
    }
    applied
}

/// Whether `a` and `b` are alike in all the cluster-wide stages read.
fn same_allocation(a: &Policy, b: &Policy) -> bool {
    let Policy {
        id,
        gateway,
        egress_ip,
        pods: _,
        namespace_selector: _,
        dest_subnets: _,
        exclude_subnets: _,
        priority: _,
        age,
        previous_eips,
        previous_node,
    } = a;
    *id == b.id
        && *gateway == b.gateway
        && *egress_ip == b.egress_ip
        && *age == b.age
        && *previous_eips == b.previous_eips
        && *previous_node == b.previous_node
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::PodMatch;
    use crate::selector::LabelSelector;

    fn policy(name: &str) -> Arc<Policy> {
        Arc::new(Policy {
            id: PolicyRef {
                namespace: Some("shop".into()),
                name: name.into(),
            },
            gateway: None,
            egress_ip: Default::default(),
            pods: PodMatch::Selector(LabelSelector::eq("app", "web")),
            namespace_selector: None,
            dest_subnets: Vec::new(),
            exclude_subnets: Vec::new(),
            priority: 0,
            age: Default::default(),
            previous_eips: Vec::new(),
            previous_node: None,
        })
    }

    fn cluster() -> Snapshot {
        Snapshot {
            policies: vec![policy("a"), policy("b"), policy("c")],
            ..Default::default()
        }
    }

    #[test]
    fn selectors_destinations_and_priority_are_edits_the_stages_do_not_see() {
        let old = cluster();
        let mut new = old.clone();
        new.policy_mut(1).unwrap().dest_subnets = vec!["192.0.2.0/24".parse().unwrap()];
        new.policy_mut(2).unwrap().priority = 7;
        new.policy_mut(2).unwrap().pods = PodMatch::Selector(LabelSelector::eq("app", "db"));
        assert_eq!(edited_policies(&old, &new), Some(vec![1, 2]));
        assert_eq!(edited_policies(&old, &old), Some(vec![]));
    }

    #[test]
    fn changes_are_carried_out_in_order_and_say_whether_the_stages_run_again() {
        let mut cluster = cluster();
        let mut web = cluster.policies[1].clone();
        Arc::make_mut(&mut web).priority = 4;
        let applied = apply(&mut cluster, [PolicyChange::Set(web.clone())]);
        assert_eq!(applied.edited, vec![web.clone()]);
        assert!(!applied.restage);
        assert_eq!(cluster.policies[1], web);

        // The same policy again, and a deleted one that is not there.
        let gone = PolicyRef {
            namespace: Some("shop".into()),
            name: "gone".into(),
        };
        let applied = apply(
            &mut cluster,
            [PolicyChange::Set(web.clone()), PolicyChange::Removed(gone)],
        );
        assert!(applied.edited.is_empty() && !applied.restage);

        let mut moved = web.clone();
        Arc::make_mut(&mut moved).gateway = Some("gw2".into());
        let added = policy("bb");
        let first = cluster.policies[0].id.clone();
        let applied = apply(
            &mut cluster,
            [
                PolicyChange::Set(moved.clone()),
                PolicyChange::Set(added.clone()),
                PolicyChange::Removed(first),
            ],
        );
        assert!(applied.edited.is_empty() && applied.restage);
        let names: Vec<&str> = cluster
            .policies
            .iter()
            .map(|p| p.id.name.as_str())
            .collect();
        assert_eq!(names, ["b", "bb", "c"]);
        assert_eq!(cluster.policies[0], moved);
    }

    #[test]
    fn what_the_stages_read_or_another_object_changed_is_no_such_edit() {
        let old = cluster();
        let mut gateway = old.clone();
        gateway.policy_mut(0).unwrap().gateway = Some("gw2".into());
        let mut placed = old.clone();
        placed.policy_mut(0).unwrap().previous_node = Some("node-1".into());
        let mut deleted = old.clone();
        deleted.policies.pop();
        let mut renamed = old.clone();
        renamed.policy_mut(0).unwrap().id.name = "z".into();
        let mut namespace = old.clone();
        namespace.namespaces.push(crate::model::Namespace {
            name: "shop".into(),
            labels: Default::default(),
        });
        let mut twice = old.clone();
        twice.policy_mut(1).unwrap().id.name = "a".into();
        let mut twice_edited = twice.clone();
        twice_edited.policy_mut(1).unwrap().priority = 3;
        for new in [gateway, placed, deleted, renamed, namespace] {
            assert_eq!(edited_policies(&old, &new), None, "{new:?}");
        }
        assert_eq!(edited_policies(&twice, &twice_edited), None);
    }
}
