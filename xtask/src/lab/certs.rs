//! The control plane's credentials, made with the `openssl` CLI: a
//! self-signed CA, kube-apiserver's serving certificate and its client
//! certificate for kubelets, each node's kubelet serving certificate (the
//! kubelet stand-in's), the service-account signing key, and bearer tokens
//! for the admin, the controller-manager and the scheduler.
//! All keys are ECDSA P-256.

use std::fs;
use std::io::Read;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use anyhow::Context;

use super::cmd;
use super::topology::Node;

/// How long the lab's certificates are valid.
const DAYS: &str = "365";

/// The files in the lab's `pki` directory.
#[derive(Debug, Clone)]
pub struct Pki {
    pub dir: PathBuf,
    /// Bearer token of the `admin` user (group `system:masters`).
    pub admin_token: String,
    /// Bearer token of `system:kube-controller-manager` (group `system:masters`).
    pub controller_manager_token: String,
    /// Bearer token of `system:kube-scheduler`: the user the API server's
    /// bootstrap RBAC policy grants what a scheduler needs (no other group).
    pub scheduler_token: String,
}

/// The lab CA's certificate in the pki directory `dir`.
pub fn ca_cert_in(dir: &Path) -> PathBuf {
    dir.join("ca.crt")
}

/// The serving certificate and key of `node`'s kubelet (the stand-in, on
/// the node's address) in the pki directory `dir`.
pub fn kubelet_serving_in(dir: &Path, node: &str) -> (PathBuf, PathBuf) {
    let stem = dir.join("kubelet").join(node);
    (stem.with_extension("crt"), stem.with_extension("key"))
}

impl Pki {
    pub fn ca_cert(&self) -> PathBuf {
        ca_cert_in(&self.dir)
    }
    fn ca_key(&self) -> PathBuf {
        self.dir.join("ca.key")
    }
    pub fn apiserver_cert(&self) -> PathBuf {
        self.dir.join("apiserver.crt")
    }
    pub fn apiserver_key(&self) -> PathBuf {
        self.dir.join("apiserver.key")
    }
    /// kube-apiserver's client certificate for kubelets
    /// (`--kubelet-client-certificate`), in group `system:masters`.
    pub fn kubelet_client_cert(&self) -> PathBuf {
        self.dir.join("apiserver-kubelet-client.crt")
    }
    pub fn kubelet_client_key(&self) -> PathBuf {
        self.dir.join("apiserver-kubelet-client.key")
    }
    pub fn sa_key(&self) -> PathBuf {
        self.dir.join("sa.key")
    }
    pub fn sa_pub(&self) -> PathBuf {
        self.dir.join("sa.pub")
    }
    /// kube-apiserver's `--token-auth-file`.
    pub fn tokens(&self) -> PathBuf {
        self.dir.join("tokens.csv")
    }
}

/// Writes a fresh CA, kube-apiserver's serving certificate (valid for
/// `api_ip`, loopback, the first service address and the
/// `kubernetes.default` names) and kubelet client certificate, a kubelet
/// serving certificate for each of `nodes` (valid for its address and
/// name), the service-account key pair and the token file into `dir`.
pub fn create(
    dir: &Path,
    api_ip: Ipv4Addr,
    service_ip: Ipv4Addr,
    nodes: &[Node],
) -> anyhow::Result<Pki> {
    let pki = Pki {
        dir: dir.to_path_buf(),
        admin_token: random_token()?,
        controller_manager_token: random_token()?,
        scheduler_token: random_token()?,
    };
    ca(&pki).context("making the CA")?;
    apiserver_cert(&pki, api_ip, service_ip).context("making kube-apiserver's certificate")?;
    kubelet_client_cert(&pki).context("making kube-apiserver's kubelet client certificate")?;
    for node in nodes {
        kubelet_serving_cert(&pki, node)
            .with_context(|| format!("making the kubelet serving certificate of {}", node.name))?;
    }
    sa_keys(&pki).context("making the service-account key")?;
    tokens(&pki).context("writing the token file")?;
    Ok(pki)
}

fn openssl(args: &[&str]) -> anyhow::Result<()> {
    cmd::run("openssl", args).map(drop)
}

/// `p` as text; lab paths are checked to be UTF-8 when they are chosen
/// ([`super::state::Paths::from_env`]).
fn path(p: &Path) -> &str {
    p.to_str().unwrap_or_default()
}

fn new_key(out: &Path) -> anyhow::Result<()> {
    openssl(&[
        "genpkey",
        "-algorithm",
        "EC",
        "-pkeyopt",
        "ec_paramgen_curve:P-256",
        "-out",
        path(out),
    ])
}

