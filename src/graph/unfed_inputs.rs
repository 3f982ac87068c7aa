//! Model inputs the data does not feed. Exporters add inputs a training step has no data
//! for: the TorchScript exporter turns every argument of `forward` left at its default
//! into a graph input (Hugging Face's `num_logits_to_keep=0` becomes a rank-0 int64 named
//! `onnx::Neg_1`, after the first node that reads it). Each such input becomes a
//! constant of the training graph: the value `[inputs]` gives it, or, for the one form
//! whose default the graph itself shows (a count of positions kept from the end of an
//! axis, `x[-n:]`, where 0 keeps them all), that default, said in the log. Every other
//! input the data does not feed is an error naming all of them at once.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::graph::ir::{declared_type, Graph};
use crate::onnx::proto::{NodeProto, ValueInfoProto};
use crate::tensor::{DType, Tensor, TensorData};
use crate::{Error, Result};

/// A value set for a model input in the configuration (`[inputs]`): a number, a flag, or
/// a flat list of them (a rank-1 input). Its element type is the input's declared one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum InputValue {
    /// `true` / `false`.
    Bool(bool),
    /// An integer (also for a float input).
    Int(i64),
    /// A float.
    Float(f64),
    /// A rank-1 input's values.
    List(Vec<f64>),
}

impl std::fmt::Display for InputValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            InputValue::Bool(b) => write!(f, "{b}"),
            InputValue::Int(i) => write!(f, "{i}"),
            InputValue::Float(x) => write!(f, "{x}"),
            InputValue::List(l) => write!(f, "{l:?}"),
        }
    }
}

/// How an input the data does not feed got its value.
#[derive(Debug, Clone, PartialEq)]
pub enum Bound {
    /// From `[inputs]`.
    Configured,
    /// The default the graph shows, with why.
    Default(String),
}

/// An input the data does not feed, described for a message: its name, declared type
/// and rank, and what reads it (`Neg -> Slice`), with what the exporter made it from
/// where the name tells.
pub fn describe_input(g: &Graph, v: &ValueInfoProto) -> String {
    let (elem, rank) = declared_type(v).map_or((0, None), |(e, d)| (e, Some(d.len())));
    let ty = DType::from_onnx(elem).map_or(format!("element type {elem}"), |d| format!("{d:?}"));
    let rank = rank.map_or("unknown rank".to_string(), |r| format!("rank {r}"));
    let chain = reader_chain(g, &v.name);
    let made = match v.name.strip_prefix("onnx::") {
        Some(_) => {
            "; the TorchScript exporter names an input it added this way, from an argument of \
             `forward` left at its default (Hugging Face's `num_logits_to_keep`, for one)"
        }
        None => "",
    };
    let read = match chain.is_empty() {
        true => "read by no node".to_string(),
        false => format!("read by {chain}"),
    };
    format!("`{}` ({ty}, {rank}, {read}{made})", v.name)
}

/// `Neg -> Unsqueeze -> Slice`: the ops along the first reader of `name`, up to 4 deep.
fn reader_chain(g: &Graph, name: &str) -> String {
    let mut ops = Vec::new();
    let mut value = name.to_string();
    while ops.len() < 4 {
        let Some(n) = g.nodes.iter().find(|n| n.input.contains(&value)) else {
            break;
        };
        ops.push(n.op_type.clone());
        match n.output.first() {
            Some(out) if n.op_type != "Slice" => value = out.clone(),
            _ => break,
        }
    }
    ops.join(" -> ")
}

/// The value `g` itself implies for the unfed input `v`, with why: a rank-0 integer read
/// only through `Neg` (and shape ops) as the start of a `Slice` that runs to the end of
/// its axis is a count of positions kept from the end (`x[-n:]`), and 0 keeps them all,
/// as Hugging Face's `num_logits_to_keep` default does.
pub fn implied_default(g: &Graph, v: &ValueInfoProto) -> Option<(Tensor, String)> {
    let (elem, dims) = declared_type(v)?;
    let dtype = DType::from_onnx(elem).filter(|d| matches!(d, DType::I64 | DType::I32))?;
    if !dims.is_empty() || !only_negated_slice_starts(g, &v.name) {
        return None;
    }
    let why = "0: it is read as `x[-n:]`, a count of positions kept from the end of an \
               axis, and 0 keeps them all"
        .to_string();
    Some((Tensor::zeros(dtype, vec![]), why))
}

/// Whether every reader of `name` is a `Neg` whose value reaches only `Slice` starts
/// (through `Unsqueeze`, `Reshape`, `Cast`, `Concat`), each slice running to the end.
fn only_negated_slice_starts(g: &Graph, name: &str) -> bool {
    let readers: Vec<&NodeProto> = g
        .nodes
        .iter()
        .filter(|n| n.input.iter().any(|i| i == name))
        .collect();
    !readers.is_empty()
        && readers.iter().all(|n| {
            n.op_type == "Neg"
                && n.output
                    .first()
                    .is_some_and(|o| reaches_slice_start(g, o, 0))
        })
}

fn reaches_slice_start(g: &Graph, value: &str, depth: usize) -> bool {
    let readers: Vec<&NodeProto> = g
        .nodes
        .iter()
        .filter(|n| n.input.iter().any(|i| i == value))
        .collect();
    depth < 6
        && !readers.is_empty()
        && readers.iter().all(|n| match n.op_type.as_str() {
            "Slice" => n.input.get(1).is_some_and(|s| s == value) && slice_runs_to_end(g, n),
            "Unsqueeze" | "Reshape" | "Cast" | "Concat" => n
                .output
                .first()
                .is_some_and(|o| reaches_slice_start(g, o, depth + 1)),
            _ => false,
        })
}

