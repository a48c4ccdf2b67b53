//! Builds the control plane (`xtask/controlplane`, a Go module) and Helm
//! into the cache.
//!
//! The control-plane binaries live in `<cache>/controlplane/<key>/bin/`, where
//! the key hashes the module's files, the package list and the build flags:
//! a second run finds them and builds nothing, and a change to go.mod,
//! go.sum, the packages or the flags builds anew. Helm, pinned to
//! [`HELM_VERSION`], lives in `<cache>/helm/<key>/bin/helm`, keyed by its
//! version and flags. A build goes to a temporary directory that is renamed
//! into place only when it succeeded, so a half-built directory is never
//! taken for a cached one.

use std::fs::{self, File};
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};

use super::cmd;
use super::state::Paths;

/// The Kubernetes release the module pins (k8s.io/kubernetes in go.mod).
pub const KUBERNETES_VERSION: &str = "v1.34.4";
/// The Helm release the lab builds (Helm 4; charts of `apiVersion: v2`).
pub const HELM_VERSION: &str = "v4.3.1";
/// Helm's command, built with `go install <package>@<version>`.
const HELM_PACKAGE: &str = "helm.sh/helm/v4/cmd/helm";
/// Where Helm's release version is set at link time (its Makefile's `-X`).
const HELM_VERSION_VAR: &str = "helm.sh/helm/v4/internal/version";
/// The oldest Go that builds k8s.io/kubernetes v1.34 (its go.mod says 1.24).
const MIN_GO_MINOR: u32 = 24;
/// How often a running build reports progress.
const TICK: Duration = Duration::from_secs(15);

/// What `go build` builds: (binary name, package).
const PACKAGES: [(&str, &str); 5] = [
    ("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver"),
    (
        "kube-controller-manager",
        "k8s.io/kubernetes/cmd/kube-controller-manager",
    ),
    ("kube-scheduler", "k8s.io/kubernetes/cmd/kube-scheduler"),
    ("kubectl", "k8s.io/kubernetes/cmd/kubectl"),
    ("etcd", "./etcd"),
];
/// The module's files that go into the cache key.
const MODULE_FILES: [&str; 3] = ["go.mod", "go.sum", "etcd/main.go"];

/// The built control-plane binaries, and Helm.
#[derive(Debug, Clone)]
pub struct Binaries {
    /// kube-apiserver, kube-controller-manager, kube-scheduler, kubectl, etcd.
    pub dir: PathBuf,
    /// The `helm` binary ([`HELM_VERSION`]).
    pub helm: PathBuf,
}

impl Binaries {
    pub fn etcd(&self) -> PathBuf {
        self.dir.join("etcd")
    }
    pub fn apiserver(&self) -> PathBuf {
        self.dir.join("kube-apiserver")
    }
    pub fn controller_manager(&self) -> PathBuf {
        self.dir.join("kube-controller-manager")
    }
    pub fn scheduler(&self) -> PathBuf {
        self.dir.join("kube-scheduler")
    }
    pub fn kubectl(&self) -> PathBuf {
        self.dir.join("kubectl")
    }
}

/// The Go module's directory, beside this crate's sources.
pub fn module_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("controlplane")
}

/// The binaries from the cache, built first if they are not there.
pub fn ensure(paths: &Paths) -> anyhow::Result<Binaries> {
    let dir = ensure_control_plane(paths)?;
    let helm = ensure_helm(paths)?;
    Ok(Binaries { dir, helm })
}

/// The control plane's binary directory, built first if needed.
fn ensure_control_plane(paths: &Paths) -> anyhow::Result<PathBuf> {
    let module = module_dir();
    let root = paths.cache.join("controlplane").join(cache_key(&module)?);
    let dir = root.join("bin");
    if PACKAGES.iter().all(|(name, _)| dir.join(name).is_file()) {
        println!(
            "control plane {KUBERNETES_VERSION}: cached in {}",
            dir.display()
        );
        return Ok(dir);
    }
    let go = find_go()?;
    let names: Vec<&str> = PACKAGES.iter().map(|(name, _)| *name).collect();
    println!(
        "building the control plane {KUBERNETES_VERSION} ({}) into {}; a cold build compiles \
         about 2 800 Go packages and takes 10 to 25 minutes on 2 cores (less when Go's build \
         cache is warm)",
        names.join(", "),
        dir.display()
    );
    let started = Instant::now();
    let build = GoBuild {
        dir: &module,
        command: "build",
        ldflags: &ldflags(),
        packages: PACKAGES.iter().map(|(_, pkg)| (*pkg).to_owned()).collect(),
        keep_goflags: true,
    };
    build
        .run(&go, &root)
        .context("building the control plane")?;
    println!("built the control plane in {}", elapsed(started));
    remove_other_builds(&root, paths);
    Ok(dir)
}