fn ca(pki: &Pki) -> anyhow::Result<()> {
    new_key(&pki.ca_key())?;
    let (key, cert) = (pki.ca_key(), pki.ca_cert());
    #[rustfmt::skip]
    let args = [
        "req", "-x509", "-new", "-key", path(&key), "-days", DAYS,
        "-subj", "/CN=egressgw-lab-ca",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign,digitalSignature",
        "-out", path(&cert),
    ];
    openssl(&args)
}

fn apiserver_cert(pki: &Pki, api_ip: Ipv4Addr, service_ip: Ipv4Addr) -> anyhow::Result<()> {
    let names = "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,\
                 DNS:kubernetes.default.svc.cluster.local,DNS:localhost";
    let extensions = format!(
        "extendedKeyUsage=serverAuth\n\
         subjectAltName=IP:{api_ip},IP:127.0.0.1,IP:{service_ip},{names}\n"
    );
    let (key, cert) = (pki.apiserver_key(), pki.apiserver_cert());
    signed(pki, &key, &cert, "/CN=kube-apiserver", &extensions)
}

/// The certificate kube-apiserver shows kubelets: the stand-in requires
/// one of the lab's CA for client use, which only this one is.
fn kubelet_client_cert(pki: &Pki) -> anyhow::Result<()> {
    let (key, cert) = (pki.kubelet_client_key(), pki.kubelet_client_cert());
    let subject = "/O=system:masters/CN=kube-apiserver-kubelet-client";
    signed(pki, &key, &cert, subject, "extendedKeyUsage=clientAuth\n")
}

/// A node's kubelet serving certificate, named as kubelet's own are
/// (`system:node:<name>` in `system:nodes`), valid for the node's address,
/// which kube-apiserver connects to and verifies, and its name.
fn kubelet_serving_cert(pki: &Pki, node: &Node) -> anyhow::Result<()> {
    let (cert, key) = kubelet_serving_in(&pki.dir, &node.name);
    if let Some(dir) = cert.parent() {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let extensions = format!(
        "extendedKeyUsage=serverAuth\nsubjectAltName=IP:{},DNS:{}\n",
        node.ip, node.name
    );
    let subject = format!("/O=system:nodes/CN=system:node:{}", node.name);
    signed(pki, &key, &cert, &subject, &extensions)
}

/// Makes a new key at `key` and a certificate for it at `cert`, signed by
/// the CA, for `subject`, with `extensions` (lines of an openssl extension
/// file) besides those of every leaf certificate. The request and the
/// extension file stay beside the certificate (`.csr`, `.ext`).
fn signed(
    pki: &Pki,
    key: &Path,
    cert: &Path,
    subject: &str,
    extensions: &str,
) -> anyhow::Result<()> {
    new_key(key)?;
    let csr = cert.with_extension("csr");
    #[rustfmt::skip]
    let args = ["req", "-new", "-key", path(key), "-subj", subject, "-out", path(&csr)];
    openssl(&args)?;
    let ext = cert.with_extension("ext");
    let text =
        format!("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n{extensions}");
    fs::write(&ext, text).with_context(|| format!("writing {}", ext.display()))?;
    let (ca_cert, ca_key) = (pki.ca_cert(), pki.ca_key());
    #[rustfmt::skip]
    let args = [
        "x509", "-req", "-in", path(&csr), "-CA", path(&ca_cert), "-CAkey", path(&ca_key),
        "-CAcreateserial", "-days", DAYS, "-extfile", path(&ext), "-out", path(cert),
    ];
    openssl(&args)
}

fn sa_keys(pki: &Pki) -> anyhow::Result<()> {
    new_key(&pki.sa_key())?;
    openssl(&[
        "pkey",
        "-in",
        path(&pki.sa_key()),
        "-pubout",
        "-out",
        path(&pki.sa_pub()),
    ])
}

fn tokens(pki: &Pki) -> anyhow::Result<()> {
    let kcm = "system:kube-controller-manager";
    let scheduler = "system:kube-scheduler";
    let text = format!(
        "{},admin,admin,system:masters\n{},{kcm},{kcm},system:masters\n{},{scheduler},{scheduler}\n",
        pki.admin_token, pki.controller_manager_token, pki.scheduler_token
    );
    let path = pki.tokens();
    fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
}

/// 32 hex digits from the kernel's random source.
fn random_token() -> anyhow::Result<String> {
    let mut bytes = [0u8; 16];
    fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut bytes))
        .context("reading /dev/urandom")?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
