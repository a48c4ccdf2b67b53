#!/usr/bin/env bash
# The demo: egressgw on the lab, a Kubernetes cluster in network namespaces
# on this machine (docs/lab.md), with real traffic.
#
#   scripts/demo.sh
#
# Prepares the machine (scripts/lab-deps.sh, which runs scripts/setup.sh),
# builds egressgw, brings up a fresh lab (removing a leftover one), deploys
# the controller and an agent per node, applies deploy/examples/lab/, and
# shows what the target sees from the pods: web-3, on a node with no way out
# of its own, leaves with the EIP through a gateway node; batch-1 leaves the
# normal way, from its node's address. Then it takes the gateway node down
# and measures how long web-3's traffic takes to come back with the same
# EIP through the other gateway node, and ends with a short bench of the
# path (docs/bench.md). The lab stays up at the end.
#
# Each step of that story is checked: when one does not happen (no EIP, a
# pod seen from the wrong address, no failover), the demo says what it
# expected and what it saw, and exits non-zero.
#
# The first run on a fresh 2-core machine takes about 25 minutes, most of it
# building the control plane and Helm from Go sources into the cache; later
# runs take a minute or two. What apt-get and cargo print goes to logs under
# ~/.cache/egressgw/logs/.
#
# Needs root (network namespaces). EGRESSGW_LAB_PREFIX picks another lab
# than the default `egl` (e.g. to leave someone's lab alone).

set -Eeuo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PREFIX="${EGRESSGW_LAB_PREFIX:-egl}"
CACHE="${EGRESSGW_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/egressgw}"
if [[ -n "${EGRESSGW_LAB_DIR:-}" ]]; then
    LAB_DIR="$EGRESSGW_LAB_DIR"
elif [[ "$PREFIX" == egl ]]; then
    LAB_DIR="$CACHE/lab"
else
    LAB_DIR="$CACHE/lab-$PREFIX"
fi
KUBECTL="$LAB_DIR/kubectl"
# The lab commands as a person types them for this lab.
XTASK="cargo xtask"
if [[ "$PREFIX" != egl ]]; then
    XTASK="EGRESSGW_LAB_PREFIX=$PREFIX cargo xtask"
fi
TARGET=198.51.100.1
WHOAMI_PORT=8080

SCRIPT_NAME=demo
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

# fail WHAT: the story did not happen. Says so, where to look, and exits 1.
fail() {
    printf '\ndemo: FAILED: %s\n' "$*" >&2
    if [[ -d "$LAB_DIR" ]]; then
        printf 'demo: the lab stays up to look at: %s lab status; the logs are in %s/logs/\n' \
            "$XTASK" "$LAB_DIR" >&2
    fi
    exit 1
}
# Any other command that fails ends the demo the same way, naming it (once:
# a failure inside $(...) is reported by the command around it).
trap 'status=$?; ((BASH_SUBSHELL)) || fail "\`$BASH_COMMAND\` exited with status $status"' ERR

header() { printf '\n=== %s\n\n' "$*"; }
run() {
    printf '$ %s\n' "$*"
    "$@" || fail "\`$*\` exited with status $?"
}

# whoami POD: what the target saw from POD (one connection, bounded).
whoami() {
    ip netns exec "$PREFIX-pod-$1" timeout "${2:-2}" \
        bash -c "exec 3<>/dev/tcp/$TARGET/$WHOAMI_PORT && cat <&3" 2>/dev/null || echo "no answer"
}

# jsonpath KIND NAME PATH: a field of a team-a object.
field() {
    "$KUBECTL" get "$1" -n team-a "$2" -o "jsonpath={$3}" 2>/dev/null || true
}

# now: seconds since the epoch, with milliseconds.
now() { date +%s.%3N; }

wait_for_eip() {
    local deadline=$((SECONDS + 60)) eip ready
    printf 'waiting for team-a/web to get its EIP'
    while ((SECONDS < deadline)); do
        eip="$(field egresspolicy web .status.eip.ipv4)"
        ready="$(field egresspolicy web '.status.conditions[?(@.type=="Ready")].status')"
        if [[ -n "$eip" && "$ready" == True ]]; then
            printf ' %s\n' "$eip"
            EIP="$eip"
            return 0
        fi
        printf '.'
        sleep 1
    done
    printf '\n'
    "$KUBECTL" get egresspolicy -n team-a web -o yaml >&2 || true
    fail "team-a/web has no EIP after 60 s (its object is above)"
}

# show_source POD LABEL ADDRESS WHY: prints what the target sees from POD;
# fails unless it is ADDRESS.
show_source() {
    local seen
    seen="$(whoami "$1")"
    printf '%-62s %s\n' "$1 ($2):" "$seen"
    [[ "$seen" == "$3" ]] || fail "the target saw '$seen' from $1, expected $3 ($4)"
}

