"""GATED_DELTA_NET's chunked form for the per-channel gate (KDA, csrc/gdn_kda_chunked_body.h) against the
float64 oracle.

Oracle: ``ref_gated_delta_net`` (tests/reference.py), the spec's token recurrence written in torch
(S <- diag(exp(g_t)) S with g_t of S channels), and torch.autograd on it; it shares no code with the
kernel, which never runs a token recurrence in this form (it solves each 64-token chunk as products of
the chunk's rows, the decays as exp of cumulative-gate differences). Every call here forces
``form="chunked"`` unless it checks the form choice itself.
"""
import ctypes

import numpy as np
import pytest

import _ssmgrad
import ssmgrad
from gdn_checks import (
    GdnParams, check_float32, check_form_choice, check_gdn, check_inputs_unchanged, check_K2_runs_recurrence,
    check_threads_bitwise, check_views_bitwise, gdn_clib, strided_views,
)
from reference import gdn_args, gdn_out_size, make_gdn_inputs

# float64 KDA chunked kernel vs the float64 torch recurrence: only rounding differs. Measured over CASES
# (both broadcasts): max abs error / max(1, max|ref|) 1.9e-15 on the output, 2.8e-15 on the gradients.
# The extreme gates are larger and still 17x below the tolerance: 5.8e-12 on the gradients with g = -inf
# (floored at -1e4: the chunk's cumulative gate reaches ~-1e5 in double, whose rounding, ~1e-11, enters the
# exponent of the differences; the oracle's exp(-inf) is exact), 5.8e-13 with g = -800 ("mixed").
# 1e-10 leaves room, and is far below any real error.
TOL = dict(atol=1e-10, rtol=1e-10)


def kda_inputs(rng, **kw):
    inp = make_gdn_inputs(rng, kda=True, **kw)
    assert inp["g"].shape[-1] == inp["v"].shape[-1]
    return inp


def assert_finite(out, got):
    assert np.all(np.isfinite(out)) and all(np.all(np.isfinite(g)) for g in got.values())


def check(inp, rng, head_bcast="tiled", grad=None, tol=TOL, form="chunked"):
    """The forward and every gradient region vs the torch reference and autograd (gdn_checks.check_gdn;
    without GRAD, a random one on the final-state region too: it seeds the reverse pass), all finite;
    returns (out, grads)."""
    out, got, _ = check_gdn(inp, rng, fwd_tol=tol, grad_tol=tol, head_bcast=head_bcast, grad=grad, form=form)
    assert_finite(out, got)
    return out, got


# name: (n_seqs, n_seqs_k, n_t, H_v, H_k, S); start states nonzero (make_gdn_inputs), K = 1
CASES = {
    "nt1": (2, 2, 1, 2, 1, 4),
    "nt5_S17": (1, 1, 5, 2, 2, 17),
    "nt63": (1, 1, 63, 2, 1, 4),
    "nt64": (2, 1, 64, 2, 2, 3),
    "nt65": (2, 2, 65, 2, 1, 5),
    "nt130_seq_bcast": (4, 2, 130, 2, 1, 3),
    "nt200": (1, 1, 200, 2, 2, 6),
    "nt200_S19": (1, 1, 200, 2, 1, 19),
    "nt200_S32": (1, 1, 200, 1, 1, 32),
}


