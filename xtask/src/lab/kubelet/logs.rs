//! What kubelet's container-log API (`GET /containerLogs/{namespace}/{pod}/
//! {container}`, where the API server's `pods/log` leads) answers, for the
//! log files the stand-in writes: the query as kubelet decodes and
//! validates it, which run of a container a request reads (the current one,
//! or with `previous` the one before), `tailLines` and `limitBytes`, and
//! kubelet's refusals. No I/O: [`super::server`] reads the files and writes
//! the answers.
//!
//! A container's log file holds every run of it, each after a line
//! [`marker`] the stand-in writes before starting it.

use std::collections::BTreeMap;
use std::ops::Range;
use std::path::PathBuf;

/// The line before each start of `container` in its log file.
pub fn marker(container: &str, restart: u32, at: &str) -> String {
    format!("{}{restart}) at {at}\n", marker_prefix(container))
}

/// What every [`marker`] line of `container` starts with.
fn marker_prefix(container: &str) -> String {
    format!("--- egressgw lab: {container} started (restart ")
}

/// A request kubelet refuses: the HTTP status and the text it answers with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub status: u16,
    pub message: String,
}

impl Refusal {
    fn new(status: u16, message: String) -> Self {
        Self { status, message }
    }

    pub fn bad_request(message: String) -> Self {
        Self::new(400, message)
    }

    pub fn not_found(message: String) -> Self {
        Self::new(404, message)
    }

    /// A request for a path kubelet has no handler for.
    pub fn no_such_path() -> Self {
        Self::not_found("404 page not found".to_owned())
    }

    pub fn method_not_allowed() -> Self {
        Self::new(405, "Method Not Allowed".to_owned())
    }

    /// A query kubelet cannot decode (its words, JSON-looking text included).
    fn undecodable() -> Self {
        Self::bad_request(r#"{"message": "Unable to decode query."}"#.to_owned())
    }

    /// A query that fails `ValidatePodLogOptions`.
    fn invalid() -> Self {
        Self::new(422, r#"{"message": "Invalid request."}"#.to_owned())
    }
}

/// The query of a log request, decoded as kubelet decodes `PodLogOptions`
/// (unknown parameters are ignored, as there).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogQuery {
    /// Stream what the container writes until it stops.
    pub follow: bool,
    /// The run before the current one.
    pub previous: bool,
    pub tail_lines: Option<i64>,
    pub limit_bytes: Option<i64>,
    /// Accepted, not applied: the log file holds no time per line.
    pub since_seconds: Option<i64>,
    /// Accepted, not applied, as `since_seconds`.
    pub since_time: Option<String>,
    /// Accepted, not applied: there is no time to put before a line.
    pub timestamps: bool,
    /// `All`, `Stdout` or `Stderr` (`PodLogsQuerySplitStreams`).
    pub stream: Option<String>,
}

impl LogQuery {
    /// Decodes and validates `raw` (the part of the URL after `?`): a value
    /// that does not decode is kubelet's 400, one that decodes but is not
    /// valid its 422.
    pub fn parse(raw: &str) -> Result<Self, Refusal> {
        let params = query_params(raw);
        let first = |key: &str| {
            params
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.as_str())
        };
        let flag = |key: &str| first(key).is_some_and(is_true);
        let number = |key: &str| -> Result<Option<i64>, Refusal> {
            match first(key).filter(|v| !v.is_empty()) {
                None => Ok(None),
                Some(v) => v.parse().map(Some).map_err(|_| Refusal::undecodable()),
            }
        };
        // kubelet's compatibility with the old `tail` parameter: it stands
        // for `tailLines`, and `all` for no limit.
        let tail_lines = match first("tail").filter(|t| !t.is_empty()) {
            Some("all") => None,
            Some(t) => Some(t.parse().map_err(|_| Refusal::undecodable())?),
            None => number("tailLines")?,
        };
        let query = Self {
            follow: flag("follow"),
            previous: flag("previous"),
            tail_lines,
            limit_bytes: number("limitBytes")?,
            since_seconds: number("sinceSeconds")?,
            since_time: first("sinceTime")
                .filter(|t| !t.is_empty())
                .map(str::to_owned),
            timestamps: flag("timestamps"),
            stream: first("stream").map(str::to_owned),
        };
        query.validate()?;
        Ok(query)
    }

