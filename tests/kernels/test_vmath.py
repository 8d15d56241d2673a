"""The kernels' own exp and softplus (vectorizable polynomials, csrc/ssm_common.h) against libm.

Stated accuracy: float32 exp within 2 ulp and float32 softplus within 4 ulp of the correctly
rounded value, float64 exp within 2 ulp of libm's exp, where the result is a normal number; the
edges (underflow to 0, overflow to inf, NaN) exactly as documented.
"""
import math

import numpy as np
import pytest

import _ssmgrad


def ulp_err(got, want):
    """|got - want| in units of the last place of want (same dtype)."""
    want = np.asarray(want)
    spacing = np.spacing(np.abs(want).astype(want.dtype))
    return np.abs(got.astype(np.float64) - want.astype(np.float64)) / spacing.astype(np.float64)


def test_expf_within_2ulp():
    x = np.linspace(-87.3, 88.7, 400001, dtype=np.float32)
    x = np.concatenate([x, np.float32(np.random.default_rng(0).uniform(-87.3, 88.7, 200000))])
    want = np.exp(x.astype(np.float64)).astype(np.float32)      # correctly rounded (to within 1/2^29)
    err = ulp_err(_ssmgrad._vmath("exp", x), want)
    assert err.max() <= 2.0, f"max {err.max():.2f} ulp at x = {x[err.argmax()]}"


def test_exp_f64_within_2ulp_of_libm():
    rng = np.random.default_rng(1)
    x = np.concatenate([np.linspace(-708, 709, 100001), rng.uniform(-50, 50, 100000), rng.uniform(-1, 1, 50000)])
    want = np.array([math.exp(v) for v in x])                   # glibc's exp
    err = ulp_err(_ssmgrad._vmath("exp", x), want)
    assert err.max() <= 2.0, f"max {err.max():.2f} ulp at x = {x[err.argmax()]}"


@pytest.mark.parametrize("dtype, lim, wide", [(np.float32, 86.5, 110.0), (np.float64, 707.0, 760.0)])
def test_exp_fast_equals_exp_where_it_applies(dtype, lim, wide):
    """The Mamba-1 step's cheap exp (2^k put straight into the exponent) must give exp's bits
    wherever the kernels use it. _vmath('exp_fast') applies it exactly where the kernels may (the
    same SSM_EXP*_FAST_MAX constant) and gives NaN elsewhere, so probing past the ends finds that
    range: it must be one interval, contain [-lim, lim] and be bit-equal to exp on all of it."""
    rng = np.random.default_rng(3)
    x = np.concatenate([np.linspace(-wide, wide, 800001), rng.uniform(-wide, wide, 200000),
                        rng.uniform(-1, 1, 100000), [-lim, lim, 0.0, -0.0]]).astype(dtype)
    x = np.sort(x)
    fast = _ssmgrad._vmath("exp_fast", x)
    used = ~np.isnan(fast)
    idx = np.flatnonzero(used)
    assert idx.size and (np.diff(idx) == 1).all(), "exp_fast's range is not one interval"
    assert x[idx[0]] <= -dtype(lim) and x[idx[-1]] >= dtype(lim)
    x, fast = x[used], fast[used]
    ref = _ssmgrad._vmath("exp", x)
    itype = np.uint32 if dtype == np.float32 else np.uint64
    bad = np.flatnonzero(fast.view(itype) != ref.view(itype))
    assert bad.size == 0, f"{bad.size} differ, first at x = {x[bad[0]]!r}: {fast[bad[0]]!r} vs {ref[bad[0]]!r}"
    assert np.isfinite(fast).all() and (fast > 0).all()


@pytest.mark.parametrize("dtype, lo, hi", [(np.float32, -103.98, 88.72), (np.float64, -745.14, 709.79)])
def test_exp_edges(dtype, lo, hi):
    x = np.array([-np.inf, lo - 1, -1e30, hi + 1, 1e30, np.inf, np.nan, 0.0], dtype=dtype)
    got = _ssmgrad._vmath("exp", x)
    assert list(got[:3]) == [0, 0, 0]
    assert np.isposinf(got[3:6]).all()
    assert np.isnan(got[6])
    assert got[7] == 1.0


def test_softplus_f32_within_4ulp():
    rng = np.random.default_rng(2)
    x = np.concatenate([np.linspace(-80, 25, 200001), rng.uniform(-30, 30, 100000),
                        [19.999, 20.0, 20.001, 30.0, -30.0]]).astype(np.float32)
    xd = x.astype(np.float64)
    want = np.where(xd <= 20, np.log1p(np.exp(np.minimum(xd, 20))), xd).astype(np.float32)
    got = _ssmgrad._vmath("softplus", x)
    err = ulp_err(got, want)
    assert err.max() <= 4.0, f"max {err.max():.2f} ulp at x = {x[err.argmax()]}"
    assert got[-3] == np.float32(20.001) and got[-2] == np.float32(30.0)     # above 20: v itself


def test_softplus_f64_threshold():
    x = np.array([19.999, 20.0, 20.001, 30.0, -30.0, np.nan])
    got = _ssmgrad._vmath("softplus", x)
    want = [math.log1p(math.exp(19.999)), math.log1p(math.exp(20.0)), 20.001, 30.0, math.log1p(math.exp(-30.0))]
    np.testing.assert_allclose(got[:5], want, rtol=1e-15, atol=0)
    assert np.isnan(got[5])


def test_dsoftplus_f32_within_4ulp():
    """The backward's d softplus / d dt (the sigmoid below ggml's threshold, 1 above) against
    float64, correctly rounded to float32."""
    rng = np.random.default_rng(4)
    x = np.concatenate([np.linspace(-80, 25, 200001), rng.uniform(-30, 30, 100000),
                        [19.999, 20.0, 20.001, 30.0, 1e30]]).astype(np.float32)
    xd = x.astype(np.float64)
    want = np.where(xd <= 20, 1.0 / (1.0 + np.exp(-np.minimum(xd, 20))), 1.0).astype(np.float32)
    err = ulp_err(_ssmgrad._vmath("dsoftplus", x), want)
    assert err.max() <= 4.0, f"max {err.max():.2f} ulp at x = {x[err.argmax()]}"


@pytest.mark.parametrize("name", ["softplus", "dsoftplus"])
def test_softplus_in_equals_softplus_where_it_applies(name):
    """softplus and its derivative with the cheap exp (csrc/ssm_common.h, *_inrange_f32: the
    token gathers and the backward's d_dt take them for a row whose every dt is >= -86.5) must give
    the full versions' bits there: the range must be one interval holding [-86.5, inf) and the
    bits equal on all of it, NaN and the values above ggml's threshold (where the cheap exp's
    argument leaves its range) included."""
    rng = np.random.default_rng(5)
    x = np.concatenate([np.linspace(-110, 110, 800001), rng.uniform(-110, 110, 200000),
                        rng.uniform(-1, 1, 100000), [-86.5, 0.0, -0.0, 19.999, 20.0, 20.001, 1e30, 3e38, np.inf]])
    x = np.sort(x.astype(np.float32))
    got = _ssmgrad._vmath(name + "_in", x)
    used = ~np.isnan(got)
    idx = np.flatnonzero(used)
    assert idx.size and (np.diff(idx) == 1).all(), "the range is not one interval"
    assert x[idx[0]] <= np.float32(-86.5) and idx[-1] == x.size - 1
    ref = _ssmgrad._vmath(name, x[used])
    bad = np.flatnonzero(got[used].view(np.uint32) != ref.view(np.uint32))
    assert bad.size == 0, f"{bad.size} differ, first at x = {x[used][bad[0]]!r}"
