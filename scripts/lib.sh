# Helpers shared by the set-up scripts; source it, do not run it.
# shellcheck shell=bash

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
        apt_get update
        APT_UPDATED=1
    fi
    apt_get install -y --no-install-recommends "${missing[@]}"
}
