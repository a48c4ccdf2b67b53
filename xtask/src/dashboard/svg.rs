//! A page of panels drawn as SVG: rows of panels under a header, each a
//! line chart (title, value axis in its unit, time axis in UTC, legend) or
//! a single value. Plain strings, Grafana's dark colours.

use std::fmt::Write as _;

const WIDTH: f64 = 1500.0;
const MARGIN: f64 = 16.0;
const GAP: f64 = 12.0;
const COLUMNS: usize = 3;
const HEADER: f64 = 70.0;
const ROW_TITLE: f64 = 34.0;
const PANEL_HEIGHT: f64 = 280.0;
/// Left of the plot: the value axis' labels.
const AXIS_WIDTH: f64 = 74.0;
const LEGEND_LINE: f64 = 17.0;
/// An average glyph's width at 12 px, for laying out legends.
const CHAR_WIDTH: f64 = 6.6;

const BACKGROUND: &str = "#111217";
const PANEL: &str = "#181b1f";
const BORDER: &str = "#2c3235";
const GRID: &str = "#262a2e";
const TEXT: &str = "#ccccdc";
const DIM: &str = "#8e8e9a";
const WHITE: &str = "#ffffff";
const GREEN: &str = "#1a7f4b";
const RED: &str = "#c4162a";
const PALETTE: [&str; 10] = [
    "#73bf69", "#f2cc0c", "#8ab8ff", "#ff780a", "#f2495c", "#5794f2", "#b877d9", "#705da0",
    "#37872d", "#fade2a",
];

/// A page: a header, then rows of panels, all over the same steps (Unix
/// seconds).
#[derive(Debug)]
pub struct Page {
    pub title: String,
    pub subtitle: String,
    pub steps: Vec<f64>,
    pub rows: Vec<Row>,
}

#[derive(Debug)]
pub struct Row {
    pub title: String,
    pub panels: Vec<Panel>,
}

#[derive(Debug)]
pub enum Panel {
    Chart(Chart),
    Stat(Stat),
}

/// A line chart.
#[derive(Debug)]
pub struct Chart {
    pub title: String,
    /// Grafana's unit: `bps`, `pps`, `ops`, `s` or `none`.
    pub unit: String,
    /// Whole numbers only on the value axis.
    pub integers: bool,
    /// The top of the value axis, if fixed.
    pub max: Option<f64>,
    pub lines: Vec<Plotted>,
}

/// One line of a chart: its legend and its value at each step.
#[derive(Debug)]
pub struct Plotted {
    pub legend: String,
    pub values: Vec<Option<f64>>,
}

/// A single value, green or, when `alarm`, red.
#[derive(Debug)]
pub struct Stat {
    pub title: String,
    pub value: Option<f64>,
    pub alarm: bool,
}

/// A panel's place on the page.
#[derive(Debug, Clone, Copy)]
struct Rect {
    x: f64,
    y: f64,
    w: f64,
    h: f64,
}

pub fn render(page: &Page) -> String {
    let rows_height: f64 = page.rows.iter().map(|r| ROW_TITLE + row_height(r)).sum();
    let height = HEADER + rows_height + MARGIN;
    let mut svg = String::new();
    let _ = write!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" font-family="Inter, Helvetica, Arial, sans-serif" font-size="12" stroke="none">"#
    );
    let _ = write!(
        svg,
        r#"<rect width="100%" height="100%" fill="{BACKGROUND}"/><text x="{MARGIN}" y="34" font-size="22" font-weight="600" fill="{TEXT}">{}</text><text x="{MARGIN}" y="56" fill="{DIM}">{}</text>"#,
        escape(&page.title),
        escape(&page.subtitle)
    );
    let panel_width = (WIDTH - 2.0 * MARGIN - GAP * (COLUMNS as f64 - 1.0)) / COLUMNS as f64;
    let mut y = HEADER;
    for row in &page.rows {
        let _ = write!(
            svg,
            r#"<text x="{MARGIN}" y="{}" font-size="15" font-weight="600" fill="{TEXT}">{}</text><line x1="{MARGIN}" x2="{}" y1="{}" y2="{}" stroke="{BORDER}"/>"#,
            y + 20.0,
            escape(&row.title),
            WIDTH - MARGIN,
            y + 27.0,
            y + 27.0
        );
        y += ROW_TITLE;
        for (i, panel) in row.panels.iter().enumerate() {
            let rect = Rect {
                x: MARGIN + (i % COLUMNS) as f64 * (panel_width + GAP),
                y: y + (i / COLUMNS) as f64 * (PANEL_HEIGHT + GAP),
                w: panel_width,
                h: PANEL_HEIGHT,
            };
            match panel {
                Panel::Chart(chart) => draw_chart(&mut svg, rect, chart, &page.steps),
                Panel::Stat(stat) => draw_stat(&mut svg, rect, stat),
            }
        }
        y += row_height(row);
    }
    svg.push_str("</svg>\n");
    svg
}

