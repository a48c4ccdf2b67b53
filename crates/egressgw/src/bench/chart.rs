//! Grouped bar charts with min–max whiskers, as standalone SVG documents.
//!
//! Text is written as SVG `<text>` in the generic `sans-serif` family and
//! laid out by whatever displays the file, so making a chart needs no font
//! file. Where the layout needs a text's width (legend wrapping), it is
//! estimated from the character count, generously for common sans fonts.

use std::ops::Range;

use anyhow::{Context as _, ensure};
use plotters::coord::Shift;
use plotters::coord::ranged1d::{KeyPointHint, NoDefaultFormatting, ValueFormatter};
use plotters::coord::types::RangedCoordf64;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

/// A grouped bar chart: one group per category, one bar per series in each.
#[derive(Debug, Clone)]
pub struct Chart {
    pub title: String,
    pub subtitle: String,
    /// The y axis' unit, e.g. "Gbit/s".
    pub y_label: String,
    /// The groups along the x axis, e.g. "node -> node".
    pub categories: Vec<String>,
    /// One colour each, named in the legend, in this order within each group.
    pub series: Vec<Series>,
}

/// One bar in every category, in one colour.
#[derive(Debug, Clone)]
pub struct Series {
    pub name: String,
    /// One per category; `None` leaves a gap where the bar would be.
    pub values: Vec<Option<Bar>>,
}

/// A bar up to `median`, with a whisker from `min` to `max`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bar {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

/// The chart as a 900×500 SVG document.
///
/// The y axis starts at 0. Fails, naming the series and category, when a
/// series has not one value per category, or a value is not a finite number
/// ≥ 0 with `min <= median <= max`; and when there is no category or series.
pub fn render_svg(chart: &Chart) -> anyhow::Result<String> {
    validate(chart)?;
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (WIDTH, HEIGHT)).into_drawing_area();
        draw(&root, chart).with_context(|| format!("drawing chart {:?}", chart.title))?;
    }
    Ok(svg)
}

const WIDTH: u32 = 900;
const HEIGHT: u32 = 500;
const MARGIN: i32 = 20;

const TITLE_PX: f64 = 20.0;
const SUBTITLE_PX: f64 = 13.0;
const LABEL_PX: f64 = 13.0;
const VALUE_PX: f64 = 11.0;

const LEGEND_TOP: i32 = 64;
const LEGEND_ROW: i32 = 20;
const SWATCH: i32 = 12;
const SWATCH_GAP: i32 = 6;
const LEGEND_SPACING: i32 = 20;

/// Share of a category's width taken by its bars; the rest parts groups.
const GROUP_WIDTH: f64 = 0.8;
/// Share of a bar's slot that it fills; the rest parts neighbouring bars.
const BAR_FILL: f64 = 0.8;

const TEXT: RGBColor = RGBColor(0x22, 0x22, 0x22);
const MUTED: RGBColor = RGBColor(0x55, 0x55, 0x55);
const GRID: RGBColor = RGBColor(0xdd, 0xdd, 0xdd);
const AXIS: RGBColor = RGBColor(0x88, 0x88, 0x88);
const WHISKER: RGBColor = RGBColor(0x33, 0x33, 0x33);
/// Tableau 10's first eight hues, of like weight; repeats after eight series.
const PALETTE: [RGBColor; 8] = [
    RGBColor(0x4e, 0x79, 0xa7),
    RGBColor(0xf2, 0x8e, 0x2b),
    RGBColor(0x59, 0xa1, 0x4f),
    RGBColor(0xe1, 0x57, 0x59),
    RGBColor(0x76, 0xb7, 0xb2),
    RGBColor(0xb0, 0x7a, 0xa1),
    RGBColor(0xed, 0xc9, 0x48),
    RGBColor(0x9c, 0x75, 0x5f),
];

type Area<'a> = DrawingArea<SVGBackend<'a>, Shift>;
type DrawResult = Result<(), DrawingAreaErrorKind<std::io::Error>>;

