//! How `--measure`'s runs bore the plan out, as text: each run's outcome, the errors
//! raw and with the control's drift taken out, the measured order of the plan's top
//! three and its pick against the fastest measured (`proof` runs them).

use super::control::Timed;
use super::rounds::median;

/// A run measured: its name, its predicted step, its measured one (the median of its
/// rounds), the fastest and slowest of its rounds, and the median of its rounds each
/// divided by the control's drift at the time (`None` without a control).
#[derive(Debug, Clone)]
pub(super) struct Outcome {
    pub name: String,
    pub predicted: f64,
    pub measured: f64,
    pub spread: (f64, f64),
    pub steady: Option<f64>,
}

/// How far `predicted` is from `measured`, as a share.
fn error(predicted: f64, measured: f64) -> f64 {
    (predicted / measured - 1.0).abs()
}

/// The mean and the largest of `errors` (zeros for none).
fn mean_and_largest(errors: &[f64]) -> (f64, f64) {
    let mean = errors.iter().sum::<f64>() / errors.len().max(1) as f64;
    (mean, errors.iter().copied().fold(0.0, f64::max))
}

/// The control's drift over the rounds, and the measured runs' errors with it taken
/// out: their median for all, and each round's own (its step divided by the drift at
/// its time); empty without a drift.
pub(super) fn drift_text(runs: &[Outcome], drifts: &[Timed], control: &str) -> String {
    let values: Vec<f64> = drifts.iter().map(|d| d.value).collect();
    let Some(middle) = median(&values) else {
        return String::new();
    };
    let low = values.iter().copied().fold(f64::INFINITY, f64::min);
    let high = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let whole: Vec<f64> = runs
        .iter()
        .map(|o| error(o.predicted * middle, o.measured))
        .collect();
    let own: Vec<f64> = runs
        .iter()
        .filter_map(|o| o.steady.map(|s| error(o.predicted, s)))
        .collect();
    let ((mean, worst), (own_mean, own_worst)) = (mean_and_largest(&whole), mean_and_largest(&own));
    format!(
        "control ({control}): {:+.1}% against its profile, {:+.1}% to {:+.1}% over {} runs; \
         with their median drift taken out, mean absolute error {:.1}%, largest {:.1}%; \
         with each run's own (between the controls either side), {:.1}%, largest {:.1}%\n",
        (middle - 1.0) * 100.0,
        (low - 1.0) * 100.0,
        (high - 1.0) * 100.0,
        values.len(),
        mean * 100.0,
        worst * 100.0,
        own_mean * 100.0,
        own_worst * 100.0
    )
}

/// Whether a measured run's name (`4 = by time`) includes `name`.
fn named(run: &str, name: &str) -> bool {
    run.split(" = ").any(|n| n == name)
}

/// The plan's rank in a measured run's name, where it has one.
fn rank(run: &str) -> Option<usize> {
    run.split(" = ").next()?.parse().ok()
}

/// How the predictions of the measured runs held: the mean and largest error, how many
/// fell within their run's own rounds (where the machine's noise alone could put them),
/// whether the measured order of the plan's top three is the predicted one, and how far
/// the plan's pick is from the fastest measured candidate.
pub(super) fn accuracy(runs: &[Outcome]) -> String {
    let errors: Vec<f64> = runs
        .iter()
        .map(|o| error(o.predicted, o.measured))
        .collect();
    let (mean, worst) = mean_and_largest(&errors);
    let mut out = format!(
        "mean absolute error {:.1}%, largest {:.1}% ({} runs)\n",
        mean * 100.0,
        worst * 100.0,
        runs.len()
    );
    let rounds = |o: &&Outcome| o.spread.0 < o.spread.1;
    let spread: Vec<&Outcome> = runs.iter().filter(rounds).collect();
    if !spread.is_empty() {
        let within = |o: &&&Outcome| (o.spread.0..=o.spread.1).contains(&o.predicted);
        out += &format!(
            "predicted within the spread of their own measured rounds: {} of {}\n",
            spread.iter().filter(within).count(),
            spread.len()
        );
    }
    let ranked: Vec<&Outcome> = runs.iter().filter(|o| rank(&o.name).is_some()).collect();
    if ranked.len() >= 3 {
        let mut top: Vec<&&Outcome> = ranked[..3].iter().collect();
        top.sort_by(|a, b| a.measured.total_cmp(&b.measured));
        let order: Vec<String> = top
            .iter()
            .filter_map(|r| rank(&r.name))
            .map(|r| r.to_string())
            .collect();
        out += &format!(
            "top 3 in measured order: {} (predicted 1 2 3{})\n",
            order.join(" "),
            swapped_text(&ranked[..3])
        );
    }
    if let Some(pick) = ranked.first() {
        let fastest = runs
            .iter()
            .map(|r| r.measured)
            .fold(f64::INFINITY, f64::min);
        out += &format!(
            "the plan's pick measured {:.2} ms; the fastest measured {:.2} ms ({:+.1}%)\n",
            pick.measured * 1e3,
            fastest * 1e3,
            (pick.measured / fastest - 1.0) * 100.0
        );
    }
    if let Some(d) = runs.iter().find(|r| named(&r.name, "default")) {
        if let Some(pick) = ranked.first() {
            out += &format!(
                "measured speed-up of the plan over the default: {:.2}x\n",
                d.measured / pick.measured
            );
        }
    }
    out
}

