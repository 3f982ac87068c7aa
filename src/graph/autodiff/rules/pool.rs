//! Convolution and pooling.

use super::Grads;
use crate::graph::autodiff::RuleCtx;
use crate::Result;

pub fn conv(ctx: &mut RuleCtx) -> Result<Grads> {
    Err(ctx.unsupported("not written yet"))
}

pub fn max_pool(ctx: &mut RuleCtx) -> Result<Grads> {
    Err(ctx.unsupported("not written yet"))
}

pub fn average_pool(ctx: &mut RuleCtx) -> Result<Grads> {
    Err(ctx.unsupported("not written yet"))
}

pub fn global_average_pool(ctx: &mut RuleCtx) -> Result<Grads> {
    Err(ctx.unsupported("not written yet"))
}
