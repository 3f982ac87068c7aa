//! One channel plane of the depthwise convolution and its backward (see the parent
//! module's doc for the method), and the walk they share.

/// The window walk of one call: the attributes and the shapes they meet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Geometry {
    /// Batch, channels.
    pub(super) n: usize,
    pub(super) c: usize,
    /// Input plane, kernel, output plane: (rows, columns).
    pub(super) input: (usize, usize),
    pub(super) kernel: (usize, usize),
    pub(super) output: (usize, usize),
    pub(super) stride: (usize, usize),
    pub(super) dilation: (usize, usize),
    /// Padding before the first row and column, and after the last.
    pub(super) pad: (usize, usize),
    pub(super) pad_end: (usize, usize),
}

impl Geometry {
    pub(super) fn in_plane(&self) -> usize {
        self.input.0 * self.input.1
    }
    pub(super) fn out_plane(&self) -> usize {
        self.output.0 * self.output.1
    }
    pub(super) fn taps(&self) -> usize {
        self.kernel.0 * self.kernel.1
    }
    /// The padded input's row length: the pitch of every scratch plane.
    fn pitch(&self) -> usize {
        self.input.1 + self.pad.1 + self.pad_end.1
    }
    /// Values of the padded input plane.
    fn padded_plane(&self) -> usize {
        (self.input.0 + self.pad.0 + self.pad_end.0) * self.pitch()
    }
    /// Values of the stride-1 output (every window position of the padded input) at the
    /// padded pitch, rounded up to whole [`CHUNK`]s.
    fn full_len(&self) -> usize {
        let rows =
            self.input.0 + self.pad.0 + self.pad_end.0 - self.dilation.0 * (self.kernel.0 - 1);
        (rows * self.pitch()).next_multiple_of(CHUNK)
    }
    /// Where tap `t` reads, relative to its output, in the padded input.
    fn offset(&self, t: usize) -> usize {
        let (kh, kw) = (t / self.kernel.1, t % self.kernel.1);
        kh * self.dilation.0 * self.pitch() + kw * self.dilation.1
    }
    /// Where output `(oh, ow)` sits in the stride-1 output.
    fn full_index(&self, oh: usize, ow: usize) -> usize {
        oh * self.stride.0 * self.pitch() + ow * self.stride.1
    }

    /// `plane` into the zeroed interior of `padded`.
    fn pad_into(&self, plane: &[f32], padded: &mut [f32]) {
        let (w, pitch) = (self.input.1, self.pitch());
        padded.fill(0.0);
        for (r, row) in plane.chunks_exact(w.max(1)).enumerate() {
            let at = (r + self.pad.0) * pitch + self.pad.1;
            padded[at..at + w].copy_from_slice(row);
        }
    }
}

/// Outputs computed side by side in registers (four AVX-512 vectors, eight AVX2).
const CHUNK: usize = 64;

/// `out[i] = sum over taps t of w[t] * src[i + at[t]]`, taps in order, a fused
/// multiply-add each, a [`CHUNK`] of outputs at a time kept in registers.
#[inline(always)]
fn correlate(src: &[f32], at: &[usize], w: &[f32], out: &mut [f32]) {
    for (i, out) in out.chunks_exact_mut(CHUNK).enumerate() {
        let mut acc = [0f32; CHUNK];
        for (&at, &w) in at.iter().zip(w) {
            let src = &src[i * CHUNK + at..(i + 1) * CHUNK + at];
            for l in 0..CHUNK {
                acc[l] = src[l].mul_add(w, acc[l]);
            }
        }
        out.copy_from_slice(&acc);
    }
}

/// `out[t] = sum over i of a[i] * b[i + at[t]]` (`a` whole [`CHUNK`]s): a [`CHUNK`] of
/// partial sums per tap in registers, then summed pairwise (halves, quarters, ...).
#[inline(always)]
fn dots(a: &[f32], b: &[f32], at: &[usize], out: &mut [f32]) {
    for (&at, out) in at.iter().zip(out) {
        let mut s = [0f32; CHUNK];
        for (i, a) in a.chunks_exact(CHUNK).enumerate() {
            let b = &b[i * CHUNK + at..(i + 1) * CHUNK + at];
            for l in 0..CHUNK {
                s[l] = a[l].mul_add(b[l], s[l]);
            }
        }
        *out = pairwise(s);
    }
}

/// The sum of `s`, halves first, then quarters, ... (fixed widths, which stay in
/// vector registers).
#[inline(always)]
fn pairwise(mut s: [f32; CHUNK]) -> f32 {
    const _: () = assert!(CHUNK == 64);
    #[inline(always)]
    fn fold<const W: usize>(s: &mut [f32; CHUNK]) {
        for l in 0..W {
            s[l] += s[l + W];
        }
    }
    fold::<32>(&mut s);
    fold::<16>(&mut s);
    fold::<8>(&mut s);
    fold::<4>(&mut s);
    fold::<2>(&mut s);
    fold::<1>(&mut s);
    s[0]
}