/// Of `top` (in predicted order), each pair measured the other way round, said as
/// within or beyond each other's rounds (within: the machine's noise alone could have
/// swapped them); empty where none is.
fn swapped_text(top: &[&Outcome]) -> String {
    let overlap = |a: &Outcome, b: &Outcome| a.spread.0 <= b.spread.1 && b.spread.0 <= a.spread.1;
    let (mut within, mut beyond) = (Vec::new(), Vec::new());
    for (i, a) in top.iter().enumerate() {
        for (j, b) in top.iter().enumerate().skip(i + 1) {
            if a.measured > b.measured {
                let pair = format!("{}-{}", i + 1, j + 1);
                match overlap(a, b) {
                    true => within.push(pair),
                    false => beyond.push(pair),
                }
            }
        }
    }
    let mut out = String::new();
    if !within.is_empty() {
        out += &format!(
            "; swapped within each other's rounds: {}",
            within.join(", ")
        );
    }
    if !beyond.is_empty() {
        out += &format!("; swapped beyond their rounds: {}", beyond.join(", "));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_under_two_names_counts_once_and_keeps_its_rank() {
        let run = |name: &str, predicted: f64, measured: f64, spread: (f64, f64)| Outcome {
            name: name.to_string(),
            predicted,
            measured,
            spread,
            steady: None,
        };
        let runs = [
            run("1", 1.00e-3, 1.10e-3, (1.05e-3, 1.2e-3)),
            run("2 = by time", 1.05e-3, 1.00e-3, (0.95e-3, 1.1e-3)),
            run("3", 1.20e-3, 1.05e-3, (1.0e-3, 1.1e-3)),
            run("default = by params", 2.0e-3, 2.2e-3, (2.2e-3, 2.2e-3)),
        ];
        assert_eq!(rank("2 = by time"), Some(2));
        assert_eq!(rank("default = by params"), None);
        assert!(named("default = by params", "default") && named("2 = by time", "by time"));
        let text = accuracy(&runs);
        assert!(text.contains("(4 runs)"), "{text}");
        // The first predicted below its rounds, the third above; one round: not counted.
        assert!(text.contains("their own measured rounds: 1 of 3"), "{text}");
        assert!(text.contains("top 3 in measured order: 2 3 1"), "{text}");
        // 1 measured slower than 2 and 3, its rounds overlapping theirs.
        assert!(
            text.contains("(predicted 1 2 3; swapped within each other's rounds: 1-2, 1-3)"),
            "{text}"
        );
        let apart = [
            run("1", 1.0e-3, 1.3e-3, (1.25e-3, 1.35e-3)),
            runs[1].clone(),
            run("3", 1.1e-3, 1.2e-3, (1.15e-3, 1.25e-3)),
        ];
        let swapped = accuracy(&apart);
        assert!(
            swapped.contains("(predicted 1 2 3; swapped within each other's rounds: 1-3; swapped beyond their rounds: 1-2)"),
            "{swapped}"
        );
        let ordered = [runs[1].clone(), apart[2].clone(), apart[0].clone()];
        let renamed: Vec<Outcome> = ordered
            .iter()
            .enumerate()
            .map(|(i, o)| Outcome {
                name: (i + 1).to_string(),
                ..o.clone()
            })
            .collect();
        assert!(accuracy(&renamed).contains("(predicted 1 2 3)\n"));
        // The pick (rank 1) against the fastest (rank 2): 10% slower.
        assert!(
            text.contains("1.10 ms; the fastest measured 1.00 ms (+10.0%)"),
            "{text}"
        );
        assert!(text.contains("over the default: 2.00x"), "{text}");
    }

    #[test]
    fn the_drift_is_taken_out_by_the_controls_median_and_by_each_round_s_own() {
        let at = |value: f64, at: f64| Timed { value, at };
        // The machine 20% slower ten seconds in, and so it stayed.
        let controls = [at(1.0, 0.0), at(1.2, 10.0), at(1.2, 20.0)];
        let run = |name: &str, steady: f64| Outcome {
            name: name.to_string(),
            predicted: 1.0e-3,
            measured: 1.15e-3,
            spread: (1.1e-3, 1.2e-3),
            steady: Some(steady),
        };
        let text = drift_text(
            &[run("1", 1.0e-3), run("2", 1.25e-3)],
            &controls,
            "one graph",
        );
        assert!(
            text.contains("+20.0% against its profile, +0.0% to +20.0% over 3 runs"),
            "{text}"
        );
        // Their median, 1.2, puts both 1 ms predictions at 1.2 against 1.15 measured.
        let whole = (1.2 / 1.15 - 1.0) * 100.0;
        assert!(
            text.contains(&format!(
                "median drift taken out, mean absolute error {whole:.1}%, largest {whole:.1}%;"
            )),
            "{text}"
        );
        // Each run's own: 1.0 and 1.25 steady against 1 ms predicted.
        assert!(
            text.contains(
                "each run's own (between the controls either side), 10.0%, largest 20.0%"
            ),
            "{text}"
        );
        assert_eq!(drift_text(&[run("1", 1.0e-3)], &[], "one graph"), "");
    }
}
