//! The control plane's credentials, made with the `openssl` CLI: a
//! self-signed CA, kube-apiserver's serving certificate, the service-account
//! signing key, and bearer tokens for the admin, the controller-manager and
//! the scheduler.
//! All keys are ECDSA P-256.

use std::fs;
use std::io::Read;
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use anyhow::Context;

use super::cmd;

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

impl Pki {
    pub fn ca_cert(&self) -> PathBuf {
        self.dir.join("ca.crt")
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

/// Writes a fresh CA, serving certificate (valid for `api_ip`, loopback,
/// the first service address and the `kubernetes.default` names),
/// service-account key pair and token file into `dir`.
pub fn create(dir: &Path, api_ip: Ipv4Addr, service_ip: Ipv4Addr) -> anyhow::Result<Pki> {
    let pki = Pki {
        dir: dir.to_path_buf(),
        admin_token: random_token()?,
        controller_manager_token: random_token()?,
        scheduler_token: random_token()?,
    };
    ca(&pki).context("making the CA")?;
    apiserver_cert(&pki, api_ip, service_ip).context("making kube-apiserver's certificate")?;
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
    new_key(&pki.apiserver_key())?;
    let csr = pki.dir.join("apiserver.csr");
    let key = pki.apiserver_key();
    openssl(&[
        "req",
        "-new",
        "-key",
        path(&key),
        "-subj",
        "/CN=kube-apiserver",
        "-out",
        path(&csr),
    ])?;
    let ext = pki.dir.join("apiserver.ext");
    let names = "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,\
                 DNS:kubernetes.default.svc.cluster.local,DNS:localhost";
    let text = format!(
        "basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n\
         extendedKeyUsage=serverAuth\n\
         subjectAltName=IP:{api_ip},IP:127.0.0.1,IP:{service_ip},{names}\n"
    );
    fs::write(&ext, text).with_context(|| format!("writing {}", ext.display()))?;
    let (ca_cert, ca_key, cert) = (pki.ca_cert(), pki.ca_key(), pki.apiserver_cert());
    #[rustfmt::skip]
    let args = [
        "x509", "-req", "-in", path(&csr), "-CA", path(&ca_cert), "-CAkey", path(&ca_key),
        "-CAcreateserial", "-days", DAYS, "-extfile", path(&ext), "-out", path(&cert),
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
