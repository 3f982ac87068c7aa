//! The schedule grid: ranks as rows, steps as columns, offending cells marked.
//!
//! Follows PyTorch pipelining's `_format_pipeline_order` and its `<-- ERROR HERE`, with the
//! axes swapped (a rank's list reads left to right) and the marked cell in brackets, since a
//! row marker alone would not say which step. Lowered schedules of many micro-batches are
//! hundreds of steps wide, so only a window around the marks is printed.

use std::fmt::Write as _;

use crate::Schedule;

/// Steps shown on each side of the marked cells.
const CONTEXT: usize = 10;
/// Widest grid printed whole when no cell is marked.
const MAX_UNMARKED: usize = 2 * CONTEXT + 1;

/// What to mark in [`Schedule::format_grid`]: one cell, or a whole row when `step` is `None`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mark {
    /// The row.
    pub rank: usize,
    /// The column, if one cell is meant.
    pub step: Option<usize>,
}

impl Schedule {
    /// The action lists as a grid, ranks as rows and steps as columns, with each marked cell
    /// in brackets and its row ending in `<-- ERROR HERE`. Wide grids are cut to a window
    /// around the marked steps (or to their last steps when only rows are marked), with `...`
    /// where columns were left out.
    pub fn format_grid(&self, marks: &[Mark]) -> String {
        let steps = self.ranks().iter().map(Vec::len).max().unwrap_or(0);
        let marked_steps = marks.iter().filter_map(|m| m.step);
        let (lo, hi) = match (marked_steps.clone().min(), marked_steps.max()) {
            (Some(min), Some(max)) => (min.saturating_sub(CONTEXT), (max + CONTEXT + 1).min(steps)),
            _ if steps > MAX_UNMARKED => (steps - MAX_UNMARKED, steps),
            _ => (0, steps),
        };
        let width = self
            .ranks()
            .iter()
            .flatten()
            .map(|a| a.to_string().len())
            .max()
            .unwrap_or(1)
            .max(hi.saturating_sub(1).to_string().len())
            + 2;
        let label = format!("rank {}", self.num_ranks().saturating_sub(1)).len() + 1;

        let mut out = String::new();
        let _ = write!(out, "{:label$}", "step");
        if lo > 0 {
            out.push_str("... ");
        }
        for step in lo..hi {
            let _ = write!(out, "{step:^width$}");
        }
        out.truncate(out.trim_end().len());
        out.push('\n');
        for (rank, list) in self.ranks().iter().enumerate() {
            let mut row = format!("{:label$}", format!("rank {rank}"));
            if lo > 0 {
                row.push_str("... ");
            }
            for step in lo..hi {
                let cell = match list.get(step) {
                    Some(a) if is_marked(marks, rank, step) => format!("[{a}]"),
                    Some(a) => a.to_string(),
                    None => String::new(),
                };
                let _ = write!(row, "{cell:^width$}");
            }
            if hi < list.len() {
                row.push_str(" ...");
            }
            let row_marks: Vec<_> = marks.iter().filter(|m| m.rank == rank).collect();
            if !row_marks.is_empty() {
                row.push_str("  <-- ERROR HERE");
                let steps: Vec<String> = row_marks
                    .iter()
                    .filter_map(|m| m.step)
                    .map(|s| s.to_string())
                    .collect();
                if !steps.is_empty() {
                    let _ = write!(row, " (step {})", steps.join(", "));
                }
            }
            out.push_str(row.trim_end());
            out.push('\n');
        }
        out
    }
}

fn is_marked(marks: &[Mark], rank: usize, step: usize) -> bool {
    marks.iter().any(|m| m.rank == rank && m.step == Some(step))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Action;

    #[test]
    fn marks_the_cell_and_the_row() {
        let s = Schedule::new(
            vec![0, 1],
            1,
            vec![
                vec![Action::forward(0, 0), Action::backward(0, 0)],
                vec![Action::forward(1, 0), Action::backward(1, 0)],
            ],
        )
        .unwrap();
        let grid = s.format_grid(&[Mark {
            rank: 1,
            step: Some(1),
        }]);
        let lines: Vec<&str> = grid.lines().collect();
        assert_eq!(lines.len(), 3);
        assert!(lines[1].starts_with("rank 0") && !lines[1].contains("ERROR"));
        assert!(lines[2].contains("[1B0]"), "{grid}");
        assert!(lines[2].ends_with("<-- ERROR HERE (step 1)"), "{grid}");
    }

    #[test]
    fn wide_grids_are_windowed() {
        let list: Vec<Action> = (0..100).map(|mb| Action::forward(0, mb)).collect();
        let s = Schedule::new(vec![0], 100, vec![list]).unwrap();
        let grid = s.format_grid(&[Mark {
            rank: 0,
            step: Some(50),
        }]);
        assert!(grid.contains("[0F50]") && grid.contains("0F40") && !grid.contains("0F39"));
        assert!(grid.contains("... ") && grid.contains(" ..."), "{grid}");
    }
}
