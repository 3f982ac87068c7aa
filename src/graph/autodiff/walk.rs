//! The walk itself: the forward nodes between the requested values and the loss, and
//! the backward pass over them, one rule (or one whole GELU) a node.

use std::collections::{BTreeMap, HashMap, HashSet};

use super::{accumulate, gelu, no_gradient_error, rules, Emitter, RuleCtx};
use crate::graph::ir::{node_label, Graph, Metas};
use crate::onnx::proto::NodeProto;
use crate::tensor::{DType, Tensor};
use crate::Result;

/// The forward nodes between the requested values and the loss.
pub(super) struct Path<'a> {
    /// Each float value that depends on a requested value, with one it depends on.
    source: HashMap<&'a str, &'a str>,
    /// Those of them the loss depends on (and the loss).
    useful: HashSet<&'a str>,
    /// Per forward node: whether it is on a path from a requested value to the loss.
    on_path: Vec<bool>,
    /// Float values (by the measured types).
    metas: &'a Metas,
}

impl<'a> Path<'a> {
    /// A forward sweep (what depends on `wrt`) and a backward one (what `loss` depends on).
    pub(super) fn new(fwd: &'a Graph, metas: &'a Metas, loss: &'a str, wrt: &'a [String]) -> Self {
        let is_float = |v: &str| metas.get(v).is_some_and(|m| m.dtype.is_float());
        let mut source: HashMap<&str, &str> =
            wrt.iter().map(|w| (w.as_str(), w.as_str())).collect();
        for n in &fwd.nodes {
            if let Some(src) = n.input.iter().find_map(|i| source.get(i.as_str()).copied()) {
                for o in n.output.iter().filter(|o| is_float(o)) {
                    source.insert(o.as_str(), src);
                }
            }
        }
        let mut useful: HashSet<&str> = HashSet::from([loss]);
        let mut on_path = vec![false; fwd.nodes.len()];
        for (i, n) in fwd.nodes.iter().enumerate().rev() {
            if n.output.iter().any(|o| useful.contains(o.as_str()))
                && n.input.iter().any(|v| source.contains_key(v.as_str()))
            {
                on_path[i] = true;
                for v in n.input.iter().filter(|v| source.contains_key(v.as_str())) {
                    useful.insert(v.as_str());
                }
            }
        }
        Path {
            source,
            useful,
            on_path,
            metas,
        }
    }

    /// Whether `v` is a float value the loss's gradient flows to.
    fn needs(&self, v: &str) -> bool {
        self.useful.contains(v) && self.metas.get(v).is_some_and(|m| m.dtype.is_float())
    }

    /// Every node on the path without a rule, named at once before any is emitted.
    pub(super) fn check_rules(&self, fwd: &Graph) -> Result<()> {
        let missing = fwd
            .nodes
            .iter()
            .enumerate()
            .rev()
            .filter(|&(i, n)| self.on_path[i] && !rules::has_rule(&n.op_type, &n.domain))
            .map(|(_, n)| {
                let input = n
                    .input
                    .iter()
                    .find(|v| self.source.contains_key(v.as_str()));
                let param = input.and_then(|v| self.source.get(v.as_str()));
                (
                    node_label(n),
                    n.op_type.clone(),
                    param.map_or_else(String::new, |p| p.to_string()),
                )
            })
            .collect();
        no_gradient_error(missing).map_or(Ok(()), Err)
    }
}

/// The backward walk over the path's nodes, nearest the loss first.
pub(super) struct Walk<'a> {
    pub(super) fwd: &'a Graph,
    pub(super) metas: &'a Metas,
    pub(super) consts: &'a HashMap<String, Tensor>,
    pub(super) frozen_rows: &'a BTreeMap<String, Vec<i64>>,
    pub(super) path: &'a Path<'a>,
}

impl Walk<'_> {
    /// Emits every path node's gradient from its outputs' (the loss's is `seed`);
    /// returns the contributions that reached values no node on the path makes (the
    /// requested values among them), by value.
    pub(super) fn run(
        &self,
        e: &mut Emitter,
        loss: &str,
        seed: &str,
    ) -> Result<HashMap<String, Vec<String>>> {
        let fwd = self.fwd;
        // GELUs as PyTorch exports them are differentiated whole (`gelu.rs`); their
        // inner nodes then get no gradient and are passed over.
        let gelus = gelu::find(fwd, self.consts, &|v| self.path.source.contains_key(v));
        let mut contributions: HashMap<String, Vec<String>> = HashMap::new();
        contributions.insert(loss.to_string(), vec![seed.to_string()]);
        for (i, n) in fwd.nodes.iter().enumerate().rev() {
            if !self.path.on_path[i] {
                continue;
            }
            e.set_anchor(i, &node_label(n));
            let dy: Vec<Option<String>> = n
                .output
                .iter()
                .map(|o| contributions.remove(o).map(|c| accumulate(e, c)))
                .collect();
            if dy.iter().all(Option::is_none) {
                continue;
            }
            if let Some(g) = gelus.get(&i) {
                if let Some(dy) = dy[0]
                    .as_deref()
                    .filter(|_| self.path.useful.contains(g.x.as_str()))
                {
                    let t = self.metas.get(g.x.as_str()).map_or(DType::F32, |m| m.dtype);
                    let dx = gelu::backward(e, g, dy, t);
                    contributions.entry(g.x.clone()).or_default().push(dx);
                }
                continue;
            }
            for (j, g) in self.node_gradient(e, n, dy)?.into_iter().enumerate() {
                if let Some(g) = g {
                    contributions.entry(n.input[j].clone()).or_default().push(g);
                }
            }
        }
        Ok(contributions)
    }

    /// Node `n`'s input gradients by its rule, from its outputs' `dy` (`None` for the
    /// inputs the loss's gradient does not flow to).
    fn node_gradient(
        &self,
        e: &mut Emitter,
        n: &NodeProto,
        dy: Vec<Option<String>>,
    ) -> Result<Vec<Option<String>>> {
        let needs: Vec<bool> = n.input.iter().map(|v| self.path.needs(v)).collect();
        let mut ctx = RuleCtx {
            node: n,
            dy,
            needs,
            metas: self.metas,
            consts: self.consts,
            fwd: self.fwd,
            opset: self.fwd.opset(),
            frozen_rows: self.frozen_rows,
            e,
        };
        let Some(dx) = rules::gradient(&mut ctx)? else {
            return Err(ctx.unsupported("no gradient rule"));
        };
        Ok(dx
            .into_iter()
            .enumerate()
            .map(|(j, g)| g.filter(|_| ctx.needs(j)))
            .collect())
    }
}
