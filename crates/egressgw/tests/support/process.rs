//! Child processes with a time limit: every command a test runs is bounded,
//! and a process a test leaves running is killed when its guard drops.

use std::io::Read;
use std::process::{Child, ChildStderr, ChildStdout, Command, ExitStatus, Output, Stdio};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// How long a set-up command (`ip`, `sysctl`, `iptables`, ...) may take.
pub const SETUP_LIMIT: Duration = Duration::from_secs(20);

/// `cmd` as it would be typed.
pub fn describe(cmd: &Command) -> String {
    let mut words = vec![cmd.get_program().to_string_lossy().into_owned()];
    words.extend(cmd.get_args().map(|a| a.to_string_lossy().into_owned()));
    words.join(" ")
}

/// Runs `cmd` to its end, killing it after `limit` (which fails the test).
pub fn run_bounded(cmd: &mut Command, limit: Duration) -> Output {
    Background::spawn(cmd).finish(limit)
}

/// Runs `cmd`, fails the test unless it succeeds, and returns its stdout.
pub fn run_ok(cmd: &mut Command) -> String {
    let out = run_bounded(cmd, SETUP_LIMIT);
    assert!(
        out.status.success(),
        "`{}` failed ({}): {}{}",
        describe(cmd),
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A running child process; killed (SIGKILL) and reaped when dropped.
#[derive(Debug)]
pub struct Background {
    child: Option<Child>,
    what: String,
    stdout: Option<JoinHandle<Vec<u8>>>,
    stderr: Option<JoinHandle<Vec<u8>>>,
}

impl Background {
    /// Starts `cmd` with stdin closed, collecting its stdout and stderr.
    pub fn spawn(cmd: &mut Command) -> Self {
        Self::spawn_with(cmd, read_all)
    }

    /// Starts `cmd`; `on_stdout` consumes its stdout on a thread of its own
    /// and returns what should count as the collected stdout.
    pub fn spawn_with(
        cmd: &mut Command,
        on_stdout: impl FnOnce(ChildStdout) -> Vec<u8> + Send + 'static,
    ) -> Self {
        let what = describe(cmd);
        let mut child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start `{what}`: {e}"));
        let stdout = child
            .stdout
            .take()
            .map(|s| thread::spawn(move || on_stdout(s)));
        let stderr: Option<ChildStderr> = child.stderr.take();
        let stderr = stderr.map(|s| thread::spawn(move || read_all(s)));
        Self {
            child: Some(child),
            what,
            stdout,
            stderr,
        }
    }

    /// Waits for the process to end; after `limit` kills it and fails the test.
    pub fn finish(mut self, limit: Duration) -> Output {
        let start = Instant::now();
        loop {
            let child = self
                .child
                .as_mut()
                .expect("the child is there until finished");
            match child.try_wait() {
                Ok(Some(status)) => return self.collect(status),
                Ok(None) if start.elapsed() < limit => thread::sleep(Duration::from_millis(10)),
                Ok(None) => {
                    let what = self.what.clone();
                    let out = self.kill();
                    panic!(
                        "`{what}` did not end within {limit:?}; stdout: {}\nstderr: {}",
                        String::from_utf8_lossy(&out.stdout),
                        String::from_utf8_lossy(&out.stderr)
                    );
                }
                Err(e) => panic!("waiting for `{}`: {e}", self.what),
            }
        }
    }

    /// Kills the process with SIGKILL and returns what it wrote.
    pub fn kill(mut self) -> Output {
        let child = self
            .child
            .as_mut()
            .expect("the child is there until finished");
        // An error means it has ended already; `wait` reaps it either way.
        let _ = child.kill();
        let status = child
            .wait()
            .unwrap_or_else(|e| panic!("reaping `{}`: {e}", self.what));
        self.collect(status)
    }

    fn collect(&mut self, status: ExitStatus) -> Output {
        self.child = None;
        let join = |h: Option<JoinHandle<Vec<u8>>>| h.map(|h| h.join().unwrap_or_default());
        Output {
            status,
            stdout: join(self.stdout.take()).unwrap_or_default(),
            stderr: join(self.stderr.take()).unwrap_or_default(),
        }
    }
}

impl Drop for Background {
    fn drop(&mut self) {
        if let Some(child) = self.child.as_mut() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn read_all(mut r: impl Read) -> Vec<u8> {
    let mut buf = Vec::new();
    // A read error ends the output; what was read so far is kept.
    let _ = r.read_to_end(&mut buf);
    buf
}
