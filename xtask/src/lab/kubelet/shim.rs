//! The lab's container runtime: `cargo xtask lab container-shim SPEC` sets
//! up one container from a [`RuntimeSpec`] and execs its program, keeping
//! its pid (the kubelet stand-in started it and watches that pid).
//!
//! In order, in a fresh process:
//! 0. unblocks every signal (the stand-in blocks some; a mask survives exec);
//! 1. joins the network namespace (the node's, or the Pod's);
//! 2. enters a mount and UTS namespace of its own, with every mount a
//!    slave of the machine's (nothing done here propagates back), and sets
//!    the hostname;
//! 3. mounts a fresh sysfs (so `/sys/class/net` shows this network
//!    namespace; read-only unless privileged), as `ip netns exec` does;
//! 4. bind-mounts each volume at its `mountPath` (read-only if asked). A
//!    `mountPath` whose directory does not exist is made inside this mount
//!    namespace only: its nearest existing parent is covered by a tmpfs that
//!    mirrors it (each entry bind-mounted back, symlinks copied), and the
//!    missing directories are made in that tmpfs ("writable mimic", as
//!    snapd calls it). Nothing is created on the machine's filesystems;
//! 5. unless privileged, makes `/proc/sys` and its kin read-only and masks
//!    `/proc/kcore` and its kin, with the lists runc and containerd use;
//! 6. with `readOnlyRootFilesystem`, remounts every other mount read-only
//!    (all but the volumes and `/proc`, `/sys`, `/dev`);
//! 7. execs `setpriv`, which sets the uid, gid and groups, the capability
//!    bounding set (inheritable and ambient empty), `no_new_privs`, and
//!    execs the program with the container's environment.
//!
//! Everything it mounts lives in the container's mount namespace and goes
//! away with its last process.

use std::fs::{self, File};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::{MetadataExt, symlink};
use std::os::unix::process::CommandExt;
use std::path::{Component, Path, PathBuf};
use std::process::Command;

use anyhow::{Context, ensure};
use nix::fcntl::{OFlag, open};
use nix::mount::{MntFlags, MsFlags, mount, umount2};
use nix::sched::{CloneFlags, setns, unshare};
use nix::sys::signal::SigSet;
use nix::sys::stat::Mode;

use super::container::RuntimeSpec;

/// Made read-only in a container that is not privileged (runc's default
/// `readonlyPaths`).
const READ_ONLY_PATHS: [&str; 5] = [
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];
/// Hidden from a container that is not privileged (containerd's default
/// `maskedPaths`).
const MASKED_PATHS: [&str; 11] = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
];
/// Kernel interfaces `readOnlyRootFilesystem` leaves as they are.
const KERNEL_TREES: [&str; 3] = ["/proc", "/sys", "/dev"];

/// Sets up the container of `spec_file` and execs its program; returns only
/// on failure.
pub fn run(spec_file: &Path) -> anyhow::Result<()> {
    let text = fs::read_to_string(spec_file)
        .with_context(|| format!("reading {}", spec_file.display()))?;
    let spec: RuntimeSpec =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", spec_file.display()))?;
    let setpriv = find_setpriv()?;
    // The stand-in blocks SIGTERM and SIGINT to read them from a signalfd,
    // and a child inherits its signal mask across exec: the container's
    // program must start with none blocked, or SIGTERM never reaches it.
    SigSet::empty()
        .thread_set_mask()
        .context("unblocking every signal")?;
    enter_namespaces(&spec).context("entering the container's namespaces")?;
    // The sources are opened before /sys is replaced: a hostPath of /sys/...
    // must be the machine's, not the fresh sysfs.
    let sources = spec
        .mounts
        .iter()
        .map(|m| {
            open(&m.source, OFlag::O_PATH | OFlag::O_CLOEXEC, Mode::empty())
                .with_context(|| format!("volume source {}", m.source.display()))
        })
        .collect::<anyhow::Result<Vec<OwnedFd>>>()?;
    fresh_sysfs(spec.privileged).context("mounting sysfs")?;
    let mut made = Made {
        dirs: Vec::new(),
        scratch: spec.scratch.clone(),
    };
    for (m, source) in spec.mounts.iter().zip(&sources) {
        bind_volume(m.target.as_ref(), source, m.read_only, &mut made)
            .with_context(|| format!("mounting a volume at {}", m.target))?;
    }
    drop(sources);
    if !spec.privileged {
        restrict_kernel_interfaces().context("restricting /proc and /sys")?;
    }
    if spec.read_only_root {
        let volumes: Vec<PathBuf> = spec.mounts.iter().map(|m| resolve(&m.target)).collect();
        read_only_root(&volumes).context("making the root filesystem read-only")?;
    }
    let dir = spec.working_dir.as_deref().unwrap_or("/");
    std::env::set_current_dir(dir).with_context(|| format!("entering workingDir {dir}"))?;
    let err = privileges(&setpriv, &spec).exec();
    Err(err).with_context(|| format!("executing {} {:?}", setpriv.display(), spec.argv))
}

