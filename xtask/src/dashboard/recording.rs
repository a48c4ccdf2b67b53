//! A recording of the daemons' `/metrics`: JSON lines, one per round of
//! scrapes, each naming every daemon scraped in it (`job/instance`) with
//! only the series that changed since that daemon's previous scrape (all
//! of them in its first, and in the first after a failed scrape or a round
//! without it). Small enough to keep beside the picture it makes, and read
//! back into every series' samples.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

use crate::lab::egressgw::{AGENT_HEALTH_PORT, NAMESPACE};
use crate::lab::session::Lab;
use crate::lab::topology::Netns;
use crate::lab::{net, probe};

/// The controllers' health port (the chart's default).
const CONTROLLER_HEALTH_PORT: u16 = 9811;
/// The names of the chart's controller Pods start with this (release
/// `egressgw`, as the lab installs it).
const CONTROLLER_POD: &str = "egressgw-controller-";
/// Time between two rounds of scrapes.
pub const INTERVAL: Duration = Duration::from_secs(1);
const SCRAPE_TIMEOUT: Duration = Duration::from_millis(800);

/// One line of a recording: a round of scrapes.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Round {
    /// When the round started, Unix seconds.
    pub t: f64,
    /// Every daemon scraped (`agent/<node>`, `controller/<pod>`).
    pub daemons: BTreeMap<String, Change>,
}

/// Samples by metric name, then by labels as the daemon wrote them
/// (`result="ok"`, empty for none).
pub type Samples = BTreeMap<String, BTreeMap<String, f64>>;

/// What a scrape of one daemon found, against its previous scrape.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Change {
    /// The series that are new or changed.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub set: Samples,
    /// The series gone, by metric name.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub gone: BTreeMap<String, Vec<String>>,
    /// Why the scrape failed; the daemon then has no series until its next
    /// scrape, which lists them all.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Every `egressgw_` sample of an exposition. Comments and values that are
/// not finite numbers are left out.
pub fn samples(exposition: &str) -> Samples {
    let mut samples = Samples::new();
    for line in exposition.lines().filter(|l| l.starts_with("egressgw_")) {
        // A label value may hold a space: the value follows the labels.
        let (name, labels, rest) = match (line.find('{'), line.rfind('}')) {
            (Some(open), Some(close)) if open < close => {
                (&line[..open], &line[open + 1..close], &line[close + 1..])
            }
            _ => match line.split_once(' ') {
                Some((name, rest)) => (name, "", rest),
                None => continue,
            },
        };
        let value = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok());
        if let Some(value) = value.filter(|v| v.is_finite()) {
            samples
                .entry(name.to_owned())
                .or_default()
                .insert(labels.to_owned(), value);
        }
    }
    samples
}

/// The changes from `before` to `now`: what to set, what is gone.
fn changes(before: Option<&Samples>, now: &Samples) -> (Samples, BTreeMap<String, Vec<String>>) {
    let Some(before) = before else {
        return (now.clone(), BTreeMap::new());
    };
    let empty = BTreeMap::new();
    let mut set = Samples::new();
    for (name, series) in now {
        let was = before.get(name).unwrap_or(&empty);
        for (labels, value) in series {
            if was.get(labels) != Some(value) {
                set.entry(name.clone())
                    .or_default()
                    .insert(labels.clone(), *value);
            }
        }
    }
    let mut gone: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for (name, series) in before {
        let is = now.get(name).unwrap_or(&empty);
        for labels in series.keys().filter(|l| !is.contains_key(*l)) {
            gone.entry(name.clone()).or_default().push(labels.clone());
        }
    }
    (set, gone)
}

/// Writes rounds of scrapes as recording lines, each daemon's relative to
/// its scrape in the round before.
#[derive(Debug)]
pub struct Writer<W: Write> {
    out: W,
    last: BTreeMap<String, Samples>,
}