fn validate(chart: &Chart) -> anyhow::Result<()> {
    ensure!(
        !chart.categories.is_empty(),
        "chart {:?} has no categories",
        chart.title
    );
    ensure!(
        !chart.series.is_empty(),
        "chart {:?} has no series",
        chart.title
    );
    for series in &chart.series {
        ensure!(
            series.values.len() == chart.categories.len(),
            "series {:?} has {} values for {} categories",
            series.name,
            series.values.len(),
            chart.categories.len(),
        );
        for (category, bar) in chart.categories.iter().zip(&series.values) {
            if let Some(bar) = bar {
                bar.validate()
                    .with_context(|| format!("series {:?}, category {category:?}", series.name))?;
            }
        }
    }
    Ok(())
}

impl Bar {
    fn validate(&self) -> anyhow::Result<()> {
        for (what, value) in [
            ("median", self.median),
            ("min", self.min),
            ("max", self.max),
        ] {
            ensure!(
                value.is_finite() && value >= 0.0,
                "{what} is {value}, not a finite number >= 0"
            );
        }
        ensure!(
            self.min <= self.median && self.median <= self.max,
            "median {} is not within min {} and max {}",
            self.median,
            self.min,
            self.max,
        );
        Ok(())
    }
}

fn draw(root: &Area<'_>, chart: &Chart) -> DrawResult {
    root.fill(&WHITE)?;
    draw_heading(root, chart)?;
    let names: Vec<&str> = chart.series.iter().map(|s| s.name.as_str()).collect();
    let rows = legend_rows(&names, WIDTH as i32 - 2 * MARGIN);
    draw_legend(root, &names, &rows)?;
    let plot_top = LEGEND_TOP + LEGEND_ROW * rows.len() as i32 + 12;
    draw_plot(&root.margin(plot_top, 10, 10, MARGIN), chart)?;
    root.present()
}

/// A text style `px` CSS pixels high (plotters writes sizes divided by 1.24).
fn font(px: f64, style: FontStyle) -> TextStyle<'static> {
    FontDesc::new(FontFamily::SansSerif, px * 1.24, style).into()
}

fn draw_heading(root: &Area<'_>, chart: &Chart) -> DrawResult {
    let centre = WIDTH as i32 / 2;
    let top = Pos::new(HPos::Center, VPos::Top);
    let title = font(TITLE_PX, FontStyle::Bold).color(&TEXT).pos(top);
    root.draw(&Text::new(chart.title.as_str(), (centre, 14), title))?;
    let subtitle = font(SUBTITLE_PX, FontStyle::Normal).color(&MUTED).pos(top);
    root.draw(&Text::new(chart.subtitle.as_str(), (centre, 42), subtitle))
}

/// Width of `text` at `px`, a little wider than most sans fonts set it.
fn text_width(text: &str, px: f64) -> i32 {
    (text.chars().count() as f64 * px * 0.55).ceil() as i32
}

fn legend_entry_width(name: &str) -> i32 {
    SWATCH + SWATCH_GAP + text_width(name, LABEL_PX)
}

/// Series indexes by legend row: as many entries a row as fit in `max_width`.
fn legend_rows(names: &[&str], max_width: i32) -> Vec<Vec<usize>> {
    let mut rows: Vec<Vec<usize>> = Vec::new();
    let mut width = 0;
    for (i, name) in names.iter().enumerate() {
        let entry = legend_entry_width(name);
        match rows.last_mut() {
            Some(row) if width + LEGEND_SPACING + entry <= max_width => {
                row.push(i);
                width += LEGEND_SPACING + entry;
            }
            _ => {
                rows.push(vec![i]);
                width = entry;
            }
        }
    }
    rows
}

