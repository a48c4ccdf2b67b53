//! A Pod's status as kubelet reports it, computed from what the stand-in
//! observes (pure): phase, addresses, conditions, container statuses.
//!
//! The result is the status object for a JSON merge patch; lists are
//! written whole, so conditions the stand-in does not own (`PodScheduled`,
//! readiness gates, `DisruptionTarget`) are carried over from the current
//! status, and a condition keeps its `lastTransitionTime` while its value
//! does not change.

use std::time::SystemTime;

use serde_json::{Value, json};

use crate::lab::cluster::rfc3339;

/// The conditions the stand-in writes, in kubelet's order.
const OWN_CONDITIONS: [&str; 4] = [
    "PodReadyToStartContainers",
    "Initialized",
    "ContainersReady",
    "Ready",
];

/// A container's state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    Waiting {
        reason: String,
        message: Option<String>,
    },
    Running {
        started_at: SystemTime,
    },
    Terminated(Terminated),
}

/// How a container ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Terminated {
    pub exit_code: i32,
    pub signal: Option<i32>,
    pub reason: String,
    pub message: Option<String>,
    pub started_at: SystemTime,
    pub finished_at: SystemTime,
    pub container_id: String,
}

/// One container as observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerView {
    pub name: String,
    pub image: String,
    pub image_id: String,
    pub container_id: Option<String>,
    pub state: State,
    pub last: Option<Terminated>,
    pub restarts: u32,
    pub ready: bool,
    pub started: bool,
}

/// One Pod as observed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodView {
    pub host_ip: String,
    /// Set once the sandbox exists.
    pub pod_ip: Option<String>,
    pub start_time: Option<SystemTime>,
    pub init: Vec<ContainerView>,
    pub containers: Vec<ContainerView>,
    /// `Always`, `OnFailure` or `Never`.
    pub restart_policy: String,
    /// The Pod's readiness gates (condition types that must be True).
    pub readiness_gates: Vec<String>,
}

impl State {
    fn json(&self) -> Value {
        match self {
            Self::Waiting { reason, message } => {
                json!({ "waiting": { "reason": reason, "message": message } })
            }
            Self::Running { started_at } => {
                json!({ "running": { "startedAt": rfc3339(*started_at) } })
            }
            Self::Terminated(t) => json!({ "terminated": t.json() }),
        }
    }
}

impl Terminated {
    fn json(&self) -> Value {
        json!({
            "exitCode": self.exit_code,
            "signal": self.signal,
            "reason": self.reason,
            "message": self.message,
            "startedAt": rfc3339(self.started_at),
            "finishedAt": rfc3339(self.finished_at),
            "containerID": self.container_id,
        })
    }
}

impl ContainerView {
    fn json(&self) -> Value {
        json!({
            "name": self.name,
            "image": self.image,
            "imageID": self.image_id,
            "containerID": self.container_id,
            "state": self.state.json(),
            "lastState": self.last.as_ref().map_or_else(|| json!({}), |t| json!({ "terminated": t.json() })),
            "ready": self.ready,
            "restartCount": self.restarts,
            "started": self.started,
        })
    }

    /// Whether it ran to the end successfully (an init container that is done).
    fn succeeded(&self) -> bool {
        matches!(&self.state, State::Terminated(t) if t.exit_code == 0)
    }
}

/// kubelet's phase rules, as far as the stand-in needs them.
pub fn phase(view: &PodView) -> &'static str {
    let policy = view.restart_policy.as_str();
    for init in &view.init {
        if init.succeeded() {
            continue;
        }
        let failed = matches!(&init.state, State::Terminated(_)) || init.last.is_some();
        return if failed && policy == "Never" {
            "Failed"
        } else {
            "Pending"
        };
    }
    let (mut running, mut waiting, mut stopped, mut succeeded) = (0, 0, 0, 0);
    for c in &view.containers {
        match &c.state {
            State::Running { .. } => running += 1,
            State::Terminated(t) => {
                stopped += 1;
                if t.exit_code == 0 {
                    succeeded += 1;
                }
            }
            State::Waiting { .. } if c.last.is_some() => stopped += 1,
            State::Waiting { .. } => waiting += 1,
        }
    }
    if waiting > 0 {
        "Pending"
    } else if running > 0 {
        "Running"
    } else if stopped == view.containers.len() && stopped > 0 {
        match policy {
            "Always" => "Running",
            "OnFailure" if succeeded < stopped => "Running",
            _ if succeeded == stopped => "Succeeded",
            _ => "Failed",
        }
    } else {
        "Pending"
    }
}

