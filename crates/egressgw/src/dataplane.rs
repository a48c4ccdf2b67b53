//! `egressgw apply` and `egressgw cleanup`: the kernel dataplane of this host.

use std::io::Write as _;
use std::time::Duration;

use anyhow::Context;
use egressgw_core::model::{Config, DatapathChoice};
use egressgw_dataplane::Report;
use egressgw_dataplane::ebpf::Classifier;
use egressgw_dataplane::netlink::Rtnetlink;
use egressgw_dataplane::nft::Nft;
use egressgw_dataplane::reconcile::Dataplane;

use crate::{ApplyArgs, CleanupArgs, ReportOutput, known_node, load, load_config, refuse_invalid};

/// Where the kernel is reached from: options of every command that changes it.
#[derive(Debug, Clone, clap::Args)]
pub struct KernelArgs {
    /// The network sysctls of this host's network namespace. In a container
    /// /proc/sys is read-only: the Helm chart mounts the host's
    /// /proc/sys/net elsewhere, writable, and names it here.
    #[arg(
        long,
        value_name = "DIR",
        env = "EGRESSGW_SYSCTL_NET",
        default_value = egressgw_dataplane::netlink::SYSCTL_NET
    )]
    pub sysctl_net: std::path::PathBuf,
    /// Where the eBPF classifier pins its maps and attachments (a directory
    /// on a bpf filesystem); cleanup removes what is there.
    #[arg(
        long,
        value_name = "DIR",
        env = "EGRESSGW_BPF_PINS",
        default_value = egressgw_dataplane::ebpf::PIN_DIR
    )]
    pub bpf_pins: std::path::PathBuf,
}

impl KernelArgs {
    /// An rtnetlink connection that writes sysctls where these options say.
    pub fn netlink(&self) -> anyhow::Result<Rtnetlink> {
        Ok(Rtnetlink::connect()?.with_sysctl_dir(&self.sysctl_net))
    }

    /// This node's dataplane on the datapath `config.datapath` asks for,
    /// and why it is that one: `auto` takes eBPF where the node can run
    /// it and says why not where it cannot; `ebpf` that cannot run is an
    /// error.
    pub fn dataplane(&self, config: Config) -> anyhow::Result<(Dataplane<Rtnetlink, Nft>, String)> {
        let choice = config.datapath;
        let dp = Dataplane::new(self.netlink()?, Nft::new(), config).with_ebpf_pins(&self.bpf_pins);
        let ebpf = || Classifier::open(&self.bpf_pins);
        Ok(match choice {
            DatapathChoice::Nftables => (dp, "datapath: nftables in the config".to_owned()),
            DatapathChoice::Ebpf => {
                let classifier = ebpf().map_err(|e| {
                    anyhow::anyhow!(
                        "datapath: ebpf, but this node cannot run the eBPF classifier: {e}"
                    )
                })?;
                let dp = dp.with_classifier(Box::new(classifier));
                (dp, "datapath: ebpf in the config".to_owned())
            }
            DatapathChoice::Auto => match ebpf() {
                Ok(classifier) => (
                    dp.with_classifier(Box::new(classifier)),
                    "datapath: auto, and this node runs the eBPF classifier".to_owned(),
                ),
                Err(e) => (
                    dp,
                    format!("datapath: auto, and this node cannot run the eBPF classifier ({e})"),
                ),
            },
        })
    }
}

/// Plans the node and reconciles the kernel to it, once or every
/// `--every` seconds. Fails when an operation failed (in one-shot mode),
/// and before any change when an object is invalid, unless
/// `--skip-invalid`: a policy left out for a typo would lose its rules.
pub(crate) fn apply(args: &ApplyArgs) -> anyhow::Result<()> {
    init_logs();
    let (snapshot, invalid) = load(&args.file, args.config.as_deref(), &args.invalid)?;
    refuse_invalid(invalid, &args.file, &args.invalid)?;
    known_node(&snapshot, &args.node, &args.file)?;
    let plan = egressgw_core::plan_node(&snapshot, &args.node);
    let state = plan
        .nodes
        .get(&args.node)
        .with_context(|| format!("no plan for node {}", args.node))?;
    runtime()?.block_on(async {
        let (mut dp, why) = args.kernel.dataplane(snapshot.config.clone())?;
        tracing::info!(datapath = %dp.datapath(), why = %why, "datapath chosen");
        loop {
            let mut report = dp.reconcile(state).await;
            report
                .facts
                .insert("datapath".into(), format!("{} ({why})", dp.datapath()));
            match dp.policy_counters() {
                Ok(counters) => {
                    for (policy, c) in counters {
                        report.facts.insert(
                            format!("traffic of {policy}"),
                            format!("{} packets, {} bytes", c.packets, c.bytes),
                        );
                    }
                }
                Err(e) => report.warn(format!("cannot read the policies' counters: {e}")),
            }
            if let Some(learning) = dp.gateway_learning() {
                report.facts.insert(
                    "gateway fast path".into(),
                    format!(
                        "{} connections held; {} taken over, {} left to the stack",
                        learning.held, learning.taken, learning.left
                    ),
                );
            }
            match dp.tunnel_end() {
                Some(Ok(end)) => {
                    report.facts.insert(
                        "tunnel end".into(),
                        format!(
                            "{} packets ({} bytes) to pods, {} packets ({} bytes) out, taken out of the tunnel on the underlay",
                            end.to_pods.packets, end.to_pods.bytes, end.out.packets, end.out.bytes
                        ),
                    );
                }
                Some(Err(e)) => report.warn(format!("cannot read the tunnel end's counters: {e}")),
                None => {}
            }
            print(&report, args.output)?;
            match args.every {
                Some(secs) => tokio::time::sleep(Duration::from_secs(secs.max(1))).await,
                None if report.is_ok() => return Ok(()),
                None => anyhow::bail!("{} operation(s) failed", report.failed.len()),
            }
        }
    })
}

/// Removes everything egressgw created on this host.
pub(crate) fn cleanup(args: &CleanupArgs) -> anyhow::Result<()> {
    init_logs();
    let config = load_config(args.config.as_deref())?;
    runtime()?.block_on(async {
        let mut dp = Dataplane::new(args.kernel.netlink()?, Nft::new(), config)
            .with_ebpf_pins(&args.kernel.bpf_pins);
        let report = dp.cleanup().await;
        print(&report, args.output)?;
        if report.is_ok() {
            Ok(())
        } else {
            anyhow::bail!("{} operation(s) failed", report.failed.len())
        }
    })
}

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")
}

/// Logs to stderr; `RUST_LOG` filters (default `warn`, so reports stay
/// readable on stdout).
fn init_logs() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

fn print(report: &Report, output: ReportOutput) -> anyhow::Result<()> {
    let text = match output {
        ReportOutput::Json => serde_json::to_string(report)? + "\n",
        ReportOutput::Text => {
            let mut out = String::new();
            for op in &report.applied {
                out += &format!("applied  {op}\n");
            }
            for f in &report.failed {
                out += &format!("FAILED   {} [{}]: {}\n", f.op, f.cause.as_str(), f.error);
            }
            for w in &report.warnings {
                out += &format!("warning  {w}\n");
            }
            for (k, v) in &report.facts {
                out += &format!("fact     {k}: {v}\n");
            }
            out += &format!(
                "{} operation(s): {} applied, {} failed\n",
                report.ops(),
                report.applied.len(),
                report.failed.len()
            );
            out
        }
    };
    let mut stdout = std::io::stdout().lock();
    stdout.write_all(text.as_bytes())?;
    stdout.flush().context("writing the report")
}
