#!/usr/bin/env bash
# Prepares this machine for the lab (`cargo xtask lab`, docs/lab.md):
#
#   1. the Rust toolchain, through scripts/setup.sh (skip with EGRESSGW_SKIP_SETUP=1);
#   2. the Debian packages the lab runs: iproute2 (ip, ss), iptables, nftables,
#      procps (sysctl, kill), openssl, iperf3;
#   3. a check that Go 1.24 or newer is installed (on PATH or /usr/local/go/bin);
#   4. xtask, the lab tool (`cargo build -p xtask`, a minute or two the first
#      time), then the control plane (kube-apiserver, kube-controller-manager,
#      kubectl, etcd) built from xtask/controlplane into the cache: about 15 to
#      20 minutes on 2 cores the first time; Helm, built from Go sources the
#      same way, takes about 4 more.
#
# Idempotent: every step checks first, and the control-plane build is cached
# by the hash of its Go module, so a second run takes a few seconds. What
# apt-get and cargo print goes to ~/.cache/egressgw/logs/lab-deps.log; the
# screen shows the steps with a progress line every 15 s, and the end of the
# log when one fails. The Go builds keep their own logs and say where.
# Runs as root, or as a user with password-less sudo for the packages (the
# lab itself needs root). Asks nothing.
#
# Environment:
#   EGRESSGW_CACHE       cache directory (default ~/.cache/egressgw)
#   EGRESSGW_SKIP_SETUP  set to 1 to skip scripts/setup.sh

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

APT_PACKAGES=(iproute2 iptables nftables procps openssl iperf3)
MIN_GO_MINOR=24

SCRIPT_NAME=lab-deps
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

step_setup() {
    if [[ "${EGRESSGW_SKIP_SETUP:-0}" == 1 ]]; then
        return 0
    fi
    bash scripts/setup.sh
    if ! command -v cargo >/dev/null; then
        export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
    fi
}

step_apt() {
    log "Debian packages for the lab"
    command -v dpkg-query >/dev/null ||
        die "not a Debian-like system: install ${APT_PACKAGES[*]} (or equivalents) by hand"
    need_apt_packages "${APT_PACKAGES[@]}"
    detail "ok: ${APT_PACKAGES[*]}"
}

step_go() {
    log "Go (1.$MIN_GO_MINOR or newer, to build the control plane)"
    if ! command -v go >/dev/null && [[ -x /usr/local/go/bin/go ]]; then
        export PATH="/usr/local/go/bin:$PATH"
    fi
    command -v go >/dev/null ||
        die "Go is not installed: install Go 1.$MIN_GO_MINOR or newer (e.g. in /usr/local/go)"
    local version minor
    version="$(go env GOVERSION)"
    minor="$(sed -E 's/^go1\.([0-9]+).*/\1/' <<<"$version")"
    [[ "$minor" =~ ^[0-9]+$ && "$minor" -ge $MIN_GO_MINOR ]] ||
        die "$version is too old: the control plane needs Go 1.$MIN_GO_MINOR or newer"
    detail "ok: $version"
}

step_controlplane() {
    # Built here, with its progress shown: `cargo xtask` compiles quietly.
    log "xtask, the lab tool"
    cargo_build "building xtask" --locked -p xtask
    detail "ok"
    log "Control plane and Helm from Go sources (cached; the first time ~15-20 min and ~4 min on 2 cores)"
    cargo xtask lab build
}

main() {
    start_log
    step_setup
    step_apt
    step_go
    step_controlplane
    log 'lab dependencies ready: run "cargo xtask lab up" as root'
}

main "$@"
