#!/usr/bin/env bash
# Prepares this machine to build and test egressgw.
#
# Idempotent and quick when there is nothing to do: every step first checks
# whether its work is done (by looking at the real state, or, for slow steps
# whose result is hard to inspect, at a marker file) and skips it if so.
# Non-interactive: safe with no stdin, as in CI. Works as root on a fresh
# Debian 12; as another user it uses sudo for system packages. What apt-get
# and rustup print goes to ~/.cache/egressgw/logs/setup.log; the screen shows
# the steps, and the end of that log when one fails.
#
# Environment:
#   EGRESSGW_CACHE  cache and marker directory (default ~/.cache/egressgw)
#
# Adding a step: write a `step_<name>` function that checks whether its work
# is done and returns early if so, then call it from `main` below. Use
# `need_apt_packages` for Debian packages, and `marker_ok`/`marker_set` with a
# key that names the version (e.g. "bpf-linker 0.13 llvm-22") for steps whose
# result cannot be checked cheaply, so a version bump reruns them.

set -euo pipefail

CACHE_DIR="${EGRESSGW_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/egressgw}"
MARKER_DIR="$CACHE_DIR/markers"
CARGO_BIN="${CARGO_HOME:-$HOME/.cargo}/bin"
ORIGINAL_PATH="$PATH"

# The pinned toolchain (rust-toolchain.toml) and the components the test
# command uses.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RUST_TOOLCHAIN="$(sed -n 's/^channel *= *"\(.*\)"/\1/p' "$ROOT/rust-toolchain.toml")"
[[ -n "$RUST_TOOLCHAIN" ]] || { echo "setup: error: no channel in rust-toolchain.toml" >&2; exit 1; }
RUST_COMPONENTS=(rustfmt clippy)
# Debian packages needed right now: a C toolchain for rustc to link with
# (and make, for the allocator the binary builds in: tikv-jemalloc-sys), and
# what it takes to download rustup.
APT_PACKAGES=(ca-certificates curl gcc libc6-dev make)
# What the privileged dataplane tests (crates/egressgw/tests/dataplane.rs)
# run: ip, bridge and ss (iproute2), nft (nftables), iptables-nft and
# iptables-legacy (both in Debian 12's iptables), ethtool, iperf3, sysctl
# (procps), conntrack (what a failed scenario shows of a node's connections).
TEST_APT_PACKAGES=(iproute2 nftables iptables ethtool iperf3 procps conntrack)

# The eBPF datapath (bpf/egressgw-ebpf) builds with a nightly toolchain that
# has rust-src (for -Z build-std=core) and bpf-linker, which links against
# that nightly's own LLVM: Debian ships no LLVM new enough. The build
# (aya-build, crates/egressgw-dataplane/build.rs) uses the `nightly` toolchain.
EBPF_TOOLCHAIN=nightly
EBPF_LLVM_MAJOR=22
BPF_LINKER_VERSION=0.13.0

# The fuzz targets (fuzz/, run by scripts/fuzz.sh) build with the same
# nightly, cargo-fuzz and libFuzzer, whose C++ sources need g++.
CARGO_FUZZ_VERSION=0.13.2
FUZZ_APT_PACKAGES=(g++)

SCRIPT_NAME=setup
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

# marker_ok NAME KEY: true if step NAME last completed with this KEY.
marker_ok() {
    [[ -f "$MARKER_DIR/$1" && "$(cat "$MARKER_DIR/$1")" == "$2" ]]
}

# marker_set NAME KEY: records that step NAME completed with KEY.
marker_set() {
    mkdir -p "$MARKER_DIR"
    printf '%s\n' "$2" >"$MARKER_DIR/$1"
}

step_apt() {
    log "Debian packages"
    if ! command -v dpkg-query >/dev/null; then
        detail "not a Debian-like system: skipped (needs ${APT_PACKAGES[*]} ${TEST_APT_PACKAGES[*]} or equivalents)"
        return 0
    fi
    need_apt_packages "${APT_PACKAGES[@]}" "${TEST_APT_PACKAGES[@]}" "${FUZZ_APT_PACKAGES[@]}"
    detail "ok: ${APT_PACKAGES[*]} ${TEST_APT_PACKAGES[*]} ${FUZZ_APT_PACKAGES[*]}"
}