/// `helm`, built first if needed: `go install` of the pinned release, with
/// its version set as Helm's own release build sets it.
fn ensure_helm(paths: &Paths) -> anyhow::Result<PathBuf> {
    let mut hash = Fnv1a::default();
    for part in [HELM_PACKAGE, HELM_VERSION, &helm_ldflags()] {
        hash.write(part.as_bytes());
    }
    let root = paths
        .cache
        .join("helm")
        .join(format!("{HELM_VERSION}-{:016x}", hash.0));
    let helm = root.join("bin").join("helm");
    if helm.is_file() {
        println!("helm {HELM_VERSION}: cached in {}", helm.display());
        return Ok(helm);
    }
    let go = find_go()?;
    println!(
        "building helm {HELM_VERSION} into {}; a cold build takes about 4 minutes on 2 cores",
        helm.display()
    );
    let started = Instant::now();
    fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let build = GoBuild {
        dir: &root,
        command: "install",
        ldflags: &helm_ldflags(),
        packages: vec![format!("{HELM_PACKAGE}@{HELM_VERSION}")],
        keep_goflags: false,
    };
    build.run(&go, &root).context("building helm")?;
    println!("built helm in {}", elapsed(started));
    remove_other_builds(&root, paths);
    Ok(helm)
}

/// Removes the builds of other keys (older versions): each holds ~300 MB,
/// and Go's own build cache makes a rebuild of one a re-link. A build that
/// a lab still uses (its `lab.json` names it, or one of its binaries runs)
/// is kept.
fn remove_other_builds(keep: &Path, paths: &Paths) {
    let Some(Ok(entries)) = keep.parent().map(fs::read_dir) else {
        return;
    };
    for dir in entries.filter_map(Result::ok).map(|e| e.path()) {
        if dir == keep || !dir.join("bin").is_dir() {
            continue;
        }
        if in_use(&dir, paths) {
            println!("kept the older build in {} (a lab uses it)", dir.display());
        } else if fs::remove_dir_all(&dir).is_ok() {
            println!("removed the older build in {}", dir.display());
        }
    }
}

/// Whether a lab's `lab.json` in the cache names `dir`, or a running
/// process's program lies in it.
fn in_use(dir: &Path, paths: &Paths) -> bool {
    let text = dir.display().to_string();
    let named = fs::read_dir(&paths.cache)
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("lab"))
        .filter_map(|e| fs::read_to_string(e.path().join("lab.json")).ok())
        .any(|json| json.contains(&text));
    let running = fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .filter_map(Result::ok)
        .filter_map(|e| fs::read_link(e.path().join("exe")).ok())
        .any(|exe| exe.starts_with(dir));
    named || running
}

/// Hash (64-bit FNV-1a, hex) of the module files, the packages and the build flags.
fn cache_key(module: &Path) -> anyhow::Result<String> {
    let mut hash = Fnv1a::default();
    for file in MODULE_FILES {
        let path = module.join(file);
        let bytes = fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        hash.write(file.as_bytes());
        hash.write(&bytes);
    }
    for (_, package) in PACKAGES {
        hash.write(package.as_bytes());
    }
    hash.write(ldflags().as_bytes());
    Ok(format!("{:016x}", hash.0))
}

/// 64-bit FNV-1a: stable across Rust versions, unlike `DefaultHasher`.
#[derive(Debug)]
pub struct Fnv1a(u64);

impl Default for Fnv1a {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv1a {
    pub fn finish(&self) -> u64 {
        self.0
    }

    pub fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = (self.0 ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

/// `-X` makes `/version` report the real release instead of v0.0.0; `-s -w`
/// leave out the symbol table and DWARF (a third of the size; stack traces
/// still name functions).
fn ldflags() -> String {
    let (major, minor) = major_minor(KUBERNETES_VERSION);
    let var = "k8s.io/component-base/version";
    format!(
        "-s -w -X {var}.gitVersion={KUBERNETES_VERSION} -X {var}.gitMajor={major} -X {var}.gitMinor={minor}"
    )
}

/// Helm's release flags (its Makefile): `helm version` then says
/// [`HELM_VERSION`] rather than the source's "v4.3".
fn helm_ldflags() -> String {
    format!(
        "-s -w -X {HELM_VERSION_VAR}.version={HELM_VERSION} -X {HELM_VERSION_VAR}.gitTreeState=clean"
    )
}

fn major_minor(version: &str) -> (&str, &str) {
    let mut parts = version.trim_start_matches('v').split('.');
    (parts.next().unwrap_or("0"), parts.next().unwrap_or("0"))
}

/// `go` from PATH, else the usual tarball location; fails if it is too old.
fn find_go() -> anyhow::Result<PathBuf> {
    let go = if cmd::on_path("go") {
        PathBuf::from("go")
    } else {
        PathBuf::from("/usr/local/go/bin/go")
    };
    let version = cmd::run(&go, &["env", "GOVERSION"]).with_context(|| {
        format!("Go 1.{MIN_GO_MINOR} or newer is needed to build the control plane; none found (scripts/lab-deps.sh checks)")
    })?;
    let minor = version
        .trim()
        .strip_prefix("go1.")
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|m| m.parse::<u32>().ok());
    ensure!(
        minor.is_some_and(|m| m >= MIN_GO_MINOR),
        "{} is too old: the control plane needs Go 1.{MIN_GO_MINOR} or newer",
        version.trim()
    );
    Ok(go)
}

/// One `go build` or `go install` into a cache directory.
struct GoBuild<'a> {
    /// Where go runs (the module, for `build`).
    dir: &'a Path,
    /// `build` or `install`.
    command: &'a str,
    ldflags: &'a str,
    packages: Vec<String>,
    /// Whether the caller's `GOFLAGS` apply (not to `go install pkg@version`,
    /// which builds outside any module).
    keep_goflags: bool,
}

impl GoBuild<'_> {
    /// Builds into `<root>/bin.partial`, then renames it to `<root>/bin`;
    /// go's output goes to `<root>/build.log`.
    fn run(&self, go: &Path, root: &Path) -> anyhow::Result<()> {
        let partial = root.join("bin.partial");
        let _ = fs::remove_dir_all(&partial);
        fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;
        let log = root.join("build.log");
        self.spawn_and_follow(go, &partial, &log)?;
        let bin = root.join("bin");
        let _ = fs::remove_dir_all(&bin);
        fs::rename(&partial, &bin)
            .with_context(|| format!("moving the binaries to {}", bin.display()))
    }

