//! One container of a Pod the stand-in runs: its process, its state as
//! kubelet reports it, its probes, and what happens when it exits.

use std::collections::BTreeMap;
use std::os::unix::process::ExitStatusExt;
use std::process::Child;
use std::time::{Duration, Instant, SystemTime};

use k8s_openapi::api::core::v1::Container;
use nix::sys::signal::{Signal, killpg};
use nix::unistd::Pid;

use super::container::RuntimeSpec;
use super::logs::LogState;
use super::pod::{PodKey, log};
use super::probes::Prober;
use super::status::{ContainerView, State, Terminated};

/// The first wait before a crashed container starts again; it doubles
/// with each crash up to [`MAX_BACKOFF`] (kubelet: 10 s to 5 min; the lab
/// keeps tests short).
pub(super) const FIRST_BACKOFF: Duration = Duration::from_secs(1);
const MAX_BACKOFF: Duration = Duration::from_secs(20);
/// A container that ran this long starts its next backoff from the beginning.
const BACKOFF_RESET: Duration = Duration::from_secs(60);

/// A running container's process.
#[derive(Debug)]
pub(super) struct Process {
    pub(super) child: Child,
    pub(super) pid: u32,
    pub(super) started_at: SystemTime,
    pub(super) since: Instant,
    /// Being stopped: SIGTERM sent; SIGKILL at the deadline.
    pub(super) stopping: Option<Instant>,
    pub(super) killed: bool,
}

#[derive(Debug)]
pub(super) enum Phase {
    Waiting {
        reason: String,
        message: Option<String>,
    },
    Running(Process),
    Terminated(Terminated),
}

/// One container of a Pod.
#[derive(Debug)]
pub(super) struct Ctr {
    pub(super) name: String,
    pub(super) image: String,
    pub(super) image_id: String,
    pub(super) phase: Phase,
    pub(super) last: Option<Terminated>,
    pub(super) restarts: u32,
    pub(super) backoff: Duration,
    pub(super) next_start: Instant,
    /// Whether it has been started at least once.
    pub(super) ever_started: bool,
    pub(super) readiness: Option<Prober>,
    pub(super) liveness: Option<Prober>,
    pub(super) startup: Option<Prober>,
    pub(super) spec: Option<RuntimeSpec>,
    pub(super) exec_argv: Option<Vec<String>>,
    pub(super) ports: BTreeMap<String, u16>,
}

impl Ctr {
    pub(super) fn new(c: &Container) -> Self {
        let ports = c
            .ports
            .iter()
            .flatten()
            .filter_map(|p| Some((p.name.clone()?, u16::try_from(p.container_port).ok()?)))
            .collect();
        Self {
            name: c.name.clone(),
            image: c.image.clone().unwrap_or_default(),
            image_id: String::new(),
            phase: Phase::Waiting {
                reason: "ContainerCreating".to_owned(),
                message: None,
            },
            last: None,
            restarts: 0,
            backoff: Duration::ZERO,
            next_start: Instant::now(),
            ever_started: false,
            readiness: None,
            liveness: None,
            startup: None,
            spec: None,
            exec_argv: None,
            ports,
        }
    }

    pub(super) fn running(&self) -> Option<&Process> {
        match &self.phase {
            Phase::Running(p) => Some(p),
            _ => None,
        }
    }

    /// Started: its startup probe passed (or it has none).
    pub(super) fn started(&self) -> bool {
        self.running().is_some() && self.startup.as_ref().is_none_or(|p| p.result == Some(true))
    }

    pub(super) fn ready(&self) -> bool {
        self.started()
            && self
                .readiness
                .as_ref()
                .is_none_or(|p| p.result == Some(true))
    }

    /// Its state as the log API sees it: a container that ran and waits
    /// to start again has that run as its `lastState`.
    pub(super) fn log_state(&self) -> LogState {
        match &self.phase {
            Phase::Running(_) => LogState::Running,
            Phase::Terminated(_) => LogState::Exited { restarting: false },
            Phase::Waiting { .. } if self.ever_started => LogState::Exited { restarting: true },
            Phase::Waiting { reason, .. } => LogState::Waiting(reason.clone()),
        }
    }

    pub(super) fn succeeded(&self) -> bool {
        matches!(&self.phase, Phase::Terminated(t) if t.exit_code == 0)
    }

    pub(super) fn view(&self) -> ContainerView {
        let state = match &self.phase {
            Phase::Waiting { reason, message } => State::Waiting {
                reason: reason.clone(),
                message: message.clone(),
            },
            Phase::Running(p) => State::Running {
                started_at: p.started_at,
            },
            Phase::Terminated(t) => State::Terminated(t.clone()),
        };
        ContainerView {
            name: self.name.clone(),
            image: self.image.clone(),
            image_id: self.image_id.clone(),
            container_id: self.running().map(|p| container_id(p.pid)),
            state,
            last: self.last.clone(),
            restarts: self.restarts,
            ready: self.ready(),
            started: self.started(),
        }
    }

