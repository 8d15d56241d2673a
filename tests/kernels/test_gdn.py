"""GATED_DELTA_NET forward and backward against the float64 oracles.

Oracles: ``ref_gated_delta_net`` (tests/reference.py), the spec's recurrence written in torch on the
untransposed state with every (sequence, head) pair batched, and torch.autograd on it; central finite
differences of that reference. Every gradient region is compared on its own, with the max difference
in the assertion message.
"""

import ctypes

import numpy as np
import pytest

import ssmgrad
from gdn_checks import (
    GdnParams, check_float32, check_gdn, check_inputs_unchanged, check_threads_bitwise, gdn_clib, set_extreme_gates,
    split_gin, split_out, strided_views,
)
from reference import GDN_NAMES, assert_close, fd_vjp, gdn_args, gdn_out_size, make_gdn_inputs, ref_gdn_np

# float64 kernel vs float64 torch reference: only rounding differs. Measured over CASES and n_t 1000
# (K 2, both gates): max abs error / max(1, max|ref|) 5.1e-16 on the output, 5.5e-16 on the
# gradients. 1e-10 leaves room for longer sums and larger states, and is far below any real error.
FWD_TOL = dict(atol=1e-10, rtol=1e-10)
GRAD_TOL = dict(atol=1e-10, rtol=1e-10)


def check(inp, rng, K=1, head_bcast="tiled", grad=None, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL, form="auto"):
    """ssmgrad's forward and every gradient region vs the torch reference and autograd: (out, gradients)."""
    out, got, _ = check_gdn(inp, rng, fwd_tol=fwd_tol, grad_tol=grad_tol, K=K, head_bcast=head_bcast, grad=grad,
                            form=form)
    return out, got


# name: (n_seqs, n_seqs_k, n_t, H_v, H_k, S)
CASES = {
    "nt1": (2, 2, 1, 2, 1, 4),
    "nt1_decode_h4": (3, 3, 1, 4, 2, 5),
    "nt5": (2, 2, 5, 2, 2, 3),
    "nt63": (1, 1, 63, 2, 1, 4),
    "nt64": (2, 1, 64, 2, 2, 3),
    "nt65": (2, 2, 65, 4, 2, 3),
    "nt130_seq_bcast": (4, 2, 130, 4, 1, 3),
    "S17": (1, 1, 9, 2, 1, 17),       # a row longer than the 16 lanes, with a remainder
    "S32": (1, 1, 4, 2, 2, 32),
}