/// The status object for `view`; `current` is the Pod's status in the API
/// (for the conditions the stand-in does not own and transition times).
pub fn build(view: &PodView, current: Option<&Value>, now: SystemTime) -> Value {
    let sandbox = view.pod_ip.is_some();
    let initialized = view.init.iter().all(ContainerView::succeeded);
    let unready: Vec<&str> = view
        .containers
        .iter()
        .filter(|c| !c.ready)
        .map(|c| c.name.as_str())
        .collect();
    let gates_ok = view
        .readiness_gates
        .iter()
        .all(|gate| condition(current, gate).is_some_and(|c| c["status"] == "True"));
    let pending_init: Vec<&str> = view
        .init
        .iter()
        .filter(|c| !c.succeeded())
        .map(|c| c.name.as_str())
        .collect();
    let not_ready_msg = format!("containers with unready status: [{}]", unready.join(" "));
    let own = [
        (OWN_CONDITIONS[0], sandbox, None),
        (
            OWN_CONDITIONS[1],
            initialized,
            Some((
                "ContainersNotInitialized",
                format!(
                    "containers with incomplete status: [{}]",
                    pending_init.join(" ")
                ),
            )),
        ),
        (
            OWN_CONDITIONS[2],
            unready.is_empty(),
            Some(("ContainersNotReady", not_ready_msg.clone())),
        ),
        (
            OWN_CONDITIONS[3],
            unready.is_empty() && gates_ok,
            Some(("ContainersNotReady", not_ready_msg)),
        ),
    ];
    let mut conditions: Vec<Value> = current
        .and_then(|s| s["conditions"].as_array())
        .into_iter()
        .flatten()
        .filter(|c| !OWN_CONDITIONS.contains(&c["type"].as_str().unwrap_or_default()))
        .cloned()
        .collect();
    for (kind, ok, why) in own {
        let status = if ok { "True" } else { "False" };
        let since = condition(current, kind)
            .filter(|c| c["status"] == status)
            .and_then(|c| c["lastTransitionTime"].as_str().map(str::to_owned))
            .unwrap_or_else(|| rfc3339(now));
        let (reason, message) = match (ok, why) {
            (false, Some((reason, message))) => (Some(reason), Some(message)),
            _ => (None, None),
        };
        conditions.push(json!({
            "type": kind,
            "status": status,
            "lastProbeTime": null,
            "lastTransitionTime": since,
            "reason": reason,
            "message": message,
        }));
    }
    let ips = |ip: &Option<String>| ip.as_ref().map(|ip| json!([{ "ip": ip }]));
    json!({
        "phase": phase(view),
        "hostIP": view.host_ip,
        "hostIPs": [{ "ip": view.host_ip }],
        "podIP": view.pod_ip,
        "podIPs": ips(&view.pod_ip),
        "startTime": view.start_time.map(rfc3339),
        "conditions": conditions,
        "initContainerStatuses": if view.init.is_empty() {
            Value::Null
        } else {
            view.init.iter().map(ContainerView::json).collect()
        },
        "containerStatuses": view.containers.iter().map(ContainerView::json).collect::<Vec<_>>(),
    })
}

fn condition<'a>(status: Option<&'a Value>, kind: &str) -> Option<&'a Value> {
    status?["conditions"]
        .as_array()?
        .iter()
        .find(|c| c["type"] == kind)
}

/// `value` without its nulls and empty objects, so a status written with
/// explicit nulls compares equal to the same status read back.
pub fn normalized(value: &Value) -> Value {
    match value {
        Value::Object(map) => Value::Object(
            map.iter()
                .map(|(k, v)| (k.clone(), normalized(v)))
                .filter(|(_, v)| !v.is_null() && v != &json!({}))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(normalized).collect()),
        other => other.clone(),
    }
}

