#!/usr/bin/env bash
# Runs every fuzz target of fuzz/ for a bounded time each (docs/fuzzing.md).
#
#   scripts/fuzz.sh [TARGET...]
#
# The targets are built under ~/.cache/egressgw/fuzz/target/. Each target
# starts from the seeds in fuzz/seeds/<target>/, the example
# objects (for `objects`), the inputs kept in fuzz/regressions/<target>/,
# and what earlier runs on this machine found (the corpus in
# ~/.cache/egressgw/fuzz/corpus/<target>/), so runs add up. An input that
# crashes a target, or runs it past its time or memory limit, fails the
# run: it is saved under ~/.cache/egressgw/fuzz/artifacts/<target>/, and
# the message says how to keep it as a regression input.
#
# Environment:
#   EGRESSGW_FUZZ_SECONDS  time per target (default 20)
#   EGRESSGW_SKIP_SETUP=1  skip scripts/setup.sh (cargo-fuzz, the nightly)

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CACHE_DIR="${EGRESSGW_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/egressgw}"
SECONDS_EACH="${EGRESSGW_FUZZ_SECONDS:-20}"
TOOLCHAIN=nightly

if [[ "${EGRESSGW_SKIP_SETUP:-0}" != 1 ]]; then
    bash "$ROOT/scripts/setup.sh"
fi
if ! command -v cargo >/dev/null; then
    export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
fi

cd "$ROOT/fuzz"
# The targets need no eBPF program: the dataplane's build script skips it
# (even where the test command asks every other build to carry it).
export AYA_BUILD_SKIP=1
unset EGRESSGW_REQUIRE_EBPF
# Rust code is memory-safe without a sanitizer; what is looked for is a
# panic, an endless loop or a runaway allocation.
FUZZ=(cargo "+$TOOLCHAIN" fuzz)
# Built in the cache, so that the next run on this machine (another clone
# included) only builds what changed.
BUILD=(--sanitizer none --debug-assertions --target-dir "$CACHE_DIR/fuzz/target")
"${FUZZ[@]}" build "${BUILD[@]}" >/dev/null

if [[ $# -gt 0 ]]; then
    targets=("$@")
else
    mapfile -t targets < <("${FUZZ[@]}" list)
fi

failed=()
for target in "${targets[@]}"; do
    corpus="$CACHE_DIR/fuzz/corpus/$target"
    artifacts="$CACHE_DIR/fuzz/artifacts/$target"
    mkdir -p "$corpus" "$artifacts"
    seeds=("$ROOT/fuzz/seeds/$target" "$ROOT/fuzz/regressions/$target")
    if [[ "$target" == objects ]]; then
        seeds+=("$ROOT/deploy/examples" "$ROOT/deploy/examples/lab")
    fi
    existing=()
    for dir in "${seeds[@]}"; do
        [[ -d "$dir" ]] && existing+=("$dir")
    done
    printf '=== fuzz %s for %ss\n' "$target" "$SECONDS_EACH"
    # The corpus first: libFuzzer writes what it finds to the first
    # directory and only reads the others.
    log="$artifacts/last-run.log"
    status=0
    "${FUZZ[@]}" run "${BUILD[@]}" "$target" "$corpus" "${existing[@]}" -- \
        -max_total_time="$SECONDS_EACH" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
        -print_final_stats=1 -artifact_prefix="$artifacts/" >"$log" 2>&1 || status=$?
    grep -E '(DONE|stat::number_of_executed_units|panicked|Test unit written|deadly signal|timeout|out-of-memory|ERROR)' "$log" || true
    if [[ $status -ne 0 ]]; then
        failed+=("$target")
        tail -n 30 "$log"
        printf '*** fuzz %s failed (exit status %d); the input is in %s/\n' "$target" "$status" "$artifacts"
        printf '*** keep it: cp %s/<file> %s/fuzz/regressions/%s/ and fix what it shows\n' \
            "$artifacts" "$ROOT" "$target"
    fi
done

if [[ ${#failed[@]} -gt 0 ]]; then
    printf '\n*** fuzz targets failed: %s\n' "${failed[*]}" >&2
    exit 1
fi
printf '\n=== fuzz: %d target(s), %ss each, nothing found\n' "${#targets[@]}" "$SECONDS_EACH"
