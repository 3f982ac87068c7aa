//! The split's rules, op by op: how each operator that keeps a tensor-parallel split
//! moves the split axis, which constants it rewrites for one shard, and where a
//! row-parallel layer ends a region.

use super::{NewConst, Split, Step, Walk};
use crate::graph::ir::{attr_i, attr_ints, node_label};
use crate::onnx::proto::NodeProto;

impl Walk<'_> {
    pub(super) fn elementwise(
        &mut self,
        n: &NodeProto,
        ins: &[(usize, Split)],
        region: usize,
    ) -> Step {
        let ro = self.rank(&n.output[0]).ok_or("no shape")?;
        let mut axis = None;
        for &(k, s) in ins {
            let ri = self.rank(&n.input[k]).ok_or("no shape")?;
            let a = s.axis + ro - ri;
            if axis.is_some_and(|x| x != a) {
                return Err("inputs split along different axes".into());
            }
            axis = Some(a);
        }
        let axis = axis.ok_or("no split input")?;
        let group = ins[0].1.group;
        for (k, v) in n.input.iter().enumerate() {
            if v.is_empty() || ins.iter().any(|&(j, _)| j == k) {
                continue;
            }
            let shape = self.shape(v).ok_or("no shape")?.to_vec();
            let lead = ro - shape.len();
            if axis < lead || shape[axis - lead] == 1 {
                continue;
            }
            let bias = self.trainable.contains(v.as_str()) && shape.len() == 1 && axis == ro - 1;
            if !bias {
                return Err(format!(
                    "`{v}` is whole along the split axis and not a bias parameter"
                ));
            }
            self.split_param(region, v, 0, group);
        }
        Ok(n.output
            .iter()
            .filter(|o| !o.is_empty())
            .map(|o| {
                let s = Split {
                    axis,
                    group,
                    region,
                };
                (o.clone(), s)
            })
            .collect())
    }

    pub(super) fn reshape(&mut self, i: usize, n: &NodeProto, s: Split, region: usize) -> Step {
        let target = self
            .const_ints(n, 1)
            .ok_or("reshapes to a computed shape")?;
        let (from, to) = (
            self.shape(&n.input[0]).ok_or("no shape")?,
            self.shape(&n.output[0]).ok_or("no shape")?,
        );
        let a = s.axis;
        // The split axis keeps its place (same leading dimensions: heads split from or
        // merged into the width), or stays last with its size (leading dimensions folded
        // into rows or unfolded from them).
        let b = if a + 1 == from.len() && to.last() == from.last() {
            to.len() - 1
        } else if a < to.len() && from[..a] == to[..a] {
            a
        } else {
            return Err("moves the split axis".into());
        };
        let mut values = target.clone();
        if from[a] != to[b] && self.sections[s.group] != 1 {
            return Err("reshapes a sectioned split axis".into());
        }
        match target.get(b).copied() {
            // Inferred from the (split) size.
            Some(-1) => {}
            Some(0) if b == a => {}
            Some(t) if t > 0 => values[b] = t / self.shards as i64,
            _ => return Err("the split dimension is not given in the target shape".into()),
        }
        for (dim, what) in [(from[a], "input"), (to[b], "output")] {
            if dim % self.shards != 0 {
                self.fatal.push((
                    region,
                    node_label(n),
                    format!(
                        "the {what}'s split dimension ({dim}: heads or width) is not divisible \
                         by {}",
                        self.shards
                    ),
                ));
            }
        }
        if values != target {
            self.consts.push((
                region,
                NewConst::Input {
                    node: i,
                    input: 1,
                    values,
                },
            ));
        }
        let out = Split { axis: b, ..s };
        Ok(vec![(n.output[0].clone(), out)])
    }

    /// `Slice` along other axes than the split one keeps it.
    pub(super) fn slice(&self, n: &NodeProto, s: Split) -> Step {
        let rank = self.rank(&n.input[0]).ok_or("no shape")? as i64;
        let starts = self.const_ints(n, 1).ok_or("slices by computed bounds")?;
        let axes = match n.input.get(3).filter(|v| !v.is_empty()) {
            Some(_) => self.const_ints(n, 3).ok_or("slices computed axes")?,
            None => (0..starts.len() as i64).collect(),
        };
        match axes.iter().any(|&x| (x + rank) % rank == s.axis as i64) {
            true => Err("slices the split axis".into()),
            false => Ok(vec![(n.output[0].clone(), s)]),
        }
    }

    /// `Concat` of split values along another axis keeps the split.
    pub(super) fn concat(&self, n: &NodeProto, ins: &[(usize, Split)], region: usize) -> Step {
        let rank = self.rank(&n.output[0]).ok_or("no shape")? as i64;
        let axis = (attr_i(n, "axis").unwrap_or(0) + rank) % rank;
        let a = ins[0].1.axis;
        if ins.len() != n.input.iter().filter(|v| !v.is_empty()).count()
            || ins.iter().any(|(_, s)| s.axis != a)
            || axis == a as i64
        {
            return Err("concatenates along the split axis or with whole values".into());
        }
        let out = Split { region, ..ins[0].1 };
        Ok(vec![(n.output[0].clone(), out)])
    }

    /// `Unsqueeze` and `Squeeze` move the split axis by the axes they add or remove.
    pub(super) fn unsqueeze(&self, n: &NodeProto, s: Split, region: usize) -> Step {
        let (ri, ro) = (
            self.rank(&n.input[0]).ok_or("no shape")? as i64,
            self.rank(&n.output[0]).ok_or("no shape")? as i64,
        );
        let axes = match n.input.get(1).filter(|v| !v.is_empty()) {
            Some(_) => self.const_ints(n, 1).ok_or("computed axes")?,
            None => attr_ints(n, "axes").unwrap_or_default(),
        };
        let a = s.axis as i64;
        let axis = if n.op_type == "Unsqueeze" {
            let mut added: Vec<i64> = axes.iter().map(|&x| (x + ro) % ro).collect();
            added.sort_unstable();
            // Output positions that are not added ones, in order, hold the input axes.
            (0..ro).filter(|p| !added.contains(p)).nth(a as usize)
        } else {
            let removed: Vec<i64> = axes.iter().map(|&x| (x + ri) % ri).collect();
            (!removed.contains(&a) && !removed.is_empty())
                .then(|| a - removed.iter().filter(|&&x| x < a).count() as i64)
        };
        let axis = axis.ok_or("removes the split axis")? as usize;
        Ok(vec![(n.output[0].clone(), Split { axis, region, ..s })])
    }

    /// `Expand` keeps the split where it broadcasts along other axes (the split axis is
    /// whole in the target shape, which is rewritten for one shard; or it is 1).
    pub(super) fn expand(&mut self, i: usize, n: &NodeProto, s: Split, region: usize) -> Step {
        let target = self.const_ints(n, 1).ok_or("expands to a computed shape")?;
        let from = self.shape(&n.input[0]).ok_or("no shape")?;
        let ro = self.rank(&n.output[0]).ok_or("no shape")?;
        let b = s.axis + ro - from.len();
        let at = (b + target.len()).checked_sub(ro).ok_or("no shape")?;
        let mut values = target.clone();
        match target.get(at).copied() {
            None | Some(1) => {}
            Some(t) if t == from[s.axis] as i64 => {
                values[at] = t / self.shards as i64;
                self.consts.push((
                    region,
                    NewConst::Input {
                        node: i,
                        input: 1,
                        values,
                    },
                ));
            }
            Some(_) => return Err("expands the split axis".into()),
        }
        Ok(vec![(n.output[0].clone(), Split { axis: b, ..s })])
    }

    /// Input `i` of `n` as constant integers.
    pub(super) fn const_ints(&self, n: &NodeProto, i: usize) -> Option<Vec<i64>> {
        self.constants.get(n.input.get(i)?)?.to_i64_vec()
    }

    pub(super) fn split_node(&mut self, i: usize, n: &NodeProto, s: Split, region: usize) -> Step {
        let rank = self.rank(&n.input[0]).ok_or("no shape")? as i64;
        let axis = ((attr_i(n, "axis").unwrap_or(0) + rank) % rank) as usize;
        let outs: Vec<&String> = n.output.iter().filter(|o| !o.is_empty()).collect();
        if axis != s.axis {
            return Ok(outs.into_iter().map(|o| (o.clone(), s)).collect());
        }
        let dim = self.shape(&n.input[0]).ok_or("no shape")?[axis] as i64;
        if outs.is_empty() {
            return Err("a Split without outputs".into());
        }
        let (sizes, from_input) = match n.input.get(1).filter(|v| !v.is_empty()) {
            Some(_) => (
                self.const_ints(n, 1).ok_or("splits by computed sizes")?,
                true,
            ),
            None => match attr_ints(n, "split") {
                Some(v) => (v, false),
                None => (vec![dim / outs.len() as i64; outs.len()], false),
            },
        };
        if sizes.is_empty() || sizes.iter().any(|&x| x != sizes[0] || x <= 0) {
            return Err("splits the split axis into unequal sections".into());
        }
        if self.sections[s.group] != 1 {
            return Err("splits a sectioned axis again".into());
        }
        self.sections[s.group] = sizes.len();
        if sizes[0] % self.shards as i64 != 0 {
            self.fatal.push((
                region,
                node_label(n),
                format!(
                    "its sections of {} are not divisible by {}",
                    sizes[0], self.shards
                ),
            ));
        }
        let values: Vec<i64> = sizes.iter().map(|x| x / self.shards as i64).collect();
        let change = match (
            from_input,
            n.input.get(1).is_some() || attr_ints(n, "split").is_some(),
        ) {
            (true, _) => Some(NewConst::Input {
                node: i,
                input: 1,
                values,
            }),
            (false, true) => Some(NewConst::SplitAttr { node: i, values }),
            (false, false) => None,
        };
        if let Some(c) = change {
            self.consts.push((region, c));
        }
        Ok(outs
            .into_iter()
            .map(|o| {
                let group = self.new_group();
                (
                    o.clone(),
                    Split {
                        axis: s.axis,
                        group,
                        region,
                    },
                )
            })
            .collect())
    }

    pub(super) fn matmul(
        &mut self,
        i: usize,
        n: &NodeProto,
        ins: &[(usize, Split)],
        region: usize,
    ) -> Step {
        let ro = self.rank(&n.output[0]).ok_or("no shape")?;
        let ra = self.rank(&n.input[0]).ok_or("no shape")?;
        let rb = self.rank(&n.input[1]).ok_or("no shape")?;
        if ins.len() == 2 {
            let (a, b) = (ins[0].1.axis, ins[1].1.axis);
            if a + 2 < ra && b + 2 < rb && a + ro - ra == b + ro - rb {
                let s = Split {
                    axis: a + ro - ra,
                    group: ins[0].1.group,
                    region,
                };
                return Ok(vec![(n.output[0].clone(), s)]);
            }
            return Err("multiplies values split along different axes".into());
        }
        let (k, s) = ins[0];
        match (k, self.linear(n)) {
            (0, Some(lin)) if s.axis == ra - 1 => {
                self.split_param(region, lin.weight, lin.in_axis, s.group);
                self.exits.push((region, i));
                Ok(Vec::new())
            }
            _ => Err("multiplies a split value by a whole one".into()),
        }
    }
}