@pytest.mark.parametrize("head_bcast", ["tiled", "interleaved"])
@pytest.mark.parametrize("kda", [False, True], ids=["scalar_gate", "kda"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_against_autograd(rng, case, kda, head_bcast):
    n_seqs, n_seqs_k, n_t, H_v, H_k, S = CASES[case]
    inp = make_gdn_inputs(rng, n_seqs=n_seqs, n_seqs_k=n_seqs_k, n_t=n_t, H_v=H_v, H_k=H_k, S=S, kda=kda)
    check(inp, rng, head_bcast=head_bcast)


# The recurrence in 64-byte vectors (the AVX-512 pass, the default on such a CPU: float64 rows a
# multiple of 8 lanes, the backward from S 16; elsewhere these run the loops): form="recurrence"
# keeps the chunked form out at n_t >= 16. n_t 70 spans two checkpoint segments of the backward, K 3
# seeds the reverse with three slots' gradients, S 8 / 16 / 32 are 1 / 2 / 4 vectors a row.
@pytest.mark.parametrize("head_bcast", ["tiled", "interleaved"])
@pytest.mark.parametrize("kda", [False, True], ids=["scalar_gate", "kda"])
@pytest.mark.parametrize("S", [8, 16, 32])
def test_vector_recurrence(rng, S, kda, head_bcast):
    inp = make_gdn_inputs(rng, n_seqs=2, n_seqs_k=1, n_t=70, H_v=4, H_k=2, S=S, kda=kda)
    check(inp, rng, K=3, head_bcast=head_bcast, form="recurrence")


# One token (decode) in 64-byte vectors (the AVX-512 pass, the default on such a CPU; elsewhere the
# loops): each state row in one pass from the start state into out's slot 0. float64 S 8 / 16 / 32
# are 1 / 2 / 4 vectors a row. The start state dense, with its rows further apart than S (read in
# place), and with strided rows (copied first); K 2: slot 1 stays zero.
@pytest.mark.parametrize("state_layout", ["dense", "row_gap", "strided"])
@pytest.mark.parametrize("kda", [False, True], ids=["scalar_gate", "kda"])
@pytest.mark.parametrize("S", [8, 16, 32])
def test_vector_decode(rng, S, kda, state_layout):
    inp = make_gdn_inputs(rng, n_seqs=3, n_seqs_k=1, n_t=1, H_v=4, H_k=2, S=S, kda=kda)
    state = inp["state"]
    if state_layout == "row_gap":
        wide = rng.standard_normal(state.shape[:3] + (S + 8,))
        wide[..., :S] = state
        inp["state"] = wide[..., :S]
    elif state_layout == "strided":
        inp["state"] = np.repeat(state, 2, axis=3)[..., ::2]
    assert np.array_equal(inp["state"], state)
    out, _ = check(inp, rng, K=2, head_bcast="interleaved", form="recurrence")
    assert np.all(split_out(out, inp, 2)[1][1] == 0)


@pytest.mark.parametrize("head_bcast", ["tiled", "interleaved"])
@pytest.mark.parametrize("ratio", [1, 2, 4])
def test_head_ratios(rng, ratio, head_bcast):
    """H_v / H_k of 1, 2, 4: the two broadcasts read different key heads, and a shared key head's
    gradients add up over its value heads."""
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=7, H_v=8, H_k=8 // ratio, S=3, kda=True)
    out, _ = check(inp, rng, head_bcast=head_bcast)
    if ratio > 1:   # the two mappings differ (8 value heads over 4 key heads: 01230123 vs 00112233)
        other = ssmgrad.gated_delta_net(*gdn_args(inp), head_bcast="interleaved" if head_bcast == "tiled" else "tiled")
        assert np.max(np.abs(other - out)) > 1e-3


@pytest.mark.parametrize("n_t,K", [(5, 1), (5, 3), (5, 5), (5, 6), (3, 8), (70, 4), (1, 2)])
def test_snapshots(rng, n_t, K):
    """K slots: slot s is the state after token n_t - 1 - s; each slot's gradient joins the reverse
    recurrence there; slots s >= n_t are 0 and their gradient is ignored."""
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=n_t, H_v=2, H_k=1, S=3)
    out, _ = check(inp, rng, K=K)
    _, slots = split_out(out, inp, K)
    assert np.all(slots[n_t:] == 0)


def test_state_gradient_only(rng):
    """A gradient on the final state alone (o's region zero) reaches every input through the
    reverse recurrence; the start state's gradient is nonzero."""
    inp = make_gdn_inputs(rng, n_seqs=1, n_t=9, H_v=2, H_k=1, S=4)
    grad = np.zeros(gdn_out_size(inp))
    grad[inp["v"].size:] = rng.standard_normal(inp["state"].size)
    _, got = check(inp, rng, grad=grad)
    assert np.max(np.abs(got["state"])) > 1e-3 and np.max(np.abs(got["q"])) == 0.0


def test_output_gradient_only_zero_start_state(rng):
    """A zero start state (the first prefill) and a gradient on o alone."""
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=6, H_v=2, H_k=2, S=3, kda=True)
    inp["state"][...] = 0
    grad = np.zeros(gdn_out_size(inp))
    grad[:inp["v"].size] = rng.standard_normal(inp["v"].size)
    check(inp, rng, grad=grad)


@pytest.mark.parametrize("kda", [False, True], ids=["scalar_gate", "kda"])
def test_long_sequence(rng, kda):
    """n_t = 1000 (16 checkpoint segments, the last one partial) on a small state."""
    inp = make_gdn_inputs(rng, n_seqs=1, n_t=1000, H_v=2, H_k=1, S=3, kda=kda)
    check(inp, rng, K=2)


@pytest.mark.parametrize("kda", [False, True], ids=["scalar_gate", "kda"])
@pytest.mark.parametrize("extreme", ["g_very_negative", "g_zero", "beta_zero", "beta_one", "mixed"])
def test_extreme_gates(rng, extreme, kda):
    """g -> -inf (exp(g) underflows to 0: the state is forgotten), g = 0 (no decay), beta 0 (no
    write), beta 1 (a full write)."""
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=8, H_v=2, H_k=1, S=4, kda=kda)
    set_extreme_gates(inp, extreme)
    check(inp, rng)


