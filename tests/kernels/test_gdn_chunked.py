"""GATED_DELTA_NET's chunked form (csrc/gdn_chunked_body.h, gdn_back_chunked_body.h) against the float64 oracle.

Oracle: ``ref_gated_delta_net`` (tests/reference.py), the spec's token recurrence written in torch, and
torch.autograd on it; it shares no code with the kernel (which never runs a token recurrence in this
form: it solves each 64-token chunk as matrix products). Every call here forces ``form="chunked"``
unless it checks the form choice itself. The chunked form takes the scalar gate with K == 1 (the
per-channel gate, KDA, has its own chunked form: tests/kernels/test_gdn_kda_chunked.py); K > 1 runs the
recurrence whatever the form asked (checked below by its bits).
"""
import ctypes

import numpy as np
import pytest

import _ssmgrad
import ssmgrad
from gdn_checks import (
    GdnParams, check_float32, check_form_choice, check_gdn, check_inputs_unchanged, check_K2_runs_recurrence,
    check_threads_bitwise, check_views_bitwise, gdn_clib, set_extreme_gates, strided_views,
)
from reference import GDN_NAMES, gdn_args, gdn_out_size, make_gdn_inputs

# float64 chunked kernel vs the float64 torch recurrence: only rounding differs. Measured over CASES
# (both broadcasts, and n_t 1000): max abs error / max(1, max|ref|) 1.3e-15 on the output, 3.8e-15 on
# the gradients (d_g, a sum over a chunk's tokens, the largest). 1e-10 leaves room, and is far below
# any real error.
TOL = dict(atol=1e-10, rtol=1e-10)


def check(inp, rng, head_bcast="tiled", grad=None, tol=TOL, form="chunked"):
    """The chunked forward and every gradient region vs the torch reference and autograd; returns
    (out, gradients, the worst relative errors)."""
    return check_gdn(inp, rng, fwd_tol=tol, grad_tol=tol, head_bcast=head_bcast, grad=grad, form=form)


# name: (n_seqs, n_seqs_k, n_t, H_v, H_k, S)
CASES = {
    "nt1": (2, 2, 1, 2, 1, 4),
    "nt5_S17": (1, 1, 5, 2, 2, 17),
    "nt63": (1, 1, 63, 2, 1, 4),
    "nt64": (2, 1, 64, 2, 2, 3),
    "nt65": (2, 2, 65, 4, 2, 5),
    "nt130_seq_bcast": (4, 2, 130, 4, 1, 3),
    "nt200_S19": (1, 1, 200, 2, 1, 19),
    "nt200_S32": (1, 1, 200, 1, 1, 32),
}


@pytest.mark.parametrize("head_bcast", ["tiled", "interleaved"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_against_autograd(rng, case, head_bcast):
    n_seqs, n_seqs_k, n_t, H_v, H_k, S = CASES[case]
    inp = make_gdn_inputs(rng, n_seqs=n_seqs, n_seqs_k=n_seqs_k, n_t=n_t, H_v=H_v, H_k=H_k, S=S)
    check(inp, rng, head_bcast=head_bcast)


@pytest.mark.parametrize("head_bcast", ["tiled", "interleaved"])
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_head_ratios(rng, ratio, head_bcast):
    """H_v / H_k of 1, 2, 4 over two chunks: a shared key head's gradients add up over its value
    heads, and the two broadcasts read different key heads."""
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=70, H_v=4, H_k=4 // ratio, S=4)
    out, _, _ = check(inp, rng, head_bcast=head_bcast)
    if ratio > 1 and ratio < 4:
        other = ssmgrad.gated_delta_net(*gdn_args(inp), head_bcast="interleaved" if head_bcast == "tiled" else "tiled",
                                        form="chunked")
        assert np.max(np.abs(other - out)) > 1e-3


def test_final_state_gradient_only(rng):
    """A gradient on the final state alone (o's region zero) seeds the reverse pass through every chunk:
    d_q is exactly 0, the start state's gradient is not (mild decays and writes, so that it survives 150
    tokens of S 4: each write with k of norm 1 contracts the state by 1 - beta along k)."""
    inp = make_gdn_inputs(rng, n_seqs=1, n_t=150, H_v=2, H_k=1, S=4)
    inp["g"] *= 0.01
    inp["beta"] *= 0.05
    grad = np.zeros(gdn_out_size(inp))
    grad[inp["v"].size:] = rng.standard_normal(inp["state"].size)
    _, got, _ = check(inp, rng, grad=grad)
    assert np.max(np.abs(got["state"])) > 1e-3 and np.max(np.abs(got["q"])) == 0.0


def test_output_gradient_only_zero_start_state(rng):
    """A zero start state (a first prefill) and a gradient on o alone."""
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=100, H_v=2, H_k=2, S=5)
    inp["state"][...] = 0
    grad = np.zeros(gdn_out_size(inp))
    grad[:inp["v"].size] = rng.standard_normal(inp["v"].size)
    check(inp, rng, grad=grad)


def test_large_start_state(rng):
    """A start state far from zero: the chunk's gamma H0 terms dominate."""
    inp = make_gdn_inputs(rng, n_seqs=1, n_t=90, H_v=2, H_k=1, S=6)
    inp["state"] *= 20
    check(inp, rng)


def test_long_sequence(rng):
    """n_t = 1000: 16 chunks, the last one partial (40 tokens)."""
    inp = make_gdn_inputs(rng, n_seqs=1, n_t=1000, H_v=2, H_k=1, S=3)
    check(inp, rng)


@pytest.mark.parametrize("extreme", ["g_very_negative", "g_minus_inf", "g_zero", "beta_zero", "beta_one", "mixed"])
def test_extreme_gates(rng, extreme):
    """g very negative (every decay underflows to 0: the state is forgotten at each token; the kernel only
    ever takes exp of differences of cumulative sums, so this is 0, not 0/0), g = -inf at some tokens,
    two in a row and a whole chunk's worth (the kernel floors g at -1e4, whose exp is 0 as exp(-inf) is,
    so the cumulative sums' differences never meet -inf - -inf), g = 0 (no decay), beta 0
    (no write), beta 1 (a full write), and a mix inside one chunk."""
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=70, H_v=2, H_k=1, S=4)
    set_extreme_gates(inp, extreme)
    check(inp, rng)