impl<W: Write> Writer<W> {
    pub fn new(out: W) -> Self {
        Self {
            out,
            last: BTreeMap::new(),
        }
    }

    /// Records a round that started at `t`: each daemon scraped, with its
    /// samples or why its scrape failed.
    pub fn round(
        &mut self,
        t: f64,
        scrapes: Vec<(String, Result<Samples, String>)>,
    ) -> anyhow::Result<()> {
        let mut line = Round {
            t: (t * 1000.0).round() / 1000.0,
            daemons: BTreeMap::new(),
        };
        let mut last = BTreeMap::new();
        for (daemon, result) in scrapes {
            let change = match result {
                Ok(now) => {
                    let (set, gone) = changes(self.last.get(&daemon), &now);
                    last.insert(daemon.clone(), now);
                    Change {
                        set,
                        gone,
                        error: None,
                    }
                }
                Err(error) => Change {
                    error: Some(error),
                    ..Change::default()
                },
            };
            line.daemons.insert(daemon, change);
        }
        self.last = last;
        serde_json::to_writer(&mut self.out, &line)?;
        self.out.write_all(b"\n")?;
        Ok(())
    }

    pub fn flush(&mut self) -> std::io::Result<()> {
        self.out.flush()
    }
}

/// One series of a recording: its labels (with `job` and `instance`) and
/// its samples, `(Unix seconds, value)`, in time order, one per scrape that
/// had it.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub labels: BTreeMap<String, String>,
    pub points: Vec<(f64, f64)>,
}

/// Every series of a recording, labelled with its daemon's `job` and
/// `instance`.
pub fn read(text: &str) -> anyhow::Result<Vec<Series>> {
    let mut state: BTreeMap<String, Samples> = BTreeMap::new();
    let mut series: BTreeMap<(String, String, String), Series> = BTreeMap::new();
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let round: Round = serde_json::from_str(line).with_context(|| format!("line {}", n + 1))?;
        state.retain(|daemon, _| round.daemons.contains_key(daemon));
        for (daemon, change) in &round.daemons {
            if change.error.is_some() {
                state.remove(daemon);
                continue;
            }
            let now = state.entry(daemon.clone()).or_default();
            for (name, gone) in &change.gone {
                if let Some(series) = now.get_mut(name) {
                    series.retain(|labels, _| !gone.contains(labels));
                }
            }
            for (name, set) in &change.set {
                now.entry(name.clone()).or_default().extend(set.clone());
            }
            let samples = now
                .iter()
                .flat_map(|(name, s)| s.iter().map(move |l| (name, l)));
            for (name, (labels, value)) in samples {
                let id = (daemon.clone(), name.clone(), labels.clone());
                if !series.contains_key(&id) {
                    let parsed = new_series(daemon, name, labels)
                        .with_context(|| format!("line {}: series {name}{{{labels}}}", n + 1))?;
                    series.insert(id.clone(), parsed);
                }
                if let Some(s) = series.get_mut(&id) {
                    s.points.push((round.t, *value));
                }
            }
        }
    }
    Ok(series.into_values().collect())
}

/// The series `name{labels}` of `daemon` (`job/instance`), without samples.
fn new_series(daemon: &str, name: &str, labels: &str) -> anyhow::Result<Series> {
    let Some((job, instance)) = daemon.split_once('/') else {
        bail!("daemon {daemon:?} is not job/instance");
    };
    let mut labels = parse_labels(labels)?;
    labels.insert("job".to_owned(), job.to_owned());
    labels.insert("instance".to_owned(), instance.to_owned());
    Ok(Series {
        name: name.to_owned(),
        labels,
        points: Vec::new(),
    })
}

