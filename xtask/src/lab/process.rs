//! The lab's long-running processes: started detached inside a lab namespace,
//! each the leader of its own process group, output to a log file, pid
//! recorded in a pid file; stopped by process group.

use std::fs::{self, File};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use anyhow::Context;

use super::cmd;
use super::state::{Paths, ProcessRecord};
use super::topology::Netns;

/// How long a process gets to exit after SIGTERM before it is killed.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// A process the lab started and still holds.
#[derive(Debug)]
pub struct Started {
    pub record: ProcessRecord,
    child: Child,
}

impl Started {
    /// Fails with the end of the process's log if it has exited.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        match self.child.try_wait() {
            Ok(None) => Ok(()),
            Ok(Some(status)) => anyhow::bail!(
                "{} exited ({status}); the end of {}:\n{}",
                self.record.name,
                self.record.log.display(),
                log_tail(&self.record.log, 20)
            ),
            Err(e) => Err(e).with_context(|| format!("checking on {}", self.record.name)),
        }
    }

    /// Collects the exit status of a process that was stopped, so it does not
    /// linger as a zombie while this program runs.
    pub fn reap(&mut self) {
        let _ = self.child.try_wait();
    }
}

/// Starts `program args...` in `ns` as `name`, detached: its own process
/// group, stdin closed, stdout and stderr to `<lab>/logs/<name>.log`. An
/// empty `ns` is the host's network namespace (see [`start_on_host`]).
pub fn start(
    paths: &Paths,
    ns: &Netns,
    name: &str,
    program: &Path,
    args: &[String],
) -> anyhow::Result<Started> {
    let log = log_path(paths, name);
    let out = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
    spawn(paths, ns, name, program, args, out)
}

/// Starts `program args...` as [`start`] does, but in the host's network
/// namespace (for the kubelet stand-in: it makes network namespaces, which
/// a process inside one could not publish to the host). Recorded with an
/// empty `netns`.
pub fn start_on_host(
    paths: &Paths,
    name: &str,
    program: &Path,
    args: &[String],
) -> anyhow::Result<Started> {
    start(paths, &Netns::parse(""), name, program, args)
}

/// Starts the process `record` describes again, the same way, its output
/// appended to its log.
pub fn start_again(paths: &Paths, record: &ProcessRecord) -> anyhow::Result<Started> {
    let out = fs::OpenOptions::new()
        .append(true)
        .create(true)
        .open(&record.log)
        .with_context(|| format!("opening {}", record.log.display()))?;
    let ns = Netns::parse(&record.netns);
    spawn(paths, &ns, &record.name, &record.program, &record.args, out)
}

fn log_path(paths: &Paths, name: &str) -> PathBuf {
    paths.logs().join(format!("{name}.log"))
}

fn spawn(
    paths: &Paths,
    ns: &Netns,
    name: &str,
    program: &Path,
    args: &[String],
    out: File,
) -> anyhow::Result<Started> {
    let log = log_path(paths, name);
    let err = out.try_clone().context("duplicating the log file handle")?;
    // `ip netns exec` enters the namespace and execs the program: same pid.
    let mut command = if ns.as_str().is_empty() {
        Command::new(program)
    } else {
        let mut ip = Command::new("ip");
        ip.args(["netns", "exec", ns.as_str()]).arg(program);
        ip
    };
    let child = command
        .args(args)
        // A lab process that is itself a lab command (the kubelet stand-in)
        // works on this lab, whatever the environment it was started from.
        .env("EGRESSGW_LAB_PREFIX", paths.prefix.to_string())
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(err)
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {name} ({})", program.display()))?;
    let record = ProcessRecord {
        name: name.to_owned(),
        netns: ns.to_string(),
        pid: child.id(),
        log,
        program: program.to_path_buf(),
        args: args.to_vec(),
    };
    write_pid_file(paths, &record, program)?;
    Ok(Started { record, child })
}

fn pid_file(paths: &Paths, name: &str) -> PathBuf {
    paths.run().join(format!("{name}.pid"))
}

