"""Numerics at the edges: long sequences, underflowing decay, no decay, dt around the softplus threshold.

n_t = 8192 tokens (small n_head / head_dim / d_state so each case runs in well under a second).
The oracle is a float64 NumPy recurrence written from the spec (tests/reference.py: ``np_ssm_scan``
and the reverse recurrence ``np_ssm_scan_back``, vectorised over sequences/heads but looping over tokens); it
never calls ssmgrad, and ``test_numpy_oracle_matches_torch_reference`` checks it against the torch
autograd reference of tests/reference.py on small inputs (torch autograd over 8192 tokens is too
slow for CI).

What is asserted, for both branches (Mamba-1 A (n_head, d_state), Mamba-2 A (n_head, 1)):
  * wherever the float64 oracle is finite, ssmgrad's result is finite (no NaN/Inf from 0*inf,
    0/0, exp overflow, or a backward that divides by an underflowed decay), for float32 and float64;
  * float64 ssmgrad vs the float64 oracle: max |err| <= 1e-12 * scale;
  * float32 ssmgrad vs the float64 oracle run on the same (float32-rounded) inputs:
        forward   (y and the K state slots)         max |err| <= 2e-5 * scale
        backward  (d_s, d_x, d_dt, d_B, d_C, d_A)   max |err| <= 5e-5 * scale
    (measured: at most 1.5e-6 forward and 3.4e-6 backward (d_A; others <= 2.9e-6) over these
    cases, so the bounds keep a ~10x margin);
    where scale = max |oracle| over the region (per output tensor), floored at 1e-20 for float32
    (a tensor whose every value is below that, e.g. d_s when every first decay underflows, is
    in float32's underflow range and is compared in absolute terms). The float32 kernel
    accumulates over 8192 tokens in float32, so the error is relative to the tensor's size,
    not to each element (an element that is the small difference of large terms can have a large
    relative error and still be exact to float32 resolution of the tensor).
"""

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/: reference.py

import ssmgrad  # noqa: E402
from reference import (np_softplus, np_softplus_deriv, np_ssm_scan, np_ssm_scan_back,  # noqa: E402
                       ref_scan_grads, ref_scan_np)

# every case once with each form of the Mamba-2 backward (conftest.scan_back_form)
pytestmark = pytest.mark.usefixtures("scan_back_form")

N_T = 8192

# float32 error bounds, relative to the max |value| of each output tensor (see the docstring).
F32_FWD_TOL = 2e-5
F32_BWD_TOL = 5e-5
F64_TOL = 1e-12
# A tensor whose every oracle value is below this is in the dtype's underflow range (e.g. d_s when
# every first decay a_1 underflows): it is compared in absolute terms against tol * floor.
UNDERFLOW_FLOOR = {np.float32: 1e-20, np.float64: 1e-290}


# ---------------------------------------------------------------------------------------------

def make_case(rng, mamba2, n_group, dt_values, A_scale, A_zero=False, n_seqs=2, n_head=2,
              head_dim=2, d_state=4, n_t=N_T):
    """Inputs of moderate size; dt drawn from dt_values (an array of candidates) per element."""
    n_rs = n_seqs + 1
    s = rng.standard_normal((n_rs, n_head, head_dim, d_state))
    x = rng.standard_normal((n_seqs, n_t, n_head, head_dim))
    dt = rng.choice(np.asarray(dt_values, dtype=np.float64), size=(n_seqs, n_t, n_head))
    A_shape = (n_head, 1) if mamba2 else (n_head, d_state)
    A = np.zeros(A_shape) if A_zero else -A_scale * rng.uniform(0.5, 1.5, size=A_shape)
    B = rng.standard_normal((n_seqs, n_t, n_group, d_state)) * 0.5
    C = rng.standard_normal((n_seqs, n_t, n_group, d_state)) * 0.5
    ids = np.array([n_rs - 1, 0][:n_seqs], dtype=np.int32)
    return s, x, dt, A, B, C, ids


def split_grads(gin, s, x, dt, B, C):
    names = ("s", "x", "dt", "B", "C")
    return dict(zip(names, ssmgrad.split(gin, s.shape, x.shape, dt.shape, B.shape, C.shape)))