@pytest.mark.parametrize("head_bcast", ["tiled", "interleaved"])
def test_finite_differences(rng, one_thread, head_bcast):
    """ssmgrad's gradients vs central differences of the float64 reference (no autograd)."""
    inp = make_gdn_inputs(rng, n_seqs=2, n_seqs_k=1, n_t=3, H_v=2, H_k=1, S=3, kda=True)
    K = 2
    grad = rng.standard_normal(gdn_out_size(inp, K))
    got = split_gin(ssmgrad.gated_delta_net_back(*gdn_args(inp), grad, K=K, head_bcast=head_bcast), inp)
    f = lambda *a: ref_gdn_np(*a, K=K, head_bcast=head_bcast)
    for i, n in enumerate(GDN_NAMES):
        fd = fd_vjp(f, gdn_args(inp), i, grad)
        # central differences, eps 1e-6: measured <= 1.2e-9 abs here
        assert_close(got[n], fd, atol=1e-7, rtol=1e-7, name=f"d_{n} vs finite differences")


def test_zero_tokens(rng):
    """n_t = 0: K == 1 passes the start state through (slot 0), as ggml does."""
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=0, H_v=2, H_k=1, S=3)
    check(inp, rng, K=1)
    out, _ = check(inp, rng, K=3)
    assert np.all(out == 0)


# float32 kernel vs the float64 reference on the same float32 inputs. Measured over these cases (n_t
# 64 and 130, S 16 and 32, both gates): max abs error / max(1, max|ref|) 6.9e-8 on the output, 3.5e-7
# on the gradients (d_g the largest). The tolerances leave ~10x. One token at S 128 (the decode path,
# five draws per gate): 1.0e-7 on the output, 1.0e-6 on the gradients (the scalar gate's d_g, one sum
# of S * S terms): 3x left there.
F32_FWD_TOL = dict(atol=1e-6, rtol=1e-5)
F32_GRAD_TOL = dict(atol=3e-6, rtol=1e-5)


@pytest.mark.parametrize("kda", [False, True], ids=["scalar_gate", "kda"])
@pytest.mark.parametrize("n_t,S", [(64, 16), (130, 32), (1, 128)])
def test_float32(rng, kda, n_t, S):
    inp = make_gdn_inputs(rng, n_seqs=1, n_t=n_t, H_v=2, H_k=1, S=S, kda=kda)
    check_float32(inp, rng, fwd_tol=F32_FWD_TOL, grad_tol=F32_GRAD_TOL, form="auto")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_threads_bitwise(rng, restore_threads, force_threads, dtype):
    """1, 2 and 3 threads give the same bits, forward and backward (several key groups sharing
    nothing, and value heads sharing a key head)."""
    inp = make_gdn_inputs(rng, n_seqs=3, n_t=70, H_v=4, H_k=2, S=5, kda=True, dtype=dtype)
    grad = rng.standard_normal(gdn_out_size(inp, 2)).astype(dtype)
    check_threads_bitwise(inp, grad, K=2, head_bcast="interleaved")


@pytest.mark.parametrize("simd", ["x86-64", "x86-64-v3", "auto"])
def test_simd_passes(rng, simd):
    """Every SIMD pass (a cap: the machine may not run the higher ones) against the reference."""
    import _ssmgrad
    old = _ssmgrad._set_simd(simd)
    try:
        inp = make_gdn_inputs(rng, n_seqs=1, n_t=20, H_v=2, H_k=1, S=19, kda=True)
        check(inp, rng, K=2)
    finally:
        _ssmgrad._set_simd(old)


def test_strided_views(rng):
    """Views with any strides (transposed, sliced, negative, broadcast zero strides) give the bits
    of their dense copies."""
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=6, H_v=2, H_k=1, S=4, kda=True)
    grad = rng.standard_normal(gdn_out_size(inp))
    dense = (ssmgrad.gated_delta_net(*gdn_args(inp)), ssmgrad.gated_delta_net_back(*gdn_args(inp), grad))
    views = strided_views(inp)
    for n, a in views.items():
        assert np.array_equal(a, inp[n])
    assert not views["q"].flags.c_contiguous and views["k"].strides[3] == 16
    args = tuple(views[n] for n in GDN_NAMES)
    assert np.array_equal(ssmgrad.gated_delta_net(*args), dense[0])
    assert np.array_equal(ssmgrad.gated_delta_net_back(*args, np.repeat(grad, 2)[::2]), dense[1])