/// Whether writing `desired` would change `current` (the API's status):
/// compares the fields the stand-in writes.
pub fn differs(desired: &Value, current: Option<&Value>) -> bool {
    let Some(current) = current else {
        return true;
    };
    let desired = normalized(desired);
    let current = normalized(current);
    desired
        .as_object()
        .into_iter()
        .flatten()
        .any(|(k, v)| current.get(k) != Some(v))
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    fn t(secs: u64) -> SystemTime {
        UNIX_EPOCH + Duration::from_secs(1_800_000_000 + secs)
    }

    fn container(name: &str, state: State, ready: bool) -> ContainerView {
        ContainerView {
            name: name.to_owned(),
            image: "lab/test:1".to_owned(),
            image_id: String::new(),
            container_id: None,
            state,
            last: None,
            restarts: 0,
            ready,
            started: ready,
        }
    }

    fn view(containers: Vec<ContainerView>, policy: &str) -> PodView {
        PodView {
            host_ip: "172.18.0.11".to_owned(),
            pod_ip: Some("10.244.1.128".to_owned()),
            start_time: Some(t(0)),
            init: Vec::new(),
            containers,
            restart_policy: policy.to_owned(),
            readiness_gates: Vec::new(),
        }
    }

    fn done(code: i32) -> State {
        State::Terminated(Terminated {
            exit_code: code,
            signal: None,
            reason: if code == 0 { "Completed" } else { "Error" }.to_owned(),
            message: None,
            started_at: t(1),
            finished_at: t(2),
            container_id: "lab://1".to_owned(),
        })
    }

    fn unknown_image() -> State {
        State::Waiting {
            reason: "ErrImageNeverPull".to_owned(),
            message: Some("image \"x\" is not known".to_owned()),
        }
    }

    #[test]
    fn a_pod_with_an_unknown_image_is_pending_and_says_why() {
        let v = view(vec![container("app", unknown_image(), false)], "Always");
        let status = build(&v, None, t(5));
        assert_eq!(status["phase"], "Pending");
        let waiting = &status["containerStatuses"][0]["state"]["waiting"];
        assert_eq!(waiting["reason"], "ErrImageNeverPull");
        let ready = condition(Some(&status), "Ready").unwrap();
        assert_eq!(ready["status"], "False");
        assert_eq!(ready["message"], "containers with unready status: [app]");
    }

    #[test]
    fn a_ready_pod_is_running_with_every_condition_true() {
        let running = State::Running { started_at: t(1) };
        let v = view(vec![container("app", running, true)], "Always");
        let status = build(&v, None, t(5));
        assert_eq!(status["phase"], "Running");
        for kind in OWN_CONDITIONS {
            assert_eq!(
                condition(Some(&status), kind).unwrap()["status"],
                "True",
                "{kind}"
            );
        }
        assert_eq!(status["podIPs"][0]["ip"], "10.244.1.128");
        assert_eq!(
            status["containerStatuses"][0]["state"]["running"]["startedAt"],
            "2027-01-15T08:00:01Z"
        );
    }

    #[test]
    fn phases_follow_the_restart_policy() {
        assert_eq!(
            phase(&view(vec![container("a", done(0), false)], "Never")),
            "Succeeded"
        );
        assert_eq!(
            phase(&view(vec![container("a", done(1), false)], "Never")),
            "Failed"
        );
        assert_eq!(
            phase(&view(vec![container("a", done(1), false)], "OnFailure")),
            "Running"
        );
        assert_eq!(
            phase(&view(vec![container("a", done(0), false)], "Always")),
            "Running"
        );
        let mut backing_off = container(
            "a",
            State::Waiting {
                reason: "CrashLoopBackOff".to_owned(),
                message: None,
            },
            false,
        );
        assert_eq!(phase(&view(vec![backing_off.clone()], "Always")), "Pending");
        backing_off.last = Some(match done(1) {
            State::Terminated(t) => t,
            _ => unreachable!(),
        });
        assert_eq!(phase(&view(vec![backing_off], "Always")), "Running");
    }

    #[test]
    fn init_containers_hold_the_pod_pending_until_they_succeed() {
        let mut v = view(
            vec![container("app", State::Running { started_at: t(1) }, true)],
            "Always",
        );
        v.init = vec![container(
            "init",
            State::Running { started_at: t(1) },
            false,
        )];
        assert_eq!(phase(&v), "Pending");
        let status = build(&v, None, t(5));
        assert_eq!(
            condition(Some(&status), "Initialized").unwrap()["status"],
            "False"
        );
        v.init[0].state = done(0);
        assert_eq!(phase(&v), "Running");
    }

    #[test]
    fn conditions_keep_their_transition_time_and_others_are_carried_over() {
        let running = State::Running { started_at: t(1) };
        let v = view(vec![container("app", running, true)], "Always");
        let mut current = build(&v, None, t(5));
        if let Some(list) = current["conditions"].as_array_mut() {
            list.insert(0, json!({"type": "PodScheduled", "status": "True", "lastTransitionTime": "2027-01-15T08:00:00Z"}));
        }
        let again = build(&v, Some(&current), t(60));
        assert!(
            !differs(&again, Some(&current)),
            "nothing changed, nothing to write"
        );
        let types: Vec<&str> = again["conditions"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["type"].as_str().unwrap())
            .collect();
        assert_eq!(types[0], "PodScheduled");
        let mut unready = v.clone();
        unready.containers[0].ready = false;
        let changed = build(&unready, Some(&current), t(60));
        assert!(differs(&changed, Some(&current)));
        assert_eq!(
            condition(Some(&changed), "Ready").unwrap()["lastTransitionTime"],
            "2027-01-15T08:01:00Z"
        );
        assert_eq!(
            condition(Some(&changed), "Initialized").unwrap()["lastTransitionTime"],
            "2027-01-15T08:00:05Z"
        );
    }
}
