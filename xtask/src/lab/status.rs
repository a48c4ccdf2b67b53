//! `lab status`: what is running, whether the API is ready, what it holds.
//! Exits zero only when a lab is up and healthy.

use std::process::ExitCode;

use super::kubectl::Kubectl;
use super::state::{LabState, Paths};
use super::topology::Netns;
use super::{kubelet, net, preflight, process};

pub fn status(paths: &Paths) -> anyhow::Result<ExitCode> {
    preflight::require_root()?;
    let Some(state) = LabState::read(paths)? else {
        return no_lab(paths);
    };
    println!(
        "lab in {} (Kubernetes {})",
        state.dir.display(),
        state.kubernetes_version
    );
    println!("helm: {}", state.helm.display());
    let mut healthy = processes(&state);
    healthy &= namespaces(&state)?;
    healthy &= api(&state, paths);
    kubelet_pods(paths);
    if healthy {
        println!("healthy");
        Ok(ExitCode::SUCCESS)
    } else {
        println!("NOT healthy: see the logs in {}", paths.logs().display());
        Ok(ExitCode::FAILURE)
    }
}

fn no_lab(paths: &Paths) -> anyhow::Result<ExitCode> {
    let left = net::lab_netns(&paths.prefix)?;
    if left.is_empty() && !paths.any_present() {
        println!("no lab is up ({} has no lab.json)", paths.lab.display());
    } else {
        let names: Vec<String> = left.iter().map(ToString::to_string).collect();
        println!(
            "no lab.json in {}, but a lab left things behind (namespaces: [{}]): run `cargo xtask lab down`",
            paths.lab.display(),
            names.join(", ")
        );
    }
    Ok(ExitCode::FAILURE)
}

fn processes(state: &LabState) -> bool {
    println!("processes:");
    let mut ok = true;
    for p in &state.processes {
        let alive = process::alive(p.pid);
        ok &= alive;
        let word = if alive { "running" } else { "DEAD" };
        let netns = if p.netns.is_empty() {
            "the host namespace"
        } else {
            &p.netns
        };
        println!(
            "  {:<24} pid {:<8} {word:<8} in {netns} (log {})",
            p.name,
            p.pid,
            p.log.display()
        );
    }
    ok
}

fn namespaces(state: &LabState) -> anyhow::Result<bool> {
    let present = net::lab_netns(&state.topology.prefix)?;
    let missing: Vec<&String> = state
        .netns
        .iter()
        .filter(|n| !present.iter().any(|p| p.as_str() == n.as_str()))
        .collect();
    let prefix = &state.topology.prefix;
    let extra: Vec<&Netns> = present
        .iter()
        .filter(|p| !state.netns.iter().any(|n| n == p.as_str()))
        .filter(|p| !kubelet::is_pod_netns(prefix, p.as_str()))
        .collect();
    println!(
        "network namespaces: {} of {} present",
        state.netns.len() - missing.len(),
        state.netns.len()
    );
    if !missing.is_empty() {
        println!("  MISSING: {missing:?}");
    }
    if !extra.is_empty() {
        let names: Vec<String> = extra.iter().map(ToString::to_string).collect();
        println!("  not part of this lab: {names:?}");
    }
    Ok(missing.is_empty())
}

/// The Pods the kubelet stand-in runs, with their containers' pids.
fn kubelet_pods(paths: &Paths) {
    let records = kubelet::records(paths);
    println!("pods run by the kubelet stand-in: {}", records.len());
    for r in records {
        let netns = if r.netns.is_empty() { "-" } else { &r.netns };
        println!(
            "  {}/{} on {} ({}) ip {} netns {netns}",
            r.namespace, r.name, r.node, r.phase, r.ip
        );
        for c in r.containers {
            let pid = c.pid.map_or_else(|| "-".to_owned(), |p| p.to_string());
            let ready = if c.ready { "ready" } else { "not ready" };
            println!(
                "    {:<20} pid {pid:<8} {} {ready}, {} restarts (log {})",
                c.name,
                c.state,
                c.restarts,
                c.log.display()
            );
        }
    }
}

fn api(state: &LabState, paths: &Paths) -> bool {
    let cp = &state.topology.control_plane.netns;
    if !net::netns_exists(cp) {
        println!("api: the control-plane namespace is missing");
        return false;
    }
    let kubectl = Kubectl::at(&state.bin_dir.join("kubectl"), &paths.kubeconfig(), cp);
    match kubectl.run(&["get", "--raw", "/readyz"]) {
        Ok(out) if out.trim() == "ok" => println!("api: {} ready (/readyz ok)", state.api_server),
        Ok(out) => {
            println!("api: {} NOT ready: {}", state.api_server, out.trim());
            return false;
        }
        Err(e) => {
            println!("api: {} NOT reachable: {e:#}", state.api_server);
            return false;
        }
    }
    match kubectl.run(&["get", "namespaces,nodes,pods", "-A", "-o", "wide"]) {
        Ok(out) => {
            println!("objects:");
            out.lines().for_each(|l| println!("  {l}"));
            true
        }
        Err(e) => {
            println!("api: listing nodes and pods failed: {e:#}");
            false
        }
    }
}
