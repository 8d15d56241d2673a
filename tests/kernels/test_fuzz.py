"""Property-based fuzzing of ssm_conv / ssm_scan forward and backward against the torch float64 oracle.

Every form of the scan is drawn: Mamba-1 (the recurrence, and the forward's decode path at
n_t <= 4), and Mamba-2 with both kernels forced to the recurrence, or to the chunked forms (the
test asserts, through _ssmgrad._scan_forms, that the calls take the forced form), so the odd
layouts below reach the chunked forward and backward too.

Each example draws (with hypothesis) the sizes — 0 and 1 are allowed on every axis; one example
in four is "medium" sized (n_t up to 70 / 150, d_state up to 40, head_dim up to 24, d_inner up to
70) so the SIMD, tile and checkpoint-segment paths run, not only scalar tails — the branch
(Mamba-1 A (n_head, d_state) or Mamba-2 A (n_head, 1), with K rollback slots 1..4 on Mamba-2),
n_group among the divisors of n_head, the state table size (extra rows, duplicated ids, ids of any
integer dtype or a plain list), the dtype (float32 / float64) and a memory layout per argument:
C order, Fortran order, a strided view into a larger NaN-filled buffer (so an out-of-view read
poisons the result), negative strides, a zero-stride broadcast, the llama.cpp xBC / x_db layout
(x, B, C as views of one projection), ggml's "xbc_overlap" layout (B, x, C overlapping views of
one array) and B is C. The upstream gradient is random and may itself be a strided view.

Checks per example:
  * shapes/dtypes of every result;
  * forward and every gradient (d_s, d_x, d_dt, d_B, d_C, d_A; d_sx, d_c) against tests/reference.py
    (torch float64 autograd):  max |ssmgrad - ref| <= tol * max(1, max |ref|), per tensor, with
    tol per dtype and result from measured errors (TOL, below: each with what it was measured at);
    (the reference runs on the float64 values of the very inputs ssmgrad got, so only ssmgrad's
    arithmetic rounding is measured);
  * every input buffer (including the NaN padding around views) is unchanged afterwards.

Budget: the "ci" hypothesis profile (registered here) is derandomized, has no deadline and no
example database, so CI is reproducible. Example counts default to SCAN_EXAMPLES / CONV_EXAMPLES
below; SSMGRAD_FUZZ_EXAMPLES=N overrides all of them (the sanitizer pass shrinks them), and
SSMGRAD_HYPOTHESIS_PROFILE=dev switches to random (non-derandomized) exploration.
"""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings, strategies as st

import _ssmgrad
import ssmgrad
from reference import ref_conv_grads, ref_conv_np, ref_scan_grads, ref_scan_np

SCAN_EXAMPLES = 40       # per (branch and form, x/B/C layout): 12 x 40 = 480
CONV_EXAMPLES = 200
# Bounds on max |ssmgrad - oracle| / max(1, max |oracle|), per dtype and result. Measured (max over
# the "ci" profile's examples | over 150 random examples per branch and layout, "dev" profile):
#   float64: every result but d_A <= 2.7e-14 | 4.9e-14 (the chunked forms; the recurrence and the
#            conv <= 1.8e-15);  d_A 6.5e-13 | 6.6e-13 (chunked; recurrence 1.8e-14)
#   float32: every result but d_A and d_dt <= 2.1e-7 | 1.1e-6;  d_dt 1.0e-6 | 7.1e-6 (chunked;
#            recurrence 4.8e-7);  d_A, recurrence 1.6e-6 | 5.1e-6
#   float32 d_A of the chunked backward: 4.2e-5 | 1.7e-3. d_A sums sp * (reverse cumulative sum of
#            the decay-log gradients) over every token: terms cancel, and the chunked form's
#            within-chunk exp differences round more than the recurrence's products.
# Each bound is 3-20x the worse of the two measurements.
TOL = {np.float64: {"d_A": 1e-11, None: 1e-12},
       np.float32: {"d_A": 2e-5, "d_A chunked": 5e-3, "d_dt": 3e-5, None: 1e-5}}

