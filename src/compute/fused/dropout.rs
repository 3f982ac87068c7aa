//! `KeyedDropout` on the CPU (`graph::custom_ops::KEYED_DROPOUT`): a training-mode
//! `Dropout` whose mask is a pure function of a key fed with each micro-batch (the run's
//! seed, the step, the data-parallel replica, the micro-batch) and the node, instead of
//! ONNX Runtime's generator, which is seeded from the clock where the node has no `seed`
//! and, seeded or not, goes on from wherever the session's last run left it. So a run
//! repeats bit for bit, a resumed run draws the masks the uninterrupted one drew, and a
//! stage that recomputes its forward in the backward draws the forward's masks again.
//!
//! Element `i` is kept where the top 24 bits of `splitmix64(base + i * GOLDEN)` (as a
//! fraction of 2^24) are at least the ratio, `base` mixing the key and the node's salt
//! (`graph::keyed_dropout` writes it). Kept elements are scaled by `1 / (1 - ratio)` as
//! ONNX `Dropout`'s; the mask is ONNX's too (true where kept). Counter-based, so the
//! blocks split over ONNX Runtime's threads draw the same values on any thread count.
//! No crate draws a stream by index this cheaply (`rand`'s generators are sequential);
//! splitmix64 is Steele, Lea and Flood's finalizer, a few lines.

use std::sync::Mutex;

use ort::operator::{
    BoxedKernel, ComputeContext, KernelContext, Operator, OperatorInput, OperatorOutput,
};
use ort::value::TensorElementType;

use super::{input, output, BLOCKS};
use crate::graph::custom_ops::KEYED_DROPOUT;

/// The `KeyedDropout` operator on the CPU.
#[derive(Clone, Copy)]
pub(crate) struct KeyedDropout;

impl Operator for KeyedDropout {
    type Kernel<'attr> = BoxedKernel<'attr>;

    fn name(&self) -> &str {
        KEYED_DROPOUT
    }

    fn inputs(&self) -> impl IntoIterator<Item = OperatorInput> {
        inputs()
    }

    fn outputs(&self) -> impl IntoIterator<Item = OperatorOutput> {
        outputs()
    }

    fn create_kernel<'attr>(
        &self,
        info: &KernelContext<'attr>,
    ) -> ort::Result<Self::Kernel<'attr>> {
        let salt = info.get::<i64>("salt").unwrap_or(0) as u64;
        Ok(Box::new(move |ctx: &ComputeContext| {
            let x = input(ctx, KEYED_DROPOUT, 0)?;
            let (shape, x) = x.try_extract_tensor::<f32>()?;
            let shape: Vec<i64> = shape.iter().copied().collect();
            let ratio = input(ctx, KEYED_DROPOUT, 1)?;
            let ratio = ratio.try_extract_tensor::<f32>()?.1.first().copied();
            let ratio = ratio.filter(|r| (0.0..1.0).contains(r)).ok_or_else(|| {
                ort::Error::new(format!("{KEYED_DROPOUT}: the ratio must be in [0, 1)"))
            })?;
            let key = input(ctx, KEYED_DROPOUT, 2)?;
            let (_, key) = key.try_extract_tensor::<i64>()?;
            if key.len() != 4 {
                let got = key.len();
                return Err(ort::Error::new(format!(
                    "{KEYED_DROPOUT}: a key of {got} values, not 4"
                )));
            }
            let base = base(key, salt);
            let mut y = output(ctx, KEYED_DROPOUT, 0, &shape)?;
            let (_, y) = y.try_extract_tensor_mut::<f32>()?;
            let mut mask = ctx.output(1, shape.clone())?;
            let mask = match mask.as_mut() {
                Some(m) => Some(m.try_extract_tensor_mut::<bool>()?.1),
                None => None,
            };
            let draw = Draw::new(base, ratio);
            par_draw(ctx, x, y, mask, &draw)
        }))
    }
}

/// `KeyedDropout`'s inputs (on the CPU and on CUDA): `X`, the ratio, the key.
pub(crate) fn inputs() -> [OperatorInput; 3] {
    [
        OperatorInput::required(TensorElementType::Float32),
        OperatorInput::required(TensorElementType::Float32),
        OperatorInput::required(TensorElementType::Int64),
    ]
}

/// Its outputs: `Y` and, where asked for, the mask.
pub(crate) fn outputs() -> [OperatorOutput; 2] {
    [
        OperatorOutput::required(TensorElementType::Float32),
        OperatorOutput::optional(TensorElementType::Bool),
    ]
}

/// The odd constant splitmix64 steps by (2^64 / the golden ratio).
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

/// Steele, Lea and Flood's splitmix64 finalizer.
fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The stream's start for `key` (each value mixed in turn) and a node's `salt`.
pub(crate) fn base(key: &[i64], salt: u64) -> u64 {
    key.iter().fold(mix(salt.wrapping_add(GOLDEN)), |h, &k| {
        mix(h ^ (k as u64).wrapping_add(GOLDEN))
    })
}

