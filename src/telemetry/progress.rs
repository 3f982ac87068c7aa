//! The training progress display:
//! `[############........] 120/200  loss 5.9123  64.1 steps/s  ETA 1.2s`.
//!
//! On a terminal it is an `indicatif` bar, redrawn in place on stderr, with notes
//! (evaluations, checkpoints) printed above it. Into a file or a pipe (a CI log, `tee`)
//! redraws would pile up as one enormous line, so there it writes the same line as plain
//! text every few steps instead ([`render`]), which `indicatif` does not offer. Whether
//! the output is a terminal is the caller's to say (the binary asks
//! [`std::io::IsTerminal`]), which keeps this testable.

use std::io::{self, Write};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Characters in the bar between the brackets.
const BAR: u64 = 20;
/// Plain lines per run when the output is not a terminal (about; see [`Progress::every`]).
const PLAIN_LINES: u64 = 20;

/// A progress display for `total` optimizer steps: a bar on a terminal, plain lines to
/// `out` otherwise; the closing summary goes to `out` either way.
#[derive(Debug)]
pub struct Progress<W: Write> {
    total: u64,
    out: W,
    every: u64,
    /// The bar, on a terminal.
    bar: Option<ProgressBar>,
}

impl<W: Write> Progress<W> {
    /// A display for `total_steps` steps. With `is_terminal` it is a bar on stderr;
    /// without, it writes a line to `out` every `total_steps / 20` steps (at least every
    /// step) and at the last step.
    pub fn new(total_steps: u64, out: W, is_terminal: bool) -> Self {
        let target = is_terminal.then(ProgressDrawTarget::stderr);
        Self::drawn_to(total_steps, out, target)
    }

    /// [`Progress::new`] with the bar drawn to `target` (`None`: plain lines to `out`).
    pub fn drawn_to(total_steps: u64, out: W, target: Option<ProgressDrawTarget>) -> Self {
        let bar = target.map(|t| {
            let width = total_steps.to_string().len();
            let template =
                format!("[{{bar:{BAR}}}] {{pos:>{width}}}/{{len}}  {{msg}}  ETA {{eta}}");
            let style = ProgressStyle::with_template(&template)
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("#.");
            ProgressBar::with_draw_target(Some(total_steps), t).with_style(style)
        });
        Progress {
            total: total_steps,
            out,
            every: total_steps.div_ceil(PLAIN_LINES).max(1),
            bar,
        }
    }

    /// Writes plain lines every `steps` steps instead (0 counts as 1). No effect on a
    /// terminal, which shows every update.
    pub fn every(mut self, steps: u64) -> Self {
        self.every = steps.max(1);
        self
    }

    /// Shows that `step` steps (counting from 1) are done, the latest loss and the current
    /// rate, from which it estimates the time left.
    ///
    /// # Errors
    /// What writing to the output returned.
    pub fn update(&mut self, step: u64, loss: f64, steps_per_s: f64) -> io::Result<()> {
        if let Some(bar) = &self.bar {
            bar.set_message(format!("loss {loss:.4}  {steps_per_s:.1} steps/s"));
            bar.set_position(step);
            return Ok(());
        }
        if step % self.every == 0 || step == self.total {
            writeln!(self.out, "{}", render(step, self.total, loss, steps_per_s))?;
            self.out.flush()?;
        }
        Ok(())
    }

    /// Writes `text` as a line of its own (an evaluation result, a checkpoint saved): above
    /// the bar on a terminal.
    ///
    /// # Errors
    /// What writing to the output returned.
    pub fn note(&mut self, text: &str) -> io::Result<()> {
        match &self.bar {
            Some(bar) => {
                bar.println(text);
                Ok(())
            }
            None => {
                writeln!(self.out, "{text}")?;
                self.out.flush()
            }
        }
    }

    /// Ends the display (the bar stays as last drawn; `out` moves past it), then writes
    /// `summary` as a line, and hands the output back.
    ///
    /// # Errors
    /// What writing to the output returned.
    pub fn finish(mut self, summary: &str) -> io::Result<W> {
        if let Some(bar) = self.bar.take() {
            // The bar stays as last drawn, the cursor at its end.
            bar.finish();
            writeln!(self.out)?;
        }
        writeln!(self.out, "{summary}")?;
        self.out.flush()?;
        Ok(self.out)
    }

    /// The bar's position and message, on a terminal.
    #[cfg(test)]
    fn shown(&self) -> Option<(u64, String)> {
        self.bar.as_ref().map(|b| (b.position(), b.message()))
    }
}

/// One progress line: bar, count, loss, rate and estimated time left. The count is padded
/// to the width of `total` so that the line does not shift as the digits grow.
pub fn render(step: u64, total: u64, loss: f64, steps_per_s: f64) -> String {
    let filled = if total == 0 {
        BAR
    } else {
        // u128: `step * BAR` cannot overflow.
        (u128::from(step.min(total)) * u128::from(BAR) / u128::from(total)) as u64
    };
    let bar: String = (0..BAR)
        .map(|i| if i < filled { '#' } else { '.' })
        .collect();
    let width = total.to_string().len();
    let left = total.saturating_sub(step) as f64;
    let eta = if steps_per_s > 0.0 {
        duration(left / steps_per_s)
    } else {
        "--".to_owned()
    };
    format!("[{bar}] {step:>width$}/{total}  loss {loss:.4}  {steps_per_s:.1} steps/s  ETA {eta}")
}

/// `1.2s`, `3m05s`, `2h07m`; `--` when unknown.
fn duration(secs: f64) -> String {
    if !secs.is_finite() || secs < 0.0 {
        return "--".to_owned();
    }
    if secs < 60.0 {
        return format!("{secs:.1}s");
    }
    let whole = secs.round() as u64;
    if whole < 3600 {
        format!("{}m{:02}s", whole / 60, whole % 60)
    } else {
        format!("{}h{:02}m", whole / 3600, whole % 3600 / 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_the_documented_line() {
        assert_eq!(
            render(120, 200, 5.91234, 64.1),
            "[############........] 120/200  loss 5.9123  64.1 steps/s  ETA 1.2s"
        );
        assert_eq!(
            render(5, 200, 1.0, 0.0),
            "[....................]   5/200  loss 1.0000  0.0 steps/s  ETA --"
        );
    }

    #[test]
    fn bar_is_full_at_the_end_and_beyond() {
        assert!(render(200, 200, 0.0, 1.0).starts_with(&format!("[{}]", "#".repeat(20))));
        assert!(render(300, 200, 0.0, 1.0).contains("ETA 0.0s"));
        assert!(render(0, 0, 0.0, 1.0).starts_with(&format!("[{}]", "#".repeat(20))));
    }

    #[test]
    fn durations_read_naturally() {
        assert_eq!(duration(1.25), "1.2s");
        assert_eq!(duration(185.0), "3m05s");
        assert_eq!(duration(7620.0), "2h07m");
        assert_eq!(duration(f64::INFINITY), "--");
    }

    #[test]
    fn on_a_terminal_the_bar_shows_the_step_and_out_only_moves_past_it() {
        let target = Some(ProgressDrawTarget::hidden());
        let mut p = Progress::drawn_to(10, Vec::new(), target);
        p.update(3, 2.0, 1.5).unwrap();
        p.note("eval loss 1.5").unwrap();
        assert_eq!(p.shown(), Some((3, "loss 2.0000  1.5 steps/s".into())));
        let out = String::from_utf8(p.finish("done").unwrap()).unwrap();
        assert_eq!(out, "\ndone\n");
    }
}
