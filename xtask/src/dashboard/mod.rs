//! `cargo xtask dashboard`: the chart's Grafana dashboard
//! (`deploy/helm/egressgw/files/dashboard.json`) drawn without Grafana, for
//! the docs. `record` scrapes the lab's daemons every second into a
//! recording ([`recording`]); `render` evaluates the dashboard's panels on
//! it ([`query`]) and draws them, in the dashboard's rows, titles, units
//! and legends, as SVG ([`svg`]).
//!
//! The panels' queries are PromQL in the dashboard and Rust here: each
//! drawn panel names the metric of each of its queries, and the tests
//! check it against the dashboard's expression of the same index.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use serde_json::Value;

use crate::chart::CHART_DIR;
use crate::lab::session::Lab;
use crate::lab::state::Paths;

mod query;
mod recording;
mod svg;

use query::{Eval, Line};

/// The dashboard, relative to the chart.
pub const DASHBOARD: &str = "files/dashboard.json";
/// The recording and the picture the docs show, relative to the workspace root.
const RECORDING: &str = "docs/img/dashboard-recording.json";
const PICTURE: &str = "docs/img/dashboard.svg";
/// The window of the panels' rates. Grafana's `$__rate_interval` for a
/// 1 s scrape is 4 s, too short for the policy counters, which the agents
/// read every 5 s; 16 s holds 16 scrapes 15 s apart, three reads, so a
/// steady rate draws flat instead of swinging by a third.
const RATE_WINDOW: f64 = 16.0;

