//! How the attention kernels read their tensors: a rank-4 tensor as the logical
//! `[B, H, rows, cols]` tensor `Transpose(tensor, perm)` (strides, no copies), a mask's
//! broadcast strides, and outputs shared by the tasks that write disjoint parts of them.

/// A tensor read (or written) as the logical `[B, H, rows, cols]` tensor
/// `Transpose(tensor, perm)`: its dimensions and the strides into the tensor's values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct View {
    pub(crate) dims: [usize; 4],
    pub(crate) strides: [usize; 4],
    /// Where the tensor starts in the values (a part of a packed tensor).
    pub(crate) offset: usize,
}

impl View {
    /// `Transpose(x, perm)` of a row-major `x` of `shape`, `None` unless rank 4.
    pub(crate) fn of(shape: &[i64], perm: [usize; 4]) -> Option<View> {
        let shape: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
        if shape.len() != 4 {
            return None;
        }
        let mut strides = [1usize; 4];
        for a in (0..3).rev() {
            strides[a] = strides[a + 1] * shape[a + 1];
        }
        Some(View::turned(
            [shape[0], shape[1], shape[2], shape[3]],
            strides,
            0,
            perm,
        ))
    }

    /// `Transpose(x, perm)` of the tensor `x` of `dims` at `strides` from `offset`.
    fn turned(dims: [usize; 4], strides: [usize; 4], offset: usize, perm: [usize; 4]) -> View {
        View {
            dims: perm.map(|a| dims[a]),
            strides: perm.map(|a| strides[a]),
            offset,
        }
    }

    /// `Transpose(x, perm)` of the `[B, T, heads, d]` tensor `x` that is the values
    /// `offset..offset + heads d` of the last axis of the packed `[B, T, W]` tensor of
    /// `shape` (as `Reshape(Split(packed))` makes it); `None` where that does not fit.
    pub(crate) fn part(
        shape: &[i64],
        [heads, d]: [usize; 2],
        offset: usize,
        perm: [usize; 4],
    ) -> Option<View> {
        let &[b, t, w] = shape else { return None };
        let (b, t, w) = (b.max(0) as usize, t.max(0) as usize, w.max(0) as usize);
        if offset + heads * d > w {
            return None;
        }
        Some(View::turned(
            [b, t, heads, d],
            [t * w, w, d, 1],
            offset,
            perm,
        ))
    }

    /// The row-major tensor `Transpose(logical, perm)` for a logical tensor of `dims`:
    /// its shape and the view of it as `dims`.
    pub(crate) fn made(dims: [usize; 4], perm: [usize; 4]) -> (Vec<i64>, View) {
        let shape: Vec<i64> = perm.iter().map(|&a| dims[a] as i64).collect();
        let mut inverse = [0usize; 4];
        for (j, &a) in perm.iter().enumerate() {
            inverse[a] = j;
        }
        let view = View::of(&shape, inverse).unwrap_or(View {
            dims,
            strides: [0; 4],
            offset: 0,
        });
        (shape, view)
    }

    /// Where the (batch, head) pair `bh` (of `dims[1]` heads) starts in the values.
    pub(super) fn at(&self, bh: usize) -> usize {
        self.offset + (bh / self.dims[1]) * self.strides[0] + (bh % self.dims[1]) * self.strides[1]
    }

    /// Pair `bh`'s matrix (the last two axes) from row `row` on, as SGEMM takes it:
    /// where it starts in the values, its row and column strides (turned: rows and
    /// columns swapped, `row` then counts the turned matrix's rows).
    pub(super) fn matrix(&self, bh: usize, row: usize, turned: bool) -> (usize, isize, isize) {
        let (r, c) = match turned {
            false => (self.strides[2], self.strides[3]),
            true => (self.strides[3], self.strides[2]),
        };
        (self.at(bh) + row * r, r as isize, c as isize)
    }
}

