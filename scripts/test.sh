#!/usr/bin/env bash
# The test command: everything CI checks, in order, stopping at the first
# failure and naming the step that failed. The e2e step brings up a lab of
# network namespaces (docs/lab.md) and needs root.
#
#   scripts/test.sh
#
# Runs from any directory; needs no stdin. Set EGRESSGW_SKIP_SETUP=1 to skip
# scripts/setup.sh when the machine is known to be ready.

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-$([[ -t 1 ]] && echo auto || echo never)}"
export RUST_BACKTRACE="${RUST_BACKTRACE:-1}"

STEPS_RUN=0
STARTED=$SECONDS

# step NAME CMD...: runs CMD under a header; on failure, says which step
# failed and stops.
step() {
    local name="$1" start=$SECONDS status=0 command
    shift
    # The command as it would be typed, ready to copy.
    command="$(printf '%q ' "$@")"
    STEPS_RUN=$((STEPS_RUN + 1))
    printf '\n=== %s\n=== $ %s\n' "$name" "${command% }"
    "$@" || status=$?
    if [[ $status -ne 0 ]]; then
        printf '\n*** FAILED: %s (exit status %d)\n*** command: %s\n' "$name" "$status" "${command% }" >&2
        exit "$status"
    fi
    printf '=== ok: %s (%ds)\n' "$name" $((SECONDS - start))
}

if [[ "${EGRESSGW_SKIP_SETUP:-0}" != 1 ]]; then
    step "setup" bash scripts/setup.sh
fi
# setup may just have installed Rust under ~/.cargo/bin.
if ! command -v cargo >/dev/null; then
    export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
fi

step "format" cargo fmt --all -- --check
# The workspace's default members: everything but the eBPF program, which
# builds for bpfel-unknown-none only (egressgw-dataplane's build script
# builds it, and fails here if the eBPF toolchain is missing).
export EGRESSGW_REQUIRE_EBPF=1
step "lints" cargo clippy --all-targets --locked -- -D warnings
step "lints of the eBPF program" rustup run nightly cargo clippy --locked -p egressgw-ebpf \
    --target bpfel-unknown-none -Z build-std=core -- -D warnings
TEST_LOG="$(mktemp)"
trap 'rm -f "$TEST_LOG"' EXIT

# run_tests: cargo test, its output kept to count the results afterwards.
run_tests() {
    cargo test --locked 2>&1 | tee "$TEST_LOG"
}

step "tests" run_tests
# Every parser of outside input, fuzzed for a bounded time (docs/fuzzing.md).
step "fuzz" env EGRESSGW_SKIP_SETUP=1 bash scripts/fuzz.sh
# The end-to-end tests run on the lab (docs/e2e.md): what it needs first
# (packages, the control plane built into the cache), then the binaries the
# lab runs, then the scenarios; their results count with the others.
step "lab dependencies" env EGRESSGW_SKIP_SETUP=1 bash scripts/lab-deps.sh
step "build egressgw and xtask" cargo build --locked -p egressgw -p xtask
# The Containerfile's image, built from Debian packages around this build's
# binary and checked (docs/image.md); the release build is left to releases.
step "image" bash scripts/build-image.sh --binary target/debug/egressgw

# run_selftest: the lab's kubelet stand-in runs Pods as a kubelet does
# (xtask/src/lab/selftest.rs), on a lab of its own, taken down whatever
# the outcome.
run_selftest() {
    local status=0
    export EGRESSGW_LAB_PREFIX=kst
    cargo xtask lab up || status=$?
    if [[ $status -eq 0 ]]; then
        cargo xtask lab selftest || status=$?
    fi
    cargo xtask lab down || true
    unset EGRESSGW_LAB_PREFIX
    return "$status"
}

step "the lab's kubelet stand-in" run_selftest

# run_e2e [ARGS]: a fresh lab, egressgw deployed, every scenario; output
# appended to the same log.
run_e2e() {
    cargo xtask e2e "$@" 2>&1 | tee -a "$TEST_LOG"
}

# The chart's default datapath (auto: eBPF on the lab's nodes) on a
# dual-stack lab, then the nftables one on an IPv4 lab, and its IPv6
# scenarios on a dual-stack one.
step "e2e on a dual-stack lab (eBPF datapath)" run_e2e --ipv6
step "e2e on the lab (nftables datapath)" run_e2e --set feature.datapath=nftables
step "e2e IPv6 scenarios (nftables datapath)" run_e2e --ipv6 --filter ipv6_ --set feature.datapath=nftables
step "generated CRDs are up to date" cargo xtask gen-crds --check
step "the chart's values reference is up to date" cargo xtask chart docs --check
# The bench targets, built as the tests were (cargo's `test` profile, with
# what the tests step compiled): that they build is what is checked here.
# Building them as `cargo bench` does compiles the workspace and its
# dependencies a second time, optimized, for nothing more.
step "benches compile" cargo build --locked --benches

printf '\n=== all %d steps passed (%ds)\n' "$STEPS_RUN" $((SECONDS - STARTED))
# One closing line over every test binary, so the total is not lost among
# the per-binary summaries.
awk '/^test result:/ { p += $4; f += $6; i += $8 } END { printf "tests: %d passed, %d failed, %d skipped\n", p, f, i }' "$TEST_LOG"