# wait_for_node_change OLD: prints the gateway node team-a/web's status
# names once it is not OLD; false after 30 s.
wait_for_node_change() {
    local deadline=$((SECONDS + 30)) node
    while ((SECONDS < deadline)); do
        node="$(field egresspolicy web .status.node)"
        if [[ -n "$node" && "$node" != "$1" ]]; then
            printf '%s' "$node"
            return 0
        fi
        sleep 0.5
    done
    return 1
}

# wait_for_source POD ADDRESS LIMIT: probes every 100 ms until the target
# sees ADDRESS from POD; prints the time it took.
wait_for_source() {
    local pod="$1" want="$2" limit="$3" start seen
    start="$(now)"
    while true; do
        seen="$(whoami "$pod" 0.3)"
        if [[ "$seen" == "$want" ]]; then
            awk -v a="$start" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }'
            return 0
        fi
        if awk -v a="$start" -v b="$(now)" -v l="$limit" 'BEGIN { exit !(b - a > l) }'; then
            echo "demo: $pod still sees '$seen' after ${limit}s, not $want" >&2
            return 1
        fi
        sleep 0.1
    done
}

start_log
header "Preparing the machine (scripts/lab-deps.sh; ~25 min the first time on 2 cores, seconds afterwards)"
bash scripts/lab-deps.sh
if ! command -v cargo >/dev/null; then
    export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
fi

header "Building egressgw and the lab tool"
cargo_build "building egressgw and xtask" --locked -p egressgw -p xtask
echo "built egressgw and xtask"

header "A fresh lab ($PREFIX)"
run cargo xtask lab down
run cargo xtask lab up

header "egressgw: a controller in the control plane, an agent on every node"
run cargo xtask lab deploy

header "The lab's examples (deploy/examples/lab/)"
run "$KUBECTL" apply -f deploy/examples/lab/
wait_for_eip
run "$KUBECTL" get egressgateways,egresspolicies,egressclusterpolicies,egresstunnels -A -o wide

header "Traffic: what the target ($TARGET) sees"
NODE="$(field egresspolicy web .status.node)"
[[ -n "$NODE" ]] || fail "team-a/web has an EIP but its status names no gateway node"
# node-1's own address on the external segment: where batch-1 leaves from.
NODE1_ADDRESS="$(ip -n "$PREFIX-node-1" -4 -o addr show dev eth1 | awk '{ split($4, a, "/"); print a[1]; exit }')"
[[ -n "$NODE1_ADDRESS" ]] || fail "node-1 has no IPv4 address on its external link eth1"
show_source web-3 "team-a, app=web, on node-3, which has no route out" "$EIP" \
    "team-a/web's EIP, through gateway node $NODE"
show_source web-1 "team-a, app=web, on gateway node-1" "$EIP" \
    "team-a/web's EIP, through gateway node $NODE"
show_source batch-1 "team-b, no policy to the target, on node-1" "$NODE1_ADDRESS" \
    "node-1's own address: no policy covers the target"
printf '\nteam-a/web leaves with %s through %s; batch-1 from its node address.\n' "$EIP" "$NODE"

header "Failover: $NODE goes down"
run cargo xtask lab node down "$NODE"
took="$(wait_for_source web-3 "$EIP" 60)" ||
    fail "no failover: web-3's traffic did not come back with EIP $EIP within 60 s of $NODE going down"
NEW_NODE="$(wait_for_node_change "$NODE")" ||
    fail "web-3's traffic is back, but team-a/web's status does not name another gateway node than $NODE after 30 s"
printf 'failover: EIP %s moved %s -> %s, traffic back after %s s\n' "$EIP" "$NODE" "$NEW_NODE" "$took"
run cargo xtask lab node up "$NODE"
run "$KUBECTL" get egresspolicies -A -o wide
wait_for_source web-3 "$EIP" 30 >/dev/null ||
    fail "web-3's traffic lost EIP $EIP after $NODE came back"
show_source web-3 "after $NODE came back" "$EIP" "team-a/web keeps its EIP"

header "Bench: what the path costs (iperf3, 3 s per case)"
# The three cases of docs/bench.md, once each, from node-3 through a gateway
# of the bench's own; `cargo xtask bench --repeat 5 --reverse --offload both`
# gives the full table.
run cargo xtask bench --duration 3 --repeat 1

header "The lab stays up"
cat <<EOF
Look around:
  $KUBECTL get egressgw -A -o wide
  $KUBECTL describe egresspolicy -n team-a web
  ip netns exec $PREFIX-pod-web-3 bash -c 'exec 3<>/dev/tcp/$TARGET/$WHOAMI_PORT; cat <&3'
  ip netns exec $PREFIX-node-1 nft list table inet egressgw
  ip -n $PREFIX-node-2 -br addr show dev egress.eip
  less $LAB_DIR/logs/egressgw-agent-node-3.log
  $XTASK lab status
Change it:
  $XTASK lab agent kill node-3; $XTASK lab agent start node-3
  $XTASK lab node down node-2; $XTASK lab node up node-2
  $XTASK lab pod add web-4 --node node-3 --namespace team-a --labels app=web
Remove it:
  $XTASK lab down
EOF
