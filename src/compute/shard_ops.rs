//! The tensor shards' collectives as ONNX Runtime custom operators (domain
//! `ai.pipetrain`; see [`crate::graph::tensor_parallel`]), and what a shard's end of its
//! group's all-reduce offers them ([`ShardComm`]: in one process `local_shards`, across
//! processes `comm::shards`).
//!
//! A kernel blocks until every shard of its group brought its tensor: each shard's
//! sessions run on the thread of its own stage actor, so the shards meet inside their
//! sessions as the data-parallel replicas meet in their all-reduce.

use std::fmt;
use std::sync::Arc;
use std::time::Instant;

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorDomain, OperatorInput,
    OperatorOutput,
};
use ort::value::TensorElementType;

use crate::graph::custom_ops::{ALL_REDUCE, DOMAIN, SHARD_ENTRY};

/// One shard's end of its group's all-reduce.
pub trait ShardComm: Send + Sync + 'static {
    /// Shards in the group.
    fn shards(&self) -> usize;

    /// This shard's rank in the group.
    fn rank(&self) -> usize;

    /// Sums `buf` over the group's shards in shard order, in place.
    ///
    /// # Errors
    /// When a shard is gone, brings a tensor of another length, or does not come.
    fn all_reduce(&self, buf: &mut [f32]) -> Result<(), String>;

    /// What this shard's all-reduces have carried so far.
    fn traffic(&self) -> ShardTraffic {
        ShardTraffic::default()
    }
}

/// What a tensor shard's all-reduces carried: how many, how many bytes it brought, and
/// the time spent in them (waiting for the other shards included).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ShardTraffic {
    /// All-reduces.
    pub calls: u64,
    /// Bytes this shard brought to them.
    pub bytes: u64,
    /// Seconds spent in them.
    pub seconds: f64,
}

impl std::ops::Add for ShardTraffic {
    type Output = ShardTraffic;
    fn add(self, o: ShardTraffic) -> ShardTraffic {
        ShardTraffic {
            calls: self.calls + o.calls,
            bytes: self.bytes + o.bytes,
            seconds: self.seconds + o.seconds,
        }
    }
}

/// A shard's running [`ShardTraffic`], counted by its comm.
#[derive(Debug, Default)]
pub(crate) struct TrafficMeter {
    calls: std::sync::atomic::AtomicU64,
    bytes: std::sync::atomic::AtomicU64,
    nanos: std::sync::atomic::AtomicU64,
}

impl TrafficMeter {
    /// Counts one all-reduce of `values` that took from `start` until now.
    pub(crate) fn count(&self, values: usize, start: Instant) {
        use std::sync::atomic::Ordering::Relaxed;
        self.calls.fetch_add(1, Relaxed);
        self.bytes.fetch_add(values as u64 * 4, Relaxed);
        self.nanos
            .fetch_add(start.elapsed().as_nanos() as u64, Relaxed);
    }

    pub(crate) fn read(&self) -> ShardTraffic {
        use std::sync::atomic::Ordering::Relaxed;
        ShardTraffic {
            calls: self.calls.load(Relaxed),
            bytes: self.bytes.load(Relaxed),
            seconds: self.nanos.load(Relaxed) as f64 * 1e-9,
        }
    }
}

/// Hands each (engine replica, stage) its shard link, for the tensor shard groups of a
/// run spread over several processes (the transport's, behind this so the training
/// engine does not depend on it).
pub trait ShardGroups: Send + Sync {
    /// The link of `stage` of engine replica `replica`.
    fn link(&self, replica: usize, stage: usize) -> ShardLink;
}

/// A shard's collective handle, as sessions are given it.
#[derive(Clone)]
pub struct ShardLink(pub Arc<dyn ShardComm>);

impl fmt::Debug for ShardLink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "ShardLink(shard {} of {})",
            self.0.rank(),
            self.0.shards()
        )
    }
}

impl ShardLink {
    /// A group of one (shape probes, and graphs run outside a sharded run): the sum is
    /// the tensor itself.
    pub fn alone() -> ShardLink {
        ShardLink(Arc::new(Alone))
    }
}

struct Alone;

impl ShardComm for Alone {
    fn shards(&self) -> usize {
        1
    }
    fn rank(&self) -> usize {
        0
    }
    fn all_reduce(&self, _buf: &mut [f32]) -> Result<(), String> {
        Ok(())
    }
}