fn row_height(row: &Row) -> f64 {
    let lines = row.panels.len().div_ceil(COLUMNS) as f64;
    lines * PANEL_HEIGHT + (lines - 1.0).max(0.0) * GAP + GAP
}

fn frame(svg: &mut String, r: Rect, title: &str, fill: &str) {
    let _ = write!(
        svg,
        r#"<rect x="{}" y="{}" width="{}" height="{}" rx="3" fill="{fill}" stroke="{BORDER}"/><text x="{}" y="{}" font-size="14" font-weight="500" fill="{TEXT}">{}</text>"#,
        r.x,
        r.y,
        r.w,
        r.h,
        r.x + 10.0,
        r.y + 22.0,
        escape(title)
    );
}

fn draw_stat(svg: &mut String, r: Rect, stat: &Stat) {
    let fill = if stat.alarm { RED } else { GREEN };
    frame(svg, r, &stat.title, fill);
    let text = stat
        .value
        .map_or("No data".to_owned(), |v| format!("{v:.0}"));
    let _ = write!(
        svg,
        r#"<text x="{}" y="{}" font-size="64" font-weight="600" text-anchor="middle" fill="{WHITE}">{text}</text>"#,
        r.x + r.w / 2.0,
        r.y + r.h / 2.0 + 30.0
    );
}

/// Legend entries laid out left to right, wrapping: each entry's line and
/// x offset, and the number of lines.
fn legend_layout(legends: &[&str], width: f64) -> (Vec<(usize, f64)>, usize) {
    let mut places = Vec::new();
    let (mut line, mut x) = (0, 0.0);
    for legend in legends {
        let w = 22.0 + legend.chars().count() as f64 * CHAR_WIDTH;
        if x > 0.0 && x + w > width {
            line += 1;
            x = 0.0;
        }
        places.push((line, x));
        x += w + 12.0;
    }
    (places, if legends.is_empty() { 0 } else { line + 1 })
}

fn draw_chart(svg: &mut String, r: Rect, chart: &Chart, steps: &[f64]) {
    frame(svg, r, &chart.title, PANEL);
    let legends: Vec<&str> = chart.lines.iter().map(|l| l.legend.as_str()).collect();
    let (places, legend_lines) = legend_layout(&legends, r.w - 20.0);
    let plot = Rect {
        x: r.x + AXIS_WIDTH,
        y: r.y + 40.0,
        w: r.w - AXIS_WIDTH - 14.0,
        h: r.h - 40.0 - 26.0 - legend_lines as f64 * LEGEND_LINE - 6.0,
    };
    let highest = chart
        .lines
        .iter()
        .flat_map(|l| l.values.iter().flatten())
        .fold(0.0_f64, |m, v| m.max(*v));
    let axis = Axis::new(chart.max.unwrap_or(highest), chart.integers, &chart.unit);
    draw_value_axis(svg, plot, &axis);
    draw_time_axis(svg, plot, steps);
    let (first, last) = match (steps.first(), steps.last()) {
        (Some(f), Some(l)) if l > f => (*f, *l),
        _ => (0.0, 1.0),
    };
    let x_of = |t: f64| plot.x + (t - first) / (last - first) * plot.w;
    let y_of = |v: f64| plot.y + plot.h - (v / axis.top).clamp(0.0, 1.0) * plot.h;
    let mut any = false;
    for (i, line) in chart.lines.iter().enumerate() {
        let colour = PALETTE[i % PALETTE.len()];
        let mut path = String::new();
        let mut pen_down = false;
        for (t, value) in steps.iter().zip(&line.values) {
            match value {
                Some(v) => {
                    let verb = if pen_down { 'L' } else { 'M' };
                    let _ = write!(path, "{verb}{:.1},{:.1} ", x_of(*t), y_of(*v));
                    pen_down = true;
                    any = true;
                }
                None => pen_down = false,
            }
        }
        let _ = write!(
            svg,
            r#"<path d="{}" fill="none" stroke="{colour}" stroke-width="1.6" stroke-linejoin="round"/>"#,
            path.trim_end()
        );
        let (legend_line, dx) = places[i];
        let ly = plot.y + plot.h + 26.0 + legend_line as f64 * LEGEND_LINE + 8.0;
        let lx = r.x + 10.0 + dx;
        let _ = write!(
            svg,
            r#"<rect x="{lx}" y="{}" width="14" height="4" rx="1" fill="{colour}"/><text x="{}" y="{}" fill="{TEXT}">{}</text>"#,
            ly - 6.0,
            lx + 20.0,
            ly,
            escape(&line.legend)
        );
    }
    if !any {
        let _ = write!(
            svg,
            r#"<text x="{}" y="{}" font-size="16" text-anchor="middle" fill="{DIM}">No data</text>"#,
            plot.x + plot.w / 2.0,
            plot.y + plot.h / 2.0
        );
    }
}

