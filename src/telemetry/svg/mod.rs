//! A pipeline [`Timeline`] drawn as a standalone SVG: one row per rank, time across, one
//! rectangle per span, with the step's makespan, bubble fraction and idle time underneath.
//!
//! The output is a pure function of its input, byte for byte (numbers are printed with
//! fixed decimals, nothing is iterated in hash order), so drawings can be diffed and kept
//! as golden files.

use std::collections::BTreeSet;
use std::fmt::Write as _;

use pipetrain_schedules::{ActionKind, Span, Timeline};

use frame::{draw_footer, draw_grid, draw_header, Frame};
use text::{escape, num};

mod frame;
mod text;

/// Width of the time axis, px.
const PLOT_WIDTH: f64 = 840.0;
/// Right margin, px.
const RIGHT: f64 = 24.0;
/// Room for the title above the rows, px.
const TOP: f64 = 44.0;
/// Height of one rank's row, px.
const ROW: f64 = 26.0;
/// Gap between rows, px.
const ROW_GAP: f64 = 6.0;
/// Room for the tick labels under the rows, px.
const AXIS: f64 = 30.0;
/// Height of the legend line, px.
const LEGEND: f64 = 24.0;
/// Height of one footer line, px.
const LINE: f64 = 18.0;
/// Approximate advance of one character at the 12 px font, px: there is no font metrics
/// without a renderer, so widths are estimated and generously rounded.
const CHAR: f64 = 7.0;
/// Ranks listed per footer line, so that wide pipelines wrap instead of running off.
const IDLE_PER_LINE: usize = 8;

/// Draws `t` as an SVG document titled `title`.
///
/// Every span gets one `<rect>`: compute spans (F, B, I, W) have `class="span compute"`
/// and a strong colour per kind, other spans (transfers, `ALLREDUCE`, `STEP`) have
/// `class="span other"` and a light one. Each carries a `<title>` tooltip with the action
/// and its times, and shows its micro-batch number when wide enough. Idle time is left
/// blank. A legend of the kinds present and a footer with [`Timeline::makespan`],
/// [`Timeline::bubble_fraction`] (3 decimals) and [`Timeline::idle`] per rank follow.
pub fn timeline_svg(t: &Timeline, title: &str) -> String {
    let labels: Vec<String> = t.ranks.iter().enumerate().map(rank_label).collect();
    let f = Frame::of(t, &labels);
    let mut s = String::new();
    draw_header(&mut s, &f, title);
    // Grid and tick labels first, so that spans are drawn over the grid lines.
    draw_grid(&mut s, &f);
    for (rank, spans) in t.ranks.iter().enumerate() {
        let y = TOP + rank as f64 * (ROW + ROW_GAP);
        let _ = writeln!(
            s,
            r#"<text class="rank" x="{}" y="{}" text-anchor="end">{}</text>"#,
            num(f.left - 8.0, 0),
            num(y + ROW / 2.0 + 4.0, 1),
            escape(&labels[rank])
        );
        for span in spans {
            draw_span(&mut s, span, f.left, y, f.scale, f.decimals);
        }
    }
    draw_legend(&mut s, t, f.left, f.legend_y);
    draw_footer(&mut s, &f, t);
    s.push_str("</svg>\n");
    s
}

/// One span's rectangle, tooltip and micro-batch label.
fn draw_span(s: &mut String, span: &Span, left: f64, y: f64, scale: f64, decimals: usize) {
    let kind = span.action.kind();
    let x0 = coord(span.start * scale);
    let x1 = coord(span.end * scale).max(x0);
    let (fill, ink) = colours(kind);
    let class = if kind.is_compute() {
        "span compute"
    } else {
        "span other"
    };
    let _ = writeln!(
        s,
        r#"<rect class="{class}" x="{}" y="{}" width="{}" height="{}" fill="{fill}" stroke="white" stroke-width="0.5"><title>{}: {} to {}</title></rect>"#,
        num(left + x0, 2),
        num(y, 0),
        num(x1 - x0, 2),
        num(ROW, 0),
        span.action,
        num(span.start, decimals),
        num(span.end, decimals),
    );
    if let Some(mb) = span.action.micro_batch() {
        let text = mb.to_string();
        if x1 - x0 >= text.len() as f64 * CHAR + 4.0 {
            let _ = writeln!(
                s,
                r#"<text class="mb" x="{}" y="{}" text-anchor="middle" font-size="11" fill="{ink}">{text}</text>"#,
                num(left + (x0 + x1) / 2.0, 2),
                num(y + ROW / 2.0 + 4.0, 1),
            );
        }
    }
}