/// `dW` and `dB` from the planes' shares (each tap's sum, then the plane's sum of `dY`),
/// in plane order: batch order per channel.
pub(super) fn reduce_shares(g: &Geometry, shares: &[f32], dw: &mut [f32], db: &mut [f32]) {
    let t = g.taps();
    dw.fill(0.0);
    db.fill(0.0);
    for (p, share) in shares.chunks_exact(t + 1).enumerate() {
        let c = p % g.c;
        let dw = &mut dw[c * t..(c + 1) * t];
        dw.iter_mut().zip(share).for_each(|(a, b)| *a += b);
        db[c] += share[t];
    }
}

/// What a block of planes reuses: the taps' offsets and the scratch planes (those of
/// the pass it is made for; the other pass's stay empty).
pub(super) struct Scratch {
    /// Where each tap reads (forward, and `dW`), and where each tap's `dX` reads in
    /// `spread` (the kernel turned around).
    at: Vec<usize>,
    back: Vec<usize>,
    /// The padded input, with room for the last tap's reach past the stride-1 output.
    padded: Vec<f32>,
    /// The stride-1 output (forward).
    full: Vec<f32>,
    /// `dY` spread to the stride-1 output's places, after `reach` zeros (backward).
    spread: Vec<f32>,
    /// The padded input's gradient, whole [`CHUNK`]s (backward).
    grad: Vec<f32>,
}

impl Scratch {
    /// For [`forward_plane`] (`backward` false) or [`backward_plane`].
    pub(super) fn new(g: &Geometry, backward: bool) -> Self {
        let at: Vec<usize> = (0..g.taps()).map(|t| g.offset(t)).collect();
        let reach = at.last().copied().unwrap_or(0);
        let grad = g.padded_plane().next_multiple_of(CHUNK);
        let sized = |len: usize, wanted: bool| vec![0.0; if wanted { len } else { 0 }];
        Self {
            back: at.iter().map(|a| reach - a).collect(),
            at,
            padded: vec![0.0; g.full_len() + reach],
            full: sized(g.full_len(), !backward),
            spread: sized(grad.max(g.full_len()) + reach, backward),
            grad: sized(grad, backward),
        }
    }

    fn reach(&self) -> usize {
        self.at.last().copied().unwrap_or(0)
    }
}

/// One output plane: the stride-1 output at the padded pitch ([`correlate`]), then the
/// strided outputs picked out, `+ bias`.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub(super) fn forward_plane(
    g: &Geometry,
    (x, w, bias): (&[f32], &[f32], f32),
    s: &mut Scratch,
    y: &mut [f32],
) {
    g.pad_into(x, &mut s.padded);
    correlate(&s.padded, &s.at, w, &mut s.full);
    for (oh, y) in y.chunks_exact_mut(g.output.1.max(1)).enumerate() {
        for (ow, y) in y.iter_mut().enumerate() {
            *y = s.full[g.full_index(oh, ow)] + bias;
        }
    }
}

/// One plane's backward: `dx`, and the plane's share of `dW` (one per tap) and of `dB`
/// (the last value of `share`). `dY` is spread to the stride-1 output's places (zeros
/// between strided outputs and past each row's last), so that the padded `dX` is a
/// correlation of it with the kernel turned around, and `dW` its dot products with the
/// padded `X` at each tap's offset.
#[multiversion::multiversion(targets("x86_64+avx512f+avx512vl", "x86_64+avx2+fma"))]
pub(super) fn backward_plane(
    g: &Geometry,
    (dy, x, w): (&[f32], &[f32], &[f32]),
    s: &mut Scratch,
    dx: &mut [f32],
    share: &mut [f32],
) {
    g.pad_into(x, &mut s.padded);
    let reach = s.reach();
    s.spread.fill(0.0);
    for (oh, dy) in dy.chunks_exact(g.output.1.max(1)).enumerate() {
        for (ow, &v) in dy.iter().enumerate() {
            s.spread[reach + g.full_index(oh, ow)] = v;
        }
    }
    correlate(&s.spread, &s.back, w, &mut s.grad);
    let full = &s.spread[reach..reach + g.full_len()];
    dots(full, &s.padded, &s.at, &mut share[..g.taps()]);
    share[g.taps()] = super::super::lane_sum(dy);
    let (width, pitch) = (g.input.1, g.pitch());
    for (r, dx) in dx.chunks_exact_mut(width.max(1)).enumerate() {
        let at = (r + g.pad.0) * pitch + g.pad.1;
        dx.copy_from_slice(&s.grad[at..at + width]);
    }
}

#[cfg(test)]
mod tests {
    use super::super::Attributes;
    use super::*;