def check(name, got, ref, tol):
    got_dtype = np.asarray(got).dtype.type
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    finite = np.isfinite(ref)
    bad = finite & ~np.isfinite(got)
    assert not bad.any(), (f"{name}: {int(bad.sum())} non-finite values where the float64 oracle is "
                           f"finite, first at {np.argwhere(bad)[0].tolist()}")
    assert finite.all(), f"{name}: the oracle itself is not finite (test case is wrong)"
    scale = max(float(np.max(np.abs(ref))) if ref.size else 0.0, UNDERFLOW_FLOOR[got_dtype])
    err = float(np.max(np.abs(got - ref))) if ref.size else 0.0
    assert err <= tol * scale, (
        f"{name}: max abs err {err:.3e} > {tol:g} * scale {scale:.3e} (= {tol * scale:.3e})")
    return err / scale if scale else 0.0


# dt candidate sets
DT_NORMAL = np.linspace(-3.0, 3.0, 13)
DT_THRESHOLD = np.array([19.999, 20.0, 20.001, 80.0, -80.0, 0.0, -5.0, 1.0])

CASES = {
    # A*softplus(dt) <= -1000: a = exp(...) underflows to exactly 0 in both precisions.
    "strong_decay": dict(dt_values=np.array([20.0, 20.001, 40.0, 80.0]), A_scale=100.0),
    # every token decays to 0 except sometimes (mixture), exercising a = 0 then a ~ 1.
    "mixed_decay": dict(dt_values=np.array([-80.0, -20.0, 0.0, 80.0]), A_scale=30.0),
    # no decay: H accumulates over all 8192 tokens.
    "no_decay": dict(dt_values=DT_NORMAL, A_scale=0.0, A_zero=True),
    # dt exactly around the threshold of the softplus and far beyond it on both sides.
    "dt_threshold": dict(dt_values=DT_THRESHOLD, A_scale=0.05),
    # realistic mild decay, long sequence.
    "mild_decay": dict(dt_values=DT_NORMAL, A_scale=0.5),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("mamba2", [False, True], ids=["mamba1", "mamba2"])
def test_long_sequence_forward_backward(case, mamba2):
    rng = np.random.default_rng([sorted(CASES).index(case), int(mamba2)])
    n_group = 1 if mamba2 else 2
    K = 3 if mamba2 else 1
    s, x, dt, A, B, C, ids = make_case(rng, mamba2, n_group, **CASES[case])
    for dtype, ftol, btol in ((np.float64, F64_TOL, F64_TOL), (np.float32, F32_FWD_TOL, F32_BWD_TOL)):
        args = [a.astype(dtype) for a in (s, x, dt, A, B, C)]
        ref_out = np_ssm_scan(*args, ids, K=K)
        n_y = x.size
        out = ssmgrad.ssm_scan(*args, ids, K=K)
        assert out.dtype == dtype
        check(f"{case}/{dtype.__name__}/y", out[:n_y], ref_out[:n_y], ftol)
        check(f"{case}/{dtype.__name__}/states", out[n_y:], ref_out[n_y:], ftol)

        grad = rng.standard_normal(out.shape).astype(dtype)
        gin, dA = ssmgrad.ssm_scan_back(*args, ids, grad, K=K, return_dA=True)
        got = split_grads(gin, *(args[i] for i in (0, 1, 2, 4, 5)))
        got["A"] = dA
        ref = np_ssm_scan_back(*args, ids, grad, K=K)
        for k in ("s", "x", "dt", "B", "C", "A"):
            check(f"{case}/{dtype.__name__}/d_{k}", got[k], ref[k], btol)


def test_strong_decay_really_underflows():
    """The 'strong_decay' case must make a == 0 exactly (else it tests nothing special)."""
    rng = np.random.default_rng(0)
    s, x, dt, A, B, C, ids = make_case(rng, True, 1, n_t=64, **CASES["strong_decay"])
    for dtype in (np.float32, np.float64):
        sp = np_softplus(dt.astype(dtype))
        a = np.exp((sp[..., None] * A.astype(dtype)[None, None]).astype(dtype))
        assert (a == 0).all()


def test_strong_decay_state_forgets_history():
    """With a == 0 at token t the state after t is B_t * x_t * sp_t only: y equals a
    one-token scan from a zero state, independent of s (exact, any dtype)."""
    rng = np.random.default_rng(1)
    n_t = 16
    for mamba2 in (False, True):
        s, x, dt, A, B, C, ids = make_case(rng, mamba2, 1, n_t=n_t, dt_values=np.array([80.0]),
                                           A_scale=100.0)
        for dtype in (np.float32, np.float64):
            args = [a.astype(dtype) for a in (s, x, dt, A, B, C)]
            out = ssmgrad.ssm_scan(*args, ids)
            y = out[:x.size].reshape(x.shape)
            zero_s = np.zeros_like(args[0])
            y0 = ssmgrad.ssm_scan(zero_s, *args[1:], ids)[:x.size].reshape(x.shape)
            np.testing.assert_array_equal(y, y0)
            gin = ssmgrad.ssm_scan_back(*args, ids, np.ones_like(out))
            d_s = split_grads(gin, *(args[i] for i in (0, 1, 2, 4, 5)))["s"]
            np.testing.assert_array_equal(d_s, np.zeros_like(d_s))  # a_1 == 0 exactly


def test_softplus_threshold_values_exact_in_float64():
    """One token, zero state, x = B = C = 1, d_state = head_dim = 1: y = softplus(dt), and the
    gradient of y w.r.t. dt is the softplus derivative, for dt around and far from 20."""
    dts = np.array([-80.0, -20.0, -1.0, 0.0, 19.999, 20.0, 20.001, 80.0])
    n = dts.size
    s = np.zeros((n, 1, 1, 1))
    x = np.ones((n, 1, 1, 1))
    dt = dts.reshape(n, 1, 1)
    A = np.zeros((1, 1))
    B = np.ones((n, 1, 1, 1))
    C = np.ones((n, 1, 1, 1))
    ids = np.arange(n)
    out = ssmgrad.ssm_scan(s, x, dt, A, B, C, ids)
    expect = np_softplus(dts)
    np.testing.assert_allclose(out[:n], expect, rtol=1e-14, atol=0)
    grad = np.zeros_like(out)
    grad[:n] = 1.0
    gin = ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, grad)
    d_dt = split_grads(gin, s, x, dt, B, C)["dt"].reshape(-1)
    # y = sp(dt) -> d_dt = sp'(dt) (the state region of grad is 0)
    np.testing.assert_allclose(d_dt, np_softplus_deriv(dts), rtol=1e-14, atol=1e-300)
    for dtype in (np.float32,):
        args = [a.astype(dtype) for a in (s, x, dt, A, B, C)]
        out32 = ssmgrad.ssm_scan(*args, ids)
        assert np.all(np.isfinite(out32))
        np.testing.assert_allclose(out32[:n], np_softplus(dts.astype(dtype)), rtol=2e-6,
                                   atol=1e-6 * 80)


