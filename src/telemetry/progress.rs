//! A training progress bar without dependencies:
//! `[############........] 120/200  loss 5.9123  64.1 steps/s  ETA 1.2s`.
//!
//! On a terminal the bar redraws itself in place with `\r`; into a file or a pipe (a CI
//! log, `tee`) carriage returns would pile up as one enormous line, so there it writes a
//! plain line every few steps instead. Whether the output is a terminal is the caller's
//! to say (the binary asks [`std::io::IsTerminal`]), which keeps this testable.

use std::io::{self, Write};

/// Characters in the bar between the brackets.
const BAR: u64 = 20;
/// Plain lines per run when the output is not a terminal (about; see [`Progress::every`]).
const PLAIN_LINES: u64 = 20;

/// A progress display for `total` optimizer steps, written to `out`.
#[derive(Debug)]
pub struct Progress<W: Write> {
    total: u64,
    out: W,
    is_terminal: bool,
    every: u64,
    /// The bar as last drawn on a terminal: a shorter line must blank out its tail, and a
    /// note printed above the bar redraws it.
    drawn: Option<String>,
}

impl<W: Write> Progress<W> {
    /// A display for `total_steps` steps. With `is_terminal` it redraws one line in place;
    /// without, it writes a line every `total_steps / 20` steps (at least every step) and at
    /// the last step.
    pub fn new(total_steps: u64, out: W, is_terminal: bool) -> Self {
        Progress {
            total: total_steps,
            out,
            is_terminal,
            every: total_steps.div_ceil(PLAIN_LINES).max(1),
            drawn: None,
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
        let line = render(step, self.total, loss, steps_per_s);
        if self.is_terminal {
            self.redraw(line)
        } else if step % self.every == 0 || step == self.total {
            writeln!(self.out, "{line}")?;
            self.out.flush()
        } else {
            Ok(())
        }
    }

    /// Writes `text` as a line of its own (an evaluation result, a checkpoint saved) without
    /// breaking the bar: on a terminal the bar is cleared, and drawn again under the text.
    ///
    /// # Errors
    /// What writing to the output returned.
    pub fn note(&mut self, text: &str) -> io::Result<()> {
        match self.drawn.take() {
            Some(bar) => {
                let pad = bar.chars().count().saturating_sub(text.chars().count());
                writeln!(self.out, "\r{text}{:pad$}", "")?;
                self.redraw(bar)
            }
            None => {
                writeln!(self.out, "{text}")?;
                self.out.flush()
            }
        }
    }

    /// Ends the display: moves past the bar on a terminal, then writes `summary` as a line,
    /// and hands the output back.
    ///
    /// # Errors
    /// What writing to the output returned.
    pub fn finish(mut self, summary: &str) -> io::Result<W> {
        if self.drawn.take().is_some() {
            writeln!(self.out)?;
        }
        writeln!(self.out, "{summary}")?;
        self.out.flush()?;
        Ok(self.out)
    }

    /// Draws `line` over the current one.
    fn redraw(&mut self, line: String) -> io::Result<()> {
        let old = self.drawn.as_deref().map_or(0, |l| l.chars().count());
        let pad = old.saturating_sub(line.chars().count());
        write!(self.out, "\r{line}{:pad$}", "")?;
        self.out.flush()?;
        self.drawn = Some(line);
        Ok(())
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
    fn note_redraws_the_bar_under_it() {
        let mut p = Progress::new(10, Vec::new(), true);
        p.update(1, 2.0, 1.0).unwrap();
        p.note("eval loss 1.5").unwrap();
        let out = String::from_utf8(p.finish("done").unwrap()).unwrap();
        let bar = render(1, 10, 2.0, 1.0);
        assert_eq!(
            out,
            format!(
                "\r{bar}\reval loss 1.5{:pad$}\n\r{bar}\ndone\n",
                "",
                pad = bar.len() - 13
            )
        );
    }
}
