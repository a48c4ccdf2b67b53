//! Builds the eBPF classifier (`bpf/egressgw-ebpf`) with aya-build and
//! hands it to the crate as `$OUT_DIR/egressgw-ebpf`, announcing it with
//! the `egressgw_ebpf` cfg.
//!
//! It needs the nightly toolchain with `rust-src` and `bpf-linker`
//! (`scripts/setup.sh` installs them). Without them, or with
//! `AYA_BUILD_SKIP=1`, the crate builds without the program and the agent
//! uses the nftables datapath; `EGRESSGW_REQUIRE_EBPF=1` (CI) turns a
//! missing toolchain into an error.

use std::path::Path;
use std::process::Command;

const PACKAGE: &str = "egressgw-ebpf";

fn main() {
    println!("cargo::rustc-check-cfg=cfg(egressgw_ebpf)");
    println!("cargo::rerun-if-env-changed=AYA_BUILD_SKIP");
    println!("cargo::rerun-if-env-changed=EGRESSGW_REQUIRE_EBPF");
    println!("cargo::rerun-if-changed=../egressgw-common/src");
    let required = std::env::var("EGRESSGW_REQUIRE_EBPF").is_ok_and(|v| v == "1");
    let skip =
        std::env::var("AYA_BUILD_SKIP").is_ok_and(|v| v == "1" || v.eq_ignore_ascii_case("true"));
    if skip {
        assert!(
            !required,
            "EGRESSGW_REQUIRE_EBPF=1 and AYA_BUILD_SKIP=1 contradict each other"
        );
        println!(
            "cargo::warning=AYA_BUILD_SKIP is set: egressgw is built without its eBPF program"
        );
        return;
    }
    if let Some(missing) = missing_toolchain() {
        assert!(
            !required,
            "EGRESSGW_REQUIRE_EBPF=1 but the eBPF toolchain is incomplete: {missing}; run scripts/setup.sh"
        );
        println!(
            "cargo::warning=egressgw is built without its eBPF program: {missing} (scripts/setup.sh installs it; AYA_BUILD_SKIP=1 silences this)"
        );
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../bpf")
        .join(PACKAGE);
    let root = root.to_str().expect("the workspace path is UTF-8");
    if let Err(e) = aya_build::build_ebpf(
        [aya_build::Package {
            name: PACKAGE,
            root_dir: root,
            ..Default::default()
        }],
        aya_build::Toolchain::default(),
    ) {
        panic!("building the eBPF program {PACKAGE} failed: {e:#}");
    }
    println!("cargo::rustc-cfg=egressgw_ebpf");
}

/// What of the eBPF toolchain is missing, if anything.
fn missing_toolchain() -> Option<String> {
    let runs = |cmd: &mut Command| cmd.output().is_ok_and(|o| o.status.success());
    if !runs(Command::new("rustup").args(["run", "nightly", "rustc", "--version"])) {
        return Some("no nightly toolchain (rustup run nightly)".into());
    }
    let src = Command::new("rustup")
        .args(["run", "nightly", "rustc", "--print", "sysroot"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned());
    let has_src = src.is_some_and(|sysroot| {
        Path::new(&sysroot)
            .join("lib/rustlib/src/rust/library/core")
            .is_dir()
    });
    if !has_src {
        return Some("the nightly toolchain has no rust-src".into());
    }
    // bpf-linker loads the nightly's LLVM, which `rustup run` puts on the
    // library path.
    if !runs(Command::new("rustup").args(["run", "nightly", "bpf-linker", "--version"])) {
        return Some("no working bpf-linker on PATH".into());
    }
    None
}
