//! SVG line charts of a measure against block size (log2 x axis) or
//! against a count such as the number of peers (log x axis), drawn with
//! plotters.

use crate::util::human_size;
use plotters::prelude::*;
use std::path::Path;

pub struct Line {
    pub name: String,
    /// (block size, value), in the order measured.
    pub points: Vec<(u64, f64)>,
}

const COLORS: [RGBColor; 8] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
];

/// Writes `lines` (and dashed horizontal `limits`) to an SVG file at `path`.
pub fn block_size_chart(
    path: &Path,
    title: &str,
    y_label: &str,
    lines: &[Line],
    limits: &[(String, f64)],
    log_y: bool,
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let all = lines.iter().flat_map(|l| l.points.iter());
    let (xmin, xmax) = all
        .clone()
        .fold((u64::MAX, 1u64), |(a, b), (x, _)| (a.min(*x), b.max(*x)));
    if xmin > xmax {
        return Err(err(&"nothing to plot"));
    }
    let ymax = all
        .clone()
        .map(|(_, y)| *y)
        .chain(limits.iter().map(|(_, y)| *y))
        .fold(0.0f64, f64::max)
        * 1.1;
    let ymin = all.map(|(_, y)| *y).fold(f64::MAX, f64::min).max(1e-3);
    let (x0, x1) = (xmin.ilog2(), xmax.ilog2().max(xmin.ilog2() + 1));
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let mut builder = ChartBuilder::on(&root);
    builder
        .caption(title, ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(64);
    let x_desc = "block size";
    let fmt_x = |v: &u32| human_size(1u64 << v);
    let xs = x0..x1;
    if log_y {
        let mut chart = builder
            .build_cartesian_2d(xs, (ymin / 1.5..ymax.max(ymin * 2.0)).log_scale())
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_label)
            .x_label_formatter(&fmt_x)
            .draw()
            .map_err(|e| err(&e))?;
        draw_lines(&mut chart, lines, limits, x0, x1).map_err(|e| err(&e))?;
    } else {
        let mut chart = builder
            .build_cartesian_2d(xs, 0.0..ymax.max(1e-3))
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_label)
            .x_label_formatter(&fmt_x)
            .draw()
            .map_err(|e| err(&e))?;
        draw_lines(&mut chart, lines, limits, x0, x1).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

type Chart<'a, Y> =
    ChartContext<'a, SVGBackend<'a>, Cartesian2d<plotters::coord::types::RangedCoordu32, Y>>;

fn draw_lines<'a, Y>(
    chart: &mut Chart<'a, Y>,
    lines: &[Line],
    limits: &[(String, f64)],
    x0: u32,
    x1: u32,
) -> Result<(), DrawingAreaErrorKind<std::io::Error>>
where
    Y: Ranged<ValueType = f64>,
{
    for (i, l) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<(u32, f64)> = l.points.iter().map(|(x, y)| (x.ilog2(), *y)).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))?
            .label(l.name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart.draw_series(pts.iter().map(|p| Circle::new(*p, 3, color.filled())))?;
    }
    for (name, y) in limits {
        let style = BLACK.mix(0.6).stroke_width(1);
        chart
            .draw_series(DashedLineSeries::new(vec![(x0, *y), (x1, *y)], 6, 4, style))?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], style));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()?;
    Ok(())
}

/// Writes `lines` to an SVG file at `path`, against a count (`x_label`,
/// e.g. peers) on a log x axis; their x values are the counts.
pub fn count_chart(
    path: &Path,
    title: &str,
    x_label: &str,
    y_label: &str,
    lines: &[Line],
) -> Result<(), String> {
    let err = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
    let all = lines.iter().flat_map(|l| l.points.iter());
    let (xmin, xmax) = all
        .clone()
        .fold((u64::MAX, 1u64), |(a, b), (x, _)| (a.min(*x), b.max(*x)));
    if xmin > xmax {
        return Err(err(&"nothing to plot"));
    }
    let ymax = all.map(|(_, y)| *y).fold(0.0f64, f64::max) * 1.15;
    let root = SVGBackend::new(path, (900, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (x0, x1) = (xmin.max(1) as f64 / 1.3, xmax.max(2) as f64 * 1.3);
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(14)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d((x0..x1).log_scale(), 0.0..ymax.max(1e-3))
        .map_err(|e| err(&e))?;
    chart
        .configure_mesh()
        .x_desc(x_label)
        .y_desc(y_label)
        .x_label_formatter(&|v: &f64| format!("{v:.0}"))
        .draw()
        .map_err(|e| err(&e))?;
    for (i, l) in lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<(f64, f64)> = l.points.iter().map(|(x, y)| (*x as f64, *y)).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label(l.name.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
            });
        chart
            .draw_series(pts.iter().map(|p| Circle::new(*p, 3, color.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(|e| err(&e))?;
    root.present().map_err(|e| err(&e))?;
    Ok(())
}
