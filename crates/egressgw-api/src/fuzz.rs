//! Entry points of the fuzz targets in `fuzz/`: everything that parses
//! input from outside the process, from arbitrary text. None may panic, or
//! take unbounded time or memory on a small input. The inputs the targets
//! once found are kept in `fuzz/regressions/<target>/` and replayed by
//! this module's tests.

use egressgw_core::model::{Config, Mac};
use egressgw_core::net::{IpRange, parse_cidr, parse_ip};
use k8s_openapi::jiff::Timestamp;

use crate::config::FileConfig;
use crate::status;

/// Objects as a user or the API server hands them over (YAML or JSON
/// documents): loaded, validated, converted to the planner's model,
/// planned, and their status made as the controller writes it. Returns the
/// number of nodes planned.
pub fn objects(text: &str) -> usize {
    let Ok(objects) = crate::objects_from_yaml(text) else {
        return 0;
    };
    let snapshot = objects.into_snapshot(Config::default());
    let plan = egressgw_core::plan(&snapshot);
    let now = Timestamp::UNIX_EPOCH;
    for policy in &plan.status.policies {
        let _ = status::policy_status(policy, None, Some(1), now);
    }
    for gateway in &plan.status.gateways {
        let _ = status::gateway_status(gateway, None, Some(1), now);
    }
    for tunnel in &plan.status.tunnels {
        let _ = status::tunnel_status(tunnel);
    }
    plan.nodes.len()
}

/// An address, prefix, range or MAC, as specs and the config carry them.
/// Returns how many of the readings took it.
pub fn addresses(text: &str) -> usize {
    [
        parse_ip(text).is_ok(),
        parse_cidr(text).is_ok(),
        text.parse::<IpRange>().is_ok_and(|r| r.first() <= r.last()),
        text.parse::<Mac>().is_ok(),
    ]
    .into_iter()
    .filter(|ok| *ok)
    .count()
}

/// The daemons' config file, parsed and resolved. Returns whether it is a
/// valid config.
pub fn config(text: &str) -> bool {
    FileConfig::parse(text).is_ok_and(|file| file.resolve().is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every input the fuzz targets kept is read again without a panic.
    #[test]
    fn what_the_fuzz_targets_found_is_read_without_a_panic() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fuzz/regressions");
        /// Reads one input the way a target does.
        type Replay = fn(&str);
        let targets: [(&str, Replay); 3] = [
            ("objects", |t| {
                objects(t);
            }),
            ("addresses", |t| {
                addresses(t);
            }),
            ("config", |t| {
                config(t);
            }),
        ];
        let mut replayed = 0;
        for (target, run) in targets {
            let dir = std::path::Path::new(root).join(target);
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for entry in entries {
                let path = entry.expect("a readable directory").path();
                let bytes = std::fs::read(&path).expect("a readable input");
                if let Ok(text) = std::str::from_utf8(&bytes) {
                    run(text);
                    replayed += 1;
                }
            }
        }
        assert!(replayed > 0, "no regression input under {root}");
    }

    #[test]
    fn the_examples_plan_and_the_charts_feature_block_is_a_valid_config() {
        let examples = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../deploy/examples/cluster.yaml"
        );
        let text = std::fs::read_to_string(examples).expect("the example cluster");
        assert!(objects(&text) > 0, "the example cluster plans no node");
        assert!(config("{}"));
        assert!(!config("vxlan: {port: 70000}"));
        assert!(addresses("10.0.0.0/8") >= 1);
        assert!(addresses("10.0.0.1-10.0.0.9") >= 1);
        assert_eq!(addresses("02:00:00:00:00:01"), 1);
        assert_eq!(addresses("10.0.0.9-10.0.0.1"), 0, "a range backwards");
        assert_eq!(addresses("nothing"), 0);
    }
}
