//! The text form (`1F3`, `1SEND_F3`, `0STEP`; see the module docs of [`crate::ir`]) and
//! serde through it.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use super::{Action, ActionKind};
use crate::ScheduleError;

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.stage, self.kind.token())?;
        match self.micro_batch() {
            Some(mb) => write!(f, "{mb}"),
            None => Ok(()),
        }
    }
}

impl FromStr for Action {
    type Err = ScheduleError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let fail = |reason| ScheduleError::Parse {
            input: s.to_owned(),
            reason,
        };
        let rest = s.trim_start_matches(|c: char| c.is_ascii_digit());
        let stage_text = &s[..s.len() - rest.len()];
        if stage_text.is_empty() {
            return Err(fail("it must start with the stage number"));
        }
        let stage = stage_text
            .parse()
            .map_err(|_| fail("the stage number is too large"))?;
        let token = rest.trim_end_matches(|c: char| c.is_ascii_digit());
        let mb_text = &rest[token.len()..];
        let kind = ActionKind::ALL
            .into_iter()
            .find(|k| k.token() == token)
            .ok_or_else(|| {
                fail("unknown kind; expected F, B, I, W, SEND_F, RECV_F, SEND_B, RECV_B, ALLREDUCE or STEP")
            })?;
        let micro_batch = if mb_text.is_empty() {
            None
        } else {
            Some(
                mb_text
                    .parse()
                    .map_err(|_| fail("the micro-batch number is too large"))?,
            )
        };
        Action::new(stage, kind, micro_batch).map_err(|_| {
            fail("F, B, I, W and transfers need a micro-batch; ALLREDUCE and STEP take none")
        })
    }
}

// Actions serialise as their text form: schedules saved as JSON stay readable
// (`["0F0", "0SEND_F0", ...]`) and are checked on the way in.
impl Serialize for Action {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Action {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = Cow::<'de, str>::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_forms() {
        let cases = [
            (Action::forward(1, 3), "1F3"),
            (Action::backward(0, 2), "0B2"),
            (Action::backward_input(2, 0), "2I0"),
            (Action::backward_weight(2, 0), "2W0"),
            (Action::send_act(1, 3), "1SEND_F3"),
            (Action::recv_act(2, 3), "2RECV_F3"),
            (Action::send_grad(1, 3), "1SEND_B3"),
            (Action::recv_grad(0, 3), "0RECV_B3"),
            (Action::all_reduce(0), "0ALLREDUCE"),
            (Action::optimizer_step(12), "12STEP"),
        ];
        for (action, text) in cases {
            assert_eq!(action.to_string(), text);
            assert_eq!(text.parse::<Action>().unwrap(), action);
        }
    }

    #[test]
    fn rejects_bad_text() {
        for bad in [
            "",
            "F3",
            "1X3",
            "1F",
            "0STEP3",
            "1f3",
            " 1F3",
            "1F-3",
            "99999999999999999999F0",
        ] {
            assert!(
                matches!(bad.parse::<Action>(), Err(ScheduleError::Parse { .. })),
                "{bad:?} parsed"
            );
        }
    }
}
