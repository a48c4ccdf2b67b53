//! Where the lab keeps its files, and `lab.json`, the machine-readable
//! description of a running lab.

use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde::{Deserialize, Serialize};

use super::topology::{Prefix, Topology};

/// Bumped when the shape of `lab.json` changes incompatibly.
pub const LAB_JSON_VERSION: u32 = 1;

/// Which lab, and its directories.
#[derive(Debug, Clone)]
pub struct Paths {
    /// The lab's name (`$EGRESSGW_LAB_PREFIX`, default `egl`).
    pub prefix: Prefix,
    /// egressgw's cache: `$EGRESSGW_CACHE`, else `$XDG_CACHE_HOME/egressgw`, else `~/.cache/egressgw`.
    pub cache: PathBuf,
    /// The lab's state: `$EGRESSGW_LAB_DIR`, else `<cache>/lab` for the
    /// default prefix and `<cache>/lab-<prefix>` for any other.
    pub lab: PathBuf,
}

/// Entries of the lab directory that `lab up` creates and `lab down` removes.
const LAB_ENTRIES: [&str; 10] = [
    "lab.json",
    "images.json",
    "kubelet",
    "egressgw",
    "kubeconfig",
    "kubectl",
    "pki",
    "etcd",
    "logs",
    "run",
];

impl Paths {
    /// The lab named by `$EGRESSGW_LAB_PREFIX`, else the default lab (`egl`).
    pub fn from_env() -> anyhow::Result<Self> {
        Self::from_env_or(super::topology::DEFAULT_PREFIX)
    }

    /// The lab named by `$EGRESSGW_LAB_PREFIX`, else the lab `prefix`.
    pub fn from_env_or(prefix: &str) -> anyhow::Result<Self> {
        let cache = match std::env::var_os("EGRESSGW_CACHE") {
            Some(dir) => PathBuf::from(dir),
            None => xdg_cache()?.join("egressgw"),
        };
        let prefix = Prefix::from_env_or(prefix)?;
        let default_lab = || {
            if prefix.is_default() {
                cache.join("lab")
            } else {
                cache.join(format!("lab-{prefix}"))
            }
        };
        let lab = std::env::var_os("EGRESSGW_LAB_DIR").map_or_else(default_lab, PathBuf::from);
        Ok(Self { prefix, cache, lab })
    }

    /// `cargo xtask <command>` as a person types it for this lab: with
    /// `EGRESSGW_LAB_PREFIX=...` in front unless the prefix is the default.
    pub fn command(&self, command: &str) -> String {
        if self.prefix.is_default() {
            format!("cargo xtask {command}")
        } else {
            format!(
                "{}={} cargo xtask {command}",
                super::topology::PREFIX_ENV,
                self.prefix
            )
        }
    }

    pub fn lab_json(&self) -> PathBuf {
        self.lab.join("lab.json")
    }
    /// The admin kubeconfig (server: the control plane's underlay address).
    pub fn kubeconfig(&self) -> PathBuf {
        self.lab.join("kubeconfig")
    }
    /// A script running the lab's kubectl inside the control-plane namespace.
    pub fn kubectl_wrapper(&self) -> PathBuf {
        self.lab.join("kubectl")
    }
    /// Certificates, keys, the token file and the controller-manager's kubeconfig.
    pub fn pki(&self) -> PathBuf {
        self.lab.join("pki")
    }
    pub fn etcd_data(&self) -> PathBuf {
        self.lab.join("etcd")
    }
    pub fn logs(&self) -> PathBuf {
        self.lab.join("logs")
    }
    /// Pid files, and a copy of the xtask binary that serves whoami.
    pub fn run(&self) -> PathBuf {
        self.lab.join("run")
    }
    /// What `lab deploy` writes: the config and the copy of the egressgw binary.
    pub fn egressgw(&self) -> PathBuf {
        self.lab.join("egressgw")
    }

    /// Creates the lab directory and its subdirectories; `pki` (keys and
    /// tokens) is readable by its owner only.
    pub fn create(&self) -> anyhow::Result<()> {
        for dir in [self.pki(), self.logs(), self.run()] {
            fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let pki = self.pki();
        fs::set_permissions(&pki, fs::Permissions::from_mode(0o700))
            .with_context(|| format!("restricting {}", pki.display()))
    }

    /// Whether anything `lab up` writes is present.
    pub fn any_present(&self) -> bool {
        LAB_ENTRIES.iter().any(|e| self.lab.join(e).exists())
    }

    /// Removes everything `lab up` writes, then the lab directory if that left it empty.
    /// Returns what could not be removed.
    pub fn remove_all(&self) -> Vec<anyhow::Error> {
        let mut errors = Vec::new();
        for entry in LAB_ENTRIES.map(|e| self.lab.join(e)) {
            if let Err(e) = remove(&entry) {
                errors.push(e.context(format!("removing {}", entry.display())));
            }
        }
        // Not empty means someone else's files are there too: leave them.
        let _ = fs::remove_dir(&self.lab);
        errors
    }
}

fn remove(path: &Path) -> anyhow::Result<()> {
    match fs::symlink_metadata(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e.into()),
        Ok(meta) if meta.is_dir() => Ok(fs::remove_dir_all(path)?),
        Ok(_) => Ok(fs::remove_file(path)?),
    }
}

