//! The bench's results: every sample, their summary per case and variant,
//! the table and the chart. Pure: no cluster, no I/O.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use egressgw_core::model::DatapathChoice;

use super::chart::{Bar, Chart, Series};
use super::client::ClientResult;

/// The three cases, as the reference system's table names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub enum Case {
    /// hostNetwork client on the source node to hostNetwork server on the
    /// gateway node, over the underlay.
    NodeToNode,
    /// The same Pods, between the two nodes' `egress.vxlan` addresses.
    TunnelToTunnel,
    /// A Pod on the source node, selected by the bench's policy, to the
    /// target outside the cluster, through the gateway node with the EIP.
    PodToTarget,
}

impl Case {
    pub const ALL: [Case; 3] = [Case::NodeToNode, Case::TunnelToTunnel, Case::PodToTarget];

    /// 1, 2 or 3.
    pub fn number(self) -> u8 {
        match self {
            Case::NodeToNode => 1,
            Case::TunnelToTunnel => 2,
            Case::PodToTarget => 3,
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            Case::NodeToNode => "node -> node",
            Case::TunnelToTunnel => "egress VXLAN -> egress VXLAN",
            Case::PodToTarget => "pod -> egress node -> target",
        }
    }

    /// Whether the tunnel's checksum offload matters to this case.
    pub fn uses_tunnel(self) -> bool {
        self != Case::NodeToNode
    }
}

/// How a sample was taken besides its case.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Variant {
    /// iperf3 `-R`: the server sends.
    pub reverse: bool,
    /// tx checksum offload on `egress.vxlan` as read back on the source
    /// node during the run (`None`: not known).
    pub offload: Option<bool>,
    /// The datapath the source node's agent reported (`None`: not known).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub datapath: Option<BenchDatapath>,
}

/// A datapath the cases run on: what the bench switches the agents to, and
/// what the source node's agent reports (its `EgressTunnel`'s
/// `status.datapath`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BenchDatapath {
    /// The eBPF classifier with its fast path.
    Ebpf,
    /// The eBPF classifier, every packet the marked way (`ebpf.fastPath`
    /// off).
    EbpfMarked,
    /// The nftables table alone.
    Nftables,
}

impl BenchDatapath {
    /// From an agent's report: the datapath's name and, on eBPF, whether
    /// the fast path is on (an agent that does not say has it on).
    pub fn reported(name: &str, fast_path: Option<bool>) -> Option<Self> {
        match (name, fast_path) {
            ("nftables", _) => Some(Self::Nftables),
            ("ebpf", Some(false)) => Some(Self::EbpfMarked),
            ("ebpf", _) => Some(Self::Ebpf),
            _ => None,
        }
    }

    /// The `datapath` config key that gives it.
    pub fn choice(self) -> DatapathChoice {
        match self {
            Self::Ebpf | Self::EbpfMarked => DatapathChoice::Ebpf,
            Self::Nftables => DatapathChoice::Nftables,
        }
    }

    /// The `ebpf.fastPath` config key that gives it (`None`: not eBPF).
    pub fn fast_path(self) -> Option<bool> {
        match self {
            Self::Ebpf => Some(true),
            Self::EbpfMarked => Some(false),
            Self::Nftables => None,
        }
    }
}

impl std::fmt::Display for BenchDatapath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Ebpf => "ebpf",
            Self::EbpfMarked => "ebpf-marked",
            Self::Nftables => "nftables",
        })
    }
}

impl Variant {
    pub fn direction(self) -> &'static str {
        if self.reverse { "reverse" } else { "forward" }
    }

    pub fn offload_label(self) -> &'static str {
        match self.offload {
            Some(true) => "on",
            Some(false) => "off",
            None => "?",
        }
    }

    pub fn datapath_label(self) -> String {
        self.datapath.map_or_else(|| "?".into(), |d| d.to_string())
    }

    /// `forward, offload on, ebpf`.
    pub fn label(self) -> String {
        let mut label = format!("{}, offload {}", self.direction(), self.offload_label());
        if let Some(d) = self.datapath {
            label += &format!(", {d}");
        }
        label
    }

    /// Table order: offload on first (as the reference system's headline
    /// numbers are), then datapath, then direction.
    fn order(self) -> (Option<bool>, Option<BenchDatapath>, bool) {
        (self.offload.map(|o| !o), self.datapath, self.reverse)
    }
}

/// One run of one case.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Sample {
    pub case: Case,
    pub variant: Variant,
    /// 1-based.
    pub repeat: u32,
    /// The Pod that ran it.
    pub pod: String,
    pub result: ClientResult,
}

