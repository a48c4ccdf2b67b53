#!/usr/bin/env bash
# Builds the egressgw image with neither a container engine nor a registry,
# then checks it:
#
#   scripts/build-image.sh [--refresh-base] [--binary FILE]
#
#   1. the tools: mmdebstrap and umoci, from Debian;
#   2. the facts it builds from, read from the Containerfile (Debian suite,
#      runtime packages, non-root uid, Rust version) and Cargo.toml (version),
#      checked against rust-toolchain.toml and against the Helm chart's default
#      image, which must be the release image's reference;
#   3. the runtime root filesystem: the Containerfile's runtime stage, made
#      from Debian's packages by mmdebstrap (bookworm-slim's package set and
#      its path excludes, plus RUNTIME_PACKAGES and the non-root user); cached
#      by its recipe, about a minute the first time;
#   4. the binary: cargo build --release --locked -p egressgw, or with
#      --binary FILE an egressgw already built (its debug info stripped),
#      for CI to check the image recipe with the binary it has just built
#      in seconds instead of a release build: the archive is then tagged
#      <version>-dev (target/image/egressgw-<version>-dev.oci.tar);
#   5. the image: an OCI layout with two layers (root filesystem, binary) and
#      the Containerfile's config (entrypoint, user, env, OCI labels), written
#      as an OCI archive, target/image/egressgw-<version>.oci.tar, tagged
#      ghcr.io/egressgw/egressgw:<version>;
#   6. the checks, on the archive as written: its config, `egressgw --version`,
#      `nft --version` and `iperf3 --version` run in its root filesystem as its user, and
#      `egressgw apply` / `cleanup` run from it in a network namespace of
#      their own (nft and netlink through the image's userland).
#
# Idempotent: a second run rebuilds only what changed (cargo decides for the
# binary; the root filesystem is reused until its recipe changes or
# --refresh-base asks for Debian's newest packages). Non-interactive; needs
# root (mmdebstrap, chroot, a network namespace) on Debian 12: the binary
# links the host's glibc, which must not be newer than the image's.
# What the tools print goes to ~/.cache/egressgw/logs/build-image.log; the
# screen gets the steps and their times. docs/image.md has the rest.
#
# Environment:
#   EGRESSGW_CACHE   cache directory (default ~/.cache/egressgw); the root
#                    filesystem is kept in its image/ folder

set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

SCRIPT_NAME=build-image
# shellcheck source=scripts/lib.sh
source "$ROOT/scripts/lib.sh"

IMAGE_REPOSITORY=ghcr.io/egressgw/egressgw
APT_PACKAGES=(mmdebstrap umoci debian-archive-keyring binutils)
CACHE_DIR="${EGRESSGW_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/egressgw}/image"
OUT_DIR="$ROOT/target/image"
# The image's environment (the Containerfile's ENV PATH): the agent runs
# `nft` from it.
IMAGE_PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
# What debian:*-slim leaves out (debuerreotype's slimming), so the root
# filesystem matches the Containerfile's base.
SLIM_DPKG_OPTS=(
    --dpkgopt='path-exclude=/usr/share/doc/*'
    --dpkgopt='path-include=/usr/share/doc/*/copyright'
    --dpkgopt='path-exclude=/usr/share/man/*'
    --dpkgopt='path-exclude=/usr/share/info/*'
    --dpkgopt='path-exclude=/usr/share/locale/*'
    --dpkgopt='path-exclude=/usr/share/groff/*'
    --dpkgopt='path-exclude=/usr/share/lintian/*'
    --dpkgopt='path-exclude=/usr/share/linda/*'
)
# Bump when the root filesystem's recipe changes in a way its inputs below
# do not show.
BASE_RECIPE_VERSION=1

REFRESH_BASE=0
# --binary FILE: package FILE instead of building the release binary.
GIVEN_BINARY=""
STARTED=$SECONDS

usage() {
    sed -n '2,/^$/{s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"
}

# step NAME: starts a step; end_step (called by the next step) prints its time.
STEP_NAME=""
STEP_START=0
step() {
    end_step
    STEP_NAME="$1"
    STEP_START=$SECONDS
    log "$1"
}
end_step() {
    if [[ -n "$STEP_NAME" ]]; then
        detail "($(minutes $((SECONDS - STEP_START))))"
    fi
    STEP_NAME=""
}