    /// `ValidatePodLogOptions` of Kubernetes v1.34.
    fn validate(&self) -> Result<(), Refusal> {
        let stream_ok = match self.stream.as_deref() {
            None | Some("All") => true,
            Some("Stdout" | "Stderr") => self.tail_lines.is_none(),
            Some(_) => false,
        };
        let valid = self.tail_lines.is_none_or(|n| n >= 0)
            && self.limit_bytes.is_none_or(|n| n >= 1)
            && !(self.since_seconds.is_some() && self.since_time.is_some())
            && self.since_seconds.is_none_or(|n| n >= 1)
            && stream_ok;
        if valid {
            Ok(())
        } else {
            Err(Refusal::invalid())
        }
    }

    /// kubelet without the `PodLogsQuerySplitStreams` feature (off by
    /// default in v1.34) serves only both streams together; so does the
    /// stand-in, whose log files hold stdout and stderr as they came.
    pub fn check_stream(&self) -> Result<(), Refusal> {
        match self.stream.as_deref() {
            None | Some("All") => Ok(()),
            Some(other) => Err(Refusal::bad_request(format!(
                "unable to return the given log stream: {other:?}. Please enable PodLogsQuerySplitStreams feature gate in kubelet"
            ))),
        }
    }
}

/// A query parameter's truth as Kubernetes converts it: absent, `0` or
/// `false` (any case) is false, anything else (the empty value too) true.
fn is_true(value: &str) -> bool {
    !(value == "0" || value.eq_ignore_ascii_case("false"))
}

/// `key=value` pairs of a URL query, decoded, in their order.
fn query_params(raw: &str) -> Vec<(String, String)> {
    raw.split('&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

/// `%XX` escapes and `+` (a space in a query) decoded; an escape that is
/// not one is kept as it is.
pub fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(byte)) => {
                out.push(byte);
                i += 3;
            }
            (b'+', _) => {
                out.push(b' ');
                i += 1;
            }
            (other, _) => {
                out.push(other);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// A container's state, as far as its logs go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogState {
    /// Never started; waiting with this reason (`ContainerCreating`,
    /// `ErrImageNeverPull`, ...).
    Waiting(String),
    Running,
    /// It ran and exited. `restarting`: it waits to start again (a
    /// backoff, a hold), so the run that ended is also its `lastState`.
    Exited {
        restarting: bool,
    },
}

/// A container of a Pod the stand-in runs, for the log API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ContainerLogs {
    /// Its log file (it may not exist yet).
    pub path: PathBuf,
    pub state: LogState,
    /// The pid of the running process: a follow ends when it changes.
    pub pid: Option<u32>,
}

/// A Pod the stand-in runs, for the log API.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodLogs {
    pub node: String,
    /// Being stopped: a new Pod of the same name wins over it.
    pub terminating: bool,
    /// Init containers and containers, by name.
    pub containers: BTreeMap<String, ContainerLogs>,
}

/// The line that starts an HTTP request: `GET /path?query HTTP/1.1`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestLine {
    pub method: String,
    pub path: String,
    /// What follows `?`, undecoded; empty without one.
    pub query: String,
}

impl RequestLine {
    /// The request line of an HTTP/1.x request head.
    pub fn parse(head: &[u8]) -> Option<Self> {
        let line = head.split(|b| *b == b'\n').next()?;
        let line = std::str::from_utf8(line).ok()?.trim_end_matches('\r');
        let mut words = line.split(' ');
        let (method, target, version) = (words.next()?, words.next()?, words.next()?);
        if !version.starts_with("HTTP/1.") || words.next().is_some() {
            return None;
        }
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        Some(Self {
            method: method.to_owned(),
            path: path.to_owned(),
            query: query.to_owned(),
        })
    }
}