@pytest.mark.parametrize("head_bcast", ["tiled", "interleaved"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_against_autograd(rng, case, head_bcast):
    n_seqs, n_seqs_k, n_t, H_v, H_k, S = CASES[case]
    inp = kda_inputs(rng, n_seqs=n_seqs, n_seqs_k=n_seqs_k, n_t=n_t, H_v=H_v, H_k=H_k, S=S)
    check(inp, rng, head_bcast=head_bcast)


@pytest.mark.parametrize("head_bcast", ["tiled", "interleaved"])
def test_shared_key_heads_differ_by_broadcast(rng, head_bcast):
    """H_v / H_k = 2 over two chunks: the two broadcasts read different key heads (so the oracle's check
    of each tells a wrong mapping), and a shared key head's gradients add up over its value heads."""
    inp = kda_inputs(rng, n_seqs=2, n_t=70, H_v=4, H_k=2, S=4)
    out, _ = check(inp, rng, head_bcast=head_bcast)
    other = ssmgrad.gated_delta_net(*gdn_args(inp), head_bcast="interleaved" if head_bcast == "tiled" else "tiled",
                                    form="chunked")
    assert np.max(np.abs(other - out)) > 1e-3


def test_final_state_gradient_only(rng):
    """A gradient on the final state alone (o's region zero) seeds the reverse pass through every chunk:
    d_q is exactly 0, the start state's gradient is not (mild decays and writes, so that it survives)."""
    inp = kda_inputs(rng, n_seqs=1, n_t=150, H_v=2, H_k=1, S=4)
    inp["g"] *= 0.01
    inp["beta"] *= 0.05
    grad = np.zeros(gdn_out_size(inp))
    grad[inp["v"].size:] = rng.standard_normal(inp["state"].size)
    _, got = check(inp, rng, grad=grad)
    assert np.max(np.abs(got["state"])) > 1e-3 and np.max(np.abs(got["q"])) == 0.0


def test_large_start_state(rng):
    """A start state far from zero: the chunk's Gam H0 terms dominate."""
    inp = kda_inputs(rng, n_seqs=1, n_t=90, H_v=2, H_k=1, S=6)
    inp["state"] *= 20
    check(inp, rng)


EXTREMES = ["g_very_negative", "g_minus_inf", "g_zero", "g_per_channel_split", "g_chunk_sum_very_negative",
            "beta_zero", "beta_one", "mixed"]


def extreme_inputs(rng, extreme, n_t=70, S=4):
    inp = kda_inputs(rng, n_seqs=2, n_t=n_t, H_v=2, H_k=1, S=S)
    g = inp["g"]
    if extreme == "g_very_negative":       # every decay underflows to 0 (exp of -1e3)
        g[...] = -1e3
    elif extreme == "g_minus_inf":         # -inf at some tokens / channels, two tokens in a row, a whole sequence
        g[:, 3::11, :, 0] = -np.inf
        g[:, 4::11] = -np.inf
        g[1, :, :, 1:] = -np.inf
    elif extreme == "g_zero":              # no decay: the state grows
        g[...] = 0.0
    elif extreme == "g_per_channel_split":  # one channel forgets at once, the others never
        g[...] = 0.0
        g[..., 0] = -800.0
    elif extreme == "g_chunk_sum_very_negative":   # -30 per token: exp(G_t) of a chunk's sum underflows
        g[...] = -30.0                             # (G reaches -1920) while the differences stay exact
        g[..., 1::2] = -0.01
    elif extreme == "beta_zero":
        inp["beta"][...] = 0.0
    elif extreme == "beta_one":
        inp["beta"][...] = 1.0
    else:
        g[:, ::2, :, ::2] = -800.0
        g[:, 1::3] = 0.0
        inp["beta"][:, ::2] = 0.0
        inp["beta"][:, 1::2] = 1.0
    return inp


@pytest.mark.parametrize("extreme", EXTREMES)
def test_extreme_gates(rng, extreme):
    """Extreme per-channel gates give finite results equal to the oracle's: the kernel takes exp only of
    differences G_t - G_s (s <= t) of the chunk's cumulative gates, channel by channel, and floors g at
    -1e4 (whose exp is 0 as exp(-inf) is), so -inf never meets -inf - -inf, and a very negative sum over a
    chunk never gives 0/0 or inf * 0."""
    check(extreme_inputs(rng, extreme), rng)


# float32 KDA chunked kernel vs the float64 reference on the same float32 inputs (q, k L2-normalized,
# g < 0, beta in (0, 1), as models feed them). Measured max abs error / max(1, max|ref|): output 1.4e-7
# (the recurrence form 8.9e-8 on the same case), gradients 5.0e-7 (d_g, S 128); with the extreme gates
# below at most 4.1e-7 on the output (g = 0: no decay, the state grows), 6.7e-7 on the gradients (d_g,
# -30 per token). The tolerances are the scalar chunked form's (tests/kernels/test_gdn_chunked.py): 2.4x
# the worst measured output error, 4.5x the worst gradient error.
F32_FWD_TOL = dict(atol=1e-6, rtol=1e-5)
F32_GRAD_TOL = dict(atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("n_t,S,H_v,H_k", [(64, 16, 2, 1), (200, 32, 2, 1), (130, 128, 2, 1)])
def test_float32(rng, n_t, S, H_v, H_k):
    inp = kda_inputs(rng, n_seqs=1, n_t=n_t, H_v=H_v, H_k=H_k, S=S)
    check_float32(inp, rng, fwd_tol=F32_FWD_TOL, grad_tol=F32_GRAD_TOL, form="chunked")


@pytest.mark.parametrize("extreme", EXTREMES)
def test_float32_extreme_gates(rng, extreme):
    """The extreme gates in float32 (n_t 130, S 32): finite, within the float32 tolerances."""
    inp = extreme_inputs(rng, extreme, n_t=130, S=32)
    assert_finite(*check_float32(inp, rng, fwd_tol=F32_FWD_TOL, grad_tol=F32_GRAD_TOL, form="chunked"))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_threads_bitwise(rng, restore_threads, force_threads, dtype):
    """1, 2 and 3 threads give the same bits, forward and backward (several key groups, value heads
    sharing a key head, a sequence broadcast, a partial last chunk)."""
    inp = kda_inputs(rng, n_seqs=4, n_seqs_k=2, n_t=100, H_v=4, H_k=2, S=20, dtype=dtype)
    grad = rng.standard_normal(gdn_out_size(inp)).astype(dtype)
    check_threads_bitwise(inp, grad, head_bcast="interleaved", form="chunked")


@pytest.mark.parametrize("simd", ["x86-64", "x86-64-v3", "auto"])
def test_simd_passes(rng, simd):
    """Every SIMD pass of the form (a cap: the machine may not run the higher ones)."""
    old = _ssmgrad._set_simd(simd)
    try:
        check(kda_inputs(rng, n_seqs=1, n_t=80, H_v=2, H_k=1, S=19), rng)
    finally:
        _ssmgrad._set_simd(old)


def test_strided_views(rng):
    """Views with any strides (a per-channel g with a channel stride among them) give the bits of their
    dense copies."""
    inp = kda_inputs(rng, n_seqs=2, n_t=70, H_v=2, H_k=1, S=4)
    grad = rng.standard_normal(gdn_out_size(inp))
    views = strided_views(inp)
    views["g"] = np.ascontiguousarray(inp["g"].transpose(3, 0, 2, 1)).transpose(1, 3, 2, 0)   # channels outermost
    assert not views["g"].flags.c_contiguous and np.array_equal(views["g"], inp["g"])
    check_views_bitwise(inp, views, grad, form="chunked")


def test_inputs_unchanged(rng):
    inp = kda_inputs(rng, n_seqs=2, n_t=66, H_v=2, H_k=1, S=4)
    check_inputs_unchanged(inp, rng.standard_normal(gdn_out_size(inp)), form="chunked")


KDA_MIN_T = 2048        # GDNK_MIN_T in csrc/gdn_kda_chunked.h: the AVX-512 pass
KDA_MIN_T_NARROW = 16   # GDNK_MIN_T_NARROW: the x86-64-v3 and baseline passes


def _auto_min_t(simd):
    """auto's threshold for the pass SIMD runs here (SIMD "auto": the best this CPU has; a build without the
    x86-64 passes, aarch64, has one pass and the level-4 rule whatever the cap)."""
    host = _ssmgrad.build_info()["simd_selected"].split(" ")[0]
    if not host.startswith("x86-64"):
        return KDA_MIN_T
    runs = host if simd == "auto" or host in ("x86-64", "x86-64-v3") and simd == "x86-64-v3" else simd
    return KDA_MIN_T if runs.startswith("x86-64-v4") else KDA_MIN_T_NARROW


@pytest.mark.parametrize("simd", ["auto", "x86-64-v3", "x86-64"])
def test_form_choice(rng, simd):
    """auto: the KDA chunked form's bits from the pass's threshold on, the recurrence's below; the two forms
    differ in rounding (so the comparison can tell them apart)."""
    old = _ssmgrad._set_simd(simd)
    try:
        check_form_choice(rng, lambda rng, n_t: kda_inputs(rng, n_seqs=1, n_t=n_t, H_v=2, H_k=1, S=8),
                          _auto_min_t(simd))
    finally:
        _ssmgrad._set_simd(old)


def test_K2_falls_back_to_recurrence(rng):
    """K > 1 snapshots run the recurrence even with form="chunked" (its bits), and stay right."""
    check_K2_runs_recurrence(kda_inputs(rng, n_seqs=1, n_t=70, H_v=2, H_k=1, S=4), rng, TOL)


def test_c_work_sizes_and_form():
    """The C API's form query for KDA, and the backward's extra memory at n_t 2048, H_v 32, S 128 within
    64 MB per thread (chunk-boundary states and per-chunk rows only)."""
    lib = gdn_clib()
    p = GdnParams(n_seqs=1, n_seqs_k=1, n_t=2048, H_v=32, H_k=16, S=128, K=1, g_per_channel=1)
    assert lib.gdn_form(ctypes.byref(p)) == 2                   # auto: chunked
    back = lib.gdn_back_work_size(ctypes.byref(p), 4, 1)
    assert 0 < back <= 64 << 20, back
    p.form = 1
    assert lib.gdn_form(ctypes.byref(p)) == 1
    p.form, p.n_t = 0, _auto_min_t("auto") - 1
    assert lib.gdn_form(ctypes.byref(p)) == 1                   # auto, short: the recurrence
    if _ssmgrad.build_info()["simd_selected"].startswith("x86-64"):
        p.simd, p.n_t = 2, KDA_MIN_T_NARROW                     # SSM_SIMD_X86_64_V3: chunked from 16 tokens
        assert lib.gdn_form(ctypes.byref(p)) == 2
        p.n_t = KDA_MIN_T_NARROW - 1
        assert lib.gdn_form(ctypes.byref(p)) == 1
        p.simd, p.n_t = 0, _auto_min_t("auto") - 1
    p.form = 2
    assert lib.gdn_form(ctypes.byref(p)) == 2                   # forced
    p.K = 2
    assert lib.gdn_form(ctypes.byref(p)) == 1                   # K > 1: the recurrence