fn find_setpriv() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain([PathBuf::from("/usr/bin"), PathBuf::from("/bin")])
        .map(|dir| dir.join("setpriv"))
        .find(|p| p.is_file())
        .context("setpriv (util-linux) is missing")
}

fn enter_namespaces(spec: &RuntimeSpec) -> anyhow::Result<()> {
    let path = Path::new("/run/netns").join(&spec.netns);
    let netns = File::open(&path).with_context(|| format!("opening {}", path.display()))?;
    setns(&netns, CloneFlags::CLONE_NEWNET)
        .with_context(|| format!("joining network namespace {}", spec.netns))?;
    unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWUTS)
        .context("unsharing the mount and UTS namespaces")?;
    mount(
        None::<&str>,
        "/",
        None::<&str>,
        MsFlags::MS_REC | MsFlags::MS_SLAVE,
        None::<&str>,
    )
    .context("making / a slave mount")?;
    // Writing the UTS hostname through /proc changes this namespace's only.
    fs::write("/proc/sys/kernel/hostname", &spec.hostname)
        .with_context(|| format!("setting the hostname {}", spec.hostname))
}

fn fresh_sysfs(privileged: bool) -> anyhow::Result<()> {
    umount2("/sys", MntFlags::MNT_DETACH).context("detaching /sys")?;
    let mut flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    if !privileged {
        flags |= MsFlags::MS_RDONLY;
    }
    mount(Some("sysfs"), "/sys", Some("sysfs"), flags, None::<&str>).context("mounting sysfs")
}

/// `/proc/self/fd/N`: the file `fd` was opened on, as a path the kernel
/// follows to that very file even where it is covered by another mount.
fn fd_path(fd: &impl AsRawFd) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// What the shim made in the container's mount namespace.
#[derive(Debug)]
struct Made {
    /// Directories made here (mirrors and what was made in them), where
    /// making more touches nothing of the machine.
    dirs: Vec<PathBuf>,
    /// An empty directory of the lab where a mirror of `/` is assembled.
    scratch: Option<PathBuf>,
}

fn bind_volume(
    target: &Path,
    source: &OwnedFd,
    read_only: bool,
    made: &mut Made,
) -> anyhow::Result<()> {
    let source_path = fd_path(source);
    let is_dir = fs::metadata(&source_path)
        .context("reading the volume source")?
        .is_dir();
    let target = prepare_target(target, is_dir, made)?;
    let bind = MsFlags::MS_BIND | MsFlags::MS_REC;
    mount(
        Some(&source_path),
        &target,
        None::<&str>,
        bind,
        None::<&str>,
    )
    .with_context(|| format!("bind-mounting onto {}", target.display()))?;
    if read_only {
        remount_read_only(&target, MsFlags::MS_NOSUID | MsFlags::MS_NODEV)?;
    }
    Ok(())
}

fn remount_read_only(target: &Path, keep: MsFlags) -> anyhow::Result<()> {
    let flags = MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY | keep;
    mount(None::<&str>, target, None::<&str>, flags, None::<&str>)
        .with_context(|| format!("remounting {} read-only", target.display()))
}

/// `path` with every symlink of its existing part resolved (as a container
/// runtime resolves a `mountPath` in the container's root).
fn resolve(path: &str) -> PathBuf {
    let (existing, rest) = split_existing(Path::new(path));
    rest.iter().fold(existing, |p, c| p.join(c))
}

/// The longest existing prefix of `path`, symlinks resolved, and the
/// components after it.
fn split_existing(path: &Path) -> (PathBuf, Vec<String>) {
    let mut current = PathBuf::from("/");
    let parts: Vec<String> = path
        .components()
        .filter_map(|c| match c {
            Component::Normal(name) => Some(name.to_string_lossy().into_owned()),
            _ => None,
        })
        .collect();
    for (i, part) in parts.iter().enumerate() {
        match fs::canonicalize(current.join(part)) {
            Ok(resolved) => current = resolved,
            Err(_) => return (current, parts[i..].to_vec()),
        }
    }
    (current, Vec::new())
}