impl std::fmt::Display for RequestLine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}", self.method, self.path)?;
        if !self.query.is_empty() {
            write!(f, "?{}", self.query)?;
        }
        Ok(())
    }
}

/// The container a log request names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    pub namespace: String,
    pub pod: String,
    pub container: String,
}

impl Target {
    /// `/containerLogs/{namespace}/{pod}/{container}`. Kubernetes names
    /// hold nothing a URL escapes, so the segments are taken as they are.
    pub fn parse(path: &str) -> Option<Self> {
        let rest = path.strip_prefix("/containerLogs/")?;
        let mut parts = rest.split('/');
        let (namespace, pod, container) = (parts.next()?, parts.next()?, parts.next()?);
        if parts.next().is_some() || [namespace, pod, container].contains(&"") {
            return None;
        }
        Some(Self {
            namespace: namespace.to_owned(),
            pod: pod.to_owned(),
            container: container.to_owned(),
        })
    }
}

/// A lab pod (a network namespace, no program), for the log API.
#[derive(Debug, Clone, PartialEq, Eq)]
struct LabPodLogs {
    node: String,
    containers: Vec<String>,
}

/// What the log API knows, as the stand-in's last round left it: the Pods
/// it runs and the lab's own pods, by namespace and name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Directory {
    pods: BTreeMap<(String, String), PodLogs>,
    lab_pods: BTreeMap<(String, String), LabPodLogs>,
}

impl Directory {
    /// Adds a Pod the stand-in runs. Of two Pods of one name (one being
    /// stopped, its successor starting), the one not being stopped is
    /// served, as kubelet serves the Pod the API has.
    pub fn add_pod(&mut self, namespace: &str, name: &str, pod: PodLogs) {
        let key = (namespace.to_owned(), name.to_owned());
        if self
            .pods
            .get(&key)
            .is_some_and(|had| !had.terminating && pod.terminating)
        {
            return;
        }
        self.pods.insert(key, pod);
    }

    /// Adds a lab pod bound to `node`, with its containers' names.
    pub fn add_lab_pod(
        &mut self,
        namespace: &str,
        name: &str,
        node: &str,
        containers: Vec<String>,
    ) {
        let key = (namespace.to_owned(), name.to_owned());
        let node = node.to_owned();
        self.lab_pods.insert(key, LabPodLogs { node, containers });
    }

    /// The container `target` names on `node`, or kubelet's answer when
    /// there is none: 404 for a Pod not on the node or a container not in
    /// the Pod, 400 for a lab pod's container, which runs nothing.
    pub fn find(&self, node: &str, target: &Target) -> Result<&ContainerLogs, Refusal> {
        let key = (target.namespace.clone(), target.pod.clone());
        let (pod, container) = (&target.pod, &target.container);
        let no_container =
            || Refusal::not_found(format!("container {container:?} not found in pod {pod:?}"));
        if let Some(found) = self.pods.get(&key).filter(|p| p.node == node) {
            return found.containers.get(container).ok_or_else(no_container);
        }
        if let Some(lab) = self.lab_pods.get(&key).filter(|p| p.node == node) {
            if !lab.containers.contains(container) {
                return Err(no_container());
            }
            return Err(Refusal::bad_request(format!(
                "container {container:?} in pod {pod:?} is not available: a lab pod is a network namespace with no program, it writes no log"
            )));
        }
        Err(Refusal::not_found(format!("pod {pod:?} does not exist")))
    }
}