/// The mask's strides over `[B, H, T, S]` (0 where it is broadcast), `None` where its
/// shape does not broadcast to `dims`.
pub(crate) fn mask_strides(shape: &[i64], dims: [usize; 4]) -> Option<[usize; 4]> {
    if shape.len() > 4 {
        return None;
    }
    let shape: Vec<usize> = shape.iter().map(|&d| d.max(0) as usize).collect();
    let lead = 4 - shape.len();
    let mut strides = [0usize; 4];
    let mut next = 1;
    for a in (lead..4).rev() {
        let d = shape[a - lead];
        if d != 1 && d != dims[a] {
            return None;
        }
        strides[a] = if d == 1 { 0 } else { next };
        next *= d;
    }
    Some(strides)
}

/// A tensor's values as a raw pointer, shared by tasks that write disjoint elements.
#[derive(Clone, Copy)]
pub(super) struct Shared(pub(super) *mut f32);
// SAFETY: the tasks of one call write disjoint elements (each its own (batch, head)
// pairs) and the call waits for all of them before the tensors are read.
unsafe impl Send for Shared {}
unsafe impl Sync for Shared {}

impl Shared {
    /// The pointer (a method, so that closures take the whole `Shared`).
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }

    /// Pair `bh`'s matrix of the viewed tensor, to write (see [`View::matrix`]).
    pub(super) fn matrix(
        self,
        v: &View,
        bh: usize,
        row: usize,
        turned: bool,
    ) -> (*mut f32, isize, isize) {
        let (at, r, c) = v.matrix(bh, row, turned);
        (self.0.wrapping_add(at), r, c)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_view_reads_the_transposed_tensor() {
        // `[B, T, H, D]` read as `[B, H, T, D]` (`perm [0, 2, 1, 3]`).
        let v = View::of(&[2, 5, 3, 4], [0, 2, 1, 3]).unwrap();
        assert_eq!(v.dims, [2, 3, 5, 4]);
        assert_eq!(v.strides, [60, 4, 12, 1]);
        // The second pair is batch 0, head 1.
        assert_eq!(v.at(1), 4);
        assert_eq!(v.at(3), 60);
    }

    #[test]
    fn a_made_tensor_is_the_logical_one_transposed() {
        let (shape, view) = View::made([2, 3, 5, 4], [0, 2, 1, 3]);
        assert_eq!(shape, vec![2, 5, 3, 4]);
        assert_eq!(view, View::of(&[2, 5, 3, 4], [0, 2, 1, 3]).unwrap());
        let (shape, view) = View::made([2, 3, 5, 4], [0, 1, 2, 3]);
        assert_eq!(shape, vec![2, 3, 5, 4]);
        assert_eq!(view.strides, [60, 20, 4, 1]);
    }

    #[test]
    fn a_part_of_a_packed_tensor_is_read_in_place() {
        // The middle third of `[2, 5, 24]` as `[2, 5, 3, 4]`, read as `[2, 3, 5, 4]`.
        let v = View::part(&[2, 5, 24], [3, 4], 8, [0, 2, 1, 3]).unwrap();
        assert_eq!(
            (v.dims, v.strides, v.offset),
            ([2, 3, 5, 4], [120, 4, 24, 1], 8)
        );
        // Batch 0, head 1 starts 4 values into the part; batch 1, head 0 a batch later.
        assert_eq!(v.at(1), 12);
        assert_eq!(v.at(3), 128);
        // A part past the end does not fit.
        assert_eq!(View::part(&[2, 5, 24], [3, 4], 16, [0, 1, 2, 3]), None);
    }

    #[test]
    fn masks_broadcast_from_the_right() {
        assert_eq!(mask_strides(&[5, 7], [2, 3, 5, 7]), Some([0, 0, 7, 1]));
        assert_eq!(
            mask_strides(&[2, 1, 1, 7], [2, 3, 5, 7]),
            Some([7, 0, 0, 1])
        );
        assert_eq!(mask_strides(&[], [2, 3, 5, 7]), Some([0; 4]));
        assert_eq!(mask_strides(&[5, 6], [2, 3, 5, 7]), None);
    }
}