    /// Runs go with `-v`; its output (package names, then errors) goes to `log`.
    fn spawn_and_follow(&self, go: &Path, out: &Path, log: &Path) -> anyhow::Result<()> {
        let mut command = Command::new(go);
        command
            .current_dir(self.dir)
            .env("GOFLAGS", goflags(self.keep_goflags));
        command.args([self.command, "-v", "-p", "2", "-ldflags", self.ldflags]);
        if self.command == "install" {
            command.env("GOBIN", out).env("CGO_ENABLED", "0");
        } else {
            let mut out_dir = out.as_os_str().to_owned();
            out_dir.push("/");
            command.arg("-o").arg(out_dir);
        }
        let mut child = command
            .args(&self.packages)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {} {}", go.display(), self.command))?;
        let stderr = child.stderr.take().context("taking go's stderr")?;
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            let lines = BufReader::new(stderr).lines().map_while(Result::ok);
            lines.for_each(|line| drop(tx.send(line)));
        });
        follow(&rx, log)?;
        let status = child.wait().context("waiting for go")?;
        if !status.success() {
            let tail = super::process::log_tail(log, 30);
            bail!(
                "go {} failed ({status}); the end of {}:\n{tail}",
                self.command,
                log.display()
            );
        }
        Ok(())
    }
}

/// `-trimpath` (no local paths in the binaries), after the caller's
/// `GOFLAGS` if `keep` says so.
fn goflags(keep: bool) -> String {
    let mut flags = if keep {
        std::env::var("GOFLAGS").unwrap_or_default()
    } else {
        String::new()
    };
    flags.push_str(" -trimpath");
    flags.trim_start().to_owned()
}

/// Copies the build's output to `log` and prints a progress line every [`TICK`].
fn follow(lines: &mpsc::Receiver<String>, log: &Path) -> anyhow::Result<()> {
    let mut file = File::create(log).with_context(|| format!("creating {}", log.display()))?;
    let started = Instant::now();
    let mut next_tick = started + TICK;
    let (mut count, mut last) = (0usize, String::new());
    loop {
        match lines.recv_timeout(Duration::from_millis(500)) {
            Ok(line) => {
                writeln!(file, "{line}").with_context(|| format!("writing {}", log.display()))?;
                count += 1;
                last = line;
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {}
            Err(mpsc::RecvTimeoutError::Disconnected) => return Ok(()),
        }
        if Instant::now() >= next_tick {
            println!(
                "  ... {} elapsed, {count} packages built, last: {last}",
                elapsed(started)
            );
            next_tick += TICK;
        }
    }
}

fn elapsed(since: Instant) -> String {
    let secs = since.elapsed().as_secs();
    format!("{}m{:02}s", secs / 60, secs % 60)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ldflags_set_the_release_in_component_base() {
        assert_eq!(
            ldflags(),
            "-s -w -X k8s.io/component-base/version.gitVersion=v1.34.4 \
             -X k8s.io/component-base/version.gitMajor=1 \
             -X k8s.io/component-base/version.gitMinor=34"
        );
    }

    #[test]
    fn helm_reports_the_pinned_release() {
        assert_eq!(
            helm_ldflags(),
            "-s -w -X helm.sh/helm/v4/internal/version.version=v4.3.1 \
             -X helm.sh/helm/v4/internal/version.gitTreeState=clean"
        );
    }

    #[test]
    fn fnv1a_matches_the_published_test_vector() {
        let mut h = Fnv1a::default();
        h.write(b"a");
        assert_eq!(h.0, 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn the_go_module_pins_the_release_this_file_names() {
        let go_mod = fs::read_to_string(module_dir().join("go.mod")).unwrap();
        assert!(go_mod.contains(&format!("k8s.io/kubernetes {KUBERNETES_VERSION}")));
    }
}