    /// The convolution and its gradients by definition, in float64.
    fn reference(g: &Geometry, x: &[f32], w: &[f32], dy: &[f32]) -> [Vec<f64>; 3] {
        let (mut y, mut dx, mut dw) = (
            vec![0f64; g.n * g.c * g.out_plane()],
            vec![0f64; x.len()],
            vec![0f64; w.len()],
        );
        for p in 0..g.n * g.c {
            let c = p % g.c;
            for oh in 0..g.output.0 {
                for ow in 0..g.output.1 {
                    let o = p * g.out_plane() + oh * g.output.1 + ow;
                    for kh in 0..g.kernel.0 {
                        for kw in 0..g.kernel.1 {
                            let ih =
                                (oh * g.stride.0 + kh * g.dilation.0) as isize - g.pad.0 as isize;
                            let iw =
                                (ow * g.stride.1 + kw * g.dilation.1) as isize - g.pad.1 as isize;
                            if ih < 0
                                || iw < 0
                                || ih >= g.input.0 as isize
                                || iw >= g.input.1 as isize
                            {
                                continue;
                            }
                            let i = p * g.in_plane() + ih as usize * g.input.1 + iw as usize;
                            let t = c * g.taps() + kh * g.kernel.1 + kw;
                            y[o] += x[i] as f64 * w[t] as f64;
                            dx[i] += dy[o] as f64 * w[t] as f64;
                            dw[t] += dy[o] as f64 * x[i] as f64;
                        }
                    }
                }
            }
        }
        [y, dx, dw]
    }

    fn close(what: &str, got: &[f32], want: &[f64]) {
        assert_eq!(got.len(), want.len(), "{what}");
        let scale = want.iter().fold(1f64, |m, v| m.max(v.abs()));
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(
                (*a as f64 - b).abs() < 1e-5 * scale,
                "{what}[{i}]: {a} vs {b}"
            );
        }
    }

    #[test]
    fn planes_match_the_definition() {
        let wave = |k: usize, a: f64| ((k as f64 * a).sin() * 1.3) as f32;
        // (input, kernel, stride, dilation, pads): ConvNeXt's 7x7, MobileNet's 3x3 at
        // stride 2, asymmetric pads, dilation, a kernel wider than the padded input's
        // last window reaches.
        let cases = [
            ((9, 11), (7, 7), (1, 1), (1, 1), [3, 3, 3, 3]),
            ((8, 7), (3, 3), (2, 2), (1, 1), [1, 1, 1, 1]),
            ((6, 9), (3, 2), (1, 2), (2, 1), [0, 2, 1, 0]),
            ((5, 5), (3, 3), (2, 3), (1, 1), [1, 0, 0, 1]),
        ];
        for (input, kernel, stride, dilation, pads) in cases {
            let attrs = Attributes {
                strides: [stride.0, stride.1],
                pads,
                dilations: [dilation.0, dilation.1],
            };
            let (n, c) = (2, 3);
            let sx = [n, c, input.0, input.1].map(|d| d as i64);
            let sw = [c, 1, kernel.0, kernel.1].map(|d| d as i64);
            let g = attrs.geometry("test", &sx, &sw).unwrap();
            let x: Vec<f32> = (0..n * c * g.in_plane()).map(|k| wave(k, 0.37)).collect();
            let w: Vec<f32> = (0..c * g.taps()).map(|k| wave(k, 0.91)).collect();
            let dy: Vec<f32> = (0..n * c * g.out_plane()).map(|k| wave(k, 0.53)).collect();
            let [ry, rdx, rdw] = reference(&g, &x, &w, &dy);
            let (mut y, mut dx, mut dw) = (
                vec![0f32; ry.len()],
                vec![0f32; x.len()],
                vec![0f32; w.len()],
            );
            let (mut scratch, mut back) = (Scratch::new(&g, false), Scratch::new(&g, true));
            let (i, o, t) = (g.in_plane(), g.out_plane(), g.taps());
            let sl = t + 1;
            let mut shares = vec![0f32; n * c * sl];
            for p in 0..n * c {
                let wc = &w[(p % c) * t..(p % c + 1) * t];
                let (xp, dyp) = (&x[p * i..(p + 1) * i], &dy[p * o..(p + 1) * o]);
                forward_plane(&g, (xp, wc, 0.0), &mut scratch, &mut y[p * o..(p + 1) * o]);
                let (dxp, share) = (
                    &mut dx[p * i..(p + 1) * i],
                    &mut shares[p * sl..(p + 1) * sl],
                );
                backward_plane(&g, (dyp, xp, wc), &mut back, dxp, share);
            }
            let mut db = vec![0f32; c];
            reduce_shares(&g, &shares, &mut dw, &mut db);
            let rdb: Vec<f64> = (0..c)
                .map(|ch| {
                    let planes = (0..n).map(|b| &dy[(b * c + ch) * o..(b * c + ch + 1) * o]);
                    planes.flatten().map(|&v| v as f64).sum()
                })
                .collect();
            close("y", &y, &ry);
            close("dx", &dx, &rdx);
            close("dw", &dw, &rdw);
            close("db", &db, &rdb);
        }
    }
}
