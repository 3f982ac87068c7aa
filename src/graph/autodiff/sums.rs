//! Gradient sums of `Slice` gradients: a tensor read as slices that tile one axis (the
//! exporter's reordering of an `nn.LSTM`'s gates, `Concat` of four `Slice`s of each
//! weight) gets from each slice its gradient padded with zeros to the whole tensor, and
//! their `Sum`. Where those padded parts tile the axis exactly, the sum is the parts
//! joined: one `Concat` of the unpadded gradients instead of a `Pad` each and a `Sum`
//! (on a PTB-size LSTM, 15 ms of a 275 ms step).

use super::emit::Emitter;
use crate::graph::ir::int_attr;

/// A `Pad` of a gradient to its input's whole shape.
#[derive(Debug, Clone)]
pub struct Padded {
    /// The unpadded gradient.
    input: String,
    /// ONNX's pads: the starts of every axis, then the ends.
    pads: Vec<i64>,
    /// The padded shape.
    full: Vec<usize>,
}

impl Emitter {
    /// `Pad(x, pads)` (zeros) to the shape `full`, recorded for [`Emitter::sum_into`].
    pub fn pad(&mut self, x: &str, pads: &[i64], full: &[usize]) -> String {
        let p = self.ints(pads);
        let out = self.op("Pad", &[x, &p], vec![]);
        let padded = Padded {
            input: x.to_string(),
            pads: pads.to_vec(),
            full: full.to_vec(),
        };
        self.padded.insert(out.clone(), padded);
        out
    }

    /// Emits the sum of `parts` as `out`: their `Concat` where they are padded parts
    /// that tile one axis (their `Pad`s then go), else `Sum` (`Identity` for one).
    pub fn sum_into(&mut self, parts: &[String], out: &str) {
        if let Some((axis, inputs)) = self.tiling(parts) {
            self.nodes_drop(parts);
            let refs: Vec<&str> = inputs.iter().map(String::as_str).collect();
            self.node("Concat", "", &refs, &[out], vec![int_attr("axis", axis)]);
            return;
        }
        let refs: Vec<&str> = parts.iter().map(String::as_str).collect();
        let op = if parts.len() == 1 { "Identity" } else { "Sum" };
        self.node(op, "", &refs, &[out], vec![]);
    }

    /// The sum of `parts` (one part is itself).
    pub fn sum(&mut self, parts: &[String]) -> String {
        if let [one] = parts {
            return one.clone();
        }
        let out = self.fresh("Sum");
        self.sum_into(parts, &out);
        out
    }

    /// The axis and the unpadded inputs in its order, where `parts` are all padded
    /// to one shape along that axis alone and together cover it once.
    fn tiling(&self, parts: &[String]) -> Option<(i64, Vec<String>)> {
        if parts.len() < 2 {
            return None;
        }
        let padded: Vec<&Padded> = parts
            .iter()
            .map(|p| self.padded.get(p))
            .collect::<Option<_>>()?;
        let full = &padded[0].full;
        let rank = full.len();
        let axis = (0..rank).find(|&a| padded[0].pads[a] != 0 || padded[0].pads[rank + a] != 0)?;
        let mut spans = Vec::with_capacity(padded.len());
        for p in &padded {
            let only_axis =
                (0..rank).all(|a| a == axis || (p.pads[a] == 0 && p.pads[rank + a] == 0));
            if &p.full != full || p.pads.len() != 2 * rank || !only_axis {
                return None;
            }
            let (lo, hi) = (p.pads[axis], full[axis] as i64 - p.pads[rank + axis]);
            spans.push((lo, hi, p.input.clone()));
        }
        spans.sort_by_key(|s| s.0);
        let mut at = 0;
        for (lo, hi, _) in &spans {
            if *lo != at || hi <= lo {
                return None;
            }
            at = *hi;
        }
        (at == full[axis] as i64).then(|| (axis as i64, spans.into_iter().map(|s| s.2).collect()))
    }

    /// Removes the `Pad` nodes that made `parts`, and their pads' constants (nothing
    /// else reads them).
    fn nodes_drop(&mut self, parts: &[String]) {
        let pads: Vec<&String> = self
            .nodes
            .iter()
            .filter(|n| n.output.iter().any(|o| parts.contains(o)))
            .filter_map(|n| n.input.get(1))
            .collect();
        let keep: Vec<bool> = self
            .nodes
            .iter()
            .map(|n| {
                !n.output
                    .iter()
                    .any(|o| parts.contains(o) || pads.contains(&o))
            })
            .collect();
        let mut k = keep.iter();
        self.nodes.retain(|_| *k.next().expect("one flag a node"));
        let mut k = keep.iter();
        self.anchors.retain(|_| *k.next().expect("one flag a node"));
        parts.iter().for_each(|p| {
            self.padded.remove(p);
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pads(e: &mut Emitter, spans: &[(i64, i64)]) -> Vec<String> {
        spans
            .iter()
            .enumerate()
            .map(|(i, &(lo, hi))| e.pad(&format!("g{i}"), &[0, lo, 0, 8 - hi], &[3, 8]))
            .collect()
    }

    #[test]
    fn pads_that_tile_an_axis_sum_as_one_concat_in_axis_order() {
        let mut e = Emitter::new(false);
        let parts = pads(&mut e, &[(4, 6), (0, 4), (6, 8)]);
        e.sum_into(&parts, "W_grad");
        let ops: Vec<&str> = e.nodes.iter().map(|n| n.op_type.as_str()).collect();
        assert_eq!(ops, ["Concat"], "the pads and their constants go");
        let concat = e.nodes.last().unwrap();
        assert_eq!(concat.op_type, "Concat");
        assert_eq!(concat.input, ["g1", "g0", "g2"]);
        assert_eq!(concat.output, ["W_grad"]);
        assert_eq!(e.nodes.len(), e.anchors.len());
    }

    #[test]
    fn pads_that_overlap_leave_a_gap_or_pad_other_axes_stay_a_sum() {
        for spans in [
            &[(0, 4), (3, 8)][..],
            &[(0, 4), (5, 8)],
            &[(0, 4), (0, 4), (4, 8)],
        ] {
            let mut e = Emitter::new(false);
            let parts = pads(&mut e, spans);
            e.sum_into(&parts, "W_grad");
            assert_eq!(e.nodes.last().unwrap().op_type, "Sum", "{spans:?}");
        }
        let mut e = Emitter::new(false);
        let a = e.pad("a", &[0, 0, 0, 4], &[3, 8]);
        let b = e.pad("b", &[1, 4, 0, 0], &[3, 8]);
        e.sum_into(&[a, b], "W_grad");
        assert_eq!(e.nodes.last().unwrap().op_type, "Sum");
    }
}
