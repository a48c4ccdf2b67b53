//! `lab pod add|delete`: pods beyond those `up` makes, wired and registered
//! the same way (a network namespace on the node's pod bridge, a Pod in the
//! API bound to the node, Running, with its address).

use std::collections::BTreeMap;

use anyhow::{Context, bail, ensure};

use super::session::Lab;
use super::state::Paths;
use super::topology::Pod;
use super::{cluster, kubelet, net, network};

/// `lab pod add|delete`.
#[derive(Debug, clap::Subcommand)]
pub enum PodCommand {
    /// Add a pod NAME on a node, in a Kubernetes namespace that exists.
    Add {
        name: String,
        /// The node it runs on.
        #[arg(long)]
        node: String,
        /// Its Kubernetes namespace (it must exist, e.g. team-a or team-b).
        #[arg(long)]
        namespace: String,
        /// Its labels: `k=v,k2=v2`.
        #[arg(long, default_value = "")]
        labels: String,
    },
    /// Delete the pod NAME: from the API, and its network namespace.
    Delete { name: String },
    /// Keep the containers of a Pod the kubelet stand-in runs from starting
    /// again (one that exits, or is killed, stays down), until `release`.
    Hold {
        /// NAMESPACE/NAME of the Pod.
        pod: String,
    },
    /// Let the kubelet stand-in start a held Pod's containers again.
    Release {
        /// NAMESPACE/NAME of the Pod.
        pod: String,
    },
}

pub fn pod(command: &PodCommand, paths: &Paths) -> anyhow::Result<()> {
    if let PodCommand::Hold { pod } | PodCommand::Release { pod } = command {
        let (namespace, name) = pod
            .split_once('/')
            .with_context(|| format!("{pod:?} is not NAMESPACE/NAME"))?;
        if matches!(command, PodCommand::Hold { .. }) {
            kubelet::hold(paths, namespace, name)?;
            println!(
                "{pod}: held; its containers do not start again until `lab pod release {pod}`"
            );
        } else {
            kubelet::release(paths, namespace, name)?;
            println!("{pod}: released");
        }
        return Ok(());
    }
    let mut lab = Lab::open(paths)?;
    match command {
        PodCommand::Add {
            name,
            node,
            namespace,
            labels,
        } => {
            let labels = parse_labels(labels)?;
            let pod = add(&mut lab, name, namespace, node, labels)?;
            println!(
                "pod {}/{} on {}: {} in network namespace {}",
                pod.namespace, pod.name, pod.node, pod.ip, pod.netns
            );
        }
        PodCommand::Delete { name } => {
            let pod = delete(&mut lab, name)?;
            println!("deleted pod {}/{} ({})", pod.namespace, pod.name, pod.netns);
        }
        PodCommand::Hold { .. } | PodCommand::Release { .. } => unreachable!("handled above"),
    }
    Ok(())
}

/// `k=v,k2=v2` as a map; empty for an empty string.
pub fn parse_labels(text: &str) -> anyhow::Result<BTreeMap<String, String>> {
    text.split(',')
        .filter(|pair| !pair.is_empty())
        .map(|pair| match pair.split_once('=') {
            Some((k, v)) if !k.is_empty() => Ok((k.to_owned(), v.to_owned())),
            _ => bail!("--labels: {pair:?} is not key=value (e.g. --labels app=web,tier=front)"),
        })
        .collect()
}

/// Adds a pod: its namespace and veth, then the Pod in the API, then
/// `lab.json`. A failure after the namespace was made removes it again.
pub fn add(
    lab: &mut Lab,
    name: &str,
    namespace: &str,
    node: &str,
    labels: BTreeMap<String, String>,
) -> anyhow::Result<Pod> {
    let node = lab.node(node)?.clone();
    let pod = lab.state.topology.new_pod(name, namespace, &node, labels)?;
    ensure!(
        lab.kubectl.run(&["get", "namespace", namespace]).is_ok(),
        "the Kubernetes namespace {namespace:?} does not exist in the lab (it has {})",
        lab.state
            .topology
            .namespaces
            .iter()
            .map(|n| n.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
    net::add_netns(&pod.netns).with_context(|| format!("creating {}", pod.netns))?;
    let wired = network::pod_links(&node, &pod)
        .with_context(|| format!("wiring pod {name}"))
        .and_then(|()| cluster::register_pod(&lab.kubectl, &pod, &node));
    if let Err(e) = wired {
        let _ = net::delete_netns(&pod.netns);
        return Err(e);
    }
    lab.state.netns.push(pod.netns.to_string());
    lab.state.topology.pods.push(pod.clone());
    lab.save()?;
    Ok(pod)
}

/// Deletes a pod from the API and removes its namespace (the veth goes with it).
pub fn delete(lab: &mut Lab, name: &str) -> anyhow::Result<Pod> {
    let Some(index) = lab.state.topology.pods.iter().position(|p| p.name == name) else {
        bail!("the lab has no pod named {name:?}");
    };
    let pod = lab.state.topology.pods[index].clone();
    cluster::unregister_pod(&lab.kubectl, &pod)?;
    if net::netns_exists(&pod.netns) {
        net::delete_netns(&pod.netns).with_context(|| format!("deleting {}", pod.netns))?;
    }
    lab.state.topology.pods.remove(index);
    lab.state.netns.retain(|n| n != pod.netns.as_str());
    lab.save()?;
    Ok(pod)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_read_as_comma_separated_pairs() {
        let labels = parse_labels("app=web,tier=front").unwrap();
        assert_eq!(labels["app"], "web");
        assert_eq!(labels["tier"], "front");
        assert!(parse_labels("").unwrap().is_empty());
        assert_eq!(parse_labels("empty=").unwrap()["empty"], "");
    }

    #[test]
    fn a_label_without_a_key_or_value_names_itself() {
        let err = parse_labels("app=web,oops").unwrap_err().to_string();
        assert!(err.contains("\"oops\""), "{err}");
        assert!(parse_labels("=v").is_err());
    }
}
