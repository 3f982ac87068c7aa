//! Where each parameter tensor of a stage lives in the stage's flat buffer.

use std::ops::Range;

/// One stage's parameters, concatenated in a fixed order into one flat `f32` buffer.
///
/// pipetrain keeps a stage's parameters, gradients and optimizer state as flat buffers of
/// [`len`](ParamLayout::len) values, so that a data-parallel AllReduce is one call and an
/// optimizer step is one loop. The layout remembers where each tensor sits, for the few
/// things that work per tensor (LAMB's trust ratio, checkpoints, feeding ONNX Runtime).
///
/// The fields are private so that names, shapes and offsets always agree.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamLayout {
    names: Vec<String>,
    shapes: Vec<Vec<usize>>,
    /// `offsets[i]..offsets[i + 1]` is tensor `i`; one more entry than there are tensors.
    offsets: Vec<usize>,
}

impl ParamLayout {
    /// Lays out the tensors one after the other, in the order given.
    ///
    /// A scalar (empty shape) takes one value; a shape with a zero dimension takes none.
    /// The shapes are those of tensors that already exist in memory, so their element
    /// counts cannot overflow `usize`.
    pub fn new<N, S>(params: impl IntoIterator<Item = (N, S)>) -> ParamLayout
    where
        N: Into<String>,
        S: Into<Vec<usize>>,
    {
        let mut layout = ParamLayout {
            names: Vec::new(),
            shapes: Vec::new(),
            offsets: vec![0],
        };
        for (name, shape) in params {
            let shape = shape.into();
            let end = layout.len() + shape.iter().product::<usize>();
            layout.names.push(name.into());
            layout.shapes.push(shape);
            layout.offsets.push(end);
        }
        layout
    }

    /// Total number of values in the flat buffer.
    pub fn len(&self) -> usize {
        // `offsets` always holds at least the leading 0.
        self.offsets.last().copied().unwrap_or(0)
    }

    /// Whether the buffer holds no values (no tensors, or only empty ones).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Number of tensors.
    pub fn count(&self) -> usize {
        self.names.len()
    }

    /// The tensors' names, in buffer order.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The tensors' shapes, in buffer order.
    pub fn shapes(&self) -> &[Vec<usize>] {
        &self.shapes
    }

    /// Where each tensor starts, in buffer order, followed by [`len`](ParamLayout::len).
    pub fn offsets(&self) -> &[usize] {
        &self.offsets
    }

    /// The index of the tensor called `name`, if there is one.
    pub fn index_of(&self, name: &str) -> Option<usize> {
        self.names.iter().position(|n| n == name)
    }

    /// The values of tensor `i` in the flat buffer.
    ///
    /// # Panics
    /// When `i >= self.count()`, like slice indexing.
    pub fn range(&self, i: usize) -> Range<usize> {
        self.offsets[i]..self.offsets[i + 1]
    }