settings.register_profile(
    "ci", derandomize=True, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
settings.register_profile(
    "dev", deadline=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture])
PROFILE = settings.get_profile(os.environ.get("SSMGRAD_HYPOTHESIS_PROFILE", "ci"))


def budget(default):
    env = os.environ.get("SSMGRAD_FUZZ_EXAMPLES")
    return max(1, int(env)) if env else default


# ---------------------------------------------------------------------------------------------
# layouts: each returns an array holding the given values (or, for "bcast", values derived from
# them) in a different memory layout.  The oracle is always evaluated on the returned arrays.

LAYOUTS = ("c", "f", "view", "neg", "bcast")


def relayout(arr, kind, rng):
    arr = np.asarray(arr)
    if kind == "c" or arr.ndim == 0:
        return np.ascontiguousarray(arr)
    if kind == "f":
        return np.asfortranarray(arr)
    if kind == "view":
        # embed in a larger NaN-filled buffer with a random offset and step per axis
        steps = rng.integers(1, 3, size=arr.ndim)
        offs = rng.integers(0, 2, size=arr.ndim)
        big_shape = tuple(int(o + st_ * n + 1) for o, st_, n in zip(offs, steps, arr.shape))
        # NaN around float views; -1 (out of range, or the max for unsigned) around integer ids
        fill = np.nan if arr.dtype.kind == "f" else np.array(-1).astype(arr.dtype)
        big = np.full(big_shape, fill, dtype=arr.dtype)
        if rng.integers(2):
            big = np.asfortranarray(big)
        sl = tuple(slice(int(o), int(o + st_ * n), int(st_)) for o, st_, n in zip(offs, steps, arr.shape))
        big[sl] = arr
        return big[sl]
    if kind == "neg":
        flip = tuple(slice(None, None, -1) if rng.integers(2) else slice(None) for _ in range(arr.ndim))
        flip = (slice(None, None, -1),) + flip[1:] if all(f == slice(None) for f in flip) else flip
        buf = np.ascontiguousarray(arr[flip])
        return buf[flip]
    if kind == "bcast":
        # zero stride on one axis: values become constant along it
        ax = int(rng.integers(arr.ndim))
        if arr.shape[ax] == 0:
            return np.ascontiguousarray(arr)
        one = np.ascontiguousarray(np.take(arr, [0], axis=ax))
        return np.broadcast_to(one, arr.shape)
    raise AssertionError(kind)