/// The byte ranges of the runs of `container` in `text`, its log file, in
/// order: what follows each [`marker`] line, up to the next one. Bytes
/// before the first marker belong to no run; marker lines belong to none.
pub fn runs(text: &[u8], container: &str) -> Vec<Range<usize>> {
    let prefix = marker_prefix(container);
    let mut runs: Vec<Range<usize>> = Vec::new();
    for start in line_starts(text, true) {
        if !text[start..].starts_with(prefix.as_bytes()) {
            continue;
        }
        if let Some(run) = runs.last_mut() {
            run.end = start;
        }
        let after = text[start..]
            .iter()
            .position(|b| *b == b'\n')
            .map_or(text.len(), |nl| start + nl + 1);
        runs.push(after..text.len());
    }
    runs
}

/// Where a run continues in `data`, bytes appended to its file since it
/// was last read (`at_line_start`: whether they begin a line): the length
/// of what still belongs to it, which is less than `data.len()` once the
/// next run's [`marker`] is there.
pub fn run_part(data: &[u8], at_line_start: bool, container: &str) -> usize {
    let prefix = marker_prefix(container);
    line_starts(data, at_line_start)
        .find(|start| data[*start..].starts_with(prefix.as_bytes()))
        .unwrap_or(data.len())
}

/// The offsets in `text` where a line starts: 0 if `first` says so, and
/// after each newline (the end of `text` excluded).
fn line_starts(text: &[u8], first: bool) -> impl Iterator<Item = usize> + '_ {
    let after_newlines = text
        .iter()
        .enumerate()
        .filter(|(_, b)| **b == b'\n')
        .map(|(i, _)| i + 1);
    first
        .then_some(0)
        .into_iter()
        .chain(after_newlines)
        .filter(move |i| *i < text.len())
}

/// Which run a request reads, as kubelet's `validateContainerLogStatus`
/// picks a container: `runs` is how many there are in the file (the last
/// is the current or latest one). `previous` reads the run that ended
/// last before the current one: for a running or finished container the
/// one before the last, for one waiting to restart the last.
pub fn pick_run(
    state: &LogState,
    runs: usize,
    previous: bool,
    container: &str,
    pod: &str,
) -> Result<usize, Refusal> {
    let last = runs.checked_sub(1);
    let picked = match (state, previous) {
        (LogState::Waiting(_), true) => None,
        (LogState::Exited { restarting: true }, true) => last,
        (LogState::Running | LogState::Exited { .. }, true) => runs.checked_sub(2),
        (LogState::Waiting(reason), false) => {
            return Err(Refusal::bad_request(format!(
                "container {container:?} in pod {pod:?} is waiting to start: {reason}"
            )));
        }
        (LogState::Running | LogState::Exited { .. }, false) => last,
    };
    picked.ok_or_else(|| {
        Refusal::bad_request(if previous {
            format!("previous terminated container {container:?} in pod {pod:?} not found")
        } else {
            format!("container {container:?} in pod {pod:?} is waiting to start - no logs yet")
        })
    })
}

/// Where the last `lines` lines of `text` start (a last line without its
/// newline counts as one); 0 when it holds fewer.
pub fn tail_start(text: &[u8], lines: u64) -> usize {
    if lines == 0 {
        return text.len();
    }
    let body = text.strip_suffix(b"\n").unwrap_or(text);
    let mut seen = 0;
    for (i, byte) in body.iter().enumerate().rev() {
        if *byte == b'\n' {
            seen += 1;
            if seen == lines {
                return i + 1;
            }
        }
    }
    0
}

/// What `limitBytes` leaves to write: `None` for no limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget(Option<u64>);

impl Budget {
    pub fn new(limit_bytes: Option<i64>) -> Self {
        Self(limit_bytes.map(|n| u64::try_from(n).unwrap_or(0)))
    }

