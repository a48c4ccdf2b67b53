//! The few PromQL operations the dashboard's panels use, evaluated on a
//! recording at evenly spaced steps, as Prometheus evaluates a range query:
//! a gauge's value at a step is its last sample within [`LOOKBACK`]; a
//! counter's increase over a window is what it rose between the window's
//! first and last samples (a drop counts as a reset to zero), extrapolated
//! to the window's edges as Prometheus does, and its rate that increase
//! over the window's length.

use std::collections::BTreeMap;

use super::recording::Series;

/// How old a sample may be and still count as a series' value.
pub const LOOKBACK: f64 = 3.0;

pub type Labels = BTreeMap<String, String>;

/// A series evaluated at every step: `None` where it has no value.
#[derive(Debug, Clone, PartialEq)]
pub struct Line {
    pub labels: Labels,
    pub values: Vec<Option<f64>>,
}

/// A recording and the steps to evaluate it at.
#[derive(Debug)]
pub struct Eval {
    series: Vec<Series>,
    pub steps: Vec<f64>,
}

impl Eval {
    /// The recording's series, evaluated every `step` seconds from its
    /// first sample to its last.
    pub fn new(series: Vec<Series>, step: f64) -> Self {
        let times = series.iter().flat_map(|s| s.points.iter().map(|p| p.0));
        let (first, last) = times.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), t| {
            (lo.min(t), hi.max(t))
        });
        let mut steps = Vec::new();
        let mut t = first.ceil();
        while t <= last {
            steps.push(t);
            t += step;
        }
        Self { series, steps }
    }

    fn each<'a>(
        &'a self,
        metric: &'a str,
        at: impl Fn(&[(f64, f64)], f64) -> Option<f64> + 'a,
    ) -> impl Iterator<Item = Line> + 'a {
        self.series
            .iter()
            .filter(move |s| s.name == metric)
            .map(move |s| Line {
                labels: s.labels.clone(),
                values: self.steps.iter().map(|t| at(&s.points, *t)).collect(),
            })
    }

    /// `metric`: each series' value at each step.
    pub fn instant(&self, metric: &str) -> Vec<Line> {
        self.each(metric, |points, t| {
            let (at, value) = points.iter().rev().find(|p| p.0 <= t)?;
            (t - at <= LOOKBACK).then_some(*value)
        })
        .collect()
    }

    /// `rate(metric[window])`, per second.
    pub fn rate(&self, metric: &str, window: f64) -> Vec<Line> {
        self.each(metric, move |points, t| {
            extrapolated_increase(points, t, window).map(|inc| inc / window)
        })
        .collect()
    }

    /// `increase(metric[window])`.
    pub fn increase(&self, metric: &str, window: f64) -> Vec<Line> {
        self.each(metric, move |points, t| {
            extrapolated_increase(points, t, window)
        })
        .collect()
    }

    /// `time() - (metric > 0)`: the age of a timestamp, where there is one.
    pub fn age(&self, metric: &str) -> Vec<Line> {
        let mut lines = self.instant(metric);
        for line in &mut lines {
            for (value, t) in line.values.iter_mut().zip(&self.steps) {
                *value = value.filter(|v| *v > 0.0).map(|v| t - v);
            }
        }
        lines
    }
}

/// How much a counter rose over `(t - window, t]`, as Prometheus'
/// `increase` says: the rise between the first and last samples in it (a
/// drop counts as a reset to zero), stretched to the window's edges where
/// the samples come within 1.1 average intervals of them (else by half an
/// interval), and towards the start no further than where the counter
/// would have been zero. `None` under two samples.
fn extrapolated_increase(points: &[(f64, f64)], t: f64, window: f64) -> Option<f64> {
    let start = t - window;
    let inside: Vec<&(f64, f64)> = points.iter().filter(|p| p.0 > start && p.0 <= t).collect();
    let (first, last) = (**inside.first()?, **inside.last()?);
    let sampled = last.0 - first.0;
    if inside.len() < 2 || sampled <= 0.0 {
        return None;
    }
    let rise: f64 = inside
        .windows(2)
        .map(|w| {
            let (before, after) = (w[0].1, w[1].1);
            if after >= before {
                after - before
            } else {
                after
            }
        })
        .sum();
    let average = sampled / (inside.len() - 1) as f64;
    let threshold = average * 1.1;
    let mut to_start = first.0 - start;
    if rise > 0.0 && first.1 >= 0.0 {
        to_start = to_start.min(sampled * first.1 / rise);
    }
    let to_end = t - last.0;
    let mut covered = sampled;
    for gap in [to_start, to_end] {
        covered += if gap < threshold { gap } else { average / 2.0 };
    }
    Some(rise * covered / sampled)
}

