//! Test support: run a closure in a private network namespace.
//!
//! The closure runs on a thread of its own that has unshared its network
//! namespace, so sockets it opens and processes it spawns (`nft`, `ip`) see
//! only that namespace; the namespace disappears with the thread, even when
//! the closure panics. Tests that need root call [`root_or_skip`] first.

use std::process::Command;

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
