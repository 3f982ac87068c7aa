//! Numbers and text as the drawing prints them: fixed decimals (so output is the same
//! bytes on every run), round tick steps, XML escaping.

/// About how many ticks the time axis gets.
const TICKS: f64 = 10.0;

/// Decimals that show times to about four significant digits of the makespan, so that a
/// simulation in unit costs and a trace in seconds both read well.
pub(super) fn time_decimals(makespan: f64) -> usize {
    if makespan.is_finite() && makespan > 0.0 {
        (3.0 - makespan.log10().floor()).clamp(0.0, 12.0) as usize
    } else {
        3
    }
}

/// A 1, 2 or 5 times a power of ten giving about [`TICKS`] ticks over `0..=end`.
pub(super) fn tick_step(end: f64) -> f64 {
    let raw = end / TICKS;
    let magnitude = 10f64.powf(raw.log10().floor());
    let nice = match raw / magnitude {
        n if n <= 1.0 => 1.0,
        n if n <= 2.0 => 2.0,
        n if n <= 5.0 => 5.0,
        _ => 10.0,
    };
    nice * magnitude
}

/// Decimals that tell ticks `step` apart.
pub(super) fn tick_decimals(step: f64) -> usize {
    (-step.log10().floor()).clamp(0.0, 12.0) as usize
}

/// `v` with `decimals` decimals, never `-0`.
pub(super) fn num(v: f64, decimals: usize) -> String {
    let s = format!("{v:.decimals$}");
    match s.strip_prefix('-') {
        Some(rest) if rest.bytes().all(|b| b == b'0' || b == b'.') => rest.to_owned(),
        _ => s,
    }
}

/// `text` safe inside XML text and attribute values.
pub(super) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_numbers() {
        assert_eq!(tick_step(11.0), 2.0);
        assert_eq!(tick_step(100.0), 10.0);
        assert!((tick_step(0.0123) - 0.002).abs() < 1e-15);
        assert_eq!(tick_decimals(2.0), 0);
        assert_eq!(tick_decimals(0.002), 3);
    }

    #[test]
    fn numbers_have_fixed_decimals_and_no_negative_zero() {
        assert_eq!(num(-0.0, 2), "0.00");
        assert_eq!(num(-0.001, 2), "0.00");
        assert_eq!(num(-1.5, 1), "-1.5");
        assert_eq!(time_decimals(11.0), 2);
        assert_eq!(time_decimals(0.0123), 5);
    }
}