    /// Tensor `i`'s part of `buf`.
    ///
    /// # Panics
    /// When `i >= self.count()` or `buf` is shorter than [`len`](ParamLayout::len).
    pub fn slice<'a>(&self, buf: &'a [f32], i: usize) -> &'a [f32] {
        &buf[self.range(i)]
    }

    /// Tensor `i`'s part of `buf`, writable.
    ///
    /// # Panics
    /// When `i >= self.count()` or `buf` is shorter than [`len`](ParamLayout::len).
    pub fn slice_mut<'a>(&self, buf: &'a mut [f32], i: usize) -> &'a mut [f32] {
        &mut buf[self.range(i)]
    }

    /// Every tensor's range, in buffer order.
    pub fn ranges(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        self.offsets.windows(2).map(|w| w[0]..w[1])
    }

    /// The layout of tensors `tensors` alone (their values start at 0).
    ///
    /// # Panics
    /// When the range reaches past [`count`](ParamLayout::count), like slice indexing.
    pub fn part(&self, tensors: Range<usize>) -> ParamLayout {
        let names = self.names[tensors.clone()].iter().cloned();
        ParamLayout::new(names.zip(self.shapes[tensors].iter().cloned()))
    }

    /// The values of tensors `tensors` in the flat buffer.
    pub fn values_of(&self, tensors: Range<usize>) -> Range<usize> {
        self.offsets[tensors.start]..self.offsets[tensors.end]
    }

    /// The tensors cut into `parts` consecutive runs of about equal values (whole
    /// tensors: a run ends at the tensor boundary nearest its share), as tensor-index
    /// ranges. A part may be empty where tensors are fewer than parts or one is large.
    pub fn partition(&self, parts: usize) -> Vec<Range<usize>> {
        let parts = parts.max(1);
        let total = self.len() as u128;
        let mut cuts = vec![0];
        for k in 1..parts {
            let target = total * k as u128 / parts as u128;
            let from = *cuts.last().unwrap_or(&0);
            // The boundary at or after the previous cut nearest to this share.
            let best = (from..=self.count())
                .min_by_key(|&i| (self.offsets[i] as u128).abs_diff(target))
                .unwrap_or(from);
            cuts.push(best);
        }
        cuts.push(self.count());
        cuts.windows(2).map(|w| w[0]..w[1]).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tensors_follow_each_other() {
        let l = ParamLayout::new([
            ("w", vec![2, 3]),
            ("s", vec![]),
            ("e", vec![0, 4]),
            ("b", vec![3]),
        ]);
        assert_eq!(l.len(), 10);
        assert_eq!(l.count(), 4);
        assert_eq!(l.offsets(), &[0, 6, 7, 7, 10]);
        assert_eq!(l.range(0), 0..6);
        assert_eq!(l.range(1), 6..7, "a scalar takes one value");
        assert_eq!(l.range(2), 7..7, "a zero dimension takes none");
        assert_eq!(l.range(3), 7..10);
        assert_eq!(
            l.ranges().collect::<Vec<_>>(),
            (0..4).map(|i| l.range(i)).collect::<Vec<_>>()
        );
        let buf: Vec<f32> = (0..10).map(|i| i as f32).collect();
        assert_eq!(l.slice(&buf, 3), &[7.0, 8.0, 9.0]);
        assert_eq!(l.index_of("b"), Some(3));
        assert_eq!(l.index_of("x"), None);
        assert_eq!(l.shapes()[0], vec![2, 3]);
        assert_eq!(l.names()[1], "s");
    }

    #[test]
    fn a_partition_cuts_whole_tensors_near_equal_shares() {
        let sizes = [10usize, 1, 30, 5, 40, 14];
        let l = ParamLayout::new(
            sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| (format!("t{i}"), vec![n])),
        );
        let parts = l.partition(2);
        assert_eq!(parts, vec![0..4, 4..6], "46 | 54 is the nearest cut to 50");
        let p3 = l.partition(3);
        assert_eq!(p3.len(), 3);
        assert_eq!(p3.first().map(|r| r.start), Some(0));
        assert_eq!(p3.last().map(|r| r.end), Some(6));
        assert!(p3.windows(2).all(|w| w[0].end == w[1].start), "consecutive");
        assert_eq!(l.values_of(4..6), 46..100);
        let sub = l.part(4..6);
        assert_eq!(sub.names(), &["t4".to_string(), "t5".to_string()]);
        assert_eq!(sub.len(), 54);
        // More parts than tensors: the extra parts are empty, none is lost.
        let many = ParamLayout::new([("a", vec![3])]).partition(3);
        assert_eq!(many.iter().map(|r| r.len()).sum::<usize>(), 1);
    }

    #[test]
    fn empty_layout_has_no_values() {
        let l = ParamLayout::new(Vec::<(String, Vec<usize>)>::new());
        assert!(l.is_empty());
        assert_eq!(l.count(), 0);
        assert_eq!(l.ranges().count(), 0);
    }
}