/// `<pid>\n<program>\n`: the program lets `lab down` tell the process from
/// an unrelated one that reused the pid.
fn write_pid_file(paths: &Paths, record: &ProcessRecord, program: &Path) -> anyhow::Result<()> {
    let path = pid_file(paths, &record.name);
    let text = format!("{}\n{}\n", record.pid, program.display());
    fs::write(&path, text).with_context(|| format!("writing {}", path.display()))
}

/// The pids recorded in pid files whose process is still the one the lab started.
pub fn recorded_pids(paths: &Paths) -> Vec<u32> {
    let Ok(entries) = fs::read_dir(paths.run()) else {
        return Vec::new();
    };
    entries
        .filter_map(Result::ok)
        .filter(|e| e.path().extension().is_some_and(|x| x == "pid"))
        .filter_map(|e| fs::read_to_string(e.path()).ok())
        .filter_map(|text| {
            let mut lines = text.lines();
            let pid = lines.next()?.parse().ok()?;
            let program = lines.next()?;
            (argv0(pid).as_deref() == Some(program)).then_some(pid)
        })
        .collect()
}

fn argv0(pid: u32) -> Option<String> {
    let cmdline = fs::read(format!("/proc/{pid}/cmdline")).ok()?;
    let first = cmdline.split(|&b| b == 0).next()?;
    Some(String::from_utf8_lossy(first).into_owned())
}

/// Whether `pid` is running (and not a zombie).
pub fn alive(pid: u32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        // The state follows the parenthesised command name, which may hold spaces.
        stat.rsplit_once(')')
            .is_some_and(|(_, rest)| !rest.trim_start().starts_with('Z'))
    })
}

/// Whether `pid` or one of its threads has not exited yet. A killed
/// process's leader shows as a zombie while its other threads are still
/// exiting, and they hold its files, listening sockets included, until
/// the last of them is gone: a process started again on the same ports
/// before that fails to bind them.
fn exiting(pid: u32) -> bool {
    alive(pid) || fs::read_dir(format!("/proc/{pid}/task")).is_ok_and(|tasks| tasks.count() > 1)
}

/// SIGKILL to the process group led by `pid` (or the process alone), with
/// no chance to clean up; waits until it and every thread of it are gone.
/// Fails if it survives.
pub fn kill_now(pid: u32) -> anyhow::Result<()> {
    signal_all(&[pid], "KILL");
    let deadline = Instant::now() + STOP_GRACE;
    while exiting(pid) {
        anyhow::ensure!(Instant::now() < deadline, "pid {pid} survived SIGKILL");
        thread::sleep(Duration::from_millis(20));
    }
    Ok(())
}

/// Stops the process groups led by `pids` (or the processes, if they lead
/// none): SIGTERM, then SIGKILL for those still alive after a grace period.
/// Returns the pids that survived SIGKILL.
pub fn stop_all(pids: &[u32]) -> Vec<u32> {
    signal_all(pids, "TERM");
    let deadline = Instant::now() + STOP_GRACE;
    while pids.iter().any(|&p| alive(p)) && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(100));
    }
    let left: Vec<u32> = pids.iter().copied().filter(|&p| alive(p)).collect();
    if left.is_empty() {
        return left;
    }
    signal_all(&left, "KILL");
    thread::sleep(Duration::from_millis(300));
    left.into_iter().filter(|&p| alive(p)).collect()
}

fn signal_all(pids: &[u32], signal: &str) {
    for &pid in pids {
        // The group first; a pid that leads no group gets the signal alone.
        if !cmd::succeeds("kill", &["-s", signal, "--", &format!("-{pid}")]) {
            let _ = cmd::succeeds("kill", &["-s", signal, "--", &pid.to_string()]);
        }
    }
}

/// The last `lines` lines of a log file, for error messages.
pub fn log_tail(path: &Path, lines: usize) -> String {
    let Ok(text) = fs::read_to_string(path) else {
        return format!("({} is missing)", path.display());
    };
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}