/// pipetrain's operator domain: both collectives bound to `link`, and the fused
/// kernels; with `blas` (the library and the session's intra-op threads) its products
/// and the attention's.
pub(crate) fn custom_domain(
    link: &ShardLink,
    blas: Option<(&std::sync::Arc<super::blas::Blas>, usize)>,
) -> ort::Result<OperatorDomain> {
    let heads_blas = blas.map(|(b, _)| b.clone());
    // One session's attention nodes share their tasks' scratch (they run one at a time).
    let scratch = super::fused::attention_scratch();
    let domain = OperatorDomain::new(DOMAIN)?
        .add(Collective {
            link: link.clone(),
            sums: true,
        })?
        .add(Collective {
            link: link.clone(),
            sums: false,
        })?
        .add(super::fused::Accumulate)?
        .add(super::fused::LayerNormGrad)?
        .add(super::fused::SOFTMAX_GRAD_OP)?
        .add(super::fused::SOFTMAX_OP)?
        .add(super::fused::Gelu { grad: false })?
        .add(super::fused::Gelu { grad: true })?
        .add(super::fused::TanhGelu { grad: false })?
        .add(super::fused::TanhGelu { grad: true })?
        .add(super::fused::RELU_GRAD_OP)?
        .add(super::fused::SoftmaxCrossEntropy)?
        .add(super::fused::SoftmaxCrossEntropyGrad)?
        .add(super::fused::DepthwiseConv)?
        .add(super::fused::DepthwiseConvGrad)?
        .add(
            super::fused::ATTENTION_OP
                .with_blas(heads_blas.clone())
                .sharing(&scratch),
        )?
        .add(
            super::fused::ATTENTION_GRAD_OP
                .with_blas(heads_blas.clone())
                .sharing(&scratch),
        )?
        .add(
            super::fused::PACKED_ATTENTION_OP
                .with_blas(heads_blas.clone())
                .sharing(&scratch),
        )?
        .add(
            super::fused::PACKED_ATTENTION_GRAD_OP
                .with_blas(heads_blas)
                .sharing(&scratch),
        )?
        .add(super::fused::RowsAdd)?
        .add(super::fused::KeyedDropout)?;
    let domain = match blas {
        Some((blas, threads)) => {
            domain.add(super::fused::BlasMatMul::new(blas.clone(), threads))?
        }
        None => domain,
    };
    // Kernels on ONNX Runtime's CUDA provider; a session on the CPU never picks them.
    #[cfg(feature = "cuda")]
    let domain = {
        let mut domain = domain.add(super::cuda_ops::RowsAdd)?;
        let module = super::cuda_fused::Shared::default();
        domain = domain.add(super::cuda_dropout::CudaKeyedDropout {
            module: module.clone(),
        })?;
        for op in super::cuda_fused::operators(&module) {
            domain = domain.add(op)?;
        }
        let attention = super::cuda_fused::Shared::default();
        for op in super::cuda_attention::CudaAttention::all(&attention) {
            domain = domain.add(op)?;
        }
        domain.add(super::cuda_layer_norm::CudaLayerNormGrad { module })?
    };
    Ok(domain)
}

/// `AllReduce` (`sums`) or `ShardEntry` (the identity forward).
struct Collective {
    link: ShardLink,
    sums: bool,
}

impl Operator for Collective {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        if self.sums {
            ALL_REDUCE
        } else {
            SHARD_ENTRY
        }
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        [OperatorInput::required(TensorElementType::Float32)]
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        [OperatorOutput::required(TensorElementType::Float32)]
    }

    fn create_kernel<'attr>(&self, _: &KernelContext<'attr>) -> ort::Result<Self::Kernel<'attr>> {
        let link = self.link.clone();
        let sums = self.sums;
        Ok(Box::new(move |ctx: &ComputeContext| {
            let x = ctx.input(0)?.ok_or_else(|| ort::Error::new("no input"))?;
            let (shape, xs) = x.try_extract_tensor::<f32>()?;
            let mut y = ctx
                .output(0, shape.to_vec())?
                .ok_or_else(|| ort::Error::new("no output"))?;
            let (_, ys) = y.try_extract_tensor_mut::<f32>()?;
            ys.copy_from_slice(xs);
            if sums {
                link.0.all_reduce(ys).map_err(ort::Error::new)?;
            }
            Ok(())
        }))
    }
}