def test_inputs_unchanged(rng):
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=66, H_v=2, H_k=1, S=4, kda=True)
    check_inputs_unchanged(inp, rng.standard_normal(gdn_out_size(inp, 3)), K=3)


@pytest.mark.parametrize("n_seqs,n_seqs_k,n_t,H_v,H_k,S", [(0, 0, 3, 2, 1, 4), (0, 1, 3, 2, 1, 4), (2, 2, 3, 0, 0, 4),
                                                          (2, 1, 3, 2, 1, 0)])
def test_empty(rng, n_seqs, n_seqs_k, n_t, H_v, H_k, S):
    """Empty batches, heads or state: results of the right (empty or zero) size, against the reference."""
    inp = make_gdn_inputs(rng, n_seqs=n_seqs, n_seqs_k=n_seqs_k, n_t=n_t, H_v=H_v, H_k=H_k, S=S, l2norm=False)
    if n_seqs_k == 0 or H_k == 0 or n_seqs == 0:   # the reference's broadcast divides by these
        out = ssmgrad.gated_delta_net(*gdn_args(inp), K=2)
        gin = ssmgrad.gated_delta_net_back(*gdn_args(inp), np.ones(out.size), K=2)
        assert out.shape == (gdn_out_size(inp, 2),) and np.all(gin == 0)
        assert gin.shape == (sum(inp[n].size for n in GDN_NAMES),)
    else:
        check(inp, rng, K=2)


@pytest.mark.parametrize("simd", [0, 1, 2, 3])           # SSM_SIMD_AUTO, _X86_64, _X86_64_V3, _V4_NO_VEC64
@pytest.mark.parametrize("kda", [False, True])
@pytest.mark.parametrize("n_t", [1, 9])
def test_recurrence_work_size_bounds_its_scratch(rng, simd, kda, n_t):
    """The C forward of the recurrence with exactly gdn_fwd_work_size bytes of scratch (2 threads, each
    called in turn) writes nothing past it (a guard after it keeps its bytes) and gives the extension's
    output: the query stays an upper bound on every path (the per-channel gate's exp(g) rows are reserved
    only for the level-4 vector path; 9 tokens take it at S 32 where the CPU has AVX-512)."""
    import _ssmgrad
    inp = {k: np.ascontiguousarray(a, dtype=np.float32)
           for k, a in make_gdn_inputs(rng, n_seqs=1, n_t=n_t, H_v=4, H_k=2, S=32, kda=kda).items()}
    st = lambda a: (ctypes.c_int64 * 4)(*(s // 4 for s in a.strides))
    p = GdnParams(n_seqs=1, n_seqs_k=1, n_t=n_t, H_v=4, H_k=2, S=32, K=1, g_per_channel=int(kda), head_bcast=0,
                  q_st=st(inp["q"]), k_st=st(inp["k"]), v_st=st(inp["v"]), g_st=st(inp["g"]),
                  beta_st=st(inp["beta"]), state_st=st(inp["state"]), form=1, simd=simd)
    lib = gdn_clib()
    lib.gdn_fwd_f32.restype = None
    size = lib.gdn_fwd_work_size(ctypes.byref(p), 4, 2)
    guard = 4096
    work = np.full(size + guard, 0x5A, np.uint8)
    out = np.zeros(gdn_out_size(inp), np.float32)
    ptr = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    for ith in range(2):
        lib.gdn_fwd_f32(ctypes.byref(p), *(ptr(inp[k]) for k in GDN_NAMES), ptr(out), ptr(work), ith, 2)
    assert (work[size:] == 0x5A).all(), "the forward wrote past gdn_fwd_work_size"
    # the extension at the same pass as the C call (auto too: under an SSMGRAD_SIMD cap, as
    # test_generic_kernels.py reruns this file, the extension's own pass is the cap's)
    old = _ssmgrad._set_simd(("auto", "x86-64", "x86-64-v3", "v4-no-vec64")[simd])
    try:
        want = ssmgrad.gated_delta_net(*gdn_args(inp), form="recurrence")
    finally:
        _ssmgrad._set_simd(old)
    assert np.array_equal(out, want)
