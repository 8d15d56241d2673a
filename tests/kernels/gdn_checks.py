"""The checks tests/kernels/test_gdn.py (every form), test_gdn_chunked.py (the scalar gate's chunked form)
and test_gdn_kda_chunked.py (the per-channel gate's) share: GATED_DELTA_NET's forward and every gradient
region against the float64 torch reference and autograd (tests/reference.py), float32 against the same
reference, the extreme gates, bitwise equality across thread counts, views and forms, inputs left
unchanged, and the C API's params struct."""
import ctypes

import numpy as np

import _ssmgrad
import ssmgrad
from reference import GDN_NAMES, assert_close, gdn_args, gdn_out_size, ref_gdn_grads, ref_gdn_np, scaled_tol


def split_out(out, inp, K=1):
    return ssmgrad.split(out, inp["v"].shape, (K,) + inp["state"].shape)


def split_gin(gin, inp):
    return dict(zip(GDN_NAMES, ssmgrad.split(gin, *(inp[n].shape for n in GDN_NAMES))))


def rel_err(got, want):
    return float(np.max(np.abs(got - want)) / max(1.0, float(np.max(np.abs(want))))) if want.size else 0.0


def check_gdn(inp, rng, *, fwd_tol, grad_tol, K=1, head_bcast="tiled", grad=None, form="auto"):
    """ssmgrad's forward and every gradient region vs the torch reference and autograd, each within its
    tolerance of scaled_tol; returns (out, the gradients by name, the worst relative errors)."""
    out = ssmgrad.gated_delta_net(*gdn_args(inp), K=K, head_bcast=head_bcast, form=form)
    ref = ref_gdn_np(*gdn_args(inp), K=K, head_bcast=head_bcast)
    assert out.shape == (gdn_out_size(inp, K),)
    assert_close(out, ref, name="out vs reference", **scaled_tol(fwd_tol, ref))
    if grad is None:
        grad = rng.standard_normal(out.shape)
    gin = ssmgrad.gated_delta_net_back(*gdn_args(inp), grad, K=K, head_bcast=head_bcast, form=form)
    assert gin.shape == (sum(inp[n].size for n in GDN_NAMES),)
    got = split_gin(gin, inp)
    want = ref_gdn_grads(*gdn_args(inp), grad, K=K, head_bcast=head_bcast)
    for n in GDN_NAMES:
        assert_close(got[n], want[n], name=f"d_{n} vs autograd", **scaled_tol(grad_tol, want[n]))
    errs = {"out": rel_err(out, ref)}
    errs.update({f"d_{n}": rel_err(got[n], want[n]) for n in GDN_NAMES})
    return out, got, errs


def check_float32(inp, rng, *, fwd_tol, grad_tol, form):
    """The float32 kernel on float32 copies of INP vs the float64 reference on the same float32 values;
    returns (out, the gradients by name)."""
    f32 = {n: a.astype(np.float32) for n, a in inp.items()}
    grad = rng.standard_normal(gdn_out_size(inp)).astype(np.float32)
    out = ssmgrad.gated_delta_net(*gdn_args(f32), form=form)
    assert out.dtype == np.float32
    ref = ref_gdn_np(*gdn_args(f32))
    assert_close(out, ref, name="float32 out", **scaled_tol(fwd_tol, ref))
    gin = ssmgrad.gated_delta_net_back(*gdn_args(f32), grad, form=form)
    assert gin.dtype == np.float32
    got, want = split_gin(gin, f32), ref_gdn_grads(*gdn_args(f32), grad)
    for n in GDN_NAMES:
        assert_close(got[n], want[n], name=f"float32 d_{n}", **scaled_tol(grad_tol, want[n]))
    return out, got


def check_threads_bitwise(inp, grad, **kw):
    """1, 2 and 3 threads give the same bits, forward and backward (KW: the calls' K, head_bcast, form)."""
    res = []
    for nth in (1, 2, 3):
        ssmgrad.set_num_threads(nth)
        res.append((ssmgrad.gated_delta_net(*gdn_args(inp), **kw),
                    ssmgrad.gated_delta_net_back(*gdn_args(inp), grad, **kw)))
    for out, gin in res[1:]:
        assert np.array_equal(out, res[0][0]) and np.array_equal(gin, res[0][1])


def set_extreme_gates(inp, extreme):
    """Sets INP's gates in place: g very negative (exp(g) underflows to 0: the state is forgotten), g =
    -inf at some tokens (two in a row, and the whole second sequence), g = 0 (no decay), beta 0 (no
    write), beta 1 (a full write), or a mix of these along the tokens."""
    if extreme == "g_very_negative":
        inp["g"][...] = -1e3
    elif extreme == "g_minus_inf":
        inp["g"][:, 3::11] = -np.inf
        inp["g"][:, 4::11] = -np.inf
        inp["g"][1, :] = -np.inf
    elif extreme == "g_zero":
        inp["g"][...] = 0.0
    elif extreme == "beta_zero":
        inp["beta"][...] = 0.0
    elif extreme == "beta_one":
        inp["beta"][...] = 1.0
    elif extreme == "mixed":
        inp["g"][:, ::2] = -800.0
        inp["g"][:, 1::3] = 0.0
        inp["beta"][:, ::2] = 0.0
        inp["beta"][:, 1::2] = 1.0
    else:
        raise ValueError(f"extreme: unknown {extreme!r}")


