//! The upgrade from the previous release (`deploy/previous-release`, built
//! by `cargo xtask previous`) to the build under test, with traffic
//! flowing through it. Runs last, on the cluster the uninstall left
//! without egressgw.

use std::time::{Duration, Instant};

use anyhow::{Context, ensure};

use super::faults::Steady;
use super::install::agent_pods;
use super::run::Run;
use super::scenarios::{setup_gateway, setup_web_policy};
use super::traffic::{Expect, Prober};
use crate::lab::egressgw::{self, DeployArgs};
use crate::lab::helm::{Helm, RELEASE};
use crate::lab::session::Lab;

const GATEWAY: &str = "e2e-upgrade-from";

/// The scenario's name: a run that selects it builds the previous release
/// first, unless it is built.
pub const SCENARIO: &str = "upgrade_from_the_previous_release_moves_no_eip_and_changes_no_source";

/// The previous release installed fresh (its chart, CRDs and binary), with
/// the run's Helm values; a gateway and team-a/web through it; web-3
/// probed every 100 ms while `lab deploy` upgrades the release to this
/// build (chart, CRDs and image) and every agent and controller is
/// replaced. Every probe sees the EIP; afterwards the allocations (the
/// policy's EIP and node, the gateway's placement, every tunnel's address,
/// MAC and mark) are what the previous release made, and no EIP moved.
pub fn upgrade_from_the_previous_release_moves_no_eip_and_changes_no_source(
    run: &mut Run,
) -> anyhow::Result<()> {
    let paths = run.lab.paths.clone();
    let previous = crate::previous::find(&paths)?;
    let set = run
        .lab
        .state
        .egressgw
        .as_ref()
        .map(|d| d.set.clone())
        .unwrap_or_default();
    // Run on its own (`--filter`), the scenario finds this build installed.
    let helm = Helm::for_lab(run.lab);
    let status = helm.output(&["status", RELEASE, "-n", egressgw::NAMESPACE])?;
    if status.status.success() {
        super::install::uninstall(run.lab).context("removing the release installed")?;
    }
    let installed = Instant::now();
    let older = DeployArgs {
        egressgw: Some(previous.binary.clone()),
        chart: Some(previous.chart.clone()),
        set: set.clone(),
        ..DeployArgs::default()
    };
    egressgw::deploy(&older, &paths).context("installing the previous release")?;
    *run.lab = Lab::open(&paths)?;
    let eip = setup_gateway(run, GATEWAY)?;
    setup_web_policy(run, GATEWAY)?;
    run.expect_all(&["web-1", "web-3"], Expect::Source(eip.into()))?;
    let steady = Steady::record(run, GATEWAY)?;
    let agents = agent_pods(&run.lab.kubectl)?;
    run.note(format!(
        "the previous release {} installed and carrying team-a/web in {:.1} s",
        &previous.revision[..12],
        installed.elapsed().as_secs_f64()
    ));

    let prober = Prober::start(
        run.netns("web-3")?,
        run.target(),
        Duration::from_millis(100),
        Duration::from_secs(240),
    );
    let upgraded = Instant::now();
    let newer = DeployArgs {
        set,
        ..DeployArgs::default()
    };
    egressgw::deploy(&newer, &paths).context("upgrading to this build")?;
    *run.lab = Lab::open(&paths)?;
    let took = upgraded.elapsed();
    let now = agent_pods(&run.lab.kubectl)?;
    let kept: Vec<&String> = agents
        .iter()
        .filter(|(node, pod)| now.get(*node) == Some(pod))
        .map(|(node, _)| node)
        .collect();
    ensure!(kept.is_empty(), "the agents of {kept:?} were not replaced");
    // A few reconciles of the new agents and the new leader.
    std::thread::sleep(Duration::from_secs(3));
    let samples = prober.finish();
    let (probes, kept) = steady.kept_across(run, "the upgrade", (&samples, upgraded, eip))?;
    run.expect_steady("web-3", Expect::Source(eip.into()), 3)?;
    run.note(format!(
        "upgraded to this build in {:.1} s ({} agents and the controllers replaced); {probes} \
         probes of web-3 all from {eip}; {kept} allocations unchanged",
        took.as_secs_f64(),
        now.len(),
    ));
    Ok(())
}