/// `op by (by) (lines)`: one line per value of the `by` labels, each step
/// combining the lines that have a value there.
fn aggregate(lines: Vec<Line>, by: &[&str], op: fn(f64, f64) -> f64) -> Vec<Line> {
    let mut groups: BTreeMap<Vec<String>, Line> = BTreeMap::new();
    for line in lines {
        let key: Vec<String> = by
            .iter()
            .map(|l| line.labels.get(*l).cloned().unwrap_or_default())
            .collect();
        let group = groups.entry(key.clone()).or_insert_with(|| Line {
            labels: by.iter().map(|l| (*l).to_owned()).zip(key).collect(),
            values: vec![None; line.values.len()],
        });
        for (sum, value) in group.values.iter_mut().zip(line.values) {
            *sum = match (*sum, value) {
                (Some(a), Some(b)) => Some(op(a, b)),
                (a, b) => a.or(b),
            };
        }
    }
    groups.into_values().collect()
}

/// `sum by (by) (lines)`.
pub fn sum_by(lines: Vec<Line>, by: &[&str]) -> Vec<Line> {
    aggregate(lines, by, |a, b| a + b)
}

/// `max by (by) (lines)`.
pub fn max_by(lines: Vec<Line>, by: &[&str]) -> Vec<Line> {
    aggregate(lines, by, f64::max)
}

/// `f(lines)`, value by value.
pub fn map(mut lines: Vec<Line>, f: impl Fn(f64) -> f64) -> Vec<Line> {
    for line in &mut lines {
        for value in &mut line.values {
            *value = value.map(&f);
        }
    }
    lines
}

/// `a or b`: the lines of `a`, and at each step where a line of `a` has no
/// value, the line of `b` with the same labels; `b`'s lines that no line of
/// `a` has the labels of.
pub fn or(a: Vec<Line>, b: Vec<Line>) -> Vec<Line> {
    let mut out: BTreeMap<Labels, Line> = a.into_iter().map(|l| (l.labels.clone(), l)).collect();
    for line in b {
        match out.get_mut(&line.labels) {
            Some(first) => {
                for (value, other) in first.values.iter_mut().zip(line.values) {
                    *value = value.or(other);
                }
            }
            None => {
                out.insert(line.labels.clone(), line);
            }
        }
    }
    out.into_values().collect()
}

/// `count(lines == value) or vector(0)`: at each step, how many lines are
/// `value` (0 where none is).
pub fn count_equal(lines: &[Line], value: f64, steps: usize) -> Line {
    let values = (0..steps)
        .map(|i| {
            let n = lines
                .iter()
                .filter(|l| l.values.get(i).copied().flatten() == Some(value))
                .count();
            Some(n as f64)
        })
        .collect();
    Line {
        labels: Labels::new(),
        values,
    }
}

/// `histogram_quantile(q, buckets)`: per group of buckets (their labels
/// but `le`), the `q` quantile, interpolated linearly in its bucket as
/// Prometheus does; the highest finite bound when it falls in the `+Inf`
/// bucket; no value where the buckets count nothing.
pub fn histogram_quantile(q: f64, buckets: Vec<Line>) -> Vec<Line> {
    /// A bucket's upper bound and its value at each step.
    type Bucket = (f64, Vec<Option<f64>>);
    let mut groups: BTreeMap<Labels, Vec<Bucket>> = BTreeMap::new();
    for mut line in buckets {
        let Some(le) = line.labels.remove("le").and_then(|le| parse_bound(&le)) else {
            continue;
        };
        groups
            .entry(line.labels)
            .or_default()
            .push((le, line.values));
    }
    groups
        .into_iter()
        .map(|(labels, mut bounds)| {
            bounds.sort_by(|a, b| a.0.total_cmp(&b.0));
            let steps = bounds.first().map_or(0, |b| b.1.len());
            let values = (0..steps)
                .map(|i| {
                    let counts: Option<Vec<(f64, f64)>> =
                        bounds.iter().map(|(le, v)| Some((*le, v[i]?))).collect();
                    quantile(q, &counts?)
                })
                .collect();
            Line { labels, values }
        })
        .collect()
}

fn parse_bound(le: &str) -> Option<f64> {
    match le {
        "+Inf" => Some(f64::INFINITY),
        other => other.parse().ok(),
    }
}