/// A swatch and a name for each kind of span in `t`, in a fixed order.
fn draw_legend(s: &mut String, t: &Timeline, left: f64, y: f64) {
    let present: BTreeSet<Key> = t
        .ranks
        .iter()
        .flatten()
        .map(|span| Key::of(span.action.kind()))
        .collect();
    let mut x = left;
    for key in present {
        let (kind, name) = key.describe();
        let (fill, _) = colours(kind);
        let _ = writeln!(
            s,
            r##"<rect class="legend" x="{}" y="{}" width="14" height="14" fill="{fill}" stroke="#888" stroke-width="0.5"/>"##,
            num(x, 0),
            num(y, 0),
        );
        let _ = writeln!(
            s,
            r#"<text class="legend" x="{}" y="{}">{name}</text>"#,
            num(x + 20.0, 0),
            num(y + 11.0, 0),
        );
        x += 20.0 + name.len() as f64 * CHAR + 18.0;
    }
}

/// Legend entries: the four transfer kinds share one entry, since they share a colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Key {
    Forward,
    Backward,
    Input,
    Weight,
    Comm,
    AllReduce,
    Step,
}

impl Key {
    fn of(kind: ActionKind) -> Key {
        match kind {
            ActionKind::Forward => Key::Forward,
            ActionKind::Backward => Key::Backward,
            ActionKind::BackwardInput => Key::Input,
            ActionKind::BackwardWeight => Key::Weight,
            ActionKind::SendAct
            | ActionKind::RecvAct
            | ActionKind::SendGrad
            | ActionKind::RecvGrad => Key::Comm,
            ActionKind::AllReduce => Key::AllReduce,
            ActionKind::OptimizerStep => Key::Step,
        }
    }

    /// A kind with this entry's colour, and the entry's text.
    fn describe(self) -> (ActionKind, &'static str) {
        match self {
            Key::Forward => (ActionKind::Forward, "F forward"),
            Key::Backward => (ActionKind::Backward, "B backward"),
            Key::Input => (ActionKind::BackwardInput, "I input grad"),
            Key::Weight => (ActionKind::BackwardWeight, "W weight grad"),
            Key::Comm => (ActionKind::SendAct, "send/recv"),
            Key::AllReduce => (ActionKind::AllReduce, "ALLREDUCE"),
            Key::Step => (ActionKind::OptimizerStep, "STEP"),
        }
    }
}

/// Fill and label colour of a kind: strong colours (Tableau 10) for compute, light ones
/// for the rest, so that the eye goes to the work and the bubbles between it.
fn colours(kind: ActionKind) -> (&'static str, &'static str) {
    match kind {
        ActionKind::Forward => ("#4e79a7", "white"),
        ActionKind::Backward => ("#e15759", "white"),
        ActionKind::BackwardInput => ("#f28e2b", "white"),
        ActionKind::BackwardWeight => ("#59a14f", "white"),
        ActionKind::SendAct | ActionKind::RecvAct | ActionKind::SendGrad | ActionKind::RecvGrad => {
            ("#d9d9d9", "#333")
        }
        ActionKind::AllReduce => ("#d4c4e8", "#333"),
        ActionKind::OptimizerStep => ("#f1e3a7", "#333"),
    }
}

/// `rank r (stage s)` or `rank r (stages a, b)`, from the stages its spans ran.
fn rank_label((rank, spans): (usize, &Vec<Span>)) -> String {
    let stages: BTreeSet<usize> = spans.iter().map(|s| s.action.stage()).collect();
    let list: Vec<String> = stages.iter().map(usize::to_string).collect();
    match list.len() {
        0 => format!("rank {rank}"),
        1 => format!("rank {rank} (stage {})", list[0]),
        _ => format!("rank {rank} (stages {})", list.join(", ")),
    }
}

/// A position on the axis, px, kept on the axis whatever the span's times.
fn coord(x: f64) -> f64 {
    if x.is_nan() {
        0.0
    } else {
        x.clamp(0.0, PLOT_WIDTH)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pipetrain_schedules::Action;

    #[test]
    fn title_is_escaped() {
        let t = Timeline {
            stages: 1,
            ranks: vec![vec![Span {
                action: Action::forward(0, 0),
                start: 0.0,
                end: 1.0,
            }]],
        };
        let svg = timeline_svg(&t, "a <b> & \"c\"");
        assert!(svg.contains("a &lt;b&gt; &amp; &quot;c&quot;"));
        assert!(!svg.contains("<b>"));
    }

    #[test]
    fn empty_timeline_still_draws() {
        let svg = timeline_svg(
            &Timeline {
                stages: 0,
                ranks: vec![],
            },
            "empty",
        );
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("bubble fraction 0.000"));
        assert!(!svg.contains("NaN"));
    }

    #[test]
    fn narrow_spans_are_not_labelled() {
        let t = Timeline {
            stages: 1,
            ranks: vec![vec![
                Span {
                    action: Action::forward(0, 0),
                    start: 0.0,
                    end: 1000.0,
                },
                Span {
                    action: Action::forward(0, 1),
                    start: 1000.0,
                    end: 1000.5,
                },
            ]],
        };
        let svg = timeline_svg(&t, "t");
        assert_eq!(svg.matches(r#"<text class="mb""#).count(), 1);
        assert_eq!(svg.matches(r#"<rect class="span compute""#).count(), 2);
    }
}
