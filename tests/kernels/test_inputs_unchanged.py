"""Inputs are never modified, whatever their layout (views of one array, overlaps, B is C), and
results never share memory with them."""

import numpy as np
import pytest

import ssmgrad
from reference import make_scan_inputs, scan_out_size


def _root(a):
    while isinstance(a.base, np.ndarray):
        a = a.base
    return a


def _snapshot(arrays):
    # bytes of every view AND of the array owning its memory: catches writes through any view
    return [(a, a.tobytes(), _root(a).tobytes()) for a in arrays]


def _check(snap, results, what):
    for i, (a, before, root_before) in enumerate(snap):
        assert a.tobytes() == before, f"{what}: input #{i} (shape {a.shape}) was modified"
        assert _root(a).tobytes() == root_before, f"{what}: memory under input #{i} (shape {a.shape}) was modified"
        for r in results:
            assert not np.shares_memory(r, a), f"{what}: a result shares memory with input #{i}"


def _scan_layouts(rng, dtype, mamba2):
    hd = 2 if mamba2 else 1
    inp = make_scan_inputs(rng, n_head=4, head_dim=hd, d_state=3, n_group=2, n_seqs=3, n_t=4,
                           ids=[2, 0, 2], n_rs=4, mamba2=mamba2, dtype=dtype)
    plain = [inp[k] for k in ("s", "x", "dt", "A", "B", "C", "ids")]
    yield "contiguous", plain
    # llama.cpp xBC views
    n_seqs, n_t, d_inner, G = 3, 4, 4 * hd, 2 * 3
    xBC = rng.standard_normal((n_seqs, n_t, d_inner + 2 * G)).astype(dtype)
    x = xBC[..., :d_inner].reshape(n_seqs, n_t, 4, hd)
    B = xBC[..., d_inner:d_inner + G].reshape(n_seqs, n_t, 2, 3)
    C = xBC[..., d_inner + G:].reshape(n_seqs, n_t, 2, 3)
    yield "xBC", [inp["s"], x, inp["dt"], inp["A"], B, C, inp["ids"]]
    yield "B is C", [inp["s"], inp["x"], inp["dt"], inp["A"], inp["B"], inp["B"], inp["ids"]]
    yield "strided", [np.asfortranarray(inp["s"]), np.ascontiguousarray(inp["x"][::-1])[::-1], np.asfortranarray(inp["dt"]),
                      np.asfortranarray(inp["A"]), inp["B"], inp["C"], inp["ids"][::-1].copy()[::-1]]


def _xbc_overlap(rng, dtype, mamba2):
    n_seqs, n_head, d_state, n_t = 2, 2, 3, 3
    xbc = rng.standard_normal((2 * n_seqs, n_t, n_head, d_state)).astype(dtype)
    inp = make_scan_inputs(rng, n_head=n_head, head_dim=d_state, d_state=d_state, n_group=n_head, n_seqs=n_seqs,
                           n_t=n_t, ids=[1, 0], mamba2=mamba2, dtype=dtype)
    return [inp["s"], xbc[1:1 + n_seqs], inp["dt"], inp["A"], xbc[0:n_seqs], xbc[2:2 + n_seqs], inp["ids"]]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("mamba2", [False, True])
def test_scan_inputs_unchanged(rng, dtype, mamba2):
    layouts = list(_scan_layouts(rng, dtype, mamba2)) + [("xbc_overlap", _xbc_overlap(rng, dtype, mamba2))]
    for name, args in layouts:
        n_out = args[1].size + args[1].shape[0] * int(np.prod(args[0].shape[1:]))
        for K in ((1, 3) if mamba2 else (1,)):
            grad = rng.standard_normal(n_out + (K - 1) * (n_out - args[1].size)).astype(dtype)
            snap = _snapshot(args + [grad])
            out = ssmgrad.ssm_scan(*args, K=K)
            _check(snap, [out], f"ssm_scan [{name}, K={K}]")
            gin, d_A = ssmgrad.ssm_scan_back(*args, grad, K=K, return_dA=True)
            _check(snap, [gin, d_A], f"ssm_scan_back [{name}, K={K}]")
            gin2 = ssmgrad.ssm_scan_back(*args, grad, K=K)
            _check(snap, [gin2], f"ssm_scan_back [{name}, K={K}, no d_A]")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_conv_inputs_unchanged(rng, dtype):
    n_s, d_inner, d_conv, n_t = 2, 5, 4, 6
    sx = rng.standard_normal((n_s, d_inner, d_conv - 1 + n_t)).astype(dtype)
    c = rng.standard_normal((d_inner, d_conv)).astype(dtype)
    grad = rng.standard_normal((n_s, n_t, d_inner)).astype(dtype)
    big = rng.standard_normal((n_s, d_inner, 2 * (d_conv - 1 + n_t))).astype(dtype)
    for name, (a, b, g) in {"contiguous": (sx, c, grad),
                            "strided": (big[..., ::2], np.asfortranarray(c), np.ascontiguousarray(grad[:, ::-1])[:, ::-1])}.items():
        snap = _snapshot([a, b, g])
        y = ssmgrad.ssm_conv(a, b)
        _check(snap, [y], f"ssm_conv [{name}]")
        d_sx = ssmgrad.ssm_conv_back(a, b, g)
        _check(snap, [d_sx], f"ssm_conv_back [{name}]")
        d_c = ssmgrad.ssm_conv_back_weight(a, b, g)
        _check(snap, [d_c], f"ssm_conv_back_weight [{name}]")


def test_split_does_not_copy_or_modify(rng):
    packed = rng.standard_normal(10)
    before = packed.tobytes()
    a, b = ssmgrad.split(packed, (2, 2), (6,))
    assert packed.tobytes() == before
    assert np.shares_memory(a, packed) and np.shares_memory(b, packed)