    /// Sends SIGTERM to its process group, SIGKILL after `grace`.
    pub(super) fn stop(&mut self, grace: Duration) -> bool {
        let Phase::Running(p) = &mut self.phase else {
            return false;
        };
        if p.stopping.is_none() {
            signal(p.pid, Signal::SIGTERM);
            p.stopping = Some(Instant::now() + grace);
            return true;
        }
        false
    }

    /// If the process exited: its terminated state, and what comes next by
    /// the restart policy (a restart after a backoff, or the end). Kills
    /// the process group when its grace period is over.
    pub(super) fn collect(&mut self, key: &PodKey, terminating: bool, policy: &str, init: bool) {
        let Phase::Running(p) = &mut self.phase else {
            return;
        };
        if let Some(deadline) = p.stopping
            && !p.killed
            && Instant::now() >= deadline
        {
            log(&format!(
                "{key}: {}: grace period over, SIGKILL to pid {}",
                self.name, p.pid
            ));
            signal(p.pid, Signal::SIGKILL);
            p.killed = true;
        }
        let status = match p.child.try_wait() {
            Ok(Some(status)) => status,
            Ok(None) => return,
            Err(e) => {
                log(&format!(
                    "{key}: {}: waiting for pid {}: {e}",
                    self.name, p.pid
                ));
                return;
            }
        };
        // Whatever the program left behind in its group goes with it.
        signal(p.pid, Signal::SIGKILL);
        let (exit_code, sig) = match (status.code(), status.signal()) {
            (Some(code), _) => (code, None),
            (None, Some(sig)) => (128 + sig, Some(sig)),
            (None, None) => (-1, None),
        };
        let ran = p.since.elapsed();
        let ended = Terminated {
            exit_code,
            signal: sig,
            reason: if exit_code == 0 { "Completed" } else { "Error" }.to_owned(),
            message: None,
            started_at: p.started_at,
            finished_at: SystemTime::now(),
            container_id: container_id(p.pid),
        };
        log(&format!(
            "{key}: {}: pid {} exited with code {exit_code} after {}s",
            self.name,
            p.pid,
            ran.as_secs()
        ));
        self.readiness = None;
        self.liveness = None;
        self.startup = None;
        if terminating || !restarts(policy, init, exit_code) {
            self.phase = Phase::Terminated(ended);
            return;
        }
        self.backoff = next_backoff(self.backoff, ran);
        self.next_start = Instant::now() + self.backoff;
        self.phase = Phase::Waiting {
            reason: "CrashLoopBackOff".to_owned(),
            message: Some(format!(
                "back-off {}s restarting failed container={} pod={}_{}({})",
                self.backoff.as_secs(),
                self.name,
                key.name,
                key.namespace,
                key.uid
            )),
        };
        self.last = Some(ended);
    }
}

pub(super) fn container_id(pid: u32) -> String {
    format!("egressgw-lab://{pid}")
}

/// A signal to the process group a container leads; no error if it is gone.
pub(super) fn signal(pid: u32, sig: Signal) {
    if let Ok(pid) = i32::try_from(pid) {
        let _ = killpg(Pid::from_raw(pid), sig);
    }
}

/// Whether a container that exited with `exit_code` starts again under
/// `policy`; an init container that succeeded is done whatever the policy.
pub(super) fn restarts(policy: &str, init: bool, exit_code: i32) -> bool {
    match policy {
        "Never" => false,
        "OnFailure" => exit_code != 0,
        _ => !init || exit_code != 0,
    }
}

/// The wait before the next start of a container that crashed after
/// running `ran`: from the beginning after a long run, else doubled, capped.
pub(super) fn next_backoff(previous: Duration, ran: Duration) -> Duration {
    if ran >= BACKOFF_RESET || previous.is_zero() {
        FIRST_BACKOFF
    } else {
        (previous * 2).min(MAX_BACKOFF)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restarts_follow_the_policy_and_finished_init_containers_stay_done() {
        assert!(restarts("Always", false, 0));
        assert!(restarts("Always", false, 1));
        assert!(!restarts("Always", true, 0));
        assert!(restarts("Always", true, 1));
        assert!(restarts("OnFailure", false, 2));
        assert!(!restarts("OnFailure", false, 0));
        assert!(!restarts("Never", false, 1));
    }

    #[test]
    fn backoff_doubles_to_its_cap_and_resets_after_a_long_run() {
        let short = Duration::from_secs(1);
        let mut b = next_backoff(Duration::ZERO, short);
        assert_eq!(b, FIRST_BACKOFF);
        let mut seen = vec![b];
        for _ in 0..6 {
            b = next_backoff(b, short);
            seen.push(b);
        }
        let secs: Vec<u64> = seen.iter().map(Duration::as_secs).collect();
        assert_eq!(secs, [1, 2, 4, 8, 16, 20, 20]);
        assert_eq!(next_backoff(MAX_BACKOFF, BACKOFF_RESET), FIRST_BACKOFF);
    }
}