def strided_views(inp):
    """Views of INP's arrays with other strides (transposed, a stride of 2, negative, a broadcast zero
    stride) holding the same values."""
    return {
        "q": np.ascontiguousarray(inp["q"].transpose(3, 1, 2, 0)).transpose(3, 1, 2, 0),
        "k": np.repeat(inp["k"], 2, axis=3)[..., ::2],
        "v": np.ascontiguousarray(inp["v"][:, ::-1]).copy()[:, ::-1],
        "g": np.ascontiguousarray(inp["g"].transpose(1, 0, 3, 2)).transpose(1, 0, 3, 2),
        "beta": np.broadcast_to(inp["beta"][:, :, :, :1], inp["beta"].shape),
        "state": np.ascontiguousarray(inp["state"].transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2),
    }


def check_views_bitwise(inp, views, grad, **kw):
    """VIEWS (INP's arrays with other strides) give the bits of the dense INP, forward and backward (KW:
    the calls' K, head_bcast, form)."""
    dense = (ssmgrad.gated_delta_net(*gdn_args(inp), **kw), ssmgrad.gated_delta_net_back(*gdn_args(inp), grad, **kw))
    args = tuple(views[n] for n in GDN_NAMES)
    assert np.array_equal(ssmgrad.gated_delta_net(*args, **kw), dense[0])
    assert np.array_equal(ssmgrad.gated_delta_net_back(*args, grad, **kw), dense[1])


def check_inputs_unchanged(inp, grad, **kw):
    """The forward and the backward leave their inputs and the incoming gradient as they were (KW: the
    calls' K, form)."""
    keep = {n: a.copy() for n, a in inp.items()}
    keep_grad = grad.copy()
    ssmgrad.gated_delta_net(*gdn_args(inp), **kw)
    ssmgrad.gated_delta_net_back(*gdn_args(inp), grad, **kw)
    for n in GDN_NAMES:
        assert np.array_equal(inp[n], keep[n]), n
    assert np.array_equal(grad, keep_grad)


def run_both(inp, grad, form, **kw):
    """(forward, backward) of INP with the form FORM."""
    return (ssmgrad.gated_delta_net(*gdn_args(inp), form=form, **kw),
            ssmgrad.gated_delta_net_back(*gdn_args(inp), grad, form=form, **kw))


def same_bits(a, b):
    return all(np.array_equal(x, y) for x, y in zip(a, b))


def check_form_choice(rng, make_inputs, min_t):
    """auto gives the chunked form's bits from MIN_T tokens on, the recurrence's below; the two forms differ
    in rounding (so the comparison can tell them apart). make_inputs(rng, n_t): one sequence's inputs."""
    for n_t, want in ((min_t - 1, "recurrence"), (min_t, "chunked"), (min_t + 268, "chunked"), (1, "recurrence")):
        inp = make_inputs(rng, n_t)
        grad = rng.standard_normal(gdn_out_size(inp))
        auto, rec, chk = run_both(inp, grad, "auto"), run_both(inp, grad, "recurrence"), run_both(inp, grad, "chunked")
        assert same_bits(auto, rec if want == "recurrence" else chk), n_t
        if n_t > 1:
            assert not same_bits(rec, chk), n_t


def check_K2_runs_recurrence(inp, rng, tol):
    """K = 2 snapshots with form="chunked" give the recurrence's bits, and its output is the reference's
    within TOL."""
    grad = rng.standard_normal(gdn_out_size(inp, 2))
    chk, rec = run_both(inp, grad, "chunked", K=2), run_both(inp, grad, "recurrence", K=2)
    assert same_bits(chk, rec)
    ref = ref_gdn_np(*gdn_args(inp), K=2)
    assert_close(chk[0], ref, name="out", **scaled_tol(tol, ref))


class GdnParams(ctypes.Structure):
    """gdn_params of csrc/ssmgrad.h (every field int64_t, in its order)."""
    _fields_ = [(n, ctypes.c_int64) for n in ("n_seqs", "n_seqs_k", "n_t", "H_v", "H_k", "S", "K", "g_per_channel",
                                              "head_bcast")] + \
               [(n, ctypes.c_int64 * 4) for n in ("q_st", "k_st", "v_st", "g_st", "beta_st", "state_st")] + \
               [("form", ctypes.c_int64), ("simd", ctypes.c_int64)]


def gdn_clib():
    """The extension as a C library, with the signatures of gdn_fwd_work_size, gdn_back_work_size (params,
    element size, threads) and gdn_form (params)."""
    lib = ctypes.CDLL(_ssmgrad.__file__)
    lib.gdn_back_work_size.restype = lib.gdn_fwd_work_size.restype = ctypes.c_size_t
    lib.gdn_back_work_size.argtypes = lib.gdn_fwd_work_size.argtypes = [ctypes.POINTER(GdnParams), ctypes.c_size_t,
                                                                        ctypes.c_int]
    lib.gdn_form.restype = ctypes.c_int
    return lib