fn xdg_cache() -> anyhow::Result<PathBuf> {
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return Ok(PathBuf::from(dir));
    }
    let home = std::env::var_os("HOME").context("neither HOME nor EGRESSGW_CACHE is set")?;
    Ok(PathBuf::from(home).join(".cache"))
}

/// `lab.json`: everything a test or a person needs to use the lab.
#[derive(Debug, Serialize, Deserialize)]
pub struct LabState {
    pub version: u32,
    pub dir: PathBuf,
    pub kubernetes_version: String,
    /// The control-plane binaries (kube-apiserver, kube-controller-manager,
    /// kube-scheduler, kubectl, etcd).
    pub bin_dir: PathBuf,
    /// The `helm` binary (Helm 4, pinned).
    #[serde(default)]
    pub helm: PathBuf,
    /// The images the kubelet stand-in runs (`images.json`, see
    /// [`super::images`]); written by `lab deploy` and tests.
    #[serde(default)]
    pub images: PathBuf,
    /// Admin kubeconfig; its server is reachable from the control-plane and node namespaces.
    pub kubeconfig: PathBuf,
    /// `kubectl` wrapper usable from the host: runs kubectl inside the control-plane namespace.
    pub kubectl: PathBuf,
    pub api_server: String,
    /// The pod network (IPv4, then IPv6 after a comma in a dual-stack lab).
    pub cluster_cidr: String,
    /// The service ranges, written the same way.
    pub service_cidr: String,
    /// Every network namespace of the lab.
    pub netns: Vec<String>,
    pub processes: Vec<ProcessRecord>,
    /// egressgw as `lab deploy` started it; absent before.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub egressgw: Option<Deployment>,
    /// The topology (`prefix`, `underlay`, `control_plane`, `namespaces`,
    /// `nodes`, `pods`, `target`).
    #[serde(flatten)]
    pub topology: Topology,
}

/// One process the lab started.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcessRecord {
    pub name: String,
    pub netns: String,
    pub pid: u32,
    pub log: PathBuf,
    /// The program and its arguments, to start it again the same way.
    #[serde(default)]
    pub program: PathBuf,
    #[serde(default)]
    pub args: Vec<String>,
}

/// egressgw in the lab: where its files are and how to reach its health endpoints.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Deployment {
    /// The copy of the egressgw binary the daemons run.
    pub binary: PathBuf,
    /// The config file every daemon reads.
    pub config: PathBuf,
    /// The Kubernetes namespace of the Leases.
    pub namespace: String,
    /// The controller's health endpoint, reachable in the control-plane namespace.
    pub controller_health: String,
    /// The agents' health port, on every node's underlay address.
    pub agent_health_port: u16,
    /// The Helm values it was installed with on the command line (`--set`).
    #[serde(default)]
    pub set: Vec<String>,
}

impl LabState {
    /// Records `record`, replacing an earlier record of the same name.
    pub fn set_process(&mut self, record: ProcessRecord) {
        match self.processes.iter_mut().find(|p| p.name == record.name) {
            Some(old) => *old = record,
            None => self.processes.push(record),
        }
    }

    pub fn write(&self, paths: &Paths) -> anyhow::Result<()> {
        let path = paths.lab_json();
        let mut text = serde_json::to_string_pretty(self).context("serializing lab.json")?;
        text.push('\n');
        fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
    }

    /// The running lab's state, or an error telling to bring one up.
    pub fn require(paths: &Paths) -> anyhow::Result<Self> {
        Self::read(paths)?.with_context(|| {
            format!(
                "no lab is up ({} is missing; prefix {}): run `cargo xtask lab up` first",
                paths.lab_json().display(),
                paths.prefix
            )
        })
    }

    /// The running lab's state, or `None` when there is no `lab.json`.
    pub fn read(paths: &Paths) -> anyhow::Result<Option<Self>> {
        let path = paths.lab_json();
        let text = match fs::read_to_string(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            other => other.with_context(|| format!("reading {}", path.display()))?,
        };
        serde_json::from_str(&text)
            .map(Some)
            .with_context(|| format!("parsing {}", path.display()))
    }
}