/// Median, minimum and maximum of some values.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// `None` for no values.
    pub fn of(values: &[f64]) -> Option<Spread> {
        let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
        if sorted.is_empty() {
            return None;
        }
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Some(Spread {
            median,
            min: sorted[0],
            max: sorted[n - 1],
        })
    }
}

/// The nearest-rank percentile `p` (0..=100) of `values`.
pub fn percentile(values: &[u64], p: f64) -> Option<u64> {
    let mut sorted = values.to_vec();
    sorted.sort_unstable();
    let n = sorted.len();
    if n == 0 {
        return None;
    }
    // Nearest rank: the smallest value with at least p % of them at or below it.
    let rank = ((p / 100.0) * n as f64).ceil().max(1.0) as usize;
    sorted.get(rank.min(n) - 1).copied()
}

/// One row of the table: a case in a variant, over its repeats.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct Row {
    pub case: Case,
    pub variant: Variant,
    pub repeats: usize,
    /// Gbit/s the sender sent.
    pub sent_gbps: Spread,
    /// Gbit/s the receiver received.
    pub received_gbps: Spread,
    /// Median of the runs' retransmits, where known.
    pub retransmits: Option<u64>,
    /// Received median over case 1's in the same direction (and offload,
    /// where case 1 ran with it).
    pub ratio_to_case1: Option<f64>,
    /// TCP handshake round trip over every connect of the repeats, in µs.
    pub connect_rtt_p50_us: Option<u64>,
    pub connect_rtt_p99_us: Option<u64>,
    /// Round trip of a small message on an open connection (TCP
    /// ping-pong with the echo server), over every exchange of the
    /// repeats, in µs.
    #[serde(default)]
    pub round_trip_p50_us: Option<u64>,
    #[serde(default)]
    pub round_trip_p99_us: Option<u64>,
    /// The round trip's median over case 1's (the one `ratio_to_case1`
    /// compares with): what the path adds, in µs.
    #[serde(default)]
    pub added_round_trip_us: Option<i64>,
}

/// The rows, in table order: by offload, then direction, then case.
pub fn summarize(samples: &[Sample]) -> Vec<Row> {
    let mut keys: Vec<(Variant, Case)> = samples.iter().map(|s| (s.variant, s.case)).collect();
    // Offload on first, as the reference system's headline numbers are.
    keys.sort_by_key(|(v, c)| (v.order(), *c));
    keys.dedup();
    let mut rows: Vec<Row> = keys
        .into_iter()
        .filter_map(|(variant, case)| row(samples, case, variant))
        .collect();
    let case1: Vec<(Variant, f64, Option<u64>)> = rows
        .iter()
        .filter(|r| r.case == Case::NodeToNode)
        .map(|r| (r.variant, r.received_gbps.median, r.round_trip_p50_us))
        .collect();
    for r in &mut rows {
        // Case 1 does not use the tunnel: compare with it in the same
        // offload state and datapath when it ran in them, else in the same
        // direction.
        let base = case1
            .iter()
            .find(|(v, ..)| *v == r.variant)
            .or_else(|| {
                case1.iter().find(|(v, ..)| {
                    v.reverse == r.variant.reverse && v.datapath == r.variant.datapath
                })
            })
            .or_else(|| case1.iter().find(|(v, ..)| v.reverse == r.variant.reverse));
        r.ratio_to_case1 = base
            .filter(|(_, b, _)| *b > 0.0)
            .map(|(_, b, _)| r.received_gbps.median / b);
        r.added_round_trip_us =
            base.and_then(|(_, _, b)| *b)
                .zip(r.round_trip_p50_us)
                .map(|(b, x)| {
                    i64::try_from(x).unwrap_or(i64::MAX) - i64::try_from(b).unwrap_or(i64::MAX)
                });
    }
    rows
}

fn row(samples: &[Sample], case: Case, variant: Variant) -> Option<Row> {
    let runs: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.case == case && s.variant == variant)
        .collect();
    let gbps = |f: fn(&ClientResult) -> f64| -> Vec<f64> {
        runs.iter().map(|s| f(&s.result) / 1e9).collect()
    };
    let mut retransmits: Vec<u64> = runs.iter().filter_map(|s| s.result.retransmits).collect();
    retransmits.sort_unstable();
    let all = |f: fn(&ClientResult) -> &Vec<u64>| -> Vec<u64> {
        runs.iter()
            .flat_map(|s| f(&s.result).iter().copied())
            .collect()
    };
    let rtts = all(|r| &r.connect_rtt_us);
    let round_trips = all(|r| &r.round_trip_us);
    Some(Row {
        case,
        variant,
        repeats: runs.len(),
        sent_gbps: Spread::of(&gbps(|r| r.sent_bps))?,
        received_gbps: Spread::of(&gbps(|r| r.received_bps))?,
        retransmits: retransmits.get(retransmits.len() / 2).copied(),
        ratio_to_case1: None,
        connect_rtt_p50_us: percentile(&rtts, 50.0),
        connect_rtt_p99_us: percentile(&rtts, 99.0),
        round_trip_p50_us: percentile(&round_trips, 50.0),
        round_trip_p99_us: percentile(&round_trips, 99.0),
        added_round_trip_us: None,
    })
}