/// The mount point for a volume at `target`: the existing path (symlinks
/// resolved), or one made inside this mount namespace.
fn prepare_target(target: &Path, is_dir: bool, made: &mut Made) -> anyhow::Result<PathBuf> {
    let (existing, missing) = split_existing(target);
    if missing.is_empty() {
        let meta = fs::metadata(&existing)?;
        ensure!(
            meta.is_dir() == is_dir,
            "{} is a {} but the volume is a {}",
            existing.display(),
            kind(meta.is_dir()),
            kind(is_dir)
        );
        return Ok(existing);
    }
    ensure!(
        fs::metadata(&existing)?.is_dir(),
        "{} is not a directory",
        existing.display()
    );
    if !made.dirs.contains(&existing) {
        if existing == Path::new("/") {
            let scratch = made.scratch.take().with_context(|| {
                format!("{}: no scratch directory to mirror / in", target.display())
            })?;
            mimic_root(&scratch).context("mirroring / on a tmpfs")?;
        } else {
            mimic(&existing)
                .with_context(|| format!("mirroring {} on a tmpfs", existing.display()))?;
        }
        made.dirs.push(existing.clone());
    }
    let mut path = existing;
    for (i, part) in missing.iter().enumerate() {
        path.push(part);
        if i + 1 < missing.len() || is_dir {
            fs::create_dir(&path).with_context(|| format!("making {}", path.display()))?;
        } else {
            File::create(&path).with_context(|| format!("making {}", path.display()))?;
        }
        made.dirs.push(path.clone());
    }
    Ok(path)
}

fn kind(dir: bool) -> &'static str {
    if dir { "directory" } else { "file" }
}

/// Covers directory `dir` with a tmpfs holding the same entries: each
/// directory and file bind-mounted back from the covered original (with
/// what is mounted below it), each symlink copied.
fn mimic(dir: &Path) -> anyhow::Result<()> {
    let original = open(
        dir,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| format!("opening {}", dir.display()))?;
    let meta = fs::metadata(dir)?;
    let options = format!(
        "mode={:o},uid={},gid={}",
        meta.mode() & 0o7777,
        meta.uid(),
        meta.gid()
    );
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount(
        Some("tmpfs"),
        dir,
        Some("tmpfs"),
        flags,
        Some(options.as_str()),
    )
    .context("mounting the tmpfs")?;
    mirror_entries(&fd_path(&original), dir)
}

/// Recreates the entries of directory `from` in `to`: directories and
/// files bind-mounted (recursively), symlinks copied.
fn mirror_entries(from: &Path, to: &Path) -> anyhow::Result<()> {
    for entry in fs::read_dir(from).context("listing the original")? {
        let entry = entry?;
        let name = entry.file_name();
        let (source, copy) = (from.join(&name), to.join(&name));
        let file_type = entry.file_type()?;
        if file_type.is_symlink() {
            symlink(fs::read_link(&source)?, &copy)?;
            continue;
        }
        if file_type.is_dir() {
            fs::create_dir(&copy)?;
        } else {
            File::create(&copy)?;
        }
        let bind = MsFlags::MS_BIND | MsFlags::MS_REC;
        mount(Some(&source), &copy, None::<&str>, bind, None::<&str>)
            .with_context(|| format!("binding {} back", copy.display()))?;
    }
    Ok(())
}

/// Makes this process's root a tmpfs mirroring `/` (as [`mimic`] mirrors a
/// directory), so a missing top-level directory can be made: the mirror is
/// assembled on `scratch` (an empty directory of the lab), moved onto `/`
/// and entered with `chroot`, as `switch_root` does. The mirror's own copy,
/// seen again through the bind of the directory holding `scratch`, is
/// detached.
fn mimic_root(scratch: &Path) -> anyhow::Result<()> {
    let original = open(
        "/",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )
    .context("opening /")?;
    let flags = MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
    mount(
        Some("tmpfs"),
        scratch,
        Some("tmpfs"),
        flags,
        Some("mode=755"),
    )
    .with_context(|| format!("mounting a tmpfs on {}", scratch.display()))?;
    mirror_entries(&fd_path(&original), scratch)?;
    std::env::set_current_dir(scratch).context("entering the mirror")?;
    mount(
        Some(scratch),
        "/",
        None::<&str>,
        MsFlags::MS_MOVE,
        None::<&str>,
    )
    .context("moving the mirror onto /")?;
    nix::unistd::chroot(".").context("chroot into the mirror")?;
    std::env::set_current_dir("/").context("entering /")?;
    let _ = umount2(scratch, MntFlags::MNT_DETACH);
    Ok(())
}