/// `cargo xtask dashboard <command>`.
#[derive(Debug, clap::Subcommand)]
pub enum DashboardCommand {
    /// Scrape every agent and controller of the running lab every second
    /// into a recording (JSON lines, a round of scrapes each, with only what
    /// changed since each daemon's previous scrape).
    Record {
        /// How long to record.
        #[arg(long, default_value_t = 90)]
        seconds: u64,
        /// The recording [default: docs/img/dashboard-recording.json].
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Draw the dashboard's panels over a recording, as SVG.
    Render {
        /// The recording [default: docs/img/dashboard-recording.json].
        #[arg(long, value_name = "FILE")]
        recording: Option<PathBuf>,
        /// The picture [default: docs/img/dashboard.svg].
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
}

pub fn run(command: &DashboardCommand) -> anyhow::Result<ExitCode> {
    let root = crate::workspace_root();
    let or_default = |given: &Option<PathBuf>, default: &str| {
        given.clone().unwrap_or_else(|| root.join(default))
    };
    match command {
        DashboardCommand::Record { seconds, out } => {
            let lab = Lab::open(&Paths::from_env()?)?;
            if lab.state.egressgw.is_none() {
                bail!(
                    "egressgw is not deployed in the lab: run `{}` first",
                    lab.command("lab deploy")
                );
            }
            let out = or_default(out, RECORDING);
            println!(
                "recording the daemons' /metrics every {} s for {seconds} s into {}",
                recording::INTERVAL.as_secs(),
                out.display()
            );
            recording::record(&lab, Duration::from_secs(*seconds), &out)?;
        }
        DashboardCommand::Render { recording, out } => {
            let recording = or_default(recording, RECORDING);
            let out = or_default(out, PICTURE);
            let svg = render(&dashboard(&root)?, &recording)?;
            fs::write(&out, svg).with_context(|| format!("writing {}", out.display()))?;
            println!("wrote {}", out.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The chart's dashboard.
pub fn dashboard(root: &Path) -> anyhow::Result<Value> {
    let path = root.join(CHART_DIR).join(DASHBOARD);
    let text = fs::read_to_string(&path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

/// Every panel of a dashboard in order, rows included, each followed by
/// the panels it holds when collapsed.
pub fn panels(dashboard: &Value) -> Vec<&Value> {
    fn walk<'a>(panels: &'a Value, out: &mut Vec<&'a Value>) {
        for panel in panels.as_array().into_iter().flatten() {
            out.push(panel);
            if let Some(nested) = panel.get("panels") {
                walk(nested, out);
            }
        }
    }
    let mut out = Vec::new();
    walk(&dashboard["panels"], &mut out);
    out
}

/// One query of a drawn panel: the metric it reads and how, as the
/// dashboard's query of the same index computes it.
struct Query {
    metric: &'static str,
    eval: fn(&Eval, &'static str) -> Vec<Line>,
}

/// The panels drawn, by title, with their queries. The dashboard's table
/// is left out: its rows are the "Policies not Ready" count's.
const DRAWN: &[(&str, &[Query])] = &[
    (
        "Egress throughput by policy",
        &[Query {
            metric: "egressgw_policy_bytes_total",
            eval: |e, m| {
                let rates = e.rate(m, RATE_WINDOW);
                query::map(query::sum_by(rates, &["namespace", "policy"]), |v| v * 8.0)
            },
        }],
    ),
    (
        "Egress packets by policy",
        &[Query {
            metric: "egressgw_policy_packets_total",
            eval: |e, m| query::sum_by(e.rate(m, RATE_WINDOW), &["namespace", "policy"]),
        }],
    ),
    (
        "Policies not Ready",
        &[Query {
            metric: "egressgw_policy_ready",
            eval: |e, m| vec![query::count_equal(&e.instant(m), 0.0, e.steps.len())],
        }],
    ),
    (
        "Ready gateway nodes",
        &[Query {
            metric: "egressgw_gateway_ready_nodes",
            eval: |e, m| query::max_by(e.instant(m), &["gateway"]),
        }],
    ),
    (
        "EIPs held by node",
        &[Query {
            metric: "egressgw_eips_held",
            eval: |e, m| query::sum_by(e.instant(m), &["instance"]),
        }],
    ),
    (
        "EIP moves in the last 10 m",
        &[Query {
            metric: "egressgw_eip_moves_total",
            eval: |e, m| {
                let moves = query::sum_by(e.increase(m, 600.0), &["gateway"]);
                let gateways =
                    query::max_by(e.instant("egressgw_gateway_ready_nodes"), &["gateway"]);
                query::or(moves, query::map(gateways, |_| 0.0))
            },
        }],
    ),
    (
        "Reconcile duration",
        &[
            Query {
                metric: "egressgw_reconcile_duration_seconds_bucket",
                eval: |e, m| quantile(e, m, 0.5),
            },
            Query {
                metric: "egressgw_reconcile_duration_seconds_bucket",
                eval: |e, m| quantile(e, m, 0.99),
            },
        ],
    ),
    (
        "Reconciles by result",
        &[Query {
            metric: "egressgw_reconciles_total",
            eval: |e, m| query::sum_by(e.rate(m, RATE_WINDOW), &["result"]),
        }],
    ),
    (
        "Reconcile operations by result",
        &[Query {
            metric: "egressgw_reconcile_operations_total",
            eval: |e, m| query::sum_by(e.rate(m, RATE_WINDOW), &["result"]),
        }],
    ),
    (
        "Time since the last successful reconcile",
        &[Query {
            metric: "egressgw_reconcile_last_success_timestamp_seconds",
            eval: |e, m| e.age(m),
        }],
    ),
    (
        "Peers not answering",
        &[Query {
            metric: "egressgw_peer_up",
            eval: |e, m| query::sum_by(query::map(e.instant(m), |v| 1.0 - v), &["instance"]),
        }],
    ),
    (
        "Controller leader",
        &[Query {
            metric: "egressgw_controller_leader",
            eval: |e, m| e.instant(m),
        }],
    ),
];

/// `histogram_quantile(q, sum by (le) (rate(buckets[w])))`.
fn quantile(e: &Eval, buckets: &str, q: f64) -> Vec<Line> {
    query::histogram_quantile(q, query::sum_by(e.rate(buckets, RATE_WINDOW), &["le"]))
}

/// A legend format (`{{namespace}}/{{policy}}`) filled in with `labels`.
fn legend(format: &str, labels: &query::Labels) -> String {
    let mut out = String::new();
    let mut rest = format;
    while let Some((before, after)) = rest.split_once("{{") {
        out.push_str(before);
        let Some((name, after)) = after.split_once("}}") else {
            rest = after;
            break;
        };
        out.push_str(labels.get(name.trim()).map_or("", String::as_str));
        rest = after;
    }
    out.push_str(rest);
    out
}

/// The dashboard's panel drawn from the recording's lines.
fn draw(panel: &Value, queries: &[Query], eval: &Eval) -> anyhow::Result<svg::Panel> {
    let title = panel["title"].as_str().unwrap_or_default().to_owned();
    let targets = panel["targets"].as_array().map_or(&[][..], Vec::as_slice);
    if targets.len() != queries.len() {
        bail!(
            "panel {title:?} has {} queries in the dashboard, {} here",
            targets.len(),
            queries.len()
        );
    }
    let defaults = &panel["fieldConfig"]["defaults"];
    let mut lines = Vec::new();
    for (target, q) in targets.iter().zip(queries) {
        let format = target["legendFormat"].as_str().unwrap_or_default();
        for line in (q.eval)(eval, q.metric) {
            lines.push(svg::Plotted {
                legend: legend(format, &line.labels),
                values: line.values,
            });
        }
    }
    if panel["type"] == "stat" {
        let value = lines
            .first()
            .and_then(|l| l.values.iter().rev().find_map(|v| *v));
        let red = defaults["thresholds"]["steps"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|s| s["color"] == "red")
            .find_map(|s| s["value"].as_f64());
        return Ok(svg::Panel::Stat(svg::Stat {
            title,
            value,
            alarm: matches!((value, red), (Some(v), Some(r)) if v >= r),
        }));
    }
    Ok(svg::Panel::Chart(svg::Chart {
        title,
        unit: defaults["unit"].as_str().unwrap_or("none").to_owned(),
        integers: defaults["decimals"].as_u64() == Some(0),
        max: defaults["max"].as_f64(),
        lines,
    }))
}

/// The dashboard's panels over `recording`, as SVG.
fn render(dashboard: &Value, recording: &Path) -> anyhow::Result<String> {
    let text = fs::read_to_string(recording)
        .with_context(|| format!("reading {}", recording.display()))?;
    let series =
        recording::read(&text).with_context(|| format!("parsing {}", recording.display()))?;
    let daemons = series
        .iter()
        .map(|s| (&s.labels["job"], &s.labels["instance"]))
        .collect::<std::collections::BTreeSet<_>>()
        .len();
    let eval = Eval::new(series, 1.0);
    let mut rows: Vec<svg::Row> = Vec::new();
    for panel in panels(dashboard) {
        let title = panel["title"].as_str().unwrap_or_default();
        if panel["type"] == "row" {
            rows.push(svg::Row {
                title: title.to_owned(),
                panels: Vec::new(),
            });
            continue;
        }
        let Some((_, queries)) = DRAWN.iter().find(|(t, _)| *t == title) else {
            continue;
        };
        let drawn = draw(panel, queries, &eval)?;
        match rows.last_mut() {
            Some(row) => row.panels.push(drawn),
            None => bail!("panel {title:?} is in no row"),
        }
    }
    let seconds = match (eval.steps.first(), eval.steps.last()) {
        (Some(first), Some(last)) => last - first,
        _ => bail!("{} holds no samples", recording.display()),
    };
    let name = recording
        .file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned());
    let page = svg::Page {
        title: dashboard["title"].as_str().unwrap_or("egressgw").to_owned(),
        subtitle: format!(
            "{name}: {daemons} daemons of the lab scraped every {} s for {seconds:.0} s \
             (times UTC); rates over {RATE_WINDOW:.0} s; namespace, policy and gateway: All",
            recording::INTERVAL.as_secs()
        ),
        steps: eval.steps.clone(),
        rows,
    };
    Ok(svg::render(&page))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_drawn_panel_reads_the_metrics_of_the_dashboards_queries() {
        let dashboard = dashboard(&crate::workspace_root()).unwrap();
        let all = panels(&dashboard);
        for (title, queries) in DRAWN {
            let panel = all
                .iter()
                .find(|p| p["title"] == *title)
                .unwrap_or_else(|| panic!("the dashboard has no panel {title:?}"));
            let targets = panel["targets"].as_array().unwrap();
            assert_eq!(targets.len(), queries.len(), "panel {title:?}");
            for (target, q) in targets.iter().zip(*queries) {
                let expr = target["expr"].as_str().unwrap();
                assert!(
                    expr.contains(q.metric),
                    "panel {title:?}: {expr:?} does not read {}",
                    q.metric
                );
            }
        }
        // Every chart and stat of the dashboard is drawn.
        for panel in all {
            let title = panel["title"].as_str().unwrap();
            if ["timeseries", "stat"].contains(&panel["type"].as_str().unwrap()) {
                assert!(
                    DRAWN.iter().any(|(t, _)| *t == title),
                    "{title:?} is not drawn"
                );
            }
        }
    }

    #[test]
    fn legends_are_filled_in_from_the_labels() {
        let labels: query::Labels = [("namespace", ""), ("policy", "web")]
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        assert_eq!(legend("{{namespace}}/{{ policy }}", &labels), "/web");
        assert_eq!(legend("p99", &labels), "p99");
        assert_eq!(legend("{{gateway}}", &labels), "");
        assert_eq!(legend("a {{broken", &labels), "a broken");
    }

    #[test]
    fn the_picture_in_the_docs_is_the_render_of_the_recording_beside_it() {
        let root = crate::workspace_root();
        let svg = render(&dashboard(&root).unwrap(), &root.join(RECORDING)).unwrap();
        let committed = fs::read_to_string(root.join(PICTURE)).unwrap();
        assert!(
            svg == committed,
            "{PICTURE} is not the render of {RECORDING}: run `cargo xtask dashboard render`"
        );
    }
}
