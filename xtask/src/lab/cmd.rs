//! Running external commands, with errors that say which command failed and why.

use std::ffi::OsStr;
use std::io::Write;
use std::process::{Command, Output, Stdio};

use anyhow::{Context, bail};

/// Runs `program args...`, returns its stdout; fails with its stderr when it exits non-zero.
pub fn run<S: AsRef<OsStr>>(program: impl AsRef<OsStr>, args: &[S]) -> anyhow::Result<String> {
    run_with_input(program, args, None)
}

/// Like [`run`], feeding `input` to the command's stdin.
pub fn run_with_input<S: AsRef<OsStr>>(
    program: impl AsRef<OsStr>,
    args: &[S],
    input: Option<&str>,
) -> anyhow::Result<String> {
    let mut command = Command::new(program.as_ref());
    command.args(args);
    let shown = show(&command);
    let output = output(command, input).with_context(|| format!("running `{shown}`"))?;
    if !output.status.success() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        bail!("`{shown}` failed ({}): {}", output.status, stderr.trim());
    }
    String::from_utf8(output.stdout).with_context(|| format!("`{shown}` printed invalid UTF-8"))
}

/// Whether `program args...` runs and exits zero (its output is dropped).
pub fn succeeds<S: AsRef<OsStr>>(program: impl AsRef<OsStr>, args: &[S]) -> bool {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Whether `program` is found on `PATH`.
pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

fn output(mut command: Command, input: Option<&str>) -> std::io::Result<Output> {
    let Some(input) = input else {
        return command.stdin(Stdio::null()).output();
    };
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(input.as_bytes())?;
    }
    child.wait_with_output()
}

/// The command line as a person would type it, for messages.
fn show(command: &Command) -> String {
    std::iter::once(command.get_program())
        .chain(command.get_args())
        .map(|a| a.to_string_lossy().into_owned())
        .collect::<Vec<_>>()
        .join(" ")
}