/// runc's `readonlyPaths` and containerd's `maskedPaths`.
fn restrict_kernel_interfaces() -> anyhow::Result<()> {
    for path in READ_ONLY_PATHS.iter().filter(|p| Path::new(p).exists()) {
        let bind = MsFlags::MS_BIND | MsFlags::MS_REC;
        mount(Some(*path), *path, None::<&str>, bind, None::<&str>)
            .with_context(|| format!("binding {path}"))?;
        remount_read_only(
            Path::new(path),
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        )?;
    }
    for path in MASKED_PATHS {
        let Ok(meta) = fs::metadata(path) else {
            continue;
        };
        let result = if meta.is_dir() {
            let flags = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV;
            mount(Some("tmpfs"), path, Some("tmpfs"), flags, None::<&str>)
        } else {
            mount(
                Some("/dev/null"),
                path,
                None::<&str>,
                MsFlags::MS_BIND,
                None::<&str>,
            )
        };
        result.with_context(|| format!("masking {path}"))?;
    }
    Ok(())
}

/// One line of `/proc/self/mountinfo`, as far as a remount needs it.
#[derive(Debug, PartialEq, Eq)]
struct MountInfo {
    point: PathBuf,
    options: String,
    fstype: String,
}

fn parse_mountinfo(text: &str) -> Vec<MountInfo> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fields: Vec<&str> = left.split(' ').collect();
            Some(MountInfo {
                point: PathBuf::from(unescape(fields.get(4)?)),
                options: (*fields.get(5)?).to_owned(),
                fstype: right.split(' ').next()?.to_owned(),
            })
        })
        .collect()
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape(field: &str) -> String {
    let mut out = Vec::with_capacity(field.len());
    let bytes = field.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let octal = bytes.get(i + 1..i + 4).and_then(|digits| {
            let text = std::str::from_utf8(digits).ok()?;
            u8::from_str_radix(text, 8).ok()
        });
        match (bytes[i], octal) {
            (b'\\', Some(byte)) => {
                out.push(byte);
                i += 4;
            }
            (byte, _) => {
                out.push(byte);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The per-mount flags of a mountinfo options field that a bind remount
/// must keep.
fn kept_flags(options: &str) -> MsFlags {
    options.split(',').fold(MsFlags::empty(), |flags, o| {
        flags
            | match o {
                "nosuid" => MsFlags::MS_NOSUID,
                "nodev" => MsFlags::MS_NODEV,
                "noexec" => MsFlags::MS_NOEXEC,
                "noatime" => MsFlags::MS_NOATIME,
                "nodiratime" => MsFlags::MS_NODIRATIME,
                "relatime" => MsFlags::MS_RELATIME,
                "strictatime" => MsFlags::MS_STRICTATIME,
                _ => MsFlags::empty(),
            }
    })
}

/// Whether `readOnlyRootFilesystem` leaves this mount as it is: a volume
/// (or below one), a kernel interface, or a namespace handle.
fn keeps_writable(m: &MountInfo, volumes: &[PathBuf]) -> bool {
    m.fstype == "nsfs"
        || KERNEL_TREES.iter().any(|k| m.point.starts_with(k))
        || volumes.iter().any(|v| m.point.starts_with(v))
}

fn read_only_root(volumes: &[PathBuf]) -> anyhow::Result<()> {
    let text = fs::read_to_string("/proc/self/mountinfo").context("reading mountinfo")?;
    for m in parse_mountinfo(&text) {
        if keeps_writable(&m, volumes) || m.options.split(',').any(|o| o == "ro") {
            continue;
        }
        remount_read_only(&m.point, kept_flags(&m.options))?;
    }
    Ok(())
}

/// `setpriv ... -- argv`: the identity, capabilities and environment.
pub(super) fn privileges(setpriv: &Path, spec: &RuntimeSpec) -> Command {
    let mut command = Command::new(setpriv);
    command
        .arg(format!("--reuid={}", spec.uid))
        .arg(format!("--regid={}", spec.gid));
    if spec.groups.is_empty() {
        command.arg("--clear-groups");
    } else {
        let groups: Vec<String> = spec.groups.iter().map(ToString::to_string).collect();
        command.arg(format!("--groups={}", groups.join(",")));
    }
    if !spec.privileged {
        let bounding = super::caps::setpriv_bounding(&spec.capabilities);
        command.arg(format!("--bounding-set={bounding}"));
    }
    command.args(["--inh-caps=-all", "--ambient-caps=-all"]);
    if spec.no_new_privs {
        command.arg("--no-new-privs");
    }
    command
        .arg("--")
        .args(&spec.argv)
        .env_clear()
        .envs(spec.env.iter().map(|(k, v)| (k, v)));
    command
}

/// Fails unless `setpriv` is there: checked when the kubelet stand-in starts.
pub fn check_tools() -> anyhow::Result<()> {
    find_setpriv().map(drop)
}

/// A shim that fails says so on the container's log, then exits 128.
pub fn fail(err: &anyhow::Error) -> ! {
    eprintln!("egressgw lab: the container did not start: {err:#}");
    std::process::exit(128)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_give_point_options_and_type() {
        let text = "36 35 98:0 / /run rw,nosuid,nodev,noexec,relatime shared:5 - tmpfs tmpfs rw,size=10m\n\
                    40 36 0:4 net:[4026532] /run/netns/egl\\040x rw shared:6 - nsfs nsfs rw\n";
        let mounts = parse_mountinfo(text);
        assert_eq!(
            mounts[0],
            MountInfo {
                point: PathBuf::from("/run"),
                options: "rw,nosuid,nodev,noexec,relatime".to_owned(),
                fstype: "tmpfs".to_owned(),
            }
        );
        assert_eq!(mounts[1].point, PathBuf::from("/run/netns/egl x"));
        assert_eq!(mounts[1].fstype, "nsfs");
    }

    #[test]
    fn a_remount_keeps_the_mounts_own_restrictions() {
        let flags = kept_flags("rw,nosuid,nodev,relatime");
        assert_eq!(
            flags,
            MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_RELATIME
        );
        assert_eq!(kept_flags("rw"), MsFlags::empty());
    }

    #[test]
    fn read_only_root_spares_volumes_and_kernel_interfaces() {
        let mount = |point: &str, fstype: &str| MountInfo {
            point: PathBuf::from(point),
            options: "rw".to_owned(),
            fstype: fstype.to_owned(),
        };
        let volumes = [PathBuf::from("/run/secrets/kubernetes.io/serviceaccount")];
        assert!(keeps_writable(&mount("/proc/sys", "proc"), &volumes));
        assert!(keeps_writable(&mount("/dev/shm", "tmpfs"), &volumes));
        assert!(keeps_writable(&mount("/run/netns/x", "nsfs"), &volumes));
        assert!(keeps_writable(
            &mount("/run/secrets/kubernetes.io/serviceaccount", "ext4"),
            &volumes
        ));
        assert!(!keeps_writable(&mount("/", "ext4"), &volumes));
        assert!(!keeps_writable(&mount("/run", "tmpfs"), &volumes));
        assert!(!keeps_writable(&mount("/procfoo", "ext4"), &volumes));
    }

    #[test]
    fn setpriv_gets_identity_capabilities_and_environment() {
        let spec = RuntimeSpec {
            name: "ns/p/c".to_owned(),
            netns: "egk-node-1".to_owned(),
            hostname: "node-1".to_owned(),
            mounts: Vec::new(),
            read_only_root: false,
            privileged: false,
            working_dir: None,
            scratch: None,
            uid: 65534,
            gid: 65534,
            groups: vec![2000],
            capabilities: vec!["NET_ADMIN".to_owned()],
            no_new_privs: true,
            argv: vec!["/bin/prog".to_owned(), "arg".to_owned()],
            env: vec![("A".to_owned(), "1".to_owned())],
        };
        let command = privileges(Path::new("/usr/bin/setpriv"), &spec);
        let args: Vec<String> = command
            .get_args()
            .map(|a| a.to_string_lossy().into_owned())
            .collect();
        assert_eq!(
            args,
            [
                "--reuid=65534",
                "--regid=65534",
                "--groups=2000",
                "--bounding-set=-all,+net_admin",
                "--inh-caps=-all",
                "--ambient-caps=-all",
                "--no-new-privs",
                "--",
                "/bin/prog",
                "arg"
            ]
        );
        let envs: Vec<_> = command.get_envs().collect();
        assert_eq!(envs.len(), 1);
    }
}