/// The `q` quantile of cumulative bucket counts `(upper bound, count)`,
/// sorted by bound, the last `+Inf`.
fn quantile(q: f64, buckets: &[(f64, f64)]) -> Option<f64> {
    let &(last, total) = buckets.last()?;
    if !last.is_infinite() || total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let i = buckets.iter().position(|(_, count)| *count >= rank)?;
    let (upper, count) = buckets[i];
    if upper.is_infinite() {
        return buckets.len().checked_sub(2).map(|j| buckets[j].0);
    }
    let (lower, below) = if i == 0 { (0.0, 0.0) } else { buckets[i - 1] };
    if count == below {
        return Some(upper);
    }
    Some(lower + (upper - lower) * (rank - below) / (count - below))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(name: &str, labels: &[(&str, &str)], points: &[(f64, f64)]) -> Series {
        Series {
            name: name.to_owned(),
            labels: labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            points: points.to_vec(),
        }
    }

    fn near(got: Option<f64>, want: f64) {
        assert!(
            got.is_some_and(|g| (g - want).abs() < 1e-9),
            "{got:?}, want {want}"
        );
    }

    #[test]
    fn a_steady_counters_rate_is_its_slope_across_a_reset() {
        // 10 a second, sampled every second; reset to 0 at t=5.
        let points: Vec<(f64, f64)> = (0..10)
            .map(|t| {
                (
                    f64::from(t),
                    f64::from(if t < 5 { 100 + 10 * t } else { 10 * (t - 5) }),
                )
            })
            .collect();
        let eval = Eval::new(vec![series("c_total", &[], &points)], 1.0);
        let rate = &eval.rate("c_total", 4.0)[0].values;
        assert_eq!(rate[0], None, "one sample");
        // Windows holding the reset lose the rise before its sample (0 at
        // t=5 counts from zero); at t=8 the first sample is 0, and a
        // counter is not stretched back past zero.
        let want = [10.0, 10.0, 20.0 / 3.0, 20.0 / 3.0, 20.0 / 3.0, 7.5, 10.0];
        for (t, want) in (3..10).zip(want) {
            near(rate[t], want);
        }
    }

    #[test]
    fn a_new_counter_is_extrapolated_no_further_back_than_its_zero() {
        // Born at t=5 at 10, then 10 a second: it was zero at t=4.
        let points: Vec<(f64, f64)> = (5..=8)
            .map(|t| (f64::from(t), f64::from(10 * (t - 4))))
            .collect();
        let eval = Eval::new(vec![series("c_total", &[], &points)], 1.0);
        // At t=8 over 10 s: 30 risen in 3 s, stretched 1 s back to zero.
        let increase = eval.increase("c_total", 10.0)[0].values[3];
        near(increase, 40.0);
        near(eval.rate("c_total", 10.0)[0].values[3], 4.0);
    }

    #[test]
    fn a_gauge_is_its_last_sample_until_it_is_too_old() {
        let gauge = series("g", &[], &[(0.0, 1.0), (1.0, 2.0), (9.0, 3.0)]);
        let eval = Eval::new(vec![gauge], 1.0);
        let values = &eval.instant("g")[0].values;
        assert_eq!(values[1], Some(2.0));
        assert_eq!(values[4], Some(2.0));
        assert_eq!(values[5], None);
        assert_eq!(values[9], Some(3.0));
    }

    #[test]
    fn sums_group_by_labels_and_skip_lines_without_a_value() {
        let line = |policy: &str, node: &str, values: Vec<Option<f64>>| Line {
            labels: [("policy", policy), ("instance", node)]
                .iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
            values,
        };
        let lines = vec![
            line("web", "node-1", vec![Some(1.0), None]),
            line("web", "node-2", vec![Some(2.0), Some(3.0)]),
            line("db", "node-1", vec![None, None]),
        ];
        let sums = sum_by(lines, &["policy"]);
        assert_eq!(sums.len(), 2);
        assert_eq!(sums[0].labels["policy"], "db");
        assert_eq!(sums[0].values, [None, None]);
        assert_eq!(sums[1].values, [Some(3.0), Some(3.0)]);
    }

    #[test]
    fn quantiles_interpolate_within_their_bucket_as_prometheus_does() {
        // 10 observations: 4 up to 0.1, 4 more up to 0.2, 2 above 0.4.
        let buckets = [(0.1, 4.0), (0.2, 8.0), (0.4, 8.0), (f64::INFINITY, 10.0)];
        near(quantile(0.5, &buckets), 0.125);
        near(quantile(0.2, &buckets), 0.05);
        near(quantile(0.99, &buckets), 0.4);
        assert_eq!(quantile(0.5, &[(0.1, 0.0), (f64::INFINITY, 0.0)]), None);
        let lines = buckets
            .iter()
            .map(|(le, n)| Line {
                labels: [(
                    "le".to_owned(),
                    if le.is_infinite() {
                        "+Inf".to_owned()
                    } else {
                        le.to_string()
                    },
                )]
                .into(),
                values: vec![Some(*n), None],
            })
            .collect();
        let q = histogram_quantile(0.5, lines);
        assert_eq!(q.len(), 1);
        near(q[0].values[0], 0.125);
        assert_eq!(q[0].values[1], None);
    }

    #[test]
    fn or_fills_in_steps_and_adds_label_sets_the_first_lacks() {
        let line = |gateway: &str, values| Line {
            labels: [("gateway".to_owned(), gateway.to_owned())].into(),
            values,
        };
        let moves = vec![line("a", vec![None, Some(2.0)])];
        let zeros = vec![
            line("a", vec![Some(0.0), Some(0.0)]),
            line("b", vec![Some(0.0), None]),
        ];
        let both = or(moves, zeros);
        assert_eq!(both.len(), 2);
        assert_eq!(both[0].values, [Some(0.0), Some(2.0)]);
        assert_eq!(both[1].values, [Some(0.0), None]);
    }

    #[test]
    fn count_equal_is_zero_where_nothing_matches() {
        let line = |values| Line {
            labels: Labels::new(),
            values,
        };
        let lines = [
            line(vec![Some(0.0), Some(1.0)]),
            line(vec![Some(0.0), None]),
        ];
        assert_eq!(count_equal(&lines, 0.0, 2).values, [Some(2.0), Some(0.0)]);
    }
}
