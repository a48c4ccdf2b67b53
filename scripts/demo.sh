#!/usr/bin/env bash
# The demo: what egressgw would set up on each node of the example cluster.
#
#   scripts/demo.sh [NODE]
#
# Prepares the machine (scripts/setup.sh), plans deploy/examples/cluster.yaml
# (allocations and status for every object, and every node's dataplane), then
# shows the dataplane of NODE alone (default: node-1, a worker whose selected
# pods leave through a gateway node).

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

CLUSTER="deploy/examples/cluster.yaml"
NODE="${1:-node-1}"

header() { printf '\n=== %s\n\n' "$*"; }

bash scripts/setup.sh
if ! command -v cargo >/dev/null; then
    export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
fi

header "Building egressgw"
cargo build --locked -p egressgw

header "The plan for $CLUSTER: allocations, status and every node's dataplane"
cargo run --quiet --locked -p egressgw -- plan -f "$CLUSTER"

header "The dataplane of $NODE alone (what its agent would apply)"
cargo run --quiet --locked -p egressgw -- plan -f "$CLUSTER" --node "$NODE"
