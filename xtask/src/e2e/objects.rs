//! The objects the scenarios apply, built in code.

use std::net::{Ipv4Addr, Ipv6Addr};

use serde_json::{Value, json};

/// A gateway on the lab's gateway-capable nodes with `pool` as its only
/// pool entry and `default_eip` as its default EIP. Never the cluster
/// default: every e2e policy names its gateway.
pub fn gateway(name: &str, pool: &str, default_eip: Ipv4Addr) -> Value {
    json!({
        "apiVersion": "egressgw.io/v1alpha1",
        "kind": "EgressGateway",
        "metadata": { "name": name },
        "spec": {
            "clusterDefault": false,
            "nodeSelector": { "selector": { "matchLabels": { "egressgw.io/gateway": "true" } } },
            "ippools": { "ipv4": [pool], "ipv4DefaultEIP": default_eip.to_string() },
        },
    })
}

/// [`gateway`] with an IPv6 pool beside the IPv4 one: `pool6`, whose
/// default EIP is `default_eip6`.
pub fn dual_stack_gateway(
    name: &str,
    (pool, default_eip): (&str, Ipv4Addr),
    (pool6, default_eip6): (&str, Ipv6Addr),
) -> Value {
    let mut object = gateway(name, pool, default_eip);
    let pools = &mut object["spec"]["ippools"];
    pools["ipv6"] = json!([pool6]);
    pools["ipv6DefaultEIP"] = json!(default_eip6.to_string());
    object
}

/// A pod selector matching `app=<app>`.
pub fn app(app: &str) -> Value {
    json!({ "podSelector": { "matchLabels": { "app": app } } })
}

/// An EgressPolicy in `namespace` through `gateway`, for the pods
/// `applied_to` selects, to `dest`; allocator `default`.
pub fn policy(
    namespace: &str,
    name: &str,
    gateway: &str,
    applied_to: &Value,
    dest: &[&str],
) -> Value {
    json!({
        "apiVersion": "egressgw.io/v1alpha1",
        "kind": "EgressPolicy",
        "metadata": { "name": name, "namespace": namespace },
        "spec": {
            "egressGatewayName": gateway,
            "egressIP": { "allocatorPolicy": "default" },
            "appliedTo": applied_to,
            "destSubnet": dest,
        },
    })
}

/// An EgressClusterPolicy: like [`policy`], cluster-scoped.
pub fn cluster_policy(name: &str, gateway: &str, applied_to: &Value, dest: &[&str]) -> Value {
    json!({
        "apiVersion": "egressgw.io/v1alpha1",
        "kind": "EgressClusterPolicy",
        "metadata": { "name": name },
        "spec": {
            "egressGatewayName": gateway,
            "egressIP": { "allocatorPolicy": "default" },
            "appliedTo": applied_to,
            "destSubnet": dest,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_policy_names_its_gateway_and_destinations() {
        let p = policy("team-a", "web", "gw", &app("web"), &["198.51.100.0/24"]);
        assert_eq!(p["spec"]["egressGatewayName"], "gw");
        assert_eq!(
            p["spec"]["appliedTo"]["podSelector"]["matchLabels"]["app"],
            "web"
        );
        assert_eq!(p["spec"]["destSubnet"][0], "198.51.100.0/24");
        let yaml = serde_yaml::to_string(&p).unwrap();
        assert!(yaml.contains("kind: EgressPolicy"), "{yaml}");
    }

    #[test]
    fn a_dual_stack_gateway_has_a_pool_and_a_default_eip_per_family() {
        let v4 = Ipv4Addr::new(198, 51, 100, 200);
        let v6: Ipv6Addr = "2001:db8:100::200".parse().unwrap();
        let g = dual_stack_gateway(
            "gw",
            ("198.51.100.200-198.51.100.202", v4),
            ("2001:db8:100::200-2001:db8:100::202", v6),
        );
        let pools = &g["spec"]["ippools"];
        assert_eq!(pools["ipv4"][0], "198.51.100.200-198.51.100.202");
        assert_eq!(pools["ipv4DefaultEIP"], "198.51.100.200");
        assert_eq!(pools["ipv6"][0], "2001:db8:100::200-2001:db8:100::202");
        assert_eq!(pools["ipv6DefaultEIP"], "2001:db8:100::200");
    }

    #[test]
    fn a_gateway_is_never_the_cluster_default() {
        let g = gateway(
            "gw",
            "198.51.100.200-198.51.100.203",
            Ipv4Addr::new(198, 51, 100, 200),
        );
        assert_eq!(g["spec"]["clusterDefault"], false);
        assert_eq!(g["spec"]["ippools"]["ipv4DefaultEIP"], "198.51.100.200");
    }
}