rustup_target() {
    case "$(uname -m)" in
        x86_64) echo x86_64-unknown-linux-gnu ;;
        aarch64 | arm64) echo aarch64-unknown-linux-gnu ;;
        *) die "no rustup build known for $(uname -m); install Rust by hand" ;;
    esac
}

# Downloads rustup-init, checks it against its published SHA-256, and installs
# rustup with the pinned toolchain. Runs in a subshell so the download
# directory goes away however it ends.
install_rustup() (
    target="$(rustup_target)"
    url="https://static.rust-lang.org/rustup/dist/$target/rustup-init"
    tmp="$(mktemp -d)"
    trap 'rm -rf "$tmp"' EXIT
    detail "downloading rustup-init for $target"
    curl --proto '=https' --tlsv1.2 -fsSL --retry 3 -o "$tmp/rustup-init" "$url"
    expected="$(curl --proto '=https' --tlsv1.2 -fsSL --retry 3 "$url.sha256" | cut -d' ' -f1)"
    actual="$(sha256sum "$tmp/rustup-init" | cut -d' ' -f1)"
    [[ -n "$expected" && "$expected" == "$actual" ]] ||
        die "rustup-init does not match its published checksum ($actual, expected $expected)"
    chmod +x "$tmp/rustup-init"
    detail "installing rustup and Rust $RUST_TOOLCHAIN"
    quietly "rustup-init" "$tmp/rustup-init" -y --no-modify-path --profile minimal \
        --default-toolchain "$RUST_TOOLCHAIN"
)