/// A value axis from 0: its top, its ticks and how to label them.
#[derive(Debug)]
struct Axis {
    top: f64,
    step: f64,
    unit: Unit,
}

impl Axis {
    fn new(highest: f64, integers: bool, unit: &str) -> Self {
        let highest = if highest > 0.0 { highest } else { 1.0 };
        let raw = highest / 4.0;
        let magnitude = 10f64.powf(raw.log10().floor());
        let mut step = [1.0, 2.0, 5.0, 10.0]
            .iter()
            .map(|m| m * magnitude)
            .find(|s| *s >= raw)
            .unwrap_or(10.0 * magnitude);
        if integers {
            step = step.max(1.0).round();
        }
        let top = (highest / step).ceil() * step;
        Self {
            top,
            step,
            unit: Unit::for_axis(unit, top),
        }
    }

    fn ticks(&self) -> impl Iterator<Item = f64> + '_ {
        let n = (self.top / self.step).round() as usize;
        (0..=n).map(|i| i as f64 * self.step)
    }

    fn label(&self, value: f64) -> String {
        let scaled_step = self.step / self.unit.scale;
        let decimals = if scaled_step >= 1.0 {
            0
        } else {
            (-scaled_step.log10()).ceil().clamp(0.0, 4.0) as usize
        };
        let number = format!("{:.*}", decimals, value / self.unit.scale);
        if value == 0.0 || self.unit.suffix.is_empty() {
            number
        } else {
            format!("{number} {}", self.unit.suffix)
        }
    }
}

/// How values of an axis are written: divided by `scale`, followed by
/// `suffix` (prefix and unit).
#[derive(Debug)]
struct Unit {
    scale: f64,
    suffix: String,
}

impl Unit {
    /// The unit for an axis up to `top`: an SI prefix for rates, ms or µs
    /// for short times.
    fn for_axis(unit: &str, top: f64) -> Self {
        let si = |base: &str| {
            let (prefix, scale) = [("G", 1e9), ("M", 1e6), ("k", 1e3)]
                .into_iter()
                .find(|(_, scale)| top >= *scale)
                .unwrap_or(("", 1.0));
            Self {
                scale,
                suffix: format!("{prefix}{base}"),
            }
        };
        match unit {
            "bps" => si("b/s"),
            "pps" => si("p/s"),
            "ops" => si("ops/s"),
            "s" => {
                let (suffix, scale) = if top < 1e-3 {
                    ("µs", 1e-6)
                } else if top < 1.0 {
                    ("ms", 1e-3)
                } else if top <= 180.0 {
                    ("s", 1.0)
                } else {
                    ("min", 60.0)
                };
                Self {
                    scale,
                    suffix: suffix.to_owned(),
                }
            }
            _ => Self {
                scale: 1.0,
                suffix: String::new(),
            },
        }
    }
}

