//! What the machine and the run cost beside the stages' compute, as the simulator reads
//! it: cores, hand-offs, how actions running at once slow each other, what keeping
//! replicas in step costs; measured by `pipetrain plan` (`plan::machine`).

use super::simulate::Candidate;
use super::topology::Link;

/// What the machine and the run cost beside the stages' compute.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Machinery {
    /// The machine's cores.
    pub cores: usize,
    /// Each session's intra-op threads at this many workers.
    pub threads: usize,
    /// A hand-off of activations between two actors of one process, seconds.
    pub hop: f64,
    /// The same for a gradient (`None`: as `hop`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hop_back: Option<f64>,
    /// Seconds to add one float32 into another (the in-process reduction's rate).
    pub add_per_value: f64,
    /// How much each further action running at once slows the others: copies of one
    /// action (replicas, tensor shards), measured on two replicas at once.
    pub contention: f64,
    /// The same between two pipeline stages' actions, measured on a two-stage run
    /// (`None`: not measured, as `contention`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stage_contention: Option<f64>,
    /// What keeping data-parallel replicas in step adds to a step.
    pub replica_sync: f64,
    /// What a step costs beside its actions (the coordinator, the data).
    pub step_overhead: f64,
    /// The connection between two nodes of a cluster (`None`: one process).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub link: Option<Link>,
    /// What ZeRO stage 2 costs a micro-batch per parameter value of a stage beyond its
    /// reduce-scatter (each micro-batch's gradients written apart, its part added in,
    /// the replicas met), fitted to two replicas run at stage 2 (`None`: not measured,
    /// and stage 2 is not searched).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub zero2_per_value: Option<f64>,
    /// How much copies of the update running at once (replicas, shards) slow each other,
    /// measured on two replicas at once (`None`: as `contention`). The update reads and
    /// writes every parameter, gradient and moment once and does little else: on the
    /// vocabulary GPT two replicas' AdamW updates at once took 1.6-1.9 times one alone,
    /// where their forward and backward took 1.07 times.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub update_contention: Option<f64>,
}

impl Machinery {
    /// `cores` cores of `threads` threads per session, where nothing beside the
    /// stages' compute costs anything: what a measured machine's figures are set on.
    pub fn bare(cores: usize, threads: usize) -> Machinery {
        Machinery {
            cores,
            threads,
            hop: 0.0,
            hop_back: None,
            add_per_value: 0.0,
            contention: 0.0,
            stage_contention: None,
            replica_sync: 0.0,
            step_overhead: 0.0,
            link: None,
            zero2_per_value: None,
            update_contention: None,
        }
    }

    /// A gradient's hand-off between two actors of one process ([`Machinery::hop_back`],
    /// else the activations').
    pub fn gradient_hop(&self) -> f64 {
        self.hop_back.unwrap_or(self.hop)
    }

    /// The contention `c`'s actions running at once meet: where copies of each action
    /// run (replicas, shards), theirs; else the stages' where measured.
    pub fn contention_of(&self, c: &Candidate) -> f64 {
        match c.dp * c.tp {
            1 => self.stage_contention.unwrap_or(self.contention),
            _ => self.contention,
        }
    }

    /// What `c`'s update costs beyond what the simulator charges every action for the
    /// others running at once: where copies of it run (replicas, shards), their measured
    /// [`Machinery::update_contention`] over their `contention`; else nothing.
    pub fn update_factor(&self, c: &Candidate) -> f64 {
        self.update_factor_of(c.dp * c.tp)
    }

    /// [`Machinery::update_factor`] for `copies` of each update running at once.
    pub fn update_factor_of(&self, copies: usize) -> f64 {
        match (copies, self.update_contention) {
            (0 | 1, _) | (_, None) => 1.0,
            (_, Some(u)) => (1.0 + u) / (1.0 + self.contention),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two cores of one thread each, the stages' contention measured at 0.5.
    fn two_cores(contention: f64, update_contention: Option<f64>) -> Machinery {
        Machinery {
            contention,
            stage_contention: Some(0.5),
            update_contention,
            ..Machinery::bare(2, 1)
        }
    }

    /// 1F1B over two micro-batches of one sample in `dp` x `tp` x `pp`.
    fn layout(dp: usize, tp: usize, pp: usize) -> Candidate {
        Candidate::one_f_one_b((dp, tp, pp), (2, 1))
    }

    #[test]
    fn copies_of_the_update_pay_its_own_measured_contention_and_a_lone_update_none() {
        let m = two_cores(0.1, Some(0.76));
        // Two replicas or two shards: the simulator slows each copy by `contention`
        // already, so the factor brings it to the update's own 1.76.
        for copies in [layout(2, 1, 1), layout(1, 2, 1), layout(2, 1, 2)] {
            let k = m.update_factor(&copies);
            assert!(
                (k * (1.0 + m.contention) - 1.76).abs() < 1e-12,
                "{copies:?}"
            );
        }
        // One copy of each update (stages alone) or nothing measured: as simulated.
        assert_eq!(m.update_factor(&layout(1, 1, 2)), 1.0);
        assert_eq!(two_cores(0.1, None).update_factor(&layout(2, 1, 1)), 1.0);
    }

    #[test]
    fn a_pipeline_s_stages_meet_their_own_contention_and_copies_of_an_action_theirs() {
        let m = two_cores(1.0, None);
        assert_eq!(m.contention_of(&layout(1, 1, 2)), 0.5);
        assert_eq!(m.contention_of(&layout(2, 1, 1)), 1.0);
        assert_eq!(m.contention_of(&layout(1, 2, 1)), 1.0);
        assert_eq!(m.contention_of(&layout(2, 1, 2)), 1.0);
        // Not measured: the replicas' figure.
        let unmeasured = Machinery {
            stage_contention: None,
            ..m
        };
        assert_eq!(unmeasured.contention_of(&layout(1, 1, 2)), 1.0);
    }
}