    /// The part of `data` the budget allows (kubelet cuts inside a line
    /// too), which it then no longer has.
    pub fn take<'a>(&mut self, data: &'a [u8]) -> &'a [u8] {
        let Some(left) = &mut self.0 else {
            return data;
        };
        let allowed = usize::try_from(*left).map_or(data.len(), |l| l.min(data.len()));
        *left = left.saturating_sub(u64::try_from(allowed).unwrap_or(u64::MAX));
        &data[..allowed]
    }

    pub fn spent(&self) -> bool {
        self.0 == Some(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AT: &str = "2026-01-01T00:00:00Z";

    fn log(parts: &[&str]) -> Vec<u8> {
        parts.concat().into_bytes()
    }

    fn text(bytes: &[u8], range: Range<usize>) -> &str {
        std::str::from_utf8(&bytes[range]).unwrap()
    }

    #[test]
    fn a_query_decodes_as_kubelet_decodes_pod_log_options() {
        let q =
            LogQuery::parse("follow=true&tailLines=10&limitBytes=5&sinceSeconds=3&timestamps=1")
                .unwrap();
        assert!(q.follow && q.timestamps && !q.previous);
        assert_eq!(
            (q.tail_lines, q.limit_bytes, q.since_seconds),
            (Some(10), Some(5), Some(3))
        );
        assert_eq!(LogQuery::parse("").unwrap(), LogQuery::default());
        let q = LogQuery::parse("previous=FALSE&follow=0&timestamps=&unknown=x").unwrap();
        assert!(!q.previous && !q.follow && q.timestamps);
        let q = LogQuery::parse("sinceTime=2026-01-01T00%3A00%3A00Z").unwrap();
        assert_eq!(q.since_time.as_deref(), Some("2026-01-01T00:00:00Z"));
    }

    #[test]
    fn the_old_tail_parameter_stands_for_tail_lines() {
        assert_eq!(
            LogQuery::parse("tail=3&tailLines=9").unwrap().tail_lines,
            Some(3)
        );
        assert_eq!(LogQuery::parse("tail=all").unwrap().tail_lines, None);
    }

    #[test]
    fn a_query_that_does_not_decode_is_400_and_an_invalid_one_422() {
        for raw in ["tailLines=x", "limitBytes=1.5", "tail=-x"] {
            assert_eq!(LogQuery::parse(raw).unwrap_err().status, 400, "{raw}");
        }
        for raw in [
            "tailLines=-1",
            "limitBytes=0",
            "sinceSeconds=0",
            "sinceSeconds=5&sinceTime=2026-01-01T00:00:00Z",
            "stream=Both",
            "stream=Stdout&tailLines=1",
        ] {
            let refusal = LogQuery::parse(raw).unwrap_err();
            assert_eq!(refusal.status, 422, "{raw}");
            assert_eq!(refusal.message, r#"{"message": "Invalid request."}"#);
        }
    }

    #[test]
    fn only_both_streams_together_are_served() {
        assert!(
            LogQuery::parse("stream=All")
                .unwrap()
                .check_stream()
                .is_ok()
        );
        let refusal = LogQuery::parse("stream=Stderr")
            .unwrap()
            .check_stream()
            .unwrap_err();
        assert_eq!(refusal.status, 400);
        assert!(refusal.message.contains("PodLogsQuerySplitStreams"));
    }

    #[test]
    fn percent_escapes_and_plus_are_decoded_and_broken_escapes_kept() {
        assert_eq!(percent_decode("a%3Ab+c%2"), "a:b c%2");
        assert_eq!(percent_decode("%zz"), "%zz");
    }

    #[test]
    fn each_run_is_what_follows_its_marker_up_to_the_next() {
        let file = log(&[
            &marker("web", 0, AT),
            "one\ntwo\n",
            &marker("web", 1, AT),
            "three\n",
            "partial",
        ]);
        let found = runs(&file, "web");
        assert_eq!(found.len(), 2);
        assert_eq!(text(&file, found[0].clone()), "one\ntwo\n");
        assert_eq!(text(&file, found[1].clone()), "three\npartial");
        assert!(runs(&file, "we").is_empty(), "another container's marker");
        assert!(runs(b"no marker\n", "web").is_empty());
    }

    #[test]
    fn a_marker_in_the_middle_of_a_line_starts_no_run() {
        let file = log(&[&marker("web", 0, AT), "said: ", &marker("web", 1, AT)]);
        assert_eq!(runs(&file, "web").len(), 1);
    }

    #[test]
    fn a_run_being_followed_ends_at_the_next_marker() {
        let next = marker("web", 1, AT);
        let data = log(&["more\n", &next, "new run\n"]);
        assert_eq!(run_part(&data, true, "web"), 5);
        assert_eq!(run_part(b"more\nstill\n", true, "web"), 11);
        let data = log(&[&next, "new run\n"]);
        assert_eq!(run_part(&data, true, "web"), 0);
        assert_eq!(run_part(&data, false, "web"), data.len(), "mid-line");
    }

    #[test]
    fn the_current_run_is_the_last_and_previous_the_one_that_ended_before() {
        let pick = |state: &LogState, runs, previous| pick_run(state, runs, previous, "c", "p");
        assert_eq!(pick(&LogState::Running, 3, false), Ok(2));
        assert_eq!(pick(&LogState::Running, 3, true), Ok(1));
        let crashed = LogState::Exited { restarting: true };
        assert_eq!(pick(&crashed, 2, false), Ok(1));
        assert_eq!(
            pick(&crashed, 2, true),
            Ok(1),
            "the run that ended is lastState"
        );
        let done = LogState::Exited { restarting: false };
        assert_eq!(pick(&done, 1, false), Ok(0));
        assert_eq!(
            pick(&done, 1, true).unwrap_err().message,
            r#"previous terminated container "c" in pod "p" not found"#
        );
        assert_eq!(pick(&LogState::Running, 1, true).unwrap_err().status, 400);
    }

    #[test]
    fn a_container_that_never_ran_is_waiting_to_start() {
        let waiting = LogState::Waiting("ErrImageNeverPull".to_owned());
        let refusal = pick_run(&waiting, 0, false, "app", "x").unwrap_err();
        assert_eq!(refusal.status, 400);
        assert_eq!(
            refusal.message,
            r#"container "app" in pod "x" is waiting to start: ErrImageNeverPull"#
        );
        assert!(pick_run(&waiting, 0, true, "app", "x").is_err());
    }

    #[test]
    fn a_request_line_gives_method_path_and_query() {
        let line =
            RequestLine::parse(b"GET /containerLogs/a/b/c?follow=true HTTP/1.1\r\nHost: x\r\n\r\n")
                .unwrap();
        assert_eq!(line.method, "GET");
        assert_eq!(line.path, "/containerLogs/a/b/c");
        assert_eq!(line.query, "follow=true");
        assert_eq!(
            RequestLine::parse(b"GET /x HTTP/1.0\r\n").unwrap().query,
            ""
        );
        assert!(RequestLine::parse(b"GET /x\r\n").is_none());
        assert!(RequestLine::parse(b"\x16\x03\x01 binary").is_none());
    }

    #[test]
    fn a_log_path_names_namespace_pod_and_container() {
        let target = Target::parse("/containerLogs/team-a/web-1/app").unwrap();
        assert_eq!(
            (
                target.namespace.as_str(),
                target.pod.as_str(),
                target.container.as_str()
            ),
            ("team-a", "web-1", "app")
        );
        for path in [
            "/containerLogs/team-a/web-1",
            "/containerLogs/team-a/web-1/app/x",
            "/containerLogs//web-1/app",
            "/logs/team-a/web-1/app",
        ] {
            assert!(Target::parse(path).is_none(), "{path}");
        }
    }

    fn pod_logs(node: &str, terminating: bool) -> PodLogs {
        let web = ContainerLogs {
            path: PathBuf::from(format!("/logs/{node}/web.log")),
            state: LogState::Running,
            pid: Some(7),
        };
        PodLogs {
            node: node.to_owned(),
            terminating,
            containers: BTreeMap::from([("web".to_owned(), web)]),
        }
    }

    fn target(pod: &str, container: &str) -> Target {
        Target {
            namespace: "ns".to_owned(),
            pod: pod.to_owned(),
            container: container.to_owned(),
        }
    }

    #[test]
    fn unknown_pods_and_containers_are_404_as_kubelet_says_them() {
        let mut directory = Directory::default();
        directory.add_pod("ns", "web-1", pod_logs("node-1", false));
        assert!(directory.find("node-1", &target("web-1", "web")).is_ok());
        let refusal = directory
            .find("node-1", &target("web-2", "web"))
            .unwrap_err();
        assert_eq!(
            refusal,
            Refusal::not_found(r#"pod "web-2" does not exist"#.to_owned())
        );
        let refusal = directory
            .find("node-2", &target("web-1", "web"))
            .unwrap_err();
        assert_eq!(refusal.status, 404, "a Pod of another node");
        let refusal = directory
            .find("node-1", &target("web-1", "nope"))
            .unwrap_err();
        assert_eq!(
            refusal,
            Refusal::not_found(r#"container "nope" not found in pod "web-1""#.to_owned())
        );
    }

    #[test]
    fn a_lab_pod_has_its_container_but_no_log() {
        let mut directory = Directory::default();
        directory.add_lab_pod("ns", "web-1", "node-1", vec!["app".to_owned()]);
        let refusal = directory
            .find("node-1", &target("web-1", "app"))
            .unwrap_err();
        assert_eq!(refusal.status, 400);
        assert!(
            refusal.message.contains("is not available"),
            "{}",
            refusal.message
        );
        let refusal = directory
            .find("node-1", &target("web-1", "web"))
            .unwrap_err();
        assert_eq!(refusal.status, 404);
    }

    #[test]
    fn a_pod_being_stopped_gives_way_to_its_successor_of_the_same_name() {
        let mut directory = Directory::default();
        directory.add_pod("ns", "web-1", pod_logs("node-1", false));
        directory.add_pod("ns", "web-1", pod_logs("node-2", true));
        assert!(directory.find("node-1", &target("web-1", "web")).is_ok());
        let mut directory = Directory::default();
        directory.add_pod("ns", "web-1", pod_logs("node-2", true));
        directory.add_pod("ns", "web-1", pod_logs("node-1", false));
        assert!(directory.find("node-1", &target("web-1", "web")).is_ok());
    }

    #[test]
    fn tail_lines_counts_a_last_line_without_newline() {
        let text = b"a\nb\nc\n";
        assert_eq!(&text[tail_start(text, 2)..], b"b\nc\n");
        assert_eq!(&text[tail_start(text, 3)..], b"a\nb\nc\n");
        assert_eq!(&text[tail_start(text, 9)..], b"a\nb\nc\n");
        assert_eq!(&text[tail_start(text, 0)..], b"");
        let partial = b"a\nb\nc";
        assert_eq!(&partial[tail_start(partial, 1)..], b"c");
        assert_eq!(&partial[tail_start(partial, 2)..], b"b\nc");
        assert_eq!(tail_start(b"", 1), 0);
    }

    #[test]
    fn limit_bytes_cuts_across_writes_and_inside_a_line() {
        let mut budget = Budget::new(Some(5));
        assert_eq!(budget.take(b"abc"), b"abc");
        assert!(!budget.spent());
        assert_eq!(budget.take(b"defg\n"), b"de");
        assert!(budget.spent());
        assert_eq!(budget.take(b"more"), b"");
        let mut unlimited = Budget::new(None);
        assert_eq!(unlimited.take(b"all of it"), b"all of it");
        assert!(!unlimited.spent());
    }
}
