//! `cargo xtask e2e`: egressgw end to end on a fresh lab. Brings a lab up,
//! deploys egressgw, runs every scenario (through the API, checked with real
//! traffic), and takes the lab down again unless `--keep`.
//!
//! Output follows libtest's (`test e2e::<name> ... ok`, then `test result:`),
//! so the scripts that count test results count these too. See docs/e2e.md.

use std::net::Ipv4Addr;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::process::ExitCode;
use std::time::Instant;

use anyhow::Context;

use crate::lab::egressgw::{self, DeployArgs};
use crate::lab::session::Lab;
use crate::lab::state::Paths;
use crate::lab::topology::{EXTERNAL6_CIDR, sibling6};
use crate::lab::up::{self, UpArgs};
use crate::lab::{down, process};

mod bench;
mod churn;
mod doctor;
mod failover;
mod faults;
mod install;
mod ipv6;
mod metrics;
mod objects;
mod run;
mod scenarios;
mod scope;
mod snapshot;
mod tenancy;
mod traffic;
mod upgrade;

use run::Run;

/// The lab the e2e tests use unless `EGRESSGW_LAB_PREFIX` names another:
/// a lab of its own, so a run never touches the lab someone is using
/// (`egl`, the default of the `lab` commands).
pub const E2E_PREFIX: &str = "e2e";

/// Addresses of the free range each scenario's gateway gets: scenario `k`
/// uses `198.51.100.(200 + 3k) ..= (202 + 3k)`.
const POOL_SLICE: u8 = 3;
const POOL_START: u8 = 100;

/// `cargo xtask e2e`.
#[derive(Debug, clap::Args)]
pub struct E2eArgs {
    /// Leave the lab up at the end (for a look around; `lab down` removes it).
    #[arg(long)]
    keep: bool,
    /// Run only the scenarios whose name contains this.
    #[arg(long, value_name = "SUBSTR")]
    filter: Option<String>,
    /// The egressgw binary to deploy [default: beside this xtask binary].
    #[arg(long, value_name = "PATH")]
    egressgw: Option<std::path::PathBuf>,
    /// Helm values for the release the scenarios run against (`helm
    /// --set`), e.g. `feature.datapath=nftables`.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    set: Vec<String>,
    /// A dual-stack lab (IPv6 beside IPv4 everywhere, egressgw with IPv6
    /// egress on); the IPv6 scenarios run only on one.
    #[arg(long)]
    ipv6: bool,
}

/// Takes the lab down when dropped, also on an error or a panic, unless kept.
struct Teardown<'a> {
    paths: &'a Paths,
    keep: bool,
}

impl Drop for Teardown<'_> {
    fn drop(&mut self) {
        if self.keep {
            println!(
                "\nthe lab is left up (--keep): remove it with `{}`",
                self.paths.command("lab down")
            );
        } else if let Err(e) = down::teardown(self.paths) {
            eprintln!("e2e: taking the lab down failed: {e:#}");
        }
    }
}

