//! The drawing's frame: where the rows, axis, legend and footer go, and the parts drawn
//! around the spans (title, grid and ticks, footer).

use std::fmt::Write as _;

use pipetrain_schedules::Timeline;

use super::text::{escape, num, tick_decimals, tick_step, time_decimals};
use super::{AXIS, CHAR, IDLE_PER_LINE, LEGEND, LINE, PLOT_WIDTH, RIGHT, ROW, ROW_GAP, TOP};

/// Where everything goes, px, and how time maps onto the plot.
pub(super) struct Frame {
    /// The plot's left edge (after the rank labels).
    pub left: f64,
    width: f64,
    height: f64,
    /// The bottom of the last row: the time axis.
    rows_bottom: f64,
    pub legend_y: f64,
    footer_y: f64,
    /// The time at the plot's right edge.
    axis_end: f64,
    /// px per unit of time.
    pub scale: f64,
    /// Decimals of the times printed.
    pub decimals: usize,
    makespan: f64,
}

impl Frame {
    /// The frame of `t` with its ranks labelled `labels`.
    pub fn of(t: &Timeline, labels: &[String]) -> Frame {
        let makespan = t.makespan();
        // A step of zero length (or a broken one) still gets an axis to draw on.
        let axis_end = if makespan.is_finite() && makespan > 0.0 {
            makespan
        } else {
            1.0
        };
        let longest = labels.iter().map(|l| l.chars().count()).max().unwrap_or(0);
        let left = (longest as f64 * CHAR + 16.0).max(72.0).ceil();
        let idle_lines = t.idle().len().div_ceil(IDLE_PER_LINE);
        let rows_bottom = TOP + t.ranks.len() as f64 * (ROW + ROW_GAP);
        let legend_y = rows_bottom + AXIS;
        let footer_y = legend_y + LEGEND;
        Frame {
            left,
            width: left + PLOT_WIDTH + RIGHT,
            height: footer_y + (1 + idle_lines) as f64 * LINE + 8.0,
            rows_bottom,
            legend_y,
            footer_y,
            axis_end,
            scale: PLOT_WIDTH / axis_end,
            decimals: time_decimals(makespan),
            makespan,
        }
    }
}

/// The document's opening tag, its title and the white background.
pub(super) fn draw_header(s: &mut String, f: &Frame, title: &str) {
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#,
        w = num(f.width, 0),
        h = num(f.height, 0),
    );
    let _ = writeln!(s, "<title>{}</title>", escape(title));
    let _ = writeln!(
        s,
        r#"<rect class="bg" width="100%" height="100%" fill="white"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text class="title" x="{}" y="26" font-size="16" font-weight="bold">{}</text>"#,
        num(f.left, 0),
        escape(title)
    );
}

/// A grid line and tick label at every tick of the time axis, and the axis.
pub(super) fn draw_grid(s: &mut String, f: &Frame) {
    let step = tick_step(f.axis_end);
    let tick_decimals = tick_decimals(step);
    let mut i = 0u32;
    loop {
        let at = f64::from(i) * step;
        if at > f.axis_end * (1.0 + 1e-9) || i > 1000 {
            break;
        }
        let x = f.left + at * f.scale;
        let _ = writeln!(
            s,
            r##"<line class="grid" x1="{x}" y1="{y1}" x2="{x}" y2="{y2}" stroke="#e6e6e6"/>"##,
            x = num(x, 2),
            y1 = num(TOP - 4.0, 0),
            y2 = num(f.rows_bottom, 0),
        );
        let _ = writeln!(
            s,
            r#"<text class="tick" x="{}" y="{}" text-anchor="middle">{}</text>"#,
            num(x, 2),
            num(f.rows_bottom + 16.0, 0),
            num(at, tick_decimals)
        );
        i += 1;
    }
    let _ = writeln!(
        s,
        r##"<line class="axis" x1="{}" y1="{y}" x2="{}" y2="{y}" stroke="#888"/>"##,
        num(f.left, 0),
        num(f.left + PLOT_WIDTH, 0),
        y = num(f.rows_bottom, 0),
    );
}

/// The makespan, bubble fraction and total idle time, then each rank's idle time,
/// [`IDLE_PER_LINE`] ranks a line.
pub(super) fn draw_footer(s: &mut String, f: &Frame, t: &Timeline) {
    let decimals = f.decimals;
    let _ = writeln!(
        s,
        r#"<text class="footer" x="{}" y="{}" xml:space="preserve">makespan {}   bubble fraction {}   total idle {}</text>"#,
        num(f.left, 0),
        num(f.footer_y + LINE - 4.0, 0),
        num(f.makespan, decimals),
        num(t.bubble_fraction(), 3),
        num(t.total_idle(), decimals)
    );
    for (line, chunk) in t.idle().chunks(IDLE_PER_LINE).enumerate() {
        let first = line * IDLE_PER_LINE;
        let parts: Vec<String> = chunk
            .iter()
            .enumerate()
            .map(|(i, v)| format!("rank {} {}", first + i, num(*v, decimals)))
            .collect();
        let lead = if line == 0 { "idle: " } else { "      " };
        let _ = writeln!(
            s,
            r#"<text class="footer" x="{}" y="{}" xml:space="preserve">{lead}{}</text>"#,
            num(f.left, 0),
            num(f.footer_y + (line + 2) as f64 * LINE - 4.0, 0),
            parts.join(", ")
        );
    }
}
