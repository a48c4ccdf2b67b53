//! What the kernel offers egressgw: the `features` check.
//!
//! The nftables side is asked of the kernel itself: egressgw's table, with
//! an element of every kind, goes to the kernel as a check-only transaction
//! ([`Nft::check`]), so every expression, set type and NAT statement
//! egressgw writes is validated by the modules that would run it, and
//! nothing is created. The eBPF side is what the classifier needs
//! before it loads: the program built in, a bpf filesystem for its pins,
//! and a kernel with TCX for attachments that outlive the agent.

use std::net::IpAddr;
use std::path::Path;

use egressgw_core::model::{Config, PolicyRef};
use egressgw_core::state::{Action, ClassifyEntry, NodeState, SnatEntry, SnatTo};
use egressgw_dataplane::nft::{FirewallSpec, Nft};

use super::{Check, Verdict};

/// What the kernel and this build offer.
#[derive(Debug, Clone)]
pub struct Features {
    /// `uname -r`.
    pub release: String,
    /// The kernel's answer to egressgw's table in a check-only transaction.
    pub nftables: Result<(), String>,
    /// Whether this build carries the eBPF program.
    pub program: bool,
    /// Whether the pin directory's mount is a bpf filesystem, or why not.
    pub bpffs: Result<(), String>,
    /// Whether the kernel attaches TC programs with TCX (6.6 and later).
    pub tcx: bool,
}

/// Asks the kernel (blocks: runs `nft`).
pub fn gather(pins: &Path) -> Features {
    let release = nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default();
    Features {
        tcx: tcx(&release),
        release,
        nftables: Nft::new().check(&sample_table()).map_err(|e| e.to_string()),
        program: egressgw_dataplane::ebpf::object().is_some(),
        bpffs: bpffs(pins),
    }
}

/// Whether a kernel release (`6.18.44-...`) is 6.6 or later.
fn tcx(release: &str) -> bool {
    let mut numbers = release
        .split(|c: char| !c.is_ascii_digit())
        .map(|n| n.parse::<u32>().unwrap_or(0));
    let major = numbers.next().unwrap_or(0);
    let minor = numbers.next().unwrap_or(0);
    (major, minor) >= (6, 6)
}

fn bpffs(pins: &Path) -> Result<(), String> {
    let mount = pins
        .ancestors()
        .find(|p| p.exists())
        .unwrap_or_else(|| Path::new("/"));
    match nix::sys::statfs::statfs(mount) {
        Ok(fs) if fs.filesystem_type() == nix::sys::statfs::BPF_FS_MAGIC => Ok(()),
        Ok(_) => Err(format!("{} is not on a bpf filesystem", mount.display())),
        Err(e) => Err(format!("{}: {e}", mount.display())),
    }
}

/// egressgw's whole table with an element of every kind, both families.
fn sample_table() -> FirewallSpec {
    let ip = |s: &str| s.parse::<IpAddr>().expect("a valid address");
    let policy = std::sync::Arc::new(PolicyRef::namespaced("doctor", "check"));
    let classify = |src: &str, dst: &str, action: Action| ClassifyEntry {
        src: ip(src),
        dst: dst.parse().expect("a valid prefix"),
        action,
        policy: Some(policy.clone()),
        group: None,
    };
    let snat = |src: &str, dst: &str, to: SnatTo| SnatEntry {
        src: ip(src),
        dst: dst.parse().expect("a valid prefix"),
        to,
        origin: "doctor".into(),
        policy: policy.clone(),
    };
    let cfg = Config::default();
    let tunnel = Action::Tunnel {
        gateway: "doctor".into(),
        mark: cfg.mark(1),
    };
    let state = NodeState {
        node: "doctor".into(),
        cluster_cidrs: vec![
            "10.0.0.0/8".parse().expect("a valid prefix"),
            "fd00::/8".parse().expect("a valid prefix"),
        ],
        classify: vec![
            classify("10.0.0.1", "0.0.0.0/0", tunnel.clone()),
            classify("10.0.0.1", "192.0.2.0/24", Action::Bypass),
            classify("10.0.0.2", "198.51.100.0/24", Action::Local),
            classify("10.0.0.3", "203.0.113.0/24", Action::Drop),
            classify("fd00::1", "::/0", tunnel),
        ],
        snat: vec![
            snat("10.0.0.4", "0.0.0.0/0", SnatTo::Eip(ip("192.0.2.10"))),
            snat("10.0.0.4", "198.51.100.0/24", SnatTo::NodeIp),
            snat("fd00::4", "::/0", SnatTo::Eip(ip("2001:db8::10"))),
        ]
        .into(),
        ..NodeState::default()
    };
    FirewallSpec::new(&state, &cfg)
}