pub fn run(args: &E2eArgs) -> anyhow::Result<ExitCode> {
    let paths = Paths::from_env_or(E2E_PREFIX)?;
    let selected: Vec<(usize, &scenarios::Scenario)> = scenarios::ALL
        .iter()
        .enumerate()
        .filter(|(_, (name, _))| args.filter.as_deref().is_none_or(|f| name.contains(f)))
        .filter(|(_, (name, _))| args.ipv6 || !scenarios::needs_dual_stack(name))
        .collect();
    let needs_ipv6 = scenarios::ALL
        .iter()
        .any(|(name, _)| args.filter.as_deref().is_none_or(|f| name.contains(f)));
    if selected.is_empty() && needs_ipv6 {
        anyhow::bail!(
            "the scenarios whose name contains {:?} need a dual-stack lab: add --ipv6",
            args.filter.as_deref().unwrap_or_default()
        );
    }
    if selected.is_empty() {
        let names: Vec<&str> = scenarios::ALL.iter().map(|(name, _)| *name).collect();
        anyhow::bail!(
            "no scenario name contains {:?}; the scenarios:\n  {}",
            args.filter.as_deref().unwrap_or_default(),
            names.join("\n  ")
        );
    }
    let filtered_out = scenarios::ALL.len() - selected.len();
    if selected
        .iter()
        .any(|(_, (name, _))| *name == upgrade::SCENARIO)
    {
        crate::previous::ensure_built(&paths).context("the previous release, to upgrade from")?;
    }
    let begun = Instant::now();
    remove_leftover(&paths)?;
    let teardown = Teardown {
        paths: &paths,
        keep: args.keep,
    };
    let mut lab = match bring_up(&paths, args) {
        Ok(lab) => lab,
        Err(e) => {
            print_running(selected.len());
            println!("test e2e::lab_setup ... FAILED\n    {e:#}");
            print_result(0, 1, filtered_out, begun);
            drop(teardown);
            return Ok(ExitCode::FAILURE);
        }
    };
    print_running(selected.len());
    let mut failures = Vec::new();
    for (index, (name, body)) in &selected {
        let marks = LogMarks::take(&lab);
        if let Err(e) = run_one(&mut lab, *index, name, *body) {
            failures.push((*name, e, marks.digest()));
        }
    }
    if !failures.is_empty() {
        println!("\nfailures:");
        for (name, e, digest) in &failures {
            println!("\n---- e2e::{name} ----\n{e:#}");
            if !digest.is_empty() {
                println!("what egressgw logged meanwhile (warnings and failover steps):\n{digest}");
            }
        }
        show_daemon_logs(&lab);
        keep_logs(&lab);
    }
    let passed = selected.len() - failures.len();
    print_result(passed, failures.len(), filtered_out, begun);
    drop(teardown);
    Ok(if failures.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// An e2e run starts from nothing: a lab of this prefix left by an earlier
/// run (`--keep`, a crash) is removed first.
fn remove_leftover(paths: &Paths) -> anyhow::Result<()> {
    crate::lab::preflight::check()?;
    if crate::lab::leftovers(paths)? {
        println!(
            "e2e: removing the lab {} left over from an earlier run",
            paths.prefix
        );
        down::teardown(paths)?;
    }
    Ok(())
}

fn bring_up(paths: &Paths, args: &E2eArgs) -> anyhow::Result<Lab> {
    let up_args = UpArgs {
        nodes: 3,
        gateways: 2,
        ipv6: args.ipv6,
        keep_on_failure: false,
    };
    up::up(&up_args, paths).context("lab up")?;
    // What the nodes are without egressgw, for the uninstall scenario.
    install::snapshot_nodes(&Lab::open(paths)?).context("snapshots of the nodes")?;
    let deploy = DeployArgs {
        egressgw: args.egressgw.clone(),
        set: args.set.clone(),
        ..DeployArgs::default()
    };
    egressgw::deploy(&deploy, paths).context("lab deploy")?;
    Lab::open(paths)
}

/// Runs one scenario with its own pool slice, then its cleanup; prints its
/// result line and notes. A panic counts as a failure.
fn run_one(
    lab: &mut Lab,
    index: usize,
    name: &str,
    body: fn(&mut Run) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let begun = Instant::now();
    let pool = pool(index);
    let pool6 = match lab.state.topology.dual_stack() {
        true => pool
            .iter()
            .map(|&ip| sibling6(EXTERNAL6_CIDR, ip))
            .collect(),
        false => Vec::new(),
    };
    let mut run = Run::new(lab, pool, pool6);
    let outcome = catch_unwind(AssertUnwindSafe(|| body(&mut run)))
        .unwrap_or_else(|panic| Err(anyhow::anyhow!("panicked: {}", panic_message(&panic))));
    let cleanup = run.clean_up();
    let outcome = match (outcome, cleanup.is_empty()) {
        (Ok(()), true) => Ok(()),
        (Ok(()), false) => Err(anyhow::anyhow!("cleanup failed: {}", join(&cleanup))),
        (Err(e), true) => Err(e),
        (Err(e), false) => Err(e.context(format!("(and cleanup failed: {})", join(&cleanup)))),
    };
    let word = if outcome.is_ok() { "ok" } else { "FAILED" };
    println!("test e2e::{name} ... {word}");
    for note in run.notes() {
        println!("    {note}");
    }
    println!("    took {:.1} s", begun.elapsed().as_secs_f64());
    outcome
}

fn pool(index: usize) -> Vec<Ipv4Addr> {
    let start = u8::try_from(index)
        .ok()
        .and_then(|i| i.checked_mul(POOL_SLICE))
        .and_then(|o| o.checked_add(POOL_START))
        .unwrap_or(POOL_START);
    (0..POOL_SLICE)
        .map(|k| Ipv4Addr::new(198, 51, 100, start.saturating_add(k)))
        .collect()
}

fn join(errors: &[anyhow::Error]) -> String {
    errors
        .iter()
        .map(|e| format!("{e:#}"))
        .collect::<Vec<_>>()
        .join("; ")
}

fn panic_message(panic: &Box<dyn std::any::Any + Send>) -> String {
    panic
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| panic.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "(no message)".to_owned())
}

fn print_running(count: usize) {
    let plural = if count == 1 { "" } else { "s" };
    println!("\nrunning {count} test{plural}");
}

fn print_result(passed: usize, failed: usize, filtered_out: usize, begun: Instant) {
    let word = if failed == 0 { "ok" } else { "FAILED" };
    println!(
        "\ntest result: {word}. {passed} passed; {failed} failed; 0 ignored; 0 measured; \
         {filtered_out} filtered out; finished in {:.2}s",
        begun.elapsed().as_secs_f64()
    );
}

/// Copies the lab's logs (control plane, stand-in, every pod) to
/// `<cache>/e2e-failed-logs`, replacing an earlier copy, so that a failed
/// run can be read after its lab is gone.
fn keep_logs(lab: &Lab) {
    let to = lab.paths.cache.join("e2e-failed-logs");
    let _ = std::fs::remove_dir_all(&to);
    let copied = crate::lab::cmd::run(
        "cp",
        &[
            "-r",
            &lab.paths.logs().display().to_string(),
            &to.display().to_string(),
        ],
    );
    match copied {
        Ok(_) => println!("\nthe lab's logs are kept in {}", to.display()),
        Err(e) => println!("\ncould not keep the lab's logs: {e:#}"),
    }
}

/// Where every egressgw pod's log stood when a scenario began.
struct LogMarks(Vec<(String, std::path::PathBuf, u64)>);

/// Log lines worth reading beside a failure.
const DIGEST_WORDS: &[&str] = &[
    "WARN",
    "ERROR",
    "taking the EIP",
    "giving the EIP up",
    "sending the group's traffic",
    "EIP holders found",
    "peers answer",
];
/// At most this many lines of each log in a digest (the last ones).
const DIGEST_LINES: usize = 12;

impl LogMarks {
    fn take(lab: &Lab) -> Self {
        let logs = crate::lab::kubelet::records(&lab.paths)
            .into_iter()
            .filter(|p| p.namespace == egressgw::NAMESPACE)
            .flat_map(|pod| {
                pod.containers.into_iter().map(move |c| {
                    let size = std::fs::metadata(&c.log).map_or(0, |m| m.len());
                    (format!("{} on {}", pod.name, pod.node), c.log, size)
                })
            })
            .collect();
        LogMarks(logs)
    }

    /// The notable lines each log gained since the marks, compactly.
    fn digest(&self) -> String {
        let mut out = String::new();
        for (who, log, offset) in &self.0 {
            let Ok(text) = std::fs::read(log) else {
                continue;
            };
            let start = usize::try_from(*offset).unwrap_or(0).min(text.len());
            let text = String::from_utf8_lossy(&text[start..]);
            let lines: Vec<&str> = text
                .lines()
                .filter(|l| DIGEST_WORDS.iter().any(|w| l.contains(w)))
                .collect();
            if lines.is_empty() {
                continue;
            }
            out.push_str(&format!("  {who} ({} lines):\n", lines.len()));
            for line in &lines[lines.len().saturating_sub(DIGEST_LINES)..] {
                let line: String = line.chars().take(300).collect();
                out.push_str(&format!("    {line}\n"));
            }
        }
        out
    }
}

/// The end of every egressgw pod's log, to read beside a failure.
fn show_daemon_logs(lab: &Lab) {
    for pod in crate::lab::kubelet::records(&lab.paths)
        .iter()
        .filter(|p| p.namespace == egressgw::NAMESPACE)
    {
        for container in &pod.containers {
            println!(
                "\n---- the end of {} on {} ({}) ----\n{}",
                pod.name,
                pod.node,
                container.log.display(),
                process::log_tail(&container.log, 15)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scenario_gets_its_own_slice_of_the_free_range() {
        let all: Vec<Vec<Ipv4Addr>> = (0..scenarios::ALL.len()).map(pool).collect();
        assert_eq!(all[0][0], Ipv4Addr::new(198, 51, 100, 100));
        let last = all.last().unwrap().last().unwrap();
        assert!(last.octets()[3] <= 250, "{last} is past the free range");
        let mut flat: Vec<Ipv4Addr> = all.concat();
        let n = flat.len();
        flat.sort_unstable();
        flat.dedup();
        assert_eq!(flat.len(), n);
    }
}