/// One centred line of swatches and names per row.
fn draw_legend(root: &Area<'_>, names: &[&str], rows: &[Vec<usize>]) -> DrawResult {
    let label = font(LABEL_PX, FontStyle::Normal)
        .color(&TEXT)
        .pos(Pos::new(HPos::Left, VPos::Center));
    for (r, row) in rows.iter().enumerate() {
        let y = LEGEND_TOP + LEGEND_ROW * r as i32 + LEGEND_ROW / 2;
        let widths: Vec<i32> = row.iter().map(|&i| legend_entry_width(names[i])).collect();
        let total = widths.iter().sum::<i32>() + LEGEND_SPACING * (row.len() as i32 - 1);
        let mut x = (WIDTH as i32 - total) / 2;
        for (&i, width) in row.iter().zip(widths) {
            let swatch = [(x, y - SWATCH / 2), (x + SWATCH, y + SWATCH / 2)];
            root.draw(&Rectangle::new(swatch, colour(i).filled()))?;
            root.draw(&Text::new(
                names[i],
                (x + SWATCH + SWATCH_GAP, y),
                label.clone(),
            ))?;
            x += width + LEGEND_SPACING;
        }
    }
    Ok(())
}

fn colour(series: usize) -> RGBColor {
    PALETTE[series % PALETTE.len()]
}

fn draw_plot(area: &Area<'_>, chart: &Chart) -> DrawResult {
    let n = chart.categories.len();
    let y_top = y_axis_top(max_value(chart));
    let mut plot = ChartBuilder::on(area)
        .x_label_area_size(30)
        .y_label_area_size(56)
        .build_cartesian_2d(Groups(n), 0.0..y_top)?;

    let category = |x: &f64| {
        chart
            .categories
            .get(x.floor() as usize)
            .cloned()
            .unwrap_or_default()
    };
    plot.configure_mesh()
        .disable_x_mesh()
        .x_label_formatter(&category)
        .y_labels(8)
        .y_label_formatter(&|y| number(*y))
        .y_desc(chart.y_label.as_str())
        .label_style(font(LABEL_PX, FontStyle::Normal).color(&TEXT))
        .axis_desc_style(font(LABEL_PX, FontStyle::Normal).color(&TEXT))
        .axis_style(AXIS)
        .bold_line_style(GRID)
        .light_line_style(TRANSPARENT)
        .draw()?;

    for (s, series) in chart.series.iter().enumerate() {
        for (c, bar) in series.values.iter().enumerate() {
            if let Some(bar) = bar {
                let (left, right) = bar_span(c, s, chart.series.len());
                draw_bar(&plot, bar, left, right, colour(s))?;
            }
        }
    }
    Ok(())
}

/// `y` without trailing zeros: "12", "2.5".
fn number(y: f64) -> String {
    format!("{y:.3}")
        .trim_end_matches('0')
        .trim_end_matches('.')
        .to_owned()
}

type Plot<'a, 'b> = ChartContext<'a, SVGBackend<'b>, Cartesian2d<Groups, RangedCoordf64>>;

/// The x axis of `n` categories: category `i` spans `i..i + 1`, its label
/// and tick at the middle.
#[derive(Debug, Clone, Copy)]
struct Groups(usize);

impl Ranged for Groups {
    type FormatOption = NoDefaultFormatting;
    type ValueType = f64;

    fn map(&self, value: &f64, (from, to): (i32, i32)) -> i32 {
        from + ((to - from) as f64 * value / self.0 as f64).round() as i32
    }

    fn key_points<Hint: KeyPointHint>(&self, _hint: Hint) -> Vec<f64> {
        (0..self.0).map(|i| i as f64 + 0.5).collect()
    }

    fn range(&self) -> Range<f64> {
        0.0..self.0 as f64
    }
}

/// Labels come from the chart's categories (`x_label_formatter`).
impl ValueFormatter<f64> for Groups {
    fn format_ext(&self, _value: &f64) -> String {
        String::new()
    }
}

/// The bar, its whisker and, above the whisker, its median.
fn draw_bar(plot: &Plot<'_, '_>, bar: &Bar, left: f64, right: f64, fill: RGBColor) -> DrawResult {
    let area = plot.plotting_area();
    area.draw(&Rectangle::new(
        [(left, 0.0), (right, bar.median)],
        fill.filled(),
    ))?;
    let centre = (left + right) / 2.0;
    if bar.max > bar.min {
        let cap = (right - left) / 4.0;
        let line = WHISKER.stroke_width(1);
        area.draw(&PathElement::new(
            vec![(centre, bar.min), (centre, bar.max)],
            line,
        ))?;
        for y in [bar.min, bar.max] {
            area.draw(&PathElement::new(
                vec![(centre - cap, y), (centre + cap, y)],
                line,
            ))?;
        }
    }
    let value = font(VALUE_PX, FontStyle::Normal)
        .color(&TEXT)
        .pos(Pos::new(HPos::Center, VPos::Bottom));
    let label = EmptyElement::at((centre, bar.max))
        + Text::new(format!("{:.2}", bar.median), (0, -4), value);
    area.draw(&label)
}