def test_numpy_oracle_matches_torch_reference():
    """The NumPy oracle used above agrees with the torch autograd reference (small inputs,
    both branches, duplicate ids, K > 1)."""
    rng = np.random.default_rng(7)
    for mamba2, K in ((False, 1), (True, 1), (True, 3)):
        n_seqs, n_t, n_head, head_dim, d_state, n_group = 3, 5, 4, 2, 3, 2
        s = rng.standard_normal((4, n_head, head_dim, d_state))
        x = rng.standard_normal((n_seqs, n_t, n_head, head_dim))
        dt = rng.choice(DT_THRESHOLD, size=(n_seqs, n_t, n_head)) * rng.choice([1.0, 0.05], size=(n_seqs, n_t, n_head))
        A = -rng.uniform(0.1, 2, size=(n_head, 1) if mamba2 else (n_head, d_state))
        B = rng.standard_normal((n_seqs, n_t, n_group, d_state))
        C = rng.standard_normal((n_seqs, n_t, n_group, d_state))
        ids = np.array([2, 0, 2])
        out = np_ssm_scan(s, x, dt, A, B, C, ids, K=K)
        np.testing.assert_allclose(out, ref_scan_np(s, x, dt, A, B, C, ids, K=K), rtol=1e-12, atol=1e-12)
        grad = rng.standard_normal(out.shape)
        mine = np_ssm_scan_back(s, x, dt, A, B, C, ids, grad, K=K)
        ref = ref_scan_grads(s, x, dt, A, B, C, ids, grad, K=K)
        for k in ("s", "x", "dt", "A", "B", "C"):
            np.testing.assert_allclose(mine[k], ref[k], rtol=1e-10, atol=1e-10, err_msg=k)