/// The verdict: the nftables table is what egressgw cannot do without;
/// what the eBPF datapath lacks matters where `auto` fell back for it.
pub fn check(features: &Features, datapath: Option<(&str, &str)>) -> Check {
    let mut missing = Vec::new();
    if !features.program {
        missing.push("this build carries no eBPF program".to_owned());
    }
    if let Err(e) = &features.bpffs {
        missing.push(e.clone());
    }
    let ebpf = if missing.is_empty() {
        let attach = if features.tcx {
            "TCX"
        } else {
            "clsact (no TCX before 6.6: attachments are not kept across agent restarts)"
        };
        format!("eBPF: can run, attaches with {attach}")
    } else {
        format!("eBPF: cannot run ({})", missing.join("; "))
    };
    let kernel = format!("kernel {}", features.release);
    if let Err(e) = &features.nftables {
        return Check::new(
            "features",
            Verdict::Fail,
            format!("{kernel}: the kernel refuses egressgw's nftables table: {e}; {ebpf}"),
        )
        .fix(
            "load nf_tables with nft_ct, nft_nat, nft_masq, nft_objref and nft_counter \
             (concatenated interval maps need Linux 5.6 or later)",
        );
    }
    let fell_back = matches!(datapath, Some(("nftables", why)) if why.contains("auto"));
    let evidence =
        format!("{kernel}: nftables: egressgw's table passes the kernel's check; {ebpf}");
    if fell_back && !missing.is_empty() {
        return Check::new("features", Verdict::Warn, evidence).fix(
            "datapath auto fell back to nftables; mount a bpf filesystem at the pin \
             directory (the Helm chart mounts the host's /sys/fs/bpf) and run an image \
             built with the eBPF program",
        );
    }
    Check::new("features", Verdict::Pass, evidence)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn features() -> Features {
        Features {
            release: "6.18.44".into(),
            nftables: Ok(()),
            program: true,
            bpffs: Ok(()),
            tcx: true,
        }
    }

    #[test]
    fn tcx_comes_with_6_6() {
        assert!(tcx("6.6.0"));
        assert!(tcx("6.18.44-fc-v769"));
        assert!(!tcx("6.1.0-27-amd64"));
        assert!(!tcx("5.15.0"));
        assert!(!tcx(""));
    }

    #[test]
    fn a_table_the_kernel_refuses_fails_and_missing_ebpf_warns_only_where_auto_fell_back() {
        let ok = check(&features(), Some(("ebpf", "datapath: auto, and ...")));
        assert_eq!(ok.verdict, Verdict::Pass, "{ok:?}");
        assert!(ok.evidence.contains("attaches with TCX"), "{ok:?}");

        let mut refused = features();
        refused.nftables = Err("Could not process rule: No such file or directory".into());
        let c = check(&refused, None);
        assert_eq!(c.verdict, Verdict::Fail);
        assert!(c.evidence.contains("refuses") && c.fix.is_some(), "{c:?}");

        let mut no_bpffs = features();
        no_bpffs.bpffs = Err("/sys/fs/bpf is not on a bpf filesystem".into());
        let auto = "datapath: auto, and this node cannot run the eBPF classifier (...)";
        let c = check(&no_bpffs, Some(("nftables", auto)));
        assert_eq!(c.verdict, Verdict::Warn, "{c:?}");
        assert!(c.evidence.contains("not on a bpf filesystem"), "{c:?}");
        // Chosen on purpose: nothing to warn about.
        let c = check(
            &no_bpffs,
            Some(("nftables", "datapath: nftables in the config")),
        );
        assert_eq!(c.verdict, Verdict::Pass, "{c:?}");
    }

    #[test]
    fn the_sample_table_has_an_element_of_every_kind() {
        let spec = sample_table();
        let script = spec.render();
        for kind in [
            "classify4",
            "classify6",
            "snat4",
            "snat6",
            "masq4",
            "count4",
            "count6",
        ] {
            assert!(
                script.contains(&format!("add element inet egressgw {kind} ")),
                "no {kind} element in {script}"
            );
        }
        assert!(script.contains("jump local") && script.contains("jump fail_closed"));
        assert_eq!(spec.counters.len(), 1);
    }
}