step_rust() {
    log "Rust toolchain ($RUST_TOOLCHAIN, with ${RUST_COMPONENTS[*]})"
    if ! command -v cargo >/dev/null && [[ -x "$CARGO_BIN/cargo" ]]; then
        export PATH="$CARGO_BIN:$PATH"
    fi
    if ! command -v cargo >/dev/null; then
        install_rustup
        export PATH="$CARGO_BIN:$PATH"
    fi
    if ! command -v rustup >/dev/null; then
        # A Rust installed without rustup (e.g. from a distribution): it must
        # already have what the test command uses.
        if ! cargo fmt --version >/dev/null 2>&1 || ! cargo clippy --version >/dev/null 2>&1; then
            die "cargo has no rustfmt or clippy, and rustup is missing; install Rust with rustup"
        fi
        detail "ok: $(rustc --version) (without rustup)"
        return 0
    fi
    if ! grep "^$RUST_TOOLCHAIN-" <<<"$(rustup toolchain list)" >/dev/null; then
        detail "installing the $RUST_TOOLCHAIN toolchain"
        quietly "rustup toolchain install" rustup toolchain install "$RUST_TOOLCHAIN" --profile minimal
    fi
    if ! rustup default >/dev/null 2>&1; then
        detail "making $RUST_TOOLCHAIN the default toolchain"
        quietly "rustup default" rustup default "$RUST_TOOLCHAIN"
    fi
    local installed missing=() component
    installed="$(rustup component list --installed --toolchain "$RUST_TOOLCHAIN")"
    for component in "${RUST_COMPONENTS[@]}"; do
        grep "^$component-" <<<"$installed" >/dev/null || missing+=("$component")
    done
    if [[ ${#missing[@]} -gt 0 ]]; then
        detail "adding ${missing[*]}"
        quietly "rustup component add" rustup component add --toolchain "$RUST_TOOLCHAIN" "${missing[@]}"
    fi
    detail "ok: $(rustc --version)"
}

# The nightly's LLVM shared library (libLLVM.so.<major>...), or nothing.
nightly_libllvm() {
    local sysroot
    sysroot="$(rustc "+$EBPF_TOOLCHAIN" --print sysroot 2>/dev/null)" || return 0
    find "$sysroot/lib" -maxdepth 1 -name "libLLVM.so.$EBPF_LLVM_MAJOR.*" -print -quit
}

step_ebpf_toolchain() {
    log "eBPF toolchain ($EBPF_TOOLCHAIN with rust-src, bpf-linker $BPF_LINKER_VERSION)"
    command -v rustup >/dev/null || die "the eBPF build needs rustup (for the $EBPF_TOOLCHAIN toolchain)"
    if ! rustc "+$EBPF_TOOLCHAIN" --version >/dev/null 2>&1; then
        detail "installing the $EBPF_TOOLCHAIN toolchain"
        quietly "rustup toolchain install" rustup toolchain install "$EBPF_TOOLCHAIN" --profile minimal
    fi
    if ! grep '^rust-src' <<<"$(rustup component list --installed --toolchain "$EBPF_TOOLCHAIN")" >/dev/null; then
        detail "adding rust-src to $EBPF_TOOLCHAIN"
        quietly "rustup component add rust-src" rustup component add --toolchain "$EBPF_TOOLCHAIN" rust-src
    fi
    local libllvm key
    libllvm="$(nightly_libllvm)"
    [[ -n "$libllvm" ]] ||
        die "$EBPF_TOOLCHAIN ($(rustc "+$EBPF_TOOLCHAIN" --version)) ships no LLVM $EBPF_LLVM_MAJOR library for bpf-linker; install a nightly with LLVM $EBPF_LLVM_MAJOR as \`nightly\` (rustup toolchain install nightly-YYYY-MM-DD, rustup toolchain link)"
    key="bpf-linker $BPF_LINKER_VERSION ${libllvm##*/}"
    if marker_ok bpf-linker "$key" && [[ -x "$CARGO_BIN/bpf-linker" ]]; then
        detail "ok: bpf-linker $BPF_LINKER_VERSION (LLVM of ${libllvm##*/})"
        return 0
    fi
    # bpf-linker finds LLVM under LLVM_PREFIX/lib64: point that at the
    # nightly's library.
    local prefix="$CACHE_DIR/bpf-linker-llvm"
    mkdir -p "$prefix/lib64"
    ln -sfn "$libllvm" "$prefix/lib64/libLLVM.so"
    detail "building bpf-linker $BPF_LINKER_VERSION against ${libllvm##*/} (about 2 minutes)"
    quietly "cargo install bpf-linker" env LLVM_PREFIX="$prefix" \
        cargo "+$EBPF_TOOLCHAIN" install bpf-linker --version "$BPF_LINKER_VERSION" --locked \
        --no-default-features --features "llvm-$EBPF_LLVM_MAJOR"
    marker_set bpf-linker "$key"
    detail "ok: bpf-linker $BPF_LINKER_VERSION"
}

step_cargo_fuzz() {
    log "cargo-fuzz $CARGO_FUZZ_VERSION"
    local key="cargo-fuzz $CARGO_FUZZ_VERSION"
    if marker_ok cargo-fuzz "$key" && [[ -x "$CARGO_BIN/cargo-fuzz" ]]; then
        detail "ok: cargo-fuzz $CARGO_FUZZ_VERSION"
        return 0
    fi
    detail "building cargo-fuzz $CARGO_FUZZ_VERSION (about a minute)"
    quietly "cargo install cargo-fuzz" \
        cargo install cargo-fuzz --version "$CARGO_FUZZ_VERSION" --locked
    marker_set cargo-fuzz "$key"
    detail "ok: cargo-fuzz $CARGO_FUZZ_VERSION"
}

main() {
    mkdir -p "$CACHE_DIR"
    start_log
    step_apt
    step_rust
    step_ebpf_toolchain
    step_cargo_fuzz
    if ! (PATH="$ORIGINAL_PATH" && command -v cargo >/dev/null); then
        detail "note: add $CARGO_BIN to your PATH (the other scripts do this themselves)"
    fi
    log "setup done"
}

main "$@"