/// One node's draw for one key: which elements it keeps and how it scales them.
pub(crate) struct Draw {
    base: u64,
    /// Kept where the 24-bit draw is at least this.
    threshold: u32,
    scale: f32,
}

impl Draw {
    pub(crate) fn new(base: u64, ratio: f32) -> Draw {
        Draw {
            base,
            threshold: (ratio as f64 * (1u64 << 24) as f64).ceil() as u32,
            scale: 1.0 / (1.0 - ratio),
        }
    }

    /// Whether element `i` is kept.
    pub(crate) fn keeps(&self, i: usize) -> bool {
        let draw = mix(self.base.wrapping_add((i as u64).wrapping_mul(GOLDEN))) >> 40;
        draw as u32 >= self.threshold
    }

    /// `y` (and `mask`) for `x`, the elements from `offset` on.
    fn apply(&self, offset: usize, x: &[f32], y: &mut [f32], mask: Option<&mut [bool]>) {
        match mask {
            Some(mask) => {
                for (j, ((y, &x), m)) in y.iter_mut().zip(x).zip(mask).enumerate() {
                    *m = self.keeps(offset + j);
                    *y = if *m { x * self.scale } else { 0.0 };
                }
            }
            None => {
                for (j, (y, &x)) in y.iter_mut().zip(x).enumerate() {
                    *y = if self.keeps(offset + j) {
                        x * self.scale
                    } else {
                        0.0
                    };
                }
            }
        }
    }
}

/// One block's outputs: its values, and its part of the mask where asked for.
type Block<'a> = (&'a mut [f32], Option<&'a mut [bool]>);

/// [`Draw::apply`] over [`BLOCKS`] blocks on ONNX Runtime's intra-op threads.
fn par_draw(
    ctx: &ComputeContext,
    x: &[f32],
    y: &mut [f32],
    mask: Option<&mut [bool]>,
    draw: &Draw,
) -> ort::Result<()> {
    let per = x.len().div_ceil(BLOCKS).max(1);
    let masks: Vec<Option<&mut [bool]>> = match mask {
        Some(m) => m.chunks_mut(per).map(Some).collect(),
        None => (0..y.len().div_ceil(per)).map(|_| None).collect(),
    };
    let blocks: Vec<Mutex<Block>> = y.chunks_mut(per).zip(masks).map(Mutex::new).collect();
    ctx.par_for(blocks.len(), blocks.len(), |b| {
        if let Ok(mut block) = blocks[b].lock() {
            let (y, mask) = &mut *block;
            let at = b * per;
            draw.apply(at, &x[at..at + y.len()], y, mask.as_deref_mut());
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_draws_one_mask_and_another_key_another() {
        let n = 200_000;
        let d = Draw::new(base(&[0, 3, 1, 2], 77), 0.25);
        let kept: Vec<bool> = (0..n).map(|i| d.keeps(i)).collect();
        // The ratio, within five standard deviations of a binomial draw.
        let share = kept.iter().filter(|&&k| !k).count() as f64 / n as f64;
        let sd = (0.25f64 * 0.75 / n as f64).sqrt();
        assert!((share - 0.25).abs() < 5.0 * sd, "dropped {share}");
        // The same key and salt, the same mask; each key value and the salt change it.
        let again = Draw::new(base(&[0, 3, 1, 2], 77), 0.25);
        assert!((0..n).all(|i| again.keeps(i) == kept[i]));
        for (key, salt) in [
            ([1, 3, 1, 2], 77),
            ([0, 4, 1, 2], 77),
            ([0, 3, 0, 2], 77),
            ([0, 3, 1, 3], 77),
            ([0, 3, 1, 2], 78),
        ] {
            let other = Draw::new(base(&key, salt), 0.25);
            let same = (0..n).filter(|&i| other.keeps(i) == kept[i]).count();
            // Independent masks agree on 0.75^2 + 0.25^2 = 62.5% of the elements.
            assert!(
                (same as f64 / n as f64 - 0.625).abs() < 0.01,
                "{key:?} {salt}: {same}"
            );
        }
    }

    #[test]
    fn kept_values_are_scaled_and_the_mask_says_which() {
        let d = Draw::new(base(&[5], 1), 0.5);
        let x: Vec<f32> = (0..1000).map(|i| i as f32 * 0.5 - 3.0).collect();
        let (mut y, mut mask) = (vec![9.0; 1000], vec![false; 1000]);
        d.apply(0, &x, &mut y, Some(&mut mask));
        for i in 0..1000 {
            assert_eq!(mask[i], d.keeps(i));
            assert_eq!(y[i], if mask[i] { x[i] * 2.0 } else { 0.0 });
        }
        // A block further on draws as the whole would there.
        let mut tail = vec![0.0; 10];
        d.apply(990, &x[990..], &mut tail, None);
        assert_eq!(tail, y[990..]);
        // Ratio 0 keeps everything.
        let all = Draw::new(base(&[5], 1), 0.0);
        assert!((0..10_000).all(|i| all.keeps(i)));
    }
}
