//! The harness of the privileged dataplane tests: namespaces and the test
//! topology, bounded processes, real traffic, and `egressgw` runs.

pub mod cluster;
pub mod netns;
pub mod process;
pub mod traffic;

/// True when the test can run; otherwise says why it is skipped.
pub fn have_root(test: &str) -> bool {
    if nix::unistd::geteuid().is_root() {
        true
    } else {
        println!("SKIPPED {test}: needs root");
        false
    }
}
