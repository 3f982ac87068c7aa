//! A tied weight's value handed on once per step (see `graph::tied`): the stage that
//! owns the weight hands its value to the later stages that read it as a forward value,
//! and the value is the same in every micro-batch of a step (parameters change only at
//! the optimizer step). So a stage sends it with its step's first forward only, and the
//! receiver keeps that value and gives it to the step's later micro-batches, which
//! arrive without it (a stage's forwards are sent and received in one order, so the
//! first arrives first).
//!
//! GPT-2 small at pp = 2: its token embedding, 154 MB, crossed the stage boundary with
//! every micro-batch, and a launched first stage held a copy per micro-batch in flight
//! and its encoded frame beside it.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::stage::{OrtStage, Payload};
use crate::compute::Value;
use crate::{Error, Result};

impl OrtStage {
    /// A forward's input from the previous stage, with the tied values it arrived
    /// without.
    pub(super) fn received(&mut self, input: Option<Payload>) -> Result<Payload> {
        let mut input = self.readable(input.unwrap_or_default())?;
        let io = &self.io;
        let tied = io.tied.iter().filter(|t| io.fwd_recv.contains(t));
        self.tied_handoffs.incoming(tied, &mut input)?;
        Ok(input)
    }
}

/// What a stage sent and received of the tied values.
#[derive(Debug, Default)]
pub(super) struct TiedHandoffs {
    /// The step (optimizer steps done) `sent` belongs to.
    step: u64,
    /// The tied values sent this step.
    sent: HashSet<String>,
    /// The last value received of each tied value.
    kept: HashMap<String, Arc<Value>>,
}

impl TiedHandoffs {
    /// Leaves out of `send` the values of `tied` already sent in `step`.
    pub(super) fn outgoing(
        &mut self,
        step: u64,
        tied: &[String],
        send: &mut HashMap<String, Arc<Value>>,
    ) {
        if self.step != step {
            self.step = step;
            self.sent.clear();
        }
        for name in tied {
            if send.contains_key(name) && !self.sent.insert(name.clone()) {
                send.remove(name);
            }
        }
    }

    /// Keeps the values of `tied` that `input` carries, and gives it the kept ones it
    /// arrived without.
    ///
    /// # Errors
    /// `MissingValue` when a tied value arrived without ever having arrived before.
    pub(super) fn incoming<'a>(
        &mut self,
        tied: impl Iterator<Item = &'a String>,
        input: &mut HashMap<String, Arc<Value>>,
    ) -> Result<()> {
        for name in tied {
            match input.get(name) {
                Some(v) => {
                    self.kept.insert(name.clone(), v.clone());
                }
                None => {
                    let v = self.kept.get(name).ok_or_else(|| Error::MissingValue {
                        role: "tied weight from the previous stage",
                        name: name.clone(),
                        hint: "; it is sent with a step's first forward only".into(),
                    })?;
                    input.insert(name.clone(), v.clone());
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;

    #[test]
    fn a_tied_value_crosses_once_a_step_and_every_micro_batch_gets_it() {
        let tied = vec!["w__shared".to_string()];
        let value: Arc<Value> = Arc::new(Tensor::f32(vec![2], vec![1.0, 2.0]).unwrap().into());
        let payload = || {
            HashMap::from([
                ("w__shared".to_string(), value.clone()),
                ("h".to_string(), value.clone()),
            ])
        };
        let (mut sender, mut receiver) = (TiedHandoffs::default(), TiedHandoffs::default());
        for step in [0, 1] {
            for mb in 0..3 {
                let mut send = payload();
                sender.outgoing(step, &tied, &mut send);
                assert_eq!(
                    send.contains_key("w__shared"),
                    mb == 0,
                    "step {step} mb {mb}"
                );
                assert!(send.contains_key("h"), "other values always go");
                receiver.incoming(tied.iter(), &mut send).unwrap();
                assert!(Arc::ptr_eq(&send["w__shared"], &value));
            }
        }
        let mut fresh = HashMap::new();
        let err = TiedHandoffs::default().incoming(tied.iter(), &mut fresh);
        assert!(err.is_err(), "nothing kept, nothing arrived");
    }
}