/// The table, one line per row, with a header.
pub fn table(rows: &[Row]) -> String {
    let header = [
        "case",
        "direction",
        "offload",
        "datapath",
        "sent Gbit/s",
        "received Gbit/s",
        "retr",
        "vs 1",
        "connect p50",
        "RTT p50",
        "RTT p99",
        "RTT +vs 1",
    ];
    let cells: Vec<[String; 12]> = rows.iter().map(cells).collect();
    let mut widths = header.map(str::len);
    for row in &cells {
        for (w, c) in widths.iter_mut().zip(row) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    let line = |out: &mut String, row: &[String]| {
        let mut text = String::new();
        for (i, (c, w)) in row.iter().zip(widths).enumerate() {
            // Text columns to the left, numbers to the right.
            if i < 4 {
                let _ = write!(text, "{c:<w$}  ");
            } else {
                let _ = write!(text, "{c:>w$}  ");
            }
        }
        out.push_str(text.trim_end());
        out.push('\n');
    };
    line(&mut out, &header.map(String::from));
    for row in &cells {
        line(&mut out, row);
    }
    out.push_str(
        "Gbit/s: median (min-max) of the repeats; retr: median TCP retransmits; \
         vs 1: received median over case 1's;\nconnect: TCP handshake round trip; \
         RTT: round trip of a 64-byte message on an open connection (echo server), \
         +vs 1: over case 1's median;\npercentiles over every connect or exchange of \
         the repeats, in µs.\n",
    );
    out
}

fn cells(r: &Row) -> [String; 12] {
    let spread = |s: Spread| format!("{:.2} ({:.2}-{:.2})", s.median, s.min, s.max);
    let us = |us: Option<u64>| us.map_or("-".into(), |u| u.to_string());
    [
        format!("{} {}", r.case.number(), r.case.label()),
        r.variant.direction().into(),
        r.variant.offload_label().into(),
        r.variant.datapath_label(),
        spread(r.sent_gbps),
        spread(r.received_gbps),
        r.retransmits.map_or("-".into(), |n| n.to_string()),
        r.ratio_to_case1.map_or("-".into(), |x| format!("{x:.2}")),
        us(r.connect_rtt_p50_us),
        us(r.round_trip_p50_us),
        us(r.round_trip_p99_us),
        r.added_round_trip_us
            .map_or("-".into(), |d| format!("{d:+}")),
    ]
}

/// The chart: one group per case, one bar per variant (received Gbit/s).
pub fn chart(rows: &[Row], title: &str, subtitle: &str) -> Chart {
    let mut variants: Vec<Variant> = rows.iter().map(|r| r.variant).collect();
    variants.sort_by_key(|v| v.order());
    variants.dedup();
    let series = variants
        .into_iter()
        .map(|v| Series {
            name: v.label(),
            values: Case::ALL
                .iter()
                .map(|c| {
                    rows.iter()
                        .find(|r| r.case == *c && r.variant == v)
                        .map(|r| Bar {
                            median: r.received_gbps.median,
                            min: r.received_gbps.min,
                            max: r.received_gbps.max,
                        })
                })
                .collect(),
        })
        .collect();
    Chart {
        title: title.to_owned(),
        subtitle: subtitle.to_owned(),
        y_label: "Gbit/s".to_owned(),
        categories: Case::ALL
            .iter()
            .map(|c| format!("{} {}", c.number(), c.label()))
            .collect(),
        series,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(case: Case, reverse: bool, offload: bool, gbps: f64, rtts: &[u64]) -> Sample {
        with_round_trips(case, reverse, offload, gbps, rtts, &[])
    }

    fn with_round_trips(
        case: Case,
        reverse: bool,
        offload: bool,
        gbps: f64,
        rtts: &[u64],
        round_trips: &[u64],
    ) -> Sample {
        Sample {
            case,
            variant: Variant {
                reverse,
                offload: Some(offload),
                datapath: None,
            },
            repeat: 1,
            pod: "p".into(),
            result: ClientResult {
                sent_bps: gbps * 1e9 + 1e7,
                received_bps: gbps * 1e9,
                retransmits: Some(3),
                local: String::new(),
                seen_from: None,
                connect_rtt_us: rtts.to_vec(),
                round_trip_us: round_trips.to_vec(),
                cpu: None,
                interfaces: Vec::new(),
                load_average: None,
                iperf3_end: serde_json::Value::Null,
            },
        }
    }

    #[test]
    fn spreads_take_the_middle_of_odd_and_even_counts() {
        let s = Spread::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!((s.median, s.min, s.max), (2.0, 1.0, 3.0));
        assert_eq!(Spread::of(&[4.0, 1.0, 2.0, 3.0]).unwrap().median, 2.5);
        assert_eq!(Spread::of(&[]), None);
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<u64> = (1..=100).collect();
        assert_eq!(percentile(&v, 50.0), Some(50));
        assert_eq!(percentile(&v, 99.0), Some(99));
        assert_eq!(percentile(&[7], 99.0), Some(7));
        assert_eq!(percentile(&[], 50.0), None);
    }

    #[test]
    fn rows_compare_with_case_1_in_the_same_direction_even_across_offload() {
        let samples = vec![
            sample(Case::NodeToNode, false, true, 10.0, &[50]),
            sample(Case::TunnelToTunnel, false, true, 9.0, &[60]),
            sample(Case::PodToTarget, false, true, 8.0, &[70]),
            sample(Case::NodeToNode, true, true, 5.0, &[50]),
            sample(Case::PodToTarget, true, true, 4.0, &[70]),
            sample(Case::TunnelToTunnel, false, false, 2.5, &[60]),
        ];
        let rows = summarize(&samples);
        let find = |c, rev, off| {
            rows.iter()
                .find(|r| r.case == c && r.variant.reverse == rev && r.variant.offload == Some(off))
                .unwrap()
        };
        assert!((find(Case::PodToTarget, false, true).ratio_to_case1.unwrap() - 0.8).abs() < 1e-9);
        assert!((find(Case::PodToTarget, true, true).ratio_to_case1.unwrap() - 0.8).abs() < 1e-9);
        assert!(
            (find(Case::TunnelToTunnel, false, false)
                .ratio_to_case1
                .unwrap()
                - 0.25)
                .abs()
                < 1e-9
        );
        // Offload on first, then forward before reverse, then by case.
        assert_eq!(rows[0].case, Case::NodeToNode);
        assert_eq!(rows.last().unwrap().variant.offload, Some(false));
    }

    #[test]
    fn the_table_shows_each_row_with_medians_and_round_trips() {
        let samples = vec![
            with_round_trips(
                Case::NodeToNode,
                false,
                true,
                9.44,
                &[50, 52, 90],
                &[30, 31, 95],
            ),
            with_round_trips(Case::PodToTarget, false, true, 9.01, &[80], &[40, 44, 47]),
        ];
        let rows = summarize(&samples);
        assert_eq!(rows[1].round_trip_p50_us, Some(44));
        assert_eq!(rows[1].added_round_trip_us, Some(13));
        let text = table(&rows);
        assert!(text.contains("1 node -> node"), "{text}");
        assert!(text.contains("9.44 (9.44-9.44)"), "{text}");
        assert!(text.contains("0.95"), "{text}");
        assert!(text.contains("  52  "), "{text}");
        assert!(text.contains("+13"), "{text}");
    }

    #[test]
    fn without_an_echo_server_the_round_trips_are_not_shown() {
        let samples = vec![
            sample(Case::NodeToNode, false, true, 9.44, &[50]),
            sample(Case::PodToTarget, false, true, 9.01, &[80]),
        ];
        let rows = summarize(&samples);
        assert_eq!(rows[1].round_trip_p50_us, None);
        assert_eq!(rows[1].added_round_trip_us, None);
    }

    #[test]
    fn the_chart_has_a_gap_where_a_variant_did_not_run() {
        let samples = vec![
            sample(Case::NodeToNode, false, true, 9.4, &[]),
            sample(Case::TunnelToTunnel, false, true, 9.1, &[]),
            sample(Case::TunnelToTunnel, false, false, 2.5, &[]),
        ];
        let chart = chart(&summarize(&samples), "t", "s");
        assert_eq!(chart.categories.len(), 3);
        let off = chart
            .series
            .iter()
            .find(|s| s.name == "forward, offload off")
            .unwrap();
        assert_eq!(off.values[0], None);
        assert_eq!(off.values[1].map(|b| b.median), Some(2.5));
    }
}