/// Labels as written between braces (`a="x",b="y"`), values unescaped.
fn parse_labels(text: &str) -> anyhow::Result<BTreeMap<String, String>> {
    let mut labels = BTreeMap::new();
    let mut chars = text.chars().peekable();
    loop {
        let key: String = chars.by_ref().take_while(|c| *c != '=').collect();
        let key = key.trim_start_matches(',').trim();
        if key.is_empty() {
            break;
        }
        if chars.next() != Some('"') {
            bail!("label {key} has no quoted value");
        }
        let mut value = String::new();
        loop {
            match chars.next() {
                Some('\\') => match chars.next() {
                    Some('n') => value.push('\n'),
                    Some(c) => value.push(c),
                    None => bail!("unterminated escape"),
                },
                Some('"') => break,
                Some(c) => value.push(c),
                None => bail!("unterminated value of label {key}"),
            }
        }
        labels.insert(key.to_owned(), value);
    }
    Ok(labels)
}

/// A daemon of the lab to scrape.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    /// `job/instance`.
    daemon: String,
    netns: Netns,
    addr: SocketAddr,
}

/// Every agent (at its node's address), and every controller Pod there is
/// now (in its own namespace): Pods that roll are found again.
fn targets(lab: &Lab) -> anyhow::Result<Vec<Target>> {
    let mut targets: Vec<Target> = lab
        .state
        .topology
        .nodes
        .iter()
        .map(|n| Target {
            daemon: format!("agent/{}", n.name),
            netns: n.netns.clone(),
            addr: SocketAddr::from((n.ip, AGENT_HEALTH_PORT)),
        })
        .collect();
    let pods = lab.paths.prefix.name("pod-");
    for ns in net::lab_netns(&lab.paths.prefix)? {
        let pod = ns
            .as_str()
            .strip_prefix(&pods)
            .and_then(|rest| rest.split_once('.'))
            .filter(|(namespace, name)| *namespace == NAMESPACE && name.starts_with(CONTROLLER_POD))
            .map(|(_, name)| format!("controller/{name}"));
        if let Some(daemon) = pod {
            targets.push(Target {
                daemon,
                netns: ns.clone(),
                addr: SocketAddr::from(([127, 0, 0, 1], CONTROLLER_HEALTH_PORT)),
            });
        }
    }
    Ok(targets)
}

