//! Builds the control plane (`xtask/controlplane`, a Go module) into the cache.
//!
//! The binaries live in `<cache>/controlplane/<key>/bin/`, where the key
//! hashes the module's files and the build flags: a second run finds them and
//! builds nothing, and a change to go.mod, go.sum or the flags builds anew.
//! A build goes to a temporary directory that is renamed into place only when
//! it succeeded, so a half-built directory is never taken for a cached one.

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
/// The oldest Go that builds k8s.io/kubernetes v1.34 (its go.mod says 1.24).
const MIN_GO_MINOR: u32 = 24;
/// How often a running build reports progress.
const TICK: Duration = Duration::from_secs(15);

/// What `go build` builds: (binary name, package).
const PACKAGES: [(&str, &str); 4] = [
    ("kube-apiserver", "k8s.io/kubernetes/cmd/kube-apiserver"),
    (
        "kube-controller-manager",
        "k8s.io/kubernetes/cmd/kube-controller-manager",
    ),
    ("kubectl", "k8s.io/kubernetes/cmd/kubectl"),
    ("etcd", "./etcd"),
];
/// The module's files that go into the cache key.
const MODULE_FILES: [&str; 3] = ["go.mod", "go.sum", "etcd/main.go"];

/// The built control-plane binaries.
#[derive(Debug, Clone)]
pub struct Binaries {
    pub dir: PathBuf,
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
    pub fn kubectl(&self) -> PathBuf {
        self.dir.join("kubectl")
    }

    fn complete(&self) -> bool {
        PACKAGES
            .iter()
            .all(|(name, _)| self.dir.join(name).is_file())
    }
}

/// The Go module's directory, beside this crate's sources.
pub fn module_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("controlplane")
}

/// The binaries from the cache, built first if they are not there.
pub fn ensure(paths: &Paths) -> anyhow::Result<Binaries> {
    let module = module_dir();
    let root = paths.cache.join("controlplane").join(cache_key(&module)?);
    let bins = Binaries {
        dir: root.join("bin"),
    };
    if bins.complete() {
        println!(
            "control plane {KUBERNETES_VERSION}: cached in {}",
            bins.dir.display()
        );
        return Ok(bins);
    }
    let go = find_go()?;
    println!(
        "building the control plane {KUBERNETES_VERSION} (kube-apiserver, kube-controller-manager, \
         kubectl, etcd) into {}; a cold build takes 4 to 8 minutes",
        bins.dir.display()
    );
    let started = Instant::now();
    build(&go, &module, &root).context("building the control plane")?;
    println!("built the control plane in {}", elapsed(started));
    remove_other_builds(&root);
    Ok(bins)
}

/// Removes the builds of other keys (older versions of the module): each
/// holds ~300 MB, and Go's own build cache makes a rebuild of one a re-link.
fn remove_other_builds(keep: &Path) {
    let Some(Ok(entries)) = keep.parent().map(fs::read_dir) else {
        return;
    };
    for dir in entries.filter_map(Result::ok).map(|e| e.path()) {
        if dir != keep && dir.join("bin").is_dir() && fs::remove_dir_all(&dir).is_ok() {
            println!("removed the older build in {}", dir.display());
        }
    }
}

/// Hash (64-bit FNV-1a, hex) of the module files and the build flags.
fn cache_key(module: &Path) -> anyhow::Result<String> {
    let mut hash = Fnv1a::default();
    for file in MODULE_FILES {
        let path = module.join(file);
        let bytes = fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        hash.write(file.as_bytes());
        hash.write(&bytes);
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

/// `go build` into `<root>/bin.partial`, then renamed to `<root>/bin`.
fn build(go: &Path, module: &Path, root: &Path) -> anyhow::Result<()> {
    let partial = root.join("bin.partial");
    let _ = fs::remove_dir_all(&partial);
    fs::create_dir_all(&partial).with_context(|| format!("creating {}", partial.display()))?;
    let log = root.join("build.log");
    run_go_build(go, module, &partial, &log)?;
    let bin = root.join("bin");
    let _ = fs::remove_dir_all(&bin);
    fs::rename(&partial, &bin).with_context(|| format!("moving the binaries to {}", bin.display()))
}

/// Runs `go build -v`; its output (package names, then errors) goes to `log`.
fn run_go_build(go: &Path, module: &Path, out: &Path, log: &Path) -> anyhow::Result<()> {
    let mut out_dir = out.as_os_str().to_owned();
    out_dir.push("/");
    let mut child = Command::new(go)
        .current_dir(module)
        .env("GOFLAGS", goflags())
        .args(["build", "-v", "-p", "2", "-ldflags", &ldflags(), "-o"])
        .arg(out_dir)
        .args(PACKAGES.map(|(_, pkg)| pkg))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {} build", go.display()))?;
    let stderr = child.stderr.take().context("taking go build's stderr")?;
    let (tx, rx) = mpsc::channel();
    thread::spawn(move || {
        let lines = BufReader::new(stderr).lines().map_while(Result::ok);
        lines.for_each(|line| drop(tx.send(line)));
    });
    follow(&rx, log)?;
    let status = child.wait().context("waiting for go build")?;
    if !status.success() {
        let tail = super::process::log_tail(log, 30);
        bail!(
            "go build failed ({status}); the end of {}:\n{tail}",
            log.display()
        );
    }
    Ok(())
}

/// The caller's `GOFLAGS` plus `-trimpath` (no local paths in the binaries).
fn goflags() -> String {
    let mut flags = std::env::var("GOFLAGS").unwrap_or_default();
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