# float32 chunked kernel vs the float64 reference on the same float32 inputs (q, k L2-normalized, g < 0,
# beta in (0, 1), as models feed them). Measured max abs error / max(1, max|ref|) over these cases:
# output 6.1e-8, gradients 3.8e-7 (d_beta; d_k 3.4e-7), against 1.3e-7 / 3.0e-7 for the recurrence form
# on the same cases. Tolerances: the recurrence tests' (tests/kernels/test_gdn.py), 16x and 8x the measured.
F32_FWD_TOL = dict(atol=1e-6, rtol=1e-5)
F32_GRAD_TOL = dict(atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("n_t,S,H_v,H_k", [(64, 16, 2, 1), (200, 32, 2, 1), (130, 128, 2, 1)])
def test_float32(rng, n_t, S, H_v, H_k):
    inp = make_gdn_inputs(rng, n_seqs=1, n_t=n_t, H_v=H_v, H_k=H_k, S=S)
    check_float32(inp, rng, fwd_tol=F32_FWD_TOL, grad_tol=F32_GRAD_TOL, form="chunked")


@pytest.mark.parametrize("extreme", ["g_very_negative", "g_zero", "beta_zero", "beta_one"])
def test_float32_extreme_gates(rng, extreme):
    """The extreme gates in float32 (n_t 130, S 32): finite, within the float32 tolerances. Measured: at
    most 3.6e-7 on the output (g = 0: no decay, the state grows), 6.5e-7 on the gradients (beta = 1)."""
    inp = make_gdn_inputs(rng, n_seqs=1, n_t=130, H_v=2, H_k=1, S=32)
    set_extreme_gates(inp, extreme)
    check_float32(inp, rng, fwd_tol=F32_FWD_TOL, grad_tol=F32_GRAD_TOL, form="chunked")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_threads_bitwise(rng, restore_threads, force_threads, dtype):
    """1, 2 and 3 threads give the same bits, forward and backward (several key groups, value heads
    sharing a key head, a sequence broadcast)."""
    inp = make_gdn_inputs(rng, n_seqs=4, n_seqs_k=2, n_t=100, H_v=4, H_k=2, S=20, dtype=dtype)
    grad = rng.standard_normal(gdn_out_size(inp)).astype(dtype)
    check_threads_bitwise(inp, grad, head_bcast="interleaved", form="chunked")


@pytest.mark.parametrize("simd", ["x86-64", "x86-64-v3", "auto"])
def test_simd_passes(rng, simd):
    """Every SIMD pass of the chunked form (a cap: the machine may not run the higher ones)."""
    old = _ssmgrad._set_simd(simd)
    try:
        inp = make_gdn_inputs(rng, n_seqs=1, n_t=80, H_v=2, H_k=1, S=19)
        check(inp, rng)
    finally:
        _ssmgrad._set_simd(old)


def test_strided_views(rng):
    """Views with any strides give the bits of their dense copies."""
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=70, H_v=2, H_k=1, S=4)
    check_views_bitwise(inp, strided_views(inp), rng.standard_normal(gdn_out_size(inp)), form="chunked")