def root(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def snapshot(arrays):
    return [(root(a), root(a).copy()) for a in arrays if isinstance(a, np.ndarray)]


def assert_unchanged(snap):
    for buf, copy in snap:
        np.testing.assert_array_equal(buf, copy, err_msg="an input buffer was modified")


def check(name, got, ref, dtype, form=None):
    got = np.asarray(got)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.dtype == dtype, f"{name}: dtype {got.dtype} != {np.dtype(dtype)}"
    assert got.shape == ref.shape, f"{name}: shape {got.shape} != {ref.shape}"
    if ref.size == 0:
        return
    assert np.all(np.isfinite(ref)), f"{name}: oracle not finite (bad test case)"
    err = float(np.max(np.abs(got.astype(np.float64) - ref)))
    scale = max(1.0, float(np.max(np.abs(ref))))
    tols = TOL[dtype]
    tol = tols.get(f"{name} {form}", tols.get(name, tols[None])) * scale
    assert err <= tol, f"{name}: max abs err {err:.3e} > {tol:.3e} (scale {scale:.3e})"


# ---------------------------------------------------------------------------------------------
# SSM_SCAN

XLAYOUTS = ("independent", "packed", "overlap", "b_is_c")


@st.composite
def scan_cases(draw, mamba2, xlayout, form):
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    # one example in four is "medium": past the kernels' SIMD lane counts (8/16), register
    # tiles and several checkpoint segments (interval ~ sqrt(n_t)), so the vector paths, their
    # remainders and the segment boundaries run, not only the scalar tails; with the chunked form
    # forced, medium lengths reach 140 tokens (chunk boundaries at 64 and 128) and tiny ones go
    # past the forward's decode path (n_t <= 4)
    medium = draw(st.sampled_from([False, False, False, True]))
    n_seqs = draw(st.integers(0, 2 if medium else 3))
    if form == "chunked":
        n_t = draw(st.integers(0, 140 if medium else 9))
    else:
        n_t = draw(st.integers(0, 70 if medium else 6))
    n_head = draw(st.integers(0 if xlayout != "overlap" else 1, 6 if medium else 4))
    d_state = draw(st.integers(0, (20 if xlayout == "overlap" else 40) if medium else 5))
    if xlayout == "overlap":
        head_dim, n_group = d_state, n_head
    else:
        head_dim = draw(st.integers(0, 24 if medium else 3))
        divisors = [g for g in range(1, max(n_head, 1) + 1) if n_head % g == 0]
        n_group = draw(st.sampled_from(divisors))
    # the chunked forms cover K == 1 only (K > 1 would take the recurrence, which the other form's
    # examples run)
    K = draw(st.integers(1, 4)) if mamba2 and form != "chunked" else 1
    n_rs = draw(st.integers(1 if n_seqs else 0, n_seqs + 3))
    ids = draw(st.lists(st.integers(0, max(n_rs - 1, 0)), min_size=n_seqs, max_size=n_seqs))
    ids_kind = draw(st.sampled_from(["int32", "int64", "int16", "uint8", "list"]))
    layouts = draw(st.lists(st.sampled_from(LAYOUTS), min_size=8, max_size=8))
    seed = draw(st.integers(0, 2**32 - 1))
    return dict(medium=medium, dtype=dtype, mamba2=mamba2, xlayout=xlayout, n_seqs=n_seqs, n_t=n_t, n_head=n_head,
                d_state=d_state, head_dim=head_dim, n_group=n_group, K=K, n_rs=n_rs, ids=ids,
                ids_kind=ids_kind, layouts=layouts, seed=seed)


def build_scan(case):
    rng = np.random.default_rng(case["seed"])
    dtype = case["dtype"]
    n_seqs, n_t, n_head, head_dim = case["n_seqs"], case["n_t"], case["n_head"], case["head_dim"]
    d_state, n_group, n_rs = case["d_state"], case["n_group"], case["n_rs"]
    lay = case["layouts"]

    def normal(*shape):
        return rng.standard_normal(shape).astype(dtype)

    s = relayout(normal(n_rs, n_head, head_dim, d_state), lay[0], rng)
    dt = rng.uniform(-4, 4, size=(n_seqs, n_t, n_head))
    special = rng.random(dt.shape) < 0.15
    dt[special] = rng.choice([19.999, 20.0, 20.001, 30.0, -30.0], size=int(special.sum()))
    dt = relayout(dt.astype(dtype), lay[1], rng)
    A_shape = (n_head, 1) if case["mamba2"] else (n_head, d_state)
    # a little growth (A > 0) on tiny sequences only: over 70 tokens it would overflow float32
    A = relayout(rng.uniform(-2.0, 0.0 if case["medium"] else 0.3, size=A_shape).astype(dtype), lay[2], rng)

    x_shape = (n_seqs, n_t, n_head, head_dim)
    bc_shape = (n_seqs, n_t, n_group, d_state)
    if case["xlayout"] == "packed":
        # llama.cpp's xBC (Mamba-2) / x_db (Mamba-1): x, B, C are column ranges of one projection
        d_inner, G = n_head * head_dim, n_group * d_state
        pre, post = int(rng.integers(0, 3)), int(rng.integers(0, 3))
        order = rng.permutation(3)
        widths = [d_inner, G, G]
        starts, pos = [0, 0, 0], pre
        for i in order:
            starts[i] = pos
            pos += widths[i]
        proj = normal(n_seqs, n_t, pos + post)
        if rng.integers(2):                                  # free token/sequence strides
            big = np.full((n_seqs, n_t * 2, pos + post), np.nan, dtype=dtype)
            big[:, ::2] = proj
            proj = big[:, ::2]
        x = proj[..., starts[0]:starts[0] + d_inner].reshape(x_shape)
        B = proj[..., starts[1]:starts[1] + G].reshape(bc_shape)
        C = proj[..., starts[2]:starts[2] + G].reshape(bc_shape)
    elif case["xlayout"] == "overlap":
        # ggml's xbc_overlap: head_dim == d_state, n_group == n_head
        xbc = relayout(normal(n_seqs + 2, n_t, n_head, d_state), lay[3], rng)
        B, x, C = xbc[0:n_seqs], xbc[1:1 + n_seqs], xbc[2:2 + n_seqs]
    else:
        x = relayout(normal(*x_shape), lay[3], rng)
        B = relayout(normal(*bc_shape), lay[4], rng)
        C = B if case["xlayout"] == "b_is_c" else relayout(normal(*bc_shape), lay[5], rng)

    ids = np.asarray(case["ids"], dtype=np.int64)
    ids = list(case["ids"]) if case["ids_kind"] == "list" else relayout(ids.astype(case["ids_kind"]), lay[6], rng)
    return s, x, dt, A, B, C, ids


@pytest.fixture
def forced_form(request):
    """Forces both the forward's and the backward's form of the Mamba-2 scan to request.param
    (SSMGRAD_SCAN_FWD / SSMGRAD_SCAN_BACK), then puts back the modes that were set."""
    old = _ssmgrad._set_scan_fwd(request.param), _ssmgrad._set_scan_back(request.param)
    try:
        yield request.param
    finally:
        _ssmgrad._set_scan_fwd(old[0])
        _ssmgrad._set_scan_back(old[1])


# Mamba-1 has one form (the recurrence; the forward's decode path at n_t <= 4); each Mamba-2
# example runs with both scan kernels forced to one form, so every layout reaches the chunked
# forward and backward too (their automatic choice would take them only at head_dim, d_state >= 32)
BRANCHES = [(False, "recurrence"), (True, "recurrence"), (True, "chunked")]


@pytest.mark.parametrize("xlayout", XLAYOUTS)
@pytest.mark.parametrize("mamba2,forced_form", BRANCHES, ids=["mamba1", "mamba2-recurrence", "mamba2-chunked"],
                         indirect=["forced_form"])
@settings(PROFILE, max_examples=budget(SCAN_EXAMPLES))
@given(data=st.data())
def test_scan_matches_reference(mamba2, xlayout, forced_form, data):
    case = data.draw(scan_cases(mamba2, xlayout, forced_form), label="case")
    s, x, dt, A, B, C, ids = build_scan(case)
    dtype, K = case["dtype"], case["K"]
    event("medium" if case["medium"] else "tiny")
    rng = np.random.default_rng(case["seed"] + 1)
    snap = snapshot([s, x, dt, A, B, C, ids])

    # the forced form is the one the kernels take (else this example would test the other one)
    forms = _ssmgrad._scan_forms(s, x, dt, A, B, C, ids, K)
    event(f"forward {forms['fwd']}, backward {forms['back']}")
    if forced_form == "chunked" and case["n_t"] >= 1:
        assert forms["back"] == "chunked", forms
        if case["n_t"] > 4:                  # n_t <= 4 may take the forward's decode path
            assert forms["fwd"] == "chunked", forms
    else:
        assert forms == dict(forms, fwd="recurrence", back="recurrence"), forms

    out = ssmgrad.ssm_scan(s, x, dt, A, B, C, ids, K=K)
    ids64 = np.asarray(ids, dtype=np.int64)
    ref_out = ref_scan_np(s, x, dt, A, B, C, ids64, K=K)
    assert out.ndim == 1
    check("out", out, ref_out, dtype)
    n_y = x.size
    y, states = ssmgrad.split(out, x.shape, (K, x.shape[0]) + s.shape[1:])
    check("y", y, ref_out[:n_y].reshape(x.shape), dtype)

    grad = relayout(rng.standard_normal(out.shape).astype(dtype), case["layouts"][7], rng)
    snap += snapshot([grad])
    gin, d_A = ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, grad, K=K, return_dA=True)
    assert gin.ndim == 1 and gin.size == s.size + x.size + dt.size + B.size + C.size
    ref = ref_scan_grads(s, x, dt, A, B, C, ids64, np.asarray(grad), K=K)
    d_s, d_x, d_dt, d_B, d_C = ssmgrad.split(gin, s.shape, x.shape, dt.shape, B.shape, C.shape)
    for name, got in (("d_s", d_s), ("d_x", d_x), ("d_dt", d_dt), ("d_B", d_B), ("d_C", d_C), ("d_A", d_A)):
        check(name, got, ref[name[2:]], dtype, forms["back"])
    gin2 = ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, grad, K=K)
    np.testing.assert_array_equal(gin2, gin)  # return_dA does not change gin, deterministic
    assert_unchanged(snap)