/// Where series `series` of `n_series` stands in category `category`.
fn bar_span(category: usize, series: usize, n_series: usize) -> (f64, f64) {
    let slot = GROUP_WIDTH / n_series as f64;
    let left = category as f64 + (1.0 - GROUP_WIDTH) / 2.0 + slot * series as f64;
    let pad = slot * (1.0 - BAR_FILL) / 2.0;
    (left + pad, left + slot - pad)
}

fn max_value(chart: &Chart) -> f64 {
    chart
        .series
        .iter()
        .flat_map(|s| s.values.iter().flatten())
        .map(|bar| bar.max)
        .fold(0.0, f64::max)
}

/// A round top for the y axis with room above the highest whisker for its label.
fn y_axis_top(max: f64) -> f64 {
    if max <= 0.0 {
        return 1.0;
    }
    let wanted = max * 1.1;
    let magnitude = 10f64.powf((wanted / 6.0).log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0]
        .into_iter()
        .map(|m| m * magnitude)
        .find(|&step| step * 6.0 >= wanted)
        .unwrap_or(10.0 * magnitude);
    (wanted / step).ceil() * step
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bar(median: f64, min: f64, max: f64) -> Option<Bar> {
        Some(Bar { median, min, max })
    }

    fn sample() -> Chart {
        Chart {
            title: "egressgw throughput".into(),
            subtitle: "lab: 3 nodes, Linux 6.12, 2 cores; 5 repeats x 10 s".into(),
            y_label: "Gbit/s".into(),
            categories: vec![
                "node -> node".into(),
                "egress VXLAN -> egress VXLAN".into(),
                "pod -> egress node -> target".into(),
            ],
            series: vec![
                Series {
                    name: "forward, offload on".into(),
                    values: vec![
                        bar(9.41, 9.32, 9.44),
                        bar(9.12, 8.97, 9.2),
                        bar(9.01, 8.8, 9.1),
                    ],
                },
                Series {
                    name: "reverse, offload on".into(),
                    values: vec![
                        bar(9.38, 9.3, 9.43),
                        bar(9.05, 8.9, 9.15),
                        bar(8.94, 8.7, 9.05),
                    ],
                },
                Series {
                    name: "forward, offload off".into(),
                    values: vec![None, bar(2.51, 2.42, 2.6), bar(2.47, 2.31, 2.55)],
                },
                Series {
                    name: "reverse, offload off".into(),
                    values: vec![None, bar(2.49, 2.4, 2.58), bar(2.44, 2.36, 2.5)],
                },
            ],
        }
    }

    /// `text` as the SVG writes it between tags.
    fn escaped(text: &str) -> String {
        text.replace('&', "&amp;")
            .replace('<', "&lt;")
            .replace('>', "&gt;")
    }

    fn filled_rects(svg: &str, colour: RGBColor) -> usize {
        let fill = format!("fill=\"#{:02X}{:02X}{:02X}\"", colour.0, colour.1, colour.2);
        svg.lines()
            .filter(|l| l.starts_with("<rect") && l.contains(&fill))
            .count()
    }

    #[test]
    fn svg_names_title_categories_series_and_medians() -> anyhow::Result<()> {
        let chart = sample();
        let svg = render_svg(&chart)?;
        assert!(svg.starts_with("<svg"), "{svg}");
        let mut texts = vec![
            chart.title.clone(),
            chart.subtitle.clone(),
            chart.y_label.clone(),
        ];
        texts.extend(chart.categories.iter().cloned());
        texts.extend(chart.series.iter().map(|s| s.name.clone()));
        for bar in chart.series.iter().flat_map(|s| s.values.iter().flatten()) {
            texts.push(format!("{:.2}", bar.median));
        }
        for text in texts {
            assert!(
                svg.contains(&format!(">\n{}\n</text>", escaped(&text))),
                "no {text:?} in\n{svg}"
            );
        }
        Ok(())
    }

    #[test]
    fn missing_value_leaves_a_gap_not_a_zero_bar() -> anyhow::Result<()> {
        let svg = render_svg(&sample())?;
        // The legend's swatch, then one bar per value.
        assert_eq!(filled_rects(&svg, colour(0)), 1 + 3);
        assert_eq!(filled_rects(&svg, colour(2)), 1 + 2);
        assert_eq!(svg.matches(">\n2.51\n</text>").count(), 1);
        assert!(!svg.contains(">\n0.00\n</text>"), "{svg}");
        Ok(())
    }

    #[test]
    fn bars_in_a_group_do_not_touch_and_groups_stay_apart() {
        for n in 1..=6 {
            let spans: Vec<_> = (0..2)
                .flat_map(|c| (0..n).map(move |s| bar_span(c, s, n)))
                .collect();
            for pair in spans.windows(2) {
                assert!(
                    pair[0].0 < pair[0].1 && pair[0].1 < pair[1].0,
                    "{n} series: {pair:?}"
                );
            }
            assert!(
                spans[0].0 > 0.0 && spans[n - 1].1 < 1.0,
                "{n} series: {spans:?}"
            );
        }
    }

    #[test]
    fn values_length_not_matching_categories_is_rejected_naming_the_series() {
        let mut chart = sample();
        chart.series[1].values.pop();
        let err = render_svg(&chart).expect_err("two values for three categories");
        assert_eq!(
            err.to_string(),
            r#"series "reverse, offload on" has 2 values for 3 categories"#
        );
    }

    #[test]
    fn nan_negative_and_inconsistent_values_are_rejected_naming_series_and_category() {
        let cases = [
            (bar(f64::NAN, 1.0, 2.0), "median is NaN"),
            (bar(1.0, -0.5, 2.0), "min is -0.5"),
            (bar(1.0, 0.5, f64::INFINITY), "max is inf"),
            (bar(3.0, 1.0, 2.0), "median 3 is not within min 1 and max 2"),
        ];
        for (value, cause) in cases {
            let mut chart = sample();
            chart.series[3].values[1] = value;
            let err = render_svg(&chart).expect_err(cause);
            assert_eq!(
                err.to_string(),
                r#"series "reverse, offload off", category "egress VXLAN -> egress VXLAN""#
            );
            assert!(format!("{err:#}").contains(cause), "{err:#}");
        }
    }

    #[test]
    fn chart_without_categories_or_series_is_rejected() {
        let mut chart = sample();
        chart.categories.clear();
        for series in &mut chart.series {
            series.values.clear();
        }
        let err = render_svg(&chart).expect_err("no categories");
        assert!(err.to_string().contains("has no categories"), "{err}");

        let mut chart = sample();
        chart.series.clear();
        let err = render_svg(&chart).expect_err("no series");
        assert!(err.to_string().contains("has no series"), "{err}");
    }

    #[test]
    fn y_axis_ends_on_a_round_number_above_the_highest_whisker() {
        for (max, top) in [
            (9.44, 12.0),
            (2.6, 3.0),
            (0.8, 1.0),
            (95.0, 120.0),
            (0.0, 1.0),
        ] {
            assert_eq!(y_axis_top(max), top, "max {max}");
        }
    }

    /// `cargo test -p egressgw sample_chart -- --ignored`, then open the file.
    #[test]
    #[ignore = "writes chart-sample.svg in the temporary directory, to look at"]
    fn sample_chart_is_written_to_look_at() -> anyhow::Result<()> {
        let path = std::env::temp_dir().join("chart-sample.svg");
        std::fs::write(&path, render_svg(&sample())?)?;
        println!("{}", path.display());
        Ok(())
    }
}