def test_v_layouts_same_bits(rng):
    """With S a multiple of 16 the forward reads contiguous v rows where they are and stores o straight
    into the result; v with a last-dimension stride goes through a copy (and o through a buffer): the
    same bits either way, forward and backward, and with the tokens' stride negative."""
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=70, H_v=2, H_k=1, S=16)
    grad = rng.standard_normal(gdn_out_size(inp))
    kw = dict(form="chunked")
    dense = (ssmgrad.gated_delta_net(*gdn_args(inp), **kw), ssmgrad.gated_delta_net_back(*gdn_args(inp), grad, **kw))
    for v in (np.repeat(inp["v"], 2, axis=3)[..., ::2], np.ascontiguousarray(inp["v"][:, ::-1])[:, ::-1]):
        assert np.array_equal(v, inp["v"])
        args = tuple(v if n == "v" else inp[n] for n in GDN_NAMES)
        assert np.array_equal(ssmgrad.gated_delta_net(*args, **kw), dense[0])
        assert np.array_equal(ssmgrad.gated_delta_net_back(*args, grad, **kw), dense[1])


def test_inputs_unchanged(rng):
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=66, H_v=2, H_k=1, S=4)
    check_inputs_unchanged(inp, rng.standard_normal(gdn_out_size(inp)), form="chunked")


def test_form_choice(rng):
    """auto: the chunked form's bits from 32 tokens on (scalar gate, K 1), the recurrence's below; the
    two forms differ in rounding (so the comparison can tell them apart)."""
    check_form_choice(rng, lambda rng, n_t: make_gdn_inputs(rng, n_seqs=1, n_t=n_t, H_v=2, H_k=1, S=8), 32)


def test_K2_falls_back_to_recurrence(rng):
    """K > 1 snapshots run the recurrence even with form="chunked" (its bits), and stay right against the
    oracle."""
    check_K2_runs_recurrence(make_gdn_inputs(rng, n_seqs=1, n_t=70, H_v=2, H_k=1, S=4), rng, TOL)


def test_bad_form(rng):
    inp = make_gdn_inputs(rng, n_seqs=1, n_t=3, H_v=1, H_k=1, S=2)
    with pytest.raises(ValueError, match="form"):
        ssmgrad.gated_delta_net(*gdn_args(inp), form="blocked")
    with pytest.raises(ValueError, match="form"):
        ssmgrad.gated_delta_net_back(*gdn_args(inp), np.zeros(gdn_out_size(inp)), form=None)


def test_c_work_sizes_and_form():
    """The C API's form query and work sizes: the backward's extra memory at n_t 2048, H_v 32, S 128
    (Qwen3-Next's layer) stays within 64 MB per thread in the chunked form (chunk-boundary states only)."""
    lib = gdn_clib()
    p = GdnParams(n_seqs=1, n_seqs_k=1, n_t=2048, H_v=32, H_k=16, S=128, K=1)
    assert lib.gdn_form(ctypes.byref(p)) == 2                   # auto: chunked
    back = lib.gdn_back_work_size(ctypes.byref(p), 4, 1)
    assert 0 < back <= 64 << 20, back
    p.form = 1
    assert lib.gdn_form(ctypes.byref(p)) == 1
    p.form, p.n_t = 0, 31
    assert lib.gdn_form(ctypes.byref(p)) == 1                   # auto, short: the recurrence
    p.n_t = 32
    assert lib.gdn_form(ctypes.byref(p)) == 2
    p.form, p.n_t, p.K = 2, 2048, 2
    assert lib.gdn_form(ctypes.byref(p)) == 1                   # K > 1: the recurrence


@pytest.mark.parametrize("region", ["out", "d_g", "d_state"])
def test_check_can_fail(rng, monkeypatch, region):
    """check() raises when one value of the chunked form's result is off by 1e-8 (100x its tolerance)."""
    inp = make_gdn_inputs(rng, n_seqs=1, n_t=70, H_v=2, H_k=1, S=4)
    name = "gated_delta_net" if region == "out" else "gated_delta_net_back"
    real = getattr(ssmgrad, name)
    sizes = [inp[n].size for n in GDN_NAMES]
    at = {"out": 5, "d_g": sum(sizes[:3]) + 7, "d_state": sum(sizes) - 1}[region]

    def fake(*args, **kw):
        res = real(*args, **kw).copy()
        res[at] += 1e-8
        return res

    monkeypatch.setattr(ssmgrad, name, fake)
    with pytest.raises(AssertionError):
        check(inp, rng)
