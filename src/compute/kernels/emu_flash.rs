//! The flash plans (`flash.cu`) on the CPU ([`super::emu`]), against the float64 reference
//! of attention's tests: the output, each row's log-sum-exp and the gradients.

use super::emu::Emulator;
use super::emu_attention::{gpt2_case, three_case, AttentionCase};
use super::emu_tests::{at, bits, close, to, wave};
use super::*;

impl AttentionCase {
    /// The flash plans' L, O and gradients, run on the emulator.
    fn flash_planned(
        &self,
        emu: &Emulator,
        d_o: &[f32],
        descending: bool,
    ) -> (Vec<f32>, Vec<f32>, Vec<Vec<f32>>) {
        let [bn, hn, t, _, _] = self.dims;
        let mut lse = vec![f32::NAN; bn * hn * t];
        let (mut o, mut grads) = self.outputs();
        let mut x = self.at(&mut o, &mut lse);
        let plan = flash_attention(&x, self.scale, self.causal).unwrap();
        // SAFETY: the buffers hold what the views index.
        unsafe { emu.run_steps(&plan, descending) }.unwrap();
        let out = x.o;
        x.o = Mat::of(&self.out, at(d_o));
        let mut delta = vec![f32::NAN; flash_grad_scratch(&x)];
        let ([dq, dkt, dv], zero) = self.grads_at(&mut grads);
        let g = FlashGradAt {
            out,
            dq,
            dkt,
            dv,
            zero,
            delta: to(&mut delta),
        };
        let plan = flash_attention_grad(&x, &g, self.scale, self.causal).unwrap();
        // SAFETY: as above.
        unsafe { emu.run_steps(&plan, descending) }.unwrap();
        (lse, o, grads)
    }
}

/// The flash plans against float64, forward (O and each row's log-sum-exp) and backward:
/// GPT-2's packed causal layout with a gap (zeroed in the gradient) over more queries than
/// a block has rows and more keys than a tile has (head size 16), the same at GPT-2's
/// head size 64, and three tensors with a padding mask and more keys than queries (head
/// size 32). The same bits with each block's threads in the other order.
#[test]
fn flash_plan_is_attentions_formula() {
    let emu = Emulator::compile(ATTENTION_SOURCE, "attention.cu");
    let cases = [
        ("packed causal, D 16", gpt2_case([2, 2, 70], 16)),
        ("packed causal, D 64", gpt2_case([1, 2, 40], 64)),
        ("three tensors, D 32", three_case([2, 2, 37, 45], 32)),
    ];
    for (name, case) in cases {
        let d_o = wave(case.out_len, 35);
        let (lse, o, grads) = case.flash_planned(&emu, &d_o, false);
        let other = case.flash_planned(&emu, &d_o, true);
        let same = bits(&lse) == bits(&other.0)
            && bits(&o) == bits(&other.1)
            && (0..grads.len()).all(|k| bits(&grads[k]) == bits(&other.2[k]));
        assert!(same, "{name}: no race, the same bits in either order");
        let (_, want_o, want_grads, want_lse) = case.reference(&d_o);
        // float32 rounding of dot products of D terms (scores of up to ~20 here).
        let tol = 1e-5 * (case.dims[4] as f64 / 16.0);
        close(&lse, &want_lse, tol, &format!("{name}: L"));
        close(&o, &want_o, tol, &format!("{name}: O"));
        for (k, (g, want)) in grads.iter().zip(&want_grads).enumerate() {
            close(g, want, 10.0 * tol, &format!("{name}: gradient {k}"));
        }
    }
}

/// Head sizes the kernels are not compiled for, unequal ones, and more (batch entry, head)
/// pairs than a grid holds are refused.
#[test]
fn flash_plan_refuses_other_head_sizes() {
    let case = gpt2_case([1, 1, 4], 8);
    let mat = |i: usize| Mat::of(&case.views[i].1, 0);
    let x = AttentionAt {
        batch: 1,
        heads: 1,
        q: mat(0),
        kt: mat(1),
        v: mat(2),
        o: Mat::of(&case.out, 0),
        p: 0,
        mask: None,
    };
    let refused = flash_attention(&x, 1.0, true).unwrap_err();
    assert!(refused.contains("[16, 32, 64, 128]"), "{refused}");
    let many = AttentionAt {
        batch: 65_536,
        q: Mat { cols: 16, ..x.q },
        kt: Mat { rows: 16, ..x.kt },
        v: Mat { cols: 16, ..x.v },
        ..x
    };
    let refused = flash_attention(&many, 1.0, true).unwrap_err();
    assert!(
        refused.contains("65536 (batch entry, head) pairs"),
        "{refused}"
    );
    assert!(flash_fits(64, 64) && !flash_fits(64, 32) && !flash_fits(48, 48));
}