# ---------------------------------------------------------------------------------------------
# SSM_CONV

@st.composite
def conv_cases(draw):
    medium = draw(st.sampled_from([False, False, False, True]))   # past lanes and time tiles (64)
    return dict(
        medium=medium, dtype=draw(st.sampled_from([np.float32, np.float64])),
        n_s=draw(st.integers(0, 3)), d_inner=draw(st.integers(0, 70 if medium else 5)),
        d_conv=draw(st.integers(1, 5)), n_t=draw(st.integers(0, 150 if medium else 7)),
        layouts=draw(st.lists(st.sampled_from(LAYOUTS), min_size=3, max_size=3)),
        seed=draw(st.integers(0, 2**32 - 1)))


@settings(PROFILE, max_examples=budget(CONV_EXAMPLES))
@given(conv_cases())
def test_conv_matches_reference(case):
    rng = np.random.default_rng(case["seed"])
    dtype, lay = case["dtype"], case["layouts"]
    event("medium" if case["medium"] else "tiny")
    n_s, d_inner, d_conv, n_t = case["n_s"], case["d_inner"], case["d_conv"], case["n_t"]
    sx = relayout(rng.standard_normal((n_s, d_inner, d_conv - 1 + n_t)).astype(dtype), lay[0], rng)
    c = relayout(rng.standard_normal((d_inner, d_conv)).astype(dtype), lay[1], rng)
    grad = relayout(rng.standard_normal((n_s, n_t, d_inner)).astype(dtype), lay[2], rng)
    snap = snapshot([sx, c, grad])

    y = ssmgrad.ssm_conv(sx, c)
    check("y", y, ref_conv_np(sx, c), dtype)
    ref = ref_conv_grads(sx, c, np.asarray(grad))
    check("d_sx", ssmgrad.ssm_conv_back(sx, c, grad), ref["sx"], dtype)
    check("d_c", ssmgrad.ssm_conv_back_weight(sx, c, grad), ref["c"], dtype)
    assert_unchanged(snap)


# ---------------------------------------------------------------------------------------------
# split

@settings(PROFILE, max_examples=budget(50))
@given(st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=3), min_size=0, max_size=4),
       st.integers(-2, 2), st.sampled_from([np.float32, np.float64]))
def test_split_views(shapes, extra, dtype):
    sizes = [int(np.prod(sh, dtype=np.int64)) for sh in shapes]
    total = sum(sizes) + extra
    if total < 0:
        total = sum(sizes) + 1
        extra = 1
    packed = np.arange(total, dtype=dtype)
    if extra != 0:
        try:
            ssmgrad.split(packed, *[tuple(sh) for sh in shapes])
        except ValueError as e:
            assert str(e)
        else:
            raise AssertionError(f"split accepted {total} elements for shapes {shapes}")
        return
    parts = ssmgrad.split(packed, *[tuple(sh) for sh in shapes])
    assert isinstance(parts, tuple) and len(parts) == len(shapes)
    off = 0
    for part, sh, n in zip(parts, shapes, sizes):
        assert part.shape == tuple(sh) and part.dtype == dtype
        assert part.flags.c_contiguous
        np.testing.assert_array_equal(part.reshape(-1), packed[off:off + n])
        if n:
            assert np.shares_memory(part, packed)
        off += n
