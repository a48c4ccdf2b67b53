//! Test support: run a closure in a private network namespace.
//!
//! The closure runs on a thread of its own that has unshared its network
//! namespace, so sockets it opens and processes it spawns (`nft`, `ip`) see
//! only that namespace; the namespace disappears with the thread, even when
//! the closure panics. Tests that need root call [`root_or_skip`] first.

use std::net::IpAddr;
use std::process::Command;

use egressgw_core::model::{Config, Mac};
use egressgw_core::state::{NodeState, OwnedEip, Peer, ReplyRoute, Route, Rule, Vxlan};
use nix::sched::{CloneFlags, unshare};

/// Whether the test may touch the kernel; prints why not otherwise.
pub(crate) fn root_or_skip(test: &str) -> bool {
    let root = nix::unistd::geteuid().is_root();
    if !root {
        eprintln!("SKIPPED {test}: needs root (network namespaces)");
    }
    root
}

/// Runs `f` in a new network namespace with `lo` up and returns its result;
/// a panic in `f` is a panic here.
pub(crate) fn in_new_netns<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            unshare(CloneFlags::CLONE_NEWNET).expect("unshare(CLONE_NEWNET)");
            sh("ip link set lo up");
            f()
        })
        .join()
        .unwrap_or_else(|e| std::panic::resume_unwind(e))
    })
}

/// Runs `f` on a current-thread tokio runtime in a new network namespace.
pub(crate) fn block_on_in_new_netns<T: Send>(f: impl AsyncFnOnce() -> T + Send) -> T {
    in_new_netns(|| {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime")
            .block_on(f())
    })
}

/// Runs a shell command line in the calling thread's namespace; panics with
/// its output when it fails. Returns stdout.
pub(crate) fn sh(cmd: &str) -> String {
    let out = Command::new("sh")
        .args(["-c", cmd])
        .output()
        .expect("spawn sh");
    assert!(
        out.status.success(),
        "`{cmd}` failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Sets the links `names` up and waits (at most 5 s) until the kernel has
/// switched each on: right after `ip link set up` a veth's carrier comes
/// through the kernel's link watcher, and until then what is sent on it is
/// dropped.
pub(crate) fn links_up(names: &[&str]) {
    for name in names {
        sh(&format!("ip link set dev {name} up"));
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    for name in names {
        loop {
            let link = sh(&format!("ip -o link show dev {name}"));
            if link.contains("state UP") {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{name} is not up after 5 s: {link}"
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

/// Node A of a two-node cluster whose gateway is B; with `eip`, A is
/// also a gateway owning it.
pub(crate) fn node_state(eip: bool) -> NodeState {
    let cfg = Config::default();
    NodeState {
        node: "a".into(),
        vxlan: Some(Vxlan {
            name: "egress.vxlan".into(),
            vni: 100,
            port: 7789,
            local: ip("172.18.0.11"),
            mac: Mac([2, 0, 0, 0, 0, 1]),
            ipv4: Some("172.31.0.1".parse().unwrap()),
            ipv6: None,
            ipv4_prefix_len: 16,
            ipv6_prefix_len: 112,
            disable_checksum_offload: false,
        }),
        peers: vec![Peer {
            node: "b".into(),
            underlay: ip("172.18.0.12"),
            mac: Mac([2, 0, 0, 0, 0, 2]),
            ipv4: Some("172.31.0.2".parse().unwrap()),
            ipv6: None,
        }],
        routes: vec![Route {
            table: 3000,
            gateway: "b".into(),
            via_ipv4: Some("172.31.0.2".parse().unwrap()),
            via_ipv6: None,
        }],
        rules: vec![
            Rule {
                priority: 3000,
                mark: cfg.mark(1),
                mask: cfg.mark_mask,
                table: 3000,
            },
            Rule {
                priority: 3000,
                mark: cfg.reply_mark(),
                mask: cfg.mark_mask,
                table: cfg.reply_table(),
            },
        ],
        replies: vec![ReplyRoute {
            dst: ip("10.244.2.10"),
            via: ip("172.31.0.2"),
            origin: "b".into(),
            table: cfg.reply_table(),
        }]
        .into(),
        eips: if eip {
            vec![OwnedEip {
                ip: ip("198.51.100.200"),
                gateway: "egw".into(),
            }]
        } else {
            vec![]
        },
        ..NodeState::default()
    }
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("address")
}