# containerfile_arg NAME: the default of `ARG NAME=value` in the Containerfile.
containerfile_arg() {
    local value
    value="$(sed -n -E "s/^ARG $1=\"?([^\"]*)\"?\$/\\1/p" Containerfile | head -n 1)"
    [[ -n "$value" ]] || die "Containerfile: no 'ARG $1=...' line"
    printf '%s\n' "$value"
}

# yaml_scalar FILE KEY [PARENT]: the value of a top-level KEY, or of KEY one
# level under the top-level PARENT, without quotes. Enough for the chart's
# Chart.yaml and values.yaml, not a YAML parser.
yaml_scalar() {
    awk -v key="$2" -v parent="${3:-}" '
        /^[^ #]/ { inside = (parent != "" && $1 == parent ":") }
        (parent == "" && $1 == key ":") || (inside && /^  [^ ]/ && $1 == key ":") {
            sub(/^[^:]*:[ \t]*/, ""); sub(/[ \t]+#.*$/, ""); gsub(/^["\047]|["\047]$/, "")
            print; exit
        }' "$1"
}

step_tools() {
    step "Tools: ${APT_PACKAGES[*]}"
    [[ $EUID -eq 0 ]] || die "run this as root: mmdebstrap, chroot and the checks' network namespace need it"
    command -v dpkg-query >/dev/null ||
        die "not a Debian-like system: build with 'podman build -f Containerfile .' instead (docs/image.md)"
    need_apt_packages "${APT_PACKAGES[@]}"
    if ! command -v cargo >/dev/null; then
        export PATH="${CARGO_HOME:-$HOME/.cargo}/bin:$PATH"
    fi
    [[ -n "$GIVEN_BINARY" ]] || command -v cargo >/dev/null || die "no cargo: run scripts/setup.sh first"
    detail "ok: mmdebstrap $(mmdebstrap --version | awk '{print $2}'), $(umoci --version)"
}

step_facts() {
    step "What to build (Containerfile, Cargo.toml, the chart)"
    SUITE="$(containerfile_arg DEBIAN_SUITE)"
    RUNTIME_PACKAGES="$(containerfile_arg RUNTIME_PACKAGES)"
    NONROOT_UID="$(containerfile_arg NONROOT_UID)"
    local rust toolchain
    rust="$(containerfile_arg RUST_VERSION)"
    toolchain="$(sed -n -E 's/^channel *= *"([^"]*)".*/\1/p' rust-toolchain.toml)"
    [[ "$rust" == "$toolchain" ]] ||
        die "Containerfile builds with Rust $rust, rust-toolchain.toml pins $toolchain: make them agree"
    VERSION="$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' Cargo.toml)"
    [[ -n "$VERSION" ]] || die "Cargo.toml: no version in [workspace.package]"
    RELEASE_REFERENCE="$IMAGE_REPOSITORY:$VERSION"
    REFERENCE="$RELEASE_REFERENCE${GIVEN_BINARY:+-dev}"
    ARCHIVE="$OUT_DIR/egressgw-$VERSION${GIVEN_BINARY:+-dev}.oci.tar"
    REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
    # The image's dates are the commit's, so the same commit and root
    # filesystem give the same archive.
    CREATED_EPOCH="$(git log -1 --format=%ct 2>/dev/null || date +%s)"
    CREATED="$(date -u -d "@$CREATED_EPOCH" +%Y-%m-%dT%H:%M:%SZ)"
    detail "image $REFERENCE (revision ${REVISION:0:12}, Debian $SUITE + $RUNTIME_PACKAGES, user $NONROOT_UID, Rust $rust)"
    check_chart
}

# The chart's default image must be the release image's reference.
check_chart() {
    local chart=deploy/helm/egressgw repository tag app_version
    if [[ ! -f "$chart/Chart.yaml" || ! -f "$chart/values.yaml" ]]; then
        detail "no chart at $chart: its default image is not checked"
        return 0
    fi
    repository="$(yaml_scalar "$chart/values.yaml" repository image)"
    tag="$(yaml_scalar "$chart/values.yaml" tag image)"
    app_version="$(yaml_scalar "$chart/Chart.yaml" appVersion)"
    [[ "$repository:${tag:-$app_version}" == "$RELEASE_REFERENCE" ]] ||
        die "the chart's default image is $repository:${tag:-$app_version} (image.repository, image.tag or appVersion), this script's is $RELEASE_REFERENCE"
    detail "ok: the chart's default image is $RELEASE_REFERENCE"
}

# The root filesystem's recipe: everything that decides its content, except
# the day's package versions.
base_recipe() {
    printf '%s\n' "recipe $BASE_RECIPE_VERSION" "suite $SUITE" "packages $RUNTIME_PACKAGES" \
        "uid $NONROOT_UID" "arch $(dpkg --print-architecture)" "${SLIM_DPKG_OPTS[@]}"
}

step_base() {
    local key
    key="$(base_recipe | sha256sum | cut -c1-16)"
    BASE_TAR="$CACHE_DIR/rootfs-$key.tar"
    step "Root filesystem: Debian $SUITE minbase (slim) + $RUNTIME_PACKAGES"
    if [[ -f "$BASE_TAR" && $REFRESH_BASE -eq 0 ]]; then
        BASE_EPOCH="$(cat "$BASE_TAR.epoch")"
        detail "cached: $BASE_TAR, packages of $(date -u -d "@$BASE_EPOCH" +%F) (--refresh-base for today's)"
        return 0
    fi
    detail "mmdebstrap from Debian's mirrors, about a minute"
    mkdir -p "$CACHE_DIR"
    BASE_EPOCH="$(date +%s)"
    quietly "mmdebstrap" build_base "$BASE_TAR.partial"
    printf '%s\n' "$BASE_EPOCH" >"$BASE_TAR.epoch"
    mv "$BASE_TAR.partial" "$BASE_TAR"
    # Only the current recipe's root filesystem is kept.
    find "$CACHE_DIR" -maxdepth 1 -name 'rootfs-*.tar*' ! -name "rootfs-$key.tar*" -delete
    detail "ok: $BASE_TAR ($(du -h "$BASE_TAR" | cut -f1))"
}

# build_base OUT: the runtime stage of the Containerfile, as a tar without
# device nodes (the runtime provides /dev) or the build host's resolv.conf
# and hostname (the runtime provides those too).
build_base() {
    local packages="${RUNTIME_PACKAGES// /,}" mirrors
    mirrors="deb http://deb.debian.org/debian $SUITE main
deb http://deb.debian.org/debian $SUITE-updates main
deb http://deb.debian.org/debian-security $SUITE-security main"
    # shellcheck disable=SC2016 # the hooks' $1 is mmdebstrap's, not ours
    SOURCE_DATE_EPOCH="$BASE_EPOCH" mmdebstrap --mode=root --variant=minbase \
        --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
        --include="$packages" "${SLIM_DPKG_OPTS[@]}" \
        --customize-hook='rm -f "$1/etc/resolv.conf" "$1/etc/hostname"' \
        --customize-hook="chroot \"\$1\" groupadd --system --gid $NONROOT_UID nonroot" \
        --customize-hook="chroot \"\$1\" useradd --system --uid $NONROOT_UID --gid $NONROOT_UID --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin nonroot" \
        --format=tar "$SUITE" - "$mirrors" |
        mmtarfilter --path-exclude='/dev/*' >"$1"
}

step_binary() {
    if [[ -n "$GIVEN_BINARY" ]]; then
        step "egressgw binary: $GIVEN_BINARY, debug info stripped"
        [[ -x "$GIVEN_BINARY" ]] || die "--binary $GIVEN_BINARY: no such executable"
        BINARY="$WORK/egressgw"
        BINARY_ORIGIN="${GIVEN_BINARY#"$ROOT"/}, debug info stripped"
        objcopy --strip-debug "$GIVEN_BINARY" "$BINARY"
        detail "ok: $("$BINARY" --version), $(du -h "$BINARY" | cut -f1)"
        return 0
    fi
    step "egressgw binary: cargo build --release --locked -p egressgw"
    detail "~10 minutes on 2 cores from an empty target directory, ~3 when only egressgw changed"
    cargo_build "cargo build" --release --locked -p egressgw
    BINARY="${CARGO_TARGET_DIR:-$ROOT/target}/release/egressgw"
    BINARY_ORIGIN="cargo build --release --locked -p egressgw"
    [[ -x "$BINARY" ]] || die "cargo built no $BINARY"
    detail "ok: $("$BINARY" --version), $(du -h "$BINARY" | cut -f1)"
}

# reproducible_tar DIR OUT PATH...: a tar of PATH... under DIR whose bytes
# depend only on the files' content, modes and the image's date.
reproducible_tar() {
    local dir="$1" out="$2"
    shift 2
    tar --create --file "$out" --directory "$dir" --sort=name --format=posix \
        --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
        --mtime="@$CREATED_EPOCH" --clamp-mtime --owner=0 --group=0 --numeric-owner "$@"
}

# The image's labels (the Containerfile's LABEL, less base.name: this image
# is not built on a registry's image), also set as manifest annotations.
image_labels() {
    printf '%s\n' \
        "org.opencontainers.image.title=egressgw" \
        "org.opencontainers.image.description=Egress gateway for Kubernetes: agent and controller" \
        "org.opencontainers.image.source=https://github.com/egressgw/egressgw" \
        "org.opencontainers.image.url=https://github.com/egressgw/egressgw" \
        "org.opencontainers.image.licenses=Apache-2.0" \
        "org.opencontainers.image.version=$VERSION" \
        "org.opencontainers.image.revision=$REVISION" \
        "org.opencontainers.image.created=$CREATED"
}

step_image() {
    step "OCI archive: $REFERENCE"
    local layout="$WORK/layout" stage="$WORK/stage" image label config_args=()
    image="$layout:$REFERENCE"
    install -D -m 0755 "$BINARY" "$stage/usr/local/bin/egressgw"
    chmod 0755 "$stage/usr" "$stage/usr/local" "$stage/usr/local/bin"
    reproducible_tar "$stage" "$WORK/binary.tar" ./usr
    quietly "umoci init" umoci init --layout "$layout"
    quietly "umoci new" umoci new --image "$image"
    quietly "umoci add root filesystem" umoci raw add-layer --image "$image" \
        --history.created "$(date -u -d "@$BASE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)" \
        --history.created_by "mmdebstrap --variant=minbase --include=${RUNTIME_PACKAGES// /,} $SUITE (slim), user nonroot ($NONROOT_UID)" \
        "$BASE_TAR"
    quietly "umoci add binary" umoci raw add-layer --image "$image" \
        --history.created "$CREATED" \
        --history.created_by "$BINARY_ORIGIN: /usr/local/bin/egressgw" \
        "$WORK/binary.tar"
    while IFS= read -r label; do
        config_args+=(--config.label "$label" --manifest.annotation "$label")
    done < <(image_labels)
    quietly "umoci config" umoci config --image "$image" --no-history \
        --created "$CREATED" \
        --config.entrypoint /usr/local/bin/egressgw --config.cmd=--help \
        --config.user "$NONROOT_UID:$NONROOT_UID" --config.env "PATH=$IMAGE_PATH" \
        --config.workingdir / "${config_args[@]}"
    quietly "umoci gc" umoci gc --layout "$layout"
    mkdir -p "$OUT_DIR"
    reproducible_tar "$layout" "$ARCHIVE.partial" oci-layout index.json blobs
    mv "$ARCHIVE.partial" "$ARCHIVE"
    MANIFEST_DIGEST="$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["manifests"][0]["digest"])' "$layout/index.json")"
    detail "ok: $ARCHIVE ($(du -h "$ARCHIVE" | cut -f1), manifest $MANIFEST_DIGEST)"
}

step_check() {
    step "Checks on the archive"
    local check="$WORK/check" bundle="$WORK/bundle" rootfs
    mkdir -p "$check"
    tar --extract --file "$ARCHIVE" --directory "$check"
    quietly "umoci unpack" umoci unpack --image "$check:$REFERENCE" "$bundle"
    rootfs="$bundle/rootfs"
    check_config "$check" "$bundle/config.json"
    check_runs "$rootfs"
    check_dataplane "$rootfs"
}

# check_config LAYOUT RUNTIME_SPEC: the archive names one image, REFERENCE,
# whose config is the Containerfile's.
check_config() {
    python3 - "$1" "$2" "$REFERENCE" "$NONROOT_UID" "$IMAGE_PATH" "$VERSION" <<'EOF'
import json, os, sys

layout, spec_path, reference, uid, path, version = sys.argv[1:]
problems = []

def blob(digest):
    algorithm, hexdigest = digest.split(":")
    with open(os.path.join(layout, "blobs", algorithm, hexdigest)) as f:
        return json.load(f)

index = json.load(open(os.path.join(layout, "index.json")))
names = [m.get("annotations", {}).get("org.opencontainers.image.ref.name") for m in index["manifests"]]
if names != [reference]:
    problems.append(f"index names {names}, expected [{reference!r}]")
manifest = blob(index["manifests"][0]["digest"])
image = blob(manifest["config"]["digest"])
config = image["config"]
expect = {
    "Entrypoint": ["/usr/local/bin/egressgw"],
    "Cmd": ["--help"],
    "User": f"{uid}:{uid}",
    "Env": [f"PATH={path}"],
    "WorkingDir": "/",
}
for key, value in expect.items():
    if config.get(key) != value:
        problems.append(f"config {key} is {config.get(key)!r}, expected {value!r}")
labels = config.get("Labels", {})
for key, value in {
    "org.opencontainers.image.version": version,
    "org.opencontainers.image.licenses": "Apache-2.0",
    "org.opencontainers.image.source": "https://github.com/egressgw/egressgw",
}.items():
    if labels.get(key) != value:
        problems.append(f"label {key} is {labels.get(key)!r}, expected {value!r}")
if len(manifest["layers"]) != 2:
    problems.append(f"{len(manifest['layers'])} layers, expected 2 (root filesystem, binary)")
# What a runtime makes of it (umoci unpack's runtime spec): the user resolves.
spec = json.load(open(spec_path))
user = spec["process"]["user"]
if (user.get("uid"), user.get("gid")) != (int(uid), int(uid)):
    problems.append(f"runtime user is {user}, expected uid and gid {uid}")
for problem in problems:
    print(f"    FAIL: {problem}")
if problems:
    sys.exit(1)
print(f"    ok: one image, {reference}; {image['architecture']}/{image['os']}, "
      f"{len(manifest['layers'])} layers; entrypoint {config['Entrypoint'][0]}, "
      f"user {config['User']}, labels version {version}, Apache-2.0")
EOF
}

# in_image ROOTFS USER CMD...: runs CMD in the image's root filesystem as USER
# (uid:gid) with the image's environment only.
in_image() {
    local rootfs="$1" user="$2"
    shift 2
    env -i PATH="$IMAGE_PATH" chroot --userspec="$user" "$rootfs" "$@"
}

check_runs() {
    local rootfs="$1" version nft iperf3
    version="$(in_image "$rootfs" "$NONROOT_UID:$NONROOT_UID" egressgw --version)" ||
        die "egressgw --version failed in the image"
    [[ "$version" == "egressgw $VERSION" ]] || die "egressgw --version says '$version', expected 'egressgw $VERSION'"
    nft="$(in_image "$rootfs" "$NONROOT_UID:$NONROOT_UID" nft --version)" || die "nft --version failed in the image"
    iperf3="$(in_image "$rootfs" "$NONROOT_UID:$NONROOT_UID" iperf3 --version | head -n 1)" ||
        die "iperf3 --version failed in the image (egressgw bench's Pods run it)"
    grep -q "^nonroot:x:$NONROOT_UID:$NONROOT_UID:" "$rootfs/etc/passwd" ||
        die "no user nonroot ($NONROOT_UID) in the image's /etc/passwd"
    [[ -z "$(find "$rootfs/dev" -mindepth 1 -print -quit 2>/dev/null)" ]] ||
        die "the image has files in /dev: the runtime provides /dev"
    detail "ok: as $NONROOT_UID: '$version', '$nft', '$iperf3'"
}

# check_dataplane ROOTFS: the agent's dataplane works from the image's
# userland: `egressgw apply` for node-2 of deploy/examples/cluster.yaml, in a
# network namespace of its own whose underlay (a veth pair) holds node-2's
# InternalIP and the segment of its EIP, applies every operation with no
# warning (the EIP announced from a packet socket); a second apply changes
# nothing; cleanup leaves no nftables table.
check_dataplane() {
    local rootfs="$1" out
    cp deploy/examples/cluster.yaml "$rootfs/tmp/cluster.yaml"
    out="$WORK/dataplane.out"
    # shellcheck disable=SC2016 # the script runs in the new namespaces
    if ! unshare --net --mount --fork bash -euo pipefail -c '
        rootfs="$1" IMAGE_PATH="$2"
        ip link set lo up
        ip link add eth0 type veth peer name underlay
        ip addr add 172.18.0.12/24 dev eth0
        ip addr add 198.51.100.2/24 dev eth0
        ip link set eth0 up
        ip link set underlay up
        mount -t proc proc "$rootfs/proc"
        run() { env -i PATH="$IMAGE_PATH" NO_COLOR=1 chroot "$rootfs" "$@"; }
        echo "### apply"; run egressgw apply -f /tmp/cluster.yaml --node node-2 -o json
        echo "### table"; run nft list table inet egressgw >/dev/null && echo present
        echo "### again"; run egressgw apply -f /tmp/cluster.yaml --node node-2 -o json
        echo "### cleanup"; run egressgw cleanup
        echo "### tables"; run nft list tables
    ' check "$rootfs" "$IMAGE_PATH" >"$out" 2>&1; then
        sed 's/^/    | /' "$out" >&2
        die "egressgw apply/cleanup from the image failed in a network namespace"
    fi
    cat "$out" >>"$LOG"
    python3 - "$out" <<'EOF'
import json, sys

sections, name = {}, None
for line in open(sys.argv[1]):
    if line.startswith("### "):
        name = line[4:].strip()
        sections[name] = []
    elif name:
        sections[name].append(line.rstrip("\n"))
def report(section):
    return [json.loads(l) for l in sections.get(section, []) if l.startswith("{")]

problems = []
first = report("apply")
if not first or not first[0].get("applied") or first[0].get("failed") or first[0].get("warnings"):
    problems.append(f"the first apply did not apply everything cleanly: {sections.get('apply')}")
if sections.get("table") != ["present"]:
    problems.append("no table inet egressgw after apply")
again = report("again")
if not again or again[0].get("applied") or again[0].get("failed"):
    problems.append(f"the second apply was not empty: {sections.get('again')}")
if any(l.strip() for l in sections.get("tables", [])):
    problems.append(f"tables left after cleanup: {sections['tables']}")
for problem in problems:
    print(f"    FAIL: {problem}")
sys.exit(1 if problems else 0)
EOF
    detail "ok: apply from the image built egressgw's table with the image's nft; a second apply changed nothing; cleanup left no table"
}

main() {
    while [[ $# -gt 0 ]]; do
        case "$1" in
            --refresh-base) REFRESH_BASE=1 ;;
            --binary)
                [[ $# -ge 2 ]] || die "--binary needs a file"
                GIVEN_BINARY="$(realpath "$2")"
                shift
                ;;
            -h | --help) usage; exit 0 ;;
            *) die "unknown argument '$1' (see --help)" ;;
        esac
        shift
    done
    mkdir -p "$OUT_DIR"
    start_log
    log "Building the egressgw image (the tools' output: $LOG)"
    step_tools
    mkdir -p "$CACHE_DIR"
    exec 9>"$CACHE_DIR/.lock"
    if ! flock --nonblock 9; then
        detail "waiting for another build-image run to finish"
        flock 9
    fi
    step_facts
    WORK="$(mktemp -d "$OUT_DIR/.work.XXXXXX")"
    trap 'rm -rf "$WORK"' EXIT
    step_base
    step_binary
    step_image
    step_check
    end_step
    log "image $REFERENCE ready in $(minutes $((SECONDS - STARTED))): $ARCHIVE"
    detail "load it: skopeo copy oci-archive:$ARCHIVE docker://REGISTRY/egressgw:${REFERENCE##*:} (docs/image.md)"
}

main "$@"
