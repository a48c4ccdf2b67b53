//! Objects for the tests, written as the YAML a user would apply.

use egressgw_api::{
    EgressClusterPolicy, EgressClusterPolicySpec, EgressGateway, EgressGatewaySpec, EgressPolicy,
    EgressPolicySpec, EgressTunnel,
};
use serde::de::DeserializeOwned;

/// Parses `yaml` as a `T`.
pub fn from_yaml<T: DeserializeOwned>(yaml: &str) -> T {
    serde_yaml::from_str(yaml).unwrap_or_else(|e| panic!("fixture does not parse: {e}\n{yaml}"))
}

/// A gateway spec.
pub fn gateway_spec(yaml: &str) -> EgressGatewaySpec {
    from_yaml(yaml)
}

/// A policy spec.
pub fn policy_spec(yaml: &str) -> EgressPolicySpec {
    from_yaml(yaml)
}

/// A cluster policy spec.
pub fn cluster_policy_spec(yaml: &str) -> EgressClusterPolicySpec {
    from_yaml(yaml)
}

/// A whole gateway object.
pub fn gateway(yaml: &str) -> EgressGateway {
    from_yaml(yaml)
}

/// A whole policy object.
pub fn policy(yaml: &str) -> EgressPolicy {
    from_yaml(yaml)
}

/// A whole cluster policy object.
pub fn cluster_policy(yaml: &str) -> EgressClusterPolicy {
    from_yaml(yaml)
}

/// A whole tunnel object.
pub fn tunnel(yaml: &str) -> EgressTunnel {
    from_yaml(yaml)
}

/// The messages of a failed validation, or an empty list.
pub fn messages<E: IntoIterator<Item = egressgw_api::FieldError>>(
    result: Result<(), E>,
) -> Vec<String> {
    match result {
        Ok(()) => Vec::new(),
        Err(errors) => errors.into_iter().map(|e| e.to_string()).collect(),
    }
}

/// A valid gateway spec to vary.
pub const GATEWAY: &str = r#"
nodeSelector:
  selector:
    matchLabels: {egress: "true"}
ippools:
  ipv4: ["10.6.1.55", "10.6.1.60-10.6.1.65", "10.6.2.0/28"]
  ipv6: ["fd00::1", "fd00::10-fd00::20"]
  ipv4DefaultEIP: "10.6.1.61"
  ipv6DefaultEIP: "fd00::15"
"#;