fn scrape(target: &Target) -> Result<Samples, String> {
    match probe::http_get(&target.netns, target.addr, "/metrics", SCRAPE_TIMEOUT) {
        Ok((200, body)) => Ok(samples(&body)),
        Ok((code, _)) => Err(format!("GET /metrics answered {code}")),
        Err(e) => Err(format!("{e:#}")),
    }
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

/// Scrapes every daemon of `lab` every [`INTERVAL`] for `length`, writing
/// the recording to `out` as it goes (an interrupted recording is a
/// shorter one).
pub fn record(lab: &Lab, length: Duration, out: &Path) -> anyhow::Result<()> {
    let file = File::create(out).with_context(|| format!("creating {}", out.display()))?;
    let mut writer = Writer::new(BufWriter::new(file));
    let started = Instant::now();
    let mut round = 0u32;
    let mut failed = 0usize;
    while started.elapsed() < length {
        let t = unix_now();
        let targets = targets(lab)?;
        let scrapes: Vec<_> = targets
            .iter()
            .map(|target| (target.daemon.clone(), scrape(target)))
            .collect();
        failed += scrapes.iter().filter(|(_, r)| r.is_err()).count();
        writer.round(t, scrapes)?;
        writer
            .flush()
            .with_context(|| format!("writing {}", out.display()))?;
        round += 1;
        if round.is_multiple_of(15) {
            println!(
                "  {}s: {} daemons scraped, {failed} failed scrapes so far",
                started.elapsed().as_secs(),
                targets.len()
            );
        }
        let next = INTERVAL * round;
        if let Some(wait) = next.checked_sub(started.elapsed()) {
            thread::sleep(wait);
        }
    }
    println!(
        "recorded {round} rounds in {} ({failed} failed scrapes)",
        out.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SCRAPE: &str = "# HELP egressgw_eips_held EIPs.\n\
        # TYPE egressgw_eips_held gauge\n\
        egressgw_eips_held 1\n\
        egressgw_reconciles_total{result=\"ok\"} 13\n\
        egressgw_policy_bytes_total{namespace=\"\",policy=\"a b\",gateway=\"g\"} 1180\n\
        egressgw_reconcile_duration_seconds_bucket{le=\"+Inf\"} 13\n\
        process_cpu_seconds_total 4\n\
        # EOF\n";

    #[test]
    fn an_exposition_gives_every_egressgw_sample_by_series() {
        let s = samples(SCRAPE);
        assert_eq!(s.values().map(BTreeMap::len).sum::<usize>(), 4, "{s:?}");
        assert_eq!(s["egressgw_eips_held"][""], 1.0);
        assert_eq!(
            s["egressgw_policy_bytes_total"]["namespace=\"\",policy=\"a b\",gateway=\"g\""],
            1180.0
        );
    }

    #[test]
    fn labels_are_read_back_unescaped() {
        let labels = parse_labels("namespace=\"\",policy=\"a\\\"b\",le=\"+Inf\"").unwrap();
        assert_eq!(labels["namespace"], "");
        assert_eq!(labels["policy"], "a\"b");
        assert_eq!(labels["le"], "+Inf");
        assert!(parse_labels("").unwrap().is_empty());
        assert!(parse_labels("a=b").is_err());
    }

    #[test]
    fn a_recording_keeps_only_changes_and_reads_back_every_sample() {
        let mut writer = Writer::new(Vec::new());
        let first = samples(SCRAPE);
        let mut second = first.clone();
        second.insert("egressgw_eips_held".into(), [(String::new(), 2.0)].into());
        second.remove("egressgw_reconcile_duration_seconds_bucket");
        let node = |result| vec![("agent/node-1".to_owned(), result)];
        writer.round(10.0, node(Ok(first.clone()))).unwrap();
        writer.round(11.0, node(Ok(second.clone()))).unwrap();
        writer.round(12.0, node(Ok(second))).unwrap();
        writer.round(13.0, node(Err("refused".into()))).unwrap();
        writer.round(14.0, node(Ok(first.clone()))).unwrap();
        writer.round(15.0, Vec::new()).unwrap();
        writer.round(16.0, node(Ok(first))).unwrap();
        let text = String::from_utf8(writer.out).unwrap();
        let lines: Vec<Change> = text
            .lines()
            .map(|l| {
                let round: Round = serde_json::from_str(l).unwrap();
                round.daemons.into_values().next().unwrap_or_default()
            })
            .collect();
        assert_eq!((lines[1].set.len(), lines[1].gone.len()), (1, 1), "{text}");
        assert_eq!(lines[2], Change::default(), "nothing changed");
        assert_eq!(lines[3].error.as_deref(), Some("refused"));
        assert_eq!(
            lines[4].set,
            samples(SCRAPE),
            "after a failure, everything again"
        );
        assert_eq!(
            lines[6].set,
            samples(SCRAPE),
            "after a round without it, too"
        );

        let series = read(&text).unwrap();
        let eips = series
            .iter()
            .find(|s| s.name == "egressgw_eips_held")
            .unwrap();
        assert_eq!(
            eips.points,
            [
                (10.0, 1.0),
                (11.0, 2.0),
                (12.0, 2.0),
                (14.0, 1.0),
                (16.0, 1.0)
            ]
        );
        assert_eq!(eips.labels["instance"], "node-1");
        assert_eq!(eips.labels["job"], "agent");
        let bucket = series
            .iter()
            .find(|s| s.name == "egressgw_reconcile_duration_seconds_bucket")
            .unwrap();
        assert_eq!(bucket.points, [(10.0, 13.0), (14.0, 13.0), (16.0, 13.0)]);
    }
}
