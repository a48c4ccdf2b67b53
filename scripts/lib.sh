# Helpers shared by the set-up scripts; source it, do not run it.
# shellcheck shell=bash
#
# The screen tells the story (one line per step, a progress line while a slow
# one runs); what the tools print (apt-get, rustup, cargo) goes to the
# script's log, $LOG, and only its end is shown when a step fails.

# The script's log: ~/.cache/egressgw/logs/SCRIPT_NAME.log unless the script
# sets LOG itself.
LOG="${EGRESSGW_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/egressgw}/logs/${SCRIPT_NAME:-${0##*/}}.log"
# How often a slow step reports that it is still running.
PROGRESS_EVERY=15

log() { printf '==> %s\n' "$*"; }
detail() { printf '    %s\n' "$*"; }
die() {
    printf '%s: error: %s\n' "${SCRIPT_NAME:-${0##*/}}" "$*" >&2
    exit 1
}

# as_root CMD...: runs CMD as root, through sudo when needed.
as_root() {
    if [[ $EUID -eq 0 ]]; then
        "$@"
    elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
        sudo -n "$@"
    else
        die "'$*' needs root: run this as root, or with sudo that needs no password"
    fi
}

apt_installed() {
    [[ "$(dpkg-query -W -f='${db:Status-Status}' "$1" 2>/dev/null)" == installed ]]
}

APT_UPDATED=0

# apt_get ARGS...: apt-get as root, never asking anything, waiting for a fresh
# machine's background apt runs instead of failing on their lock.
apt_get() {
    as_root env DEBIAN_FRONTEND=noninteractive \
        apt-get -q -o DPkg::Lock::Timeout=300 "$@" </dev/null
}

# need_apt_packages PKG...: installs the packages not installed yet; runs
# `apt-get update` at most once per run, and only if something is missing.
need_apt_packages() {
    local missing=() pkg
    for pkg in "$@"; do
        apt_installed "$pkg" || missing+=("$pkg")
    done
    if [[ ${#missing[@]} -eq 0 ]]; then
        return 0
    fi
    command -v apt-get >/dev/null ||
        die "missing packages ${missing[*]}, and this is not a Debian-like system; install them by hand"
    detail "installing ${missing[*]}"
    if [[ $APT_UPDATED -eq 0 ]]; then
        quietly "apt-get update" apt_get update
        APT_UPDATED=1
    fi
    quietly "installing ${missing[*]}" apt_get install -y --no-install-recommends "${missing[@]}"
}

# start_log: empties $LOG for this run.
start_log() {
    mkdir -p "$(dirname "$LOG")"
    printf '%s: %s\n' "${SCRIPT_NAME:-${0##*/}}" "$(date -u '+%F %T UTC')" >"$LOG"
}

# quietly WHAT CMD...: runs CMD with its output appended to $LOG. Every
# $PROGRESS_EVERY seconds it says that WHAT is still running, how long it
# has taken and where it is (for cargo: how many of its build steps are
# done). On failure it shows the end of the log, says where the whole log
# is, and stops the script.
quietly() {
    local what="$1" start=$SECONDS pid status=0 from
    shift
    mkdir -p "$(dirname "$LOG")"
    printf '\n### %s\n### $ %s\n' "$what" "$*" >>"$LOG"
    from=$(($(wc -l <"$LOG") + 1))
    "$@" >>"$LOG" 2>&1 </dev/null &
    pid=$!
    while ! wait_or_timeout "$pid" "$PROGRESS_EVERY"; do
        detail "... $what: $(minutes $((SECONDS - start)))$(progress_of_log)"
    done
    wait "$pid" || status=$?
    if [[ $status -ne 0 ]]; then
        printf '    %s failed (exit status %d) after %s; the end of its log:\n' \
            "$what" "$status" "$(minutes $((SECONDS - start)))" >&2
        tail -n "+$from" "$LOG" | tr '\r' '\n' | grep -v '^ *Building \[' | tail -n 25 |
            sed 's/^/    | /' >&2 || true
        die "$what failed; the whole log is $LOG"
    fi
}

# wait_or_timeout PID SECONDS: true once PID has ended, false after SECONDS.
wait_or_timeout() {
    local i
    for ((i = 0; i < $2 * 5; i++)); do
        kill -0 "$1" 2>/dev/null || return 0
        sleep 0.2
    done
    ! kill -0 "$1" 2>/dev/null
}

# minutes SECONDS: e.g. 2m05s.
minutes() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

# progress_of_log: where the command writing $LOG is, from its last line:
# ", 120 of 254 build steps done" from cargo's progress bar, else the line
# itself.
progress_of_log() {
    local last
    last="$(tail -c 2000 "$LOG" | tr '\r' '\n' | grep -v '^[[:space:]]*$' | tail -n 1)" || true
    if [[ "$last" =~ Building\ \[[^]]*\]\ ([0-9]+)/([0-9]+) ]]; then
        printf ', %s of %s build steps done' "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}"
    elif [[ "$last" == *"Blocking waiting for file lock"* ]]; then
        printf ', waiting for another cargo to finish with the build directory'
    elif [[ -n "$last" ]]; then
        last="${last#"${last%%[![:space:]]*}"}"
        printf ', last: %s' "${last:0:70}"
    fi
}

# cargo_build WHAT ARGS...: `cargo build ARGS`, quietly, with cargo's
# progress bar in the log so that the progress line can count its steps.
cargo_build() {
    local what="$1"
    shift
    quietly "$what" env CARGO_TERM_PROGRESS_WHEN=always CARGO_TERM_PROGRESS_WIDTH=100 \
        cargo build "$@"
}