/// Whether the `Slice`'s ends are constants of at least `i32::MAX` (PyTorch's open end).
fn slice_runs_to_end(g: &Graph, slice: &NodeProto) -> bool {
    let constants = g.constants();
    slice
        .input
        .get(2)
        .and_then(|ends| constant_ints(g, &constants, ends, 0))
        .is_some_and(|e| !e.is_empty() && e.iter().all(|&x| x >= i64::from(i32::MAX)))
}

/// The integers of `name` where they are a constant's, through the shape ops exporters
/// put between (`Unsqueeze(Constant)`, a `Concat` of such).
fn constant_ints(
    g: &Graph,
    constants: &std::collections::HashMap<String, Tensor>,
    name: &str,
    depth: usize,
) -> Option<Vec<i64>> {
    if let Some(t) = constants.get(name) {
        return t.to_i64_vec();
    }
    let n = g
        .nodes
        .iter()
        .find(|n| n.output.first().is_some_and(|o| o == name))?;
    match n.op_type.as_str() {
        _ if depth > 4 => None,
        "Unsqueeze" | "Squeeze" | "Reshape" | "Identity" | "Cast" => {
            constant_ints(g, constants, n.input.first()?, depth + 1)
        }
        "Concat" => n.input.iter().try_fold(Vec::new(), |mut all, i| {
            all.extend(constant_ints(g, constants, i, depth + 1)?);
            Some(all)
        }),
        _ => None,
    }
}

/// `value` as a tensor of `v`'s declared type and rank.
fn configured_tensor(
    v: &ValueInfoProto,
    value: &InputValue,
) -> std::result::Result<Tensor, String> {
    let (elem, dims) = declared_type(v).ok_or("the model does not declare its type")?;
    let dtype =
        DType::from_onnx(elem).ok_or(format!("its element type {elem} is not supported"))?;
    let values: Vec<f64> = match value {
        InputValue::Bool(b) => vec![f64::from(u8::from(*b))],
        InputValue::Int(i) => vec![*i as f64],
        InputValue::Float(f) => vec![*f],
        InputValue::List(l) => l.clone(),
    };
    let shape = match (dims.len(), value) {
        (0, InputValue::List(_)) => return Err("it is a scalar (rank 0), the value a list".into()),
        (0, _) => vec![],
        (1, InputValue::List(l)) => vec![l.len()],
        (r, _) => {
            return Err(format!(
                "it has rank {r}; [inputs] sets scalars and lists (rank 0 or 1)"
            ))
        }
    };
    if !dtype.is_float() && values.iter().any(|x| x.fract() != 0.0) {
        return Err(format!("it is {dtype:?}, the value is not a whole number"));
    }
    let data = match dtype {
        DType::F32 => TensorData::F32(values.iter().map(|&x| x as f32).collect()),
        DType::F64 => TensorData::F64(values),
        DType::I64 => TensorData::I64(values.iter().map(|&x| x as i64).collect()),
        DType::I32 => TensorData::I32(values.iter().map(|&x| x as i32).collect()),
        DType::Bool => TensorData::Bool(values.iter().map(|&x| x != 0.0).collect()),
    };
    Tensor::new(shape, data).map_err(|e| e.to_string())
}

/// Makes every input of `g` that `fed` (the data's names) lacks a constant: the value
/// `configured` gives it, else the default the graph implies. Returns what it bound, by
/// name (for the log).
///
/// # Errors
/// `UnfedInputs` naming every input that is neither fed nor bound, and what reads it; `BadTensor` when a configured value does not fit its input.
pub fn bind_unfed_inputs(
    g: &mut Graph,
    fed: &[&str],
    configured: &BTreeMap<String, InputValue>,
) -> Result<Vec<(String, Bound)>> {
    let mut bound = Vec::new();
    let mut missing = Vec::new();
    for v in g.inputs.clone() {
        if fed.contains(&v.name.as_str()) {
            continue;
        }
        let value = match configured.get(&v.name) {
            Some(c) => configured_tensor(&v, c)
                .map(|t| (t, Bound::Configured))
                .map_err(|reason| Error::BadTensor {
                    name: v.name.clone(),
                    reason: format!("[inputs] sets it, but {reason}"),
                })?,
            None => match implied_default(g, &v) {
                Some((t, why)) => (t, Bound::Default(why)),
                None => {
                    missing.push((v.name.clone(), describe_input(g, &v)));
                    continue;
                }
            },
        };
        make_constant(g, &v.name, &value.0);
        bound.push((v.name.clone(), value.1));
    }
    match missing.first() {
        None => Ok(bound),
        Some((first, _)) => Err(Error::UnfedInputs {
            first: first.clone(),
            inputs: missing
                .iter()
                .map(|(_, d)| d.as_str())
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// Turns the graph input `name` into a `Constant` node of `value` (a node, not an
/// initializer: a float initializer would train).
fn make_constant(g: &mut Graph, name: &str, value: &Tensor) {
    g.inputs.retain(|v| v.name != name);
    let node = crate::graph::ir::make_node(
        "Constant",
        &format!("input/{name}"),
        &[],
        &[name],
        vec![crate::graph::ir::tensor_attr("value", value.to_proto(name))],
    );
    g.nodes.insert(0, node);
}