fn draw_value_axis(svg: &mut String, plot: Rect, axis: &Axis) {
    for tick in axis.ticks() {
        let y = plot.y + plot.h - tick / axis.top * plot.h;
        let _ = write!(
            svg,
            r#"<line x1="{}" x2="{}" y1="{y:.1}" y2="{y:.1}" stroke="{GRID}"/><text x="{}" y="{:.1}" text-anchor="end" fill="{DIM}">{}</text>"#,
            plot.x,
            plot.x + plot.w,
            plot.x - 8.0,
            y + 4.0,
            escape(&axis.label(tick))
        );
    }
}

/// Ticks on whole multiples of a spacing that gives at most 7 of them,
/// labelled with the UTC time of day.
fn draw_time_axis(svg: &mut String, plot: Rect, steps: &[f64]) {
    let (Some(&first), Some(&last)) = (steps.first(), steps.last()) else {
        return;
    };
    if last <= first {
        return;
    }
    let spacing = [
        5.0, 10.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
    ]
    .into_iter()
    .find(|s| (last - first) / s <= 7.0)
    .unwrap_or(7200.0);
    let mut t = (first / spacing).ceil() * spacing;
    while t <= last {
        let x = plot.x + (t - first) / (last - first) * plot.w;
        let _ = write!(
            svg,
            r#"<line x1="{x:.1}" x2="{x:.1}" y1="{}" y2="{}" stroke="{GRID}"/><text x="{x:.1}" y="{}" text-anchor="middle" fill="{DIM}">{}</text>"#,
            plot.y,
            plot.y + plot.h,
            plot.y + plot.h + 16.0,
            time_of_day(t)
        );
        t += spacing;
    }
}

/// `HH:MM:SS` of a Unix time, UTC.
fn time_of_day(t: f64) -> String {
    let s = (t.round() as i64).rem_euclid(86_400);
    format!("{:02}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_end_on_a_round_tick_and_label_it_in_its_unit() {
        let bits = Axis::new(3.4e9, false, "bps");
        assert_eq!(bits.top, 4e9);
        assert_eq!(bits.label(2e9), "2 Gb/s");
        assert_eq!(bits.label(0.0), "0");
        let seconds = Axis::new(0.021, false, "s");
        assert_eq!(seconds.label(0.005), "5 ms");
        let rate = Axis::new(0.6, false, "ops");
        assert_eq!(rate.label(0.2), "0.2 ops/s");
        let count = Axis::new(0.0, true, "none");
        assert_eq!((count.top, count.step), (1.0, 1.0));
        assert_eq!(count.label(1.0), "1");
    }

    #[test]
    fn legends_wrap_when_the_line_is_full() {
        let (places, lines) = legend_layout(&["aaaaaaaaaa", "bbbbbbbbbb", "c"], 160.0);
        assert_eq!(lines, 2);
        assert_eq!(places[0], (0, 0.0));
        assert_eq!(places[1], (1, 0.0));
        assert_eq!(places[2].0, 1);
    }

    #[test]
    fn the_time_of_day_is_utc() {
        assert_eq!(time_of_day(1_795_601_646.4), "10:14:06");
    }

    #[test]
    fn a_page_is_one_svg_with_every_title_escaped() {
        let page = Page {
            title: "egressgw".into(),
            subtitle: "a <b>".into(),
            steps: vec![0.0, 1.0],
            rows: vec![Row {
                title: "Traffic".into(),
                panels: vec![
                    Panel::Chart(Chart {
                        title: "T & U".into(),
                        unit: "bps".into(),
                        integers: false,
                        max: None,
                        lines: vec![Plotted {
                            legend: "team-a/web".into(),
                            values: vec![Some(1.0), None],
                        }],
                    }),
                    Panel::Stat(Stat {
                        title: "Not Ready".into(),
                        value: Some(0.0),
                        alarm: false,
                    }),
                ],
            }],
        };
        let svg = render(&page);
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("T &amp; U") && svg.contains("a &lt;b&gt;"));
        assert!(svg.contains("team-a/web"));
        assert!(!svg.contains("No data"));
    }
}
