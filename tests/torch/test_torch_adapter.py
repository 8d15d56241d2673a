"""ssmgrad.torch: the autograd adapter.

gradcheck in float64 for both ops and both scan branches (with duplicate ids, spare state rows,
n_group > 1, K > 1 and K > n_t), gradients through llama.cpp's views compared with the torch
reference (tests/reference.py), "compute only what is asked for", zero-copy hand-off, errors,
and the promise that ``import ssmgrad`` alone never imports torch.
"""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import ssmgrad
import ssmgrad.torch as st
from reference import assert_close, ref_ssm_conv, ref_ssm_scan

ROOT = Path(__file__).resolve().parents[2]
F64 = torch.float64


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _randn(*shape, seed, dtype=F64, scale=1.0):
    return (torch.randn(*shape, generator=_gen(seed), dtype=F64) * scale).to(dtype)


def scan_inputs(n_rs=3, n_seqs=2, n_t=3, n_head=4, head_dim=2, d_state=3, n_group=2,
                mamba1=False, dtype=F64, seed=0):
    """Leaf tensors (s, x, dt, A, B, C) requiring grad, and ids with a duplicate."""
    s = _randn(n_rs, n_head, head_dim, d_state, seed=seed, dtype=dtype)
    x = _randn(n_seqs, n_t, n_head, head_dim, seed=seed + 1, dtype=dtype)
    dt = _randn(n_seqs, n_t, n_head, seed=seed + 2, dtype=dtype)
    A = -torch.exp(_randn(n_head, d_state if mamba1 else 1, seed=seed + 3, scale=0.5)).to(dtype)
    B = _randn(n_seqs, n_t, n_group, d_state, seed=seed + 4, dtype=dtype)
    C = _randn(n_seqs, n_t, n_group, d_state, seed=seed + 5, dtype=dtype)
    ids = torch.tensor([1] * n_seqs, dtype=torch.int32) if n_seqs > 1 else torch.tensor([n_rs - 1])
    return [t.requires_grad_() for t in (s, x, dt, A, B, C)], ids


def clones(tensors):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in tensors]


# ----------------------------------------------------------------------------------------------
# import isolation

def test_import_ssmgrad_does_not_import_torch():
    code = ("import sys, numpy as np, ssmgrad\n"
            "ssmgrad.ssm_conv(np.ones((1, 2, 4)), np.ones((2, 3)))\n"
            "assert 'torch' not in sys.modules, 'import ssmgrad pulled in torch'\n"
            "print('ok')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"


# ----------------------------------------------------------------------------------------------
# gradcheck (float64): plumbing checks. torch.autograd.gradcheck compares the registered backward
# with finite differences of ssmgrad.torch's own forward, so it shows that the adapter wires each
# gradient to its input, not that the values are right: the oracle comparisons are below (the
# torch reference, tests/reference.py) and in tests/kernels/test_scan.py / test_conv.py.

# gradcheck makes hundreds of calls on tiny inputs: waking a second thread for each costs more than
# the work, so these take tests/conftest.py's one_thread. Results do not depend on the thread count
# (tests/kernels/test_threads.py).

def test_gradcheck_conv(one_thread):
    sx = _randn(2, 3, 3 + 4, seed=1).requires_grad_()
    c = _randn(3, 4, seed=2).requires_grad_()
    assert torch.autograd.gradcheck(st.ssm_conv, (sx, c))


def test_gradcheck_conv_strided_input(one_thread):
    # llama.cpp builds sx by transposing the (n_s, n_cols, d_inner) token matrix: a strided view.
    base = _randn(2, 3 + 4, 3, seed=3).requires_grad_()
    c = _randn(3, 4, seed=4).requires_grad_()
    assert torch.autograd.gradcheck(lambda b, w: st.ssm_conv(b.transpose(1, 2), w), (base, c))


@pytest.mark.parametrize("K,n_t", [(1, 3), (2, 3), (4, 2)])
def test_gradcheck_scan_mamba2(K, n_t, one_thread):
    # K = 4 > n_t = 2 exercises the zero slots k >= n_t.
    (s, x, dt, A, B, C), ids = scan_inputs(n_t=n_t, mamba1=False, n_group=2)
    assert torch.autograd.gradcheck(lambda *a: st.ssm_scan(*a, ids, K=K), (s, x, dt, A, B, C))


def test_gradcheck_scan_mamba1(one_thread):
    # llama.cpp's Mamba-1: head_dim 1, n_group 1, A (n_head, d_state).
    (s, x, dt, A, B, C), ids = scan_inputs(n_head=4, head_dim=1, d_state=3, n_group=1, mamba1=True)
    assert torch.autograd.gradcheck(lambda *a: st.ssm_scan(*a, ids), (s, x, dt, A, B, C))


def test_gradcheck_scan_mamba1_grouped(one_thread):
    (s, x, dt, A, B, C), ids = scan_inputs(n_head=4, head_dim=2, d_state=2, n_group=2, mamba1=True, seed=7)
    assert torch.autograd.gradcheck(lambda *a: st.ssm_scan(*a, ids), (s, x, dt, A, B, C))


# ----------------------------------------------------------------------------------------------
# values and gradients against the torch reference

def _compare_grads(got, want, names, atol=1e-10, rtol=1e-9):
    for name, g, w in zip(names, got, want):
        assert (g is None) == (w is None), f"{name}: gradient presence differs"
        if g is not None:
            assert_close(g.numpy(), w.numpy(), atol, rtol, f"d_{name}")


@pytest.mark.parametrize("mamba1,K", [(False, 1), (False, 3), (False, 6), (True, 1)])
def test_scan_matches_reference(mamba1, K):
    leaves, ids = scan_inputs(n_rs=4, n_seqs=3, n_t=4, mamba1=mamba1, seed=11)
    ids = torch.tensor([2, 0, 2])
    ref_leaves = clones(leaves)
    out = st.ssm_scan(*leaves, ids, K=K)
    want = ref_ssm_scan(*ref_leaves, ids, K=K)
    assert out.dtype == F64 and out.shape == want.shape and out.dim() == 1
    assert_close(out.detach().numpy(), want.detach().numpy(), 1e-12, 1e-12, "out")
    g = _randn(*out.shape, seed=12)
    (out * g).sum().backward()
    (want * g).sum().backward()
    _compare_grads([t.grad for t in leaves], [t.grad for t in ref_leaves], "s x dt A B C".split())
    # rows of s that no id names get exactly zero gradient
    assert torch.all(leaves[0].grad[[1, 3]] == 0)


def test_zero_tokens():
    # n_t = 0: y is empty, slot 0 is s[ids[q]] (its gradient flows to s), slots k >= 1 are zero
    sx = _randn(2, 3, 3, seed=201).requires_grad_()
    c = _randn(3, 4, seed=202).requires_grad_()
    y = st.ssm_conv(sx, c)
    assert y.shape == (2, 0, 3)
    y.sum().backward()
    assert torch.all(sx.grad == 0) and torch.all(c.grad == 0)

    leaves, ids = scan_inputs(n_t=0, seed=203)
    ref_leaves = clones(leaves)
    out, want = st.ssm_scan(*leaves, ids, K=2), ref_ssm_scan(*ref_leaves, ids, K=2)
    assert_close(out.detach().numpy(), want.detach().numpy(), 0, 0, "out n_t=0")
    g = _randn(*out.shape, seed=204)
    (out * g).sum().backward()
    (want * g).sum().backward()
    for name, t, r in zip("s x dt A B C".split(), leaves, ref_leaves):
        assert_close(t.grad.numpy(), np.zeros(t.shape) if r.grad is None else r.grad.numpy(), 1e-12, 0, f"d_{name}")


def test_conv_matches_reference():
    sx = _randn(2, 5, 3 + 6, seed=21).requires_grad_()
    c = _randn(5, 4, seed=22).requires_grad_()
    sx_r, c_r = clones([sx, c])
    y, y_r = st.ssm_conv(sx, c), ref_ssm_conv(sx_r, c_r)
    assert y.shape == (2, 6, 5)
    assert_close(y.detach().numpy(), y_r.detach().numpy(), 1e-12, 1e-12, "y")
    g = _randn(*y.shape, seed=23)
    (y * g).sum().backward()
    (y_r * g).sum().backward()
    _compare_grads([sx.grad, c.grad], [sx_r.grad, c_r.grad], ["sx", "c"])


def test_expanded_and_strided_upstream_gradients():
    # out.sum() hands backward a stride-0 expanded gradient; a transposed use a non-contiguous one.
    sx = _randn(2, 3, 3 + 4, seed=31).requires_grad_()
    c = _randn(3, 4, seed=32).requires_grad_()
    st.ssm_conv(sx, c).sum().backward()
    sx_r, c_r = clones([sx, c])
    ref_ssm_conv(sx_r, c_r).sum().backward()
    _compare_grads([sx.grad, c.grad], [sx_r.grad, c_r.grad], ["sx", "c"])

    sx.grad = c.grad = sx_r.grad = c_r.grad = None
    w = _randn(3, 4, 2, seed=33)                    # (d_inner, n_t, n_s): forces a permuted grad
    (st.ssm_conv(sx, c).permute(2, 1, 0) * w).sum().backward()
    (ref_ssm_conv(sx_r, c_r).permute(2, 1, 0) * w).sum().backward()
    _compare_grads([sx.grad, c.grad], [sx_r.grad, c_r.grad], ["sx", "c"])

    leaves, ids = scan_inputs(seed=34)
    ref_leaves = clones(leaves)
    st.ssm_scan(*leaves, ids, K=2).sum().backward()
    ref_ssm_scan(*ref_leaves, ids, K=2).sum().backward()
    _compare_grads([t.grad for t in leaves], [t.grad for t in ref_leaves], "s x dt A B C".split())

    for t in leaves + ref_leaves:
        t.grad = None
    out, out_r = st.ssm_scan(*leaves, ids), ref_ssm_scan(*ref_leaves, ids)
    out[::3].sum().backward()                       # strided slice of the packed output
    out_r[::3].sum().backward()
    _compare_grads([t.grad for t in leaves], [t.grad for t in ref_leaves], "s x dt A B C".split())


def test_float32():
    leaves, ids = scan_inputs(dtype=torch.float32, seed=41)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    out = st.ssm_scan(*leaves, ids)
    assert out.dtype == torch.float32
    want = ref_ssm_scan(*ref_leaves, ids)
    assert_close(out.detach().numpy(), want.detach().numpy(), 1e-5, 1e-5, "out f32")
    g = _randn(*out.shape, seed=42)
    (out * g.float()).sum().backward()
    (want * g).sum().backward()
    for name, t, r in zip("s x dt A B C".split(), leaves, ref_leaves):
        assert t.grad.dtype == torch.float32
        assert_close(t.grad.numpy(), r.grad.numpy(), 1e-4, 1e-4, f"d_{name} f32")

    sx = _randn(1, 4, 3 + 5, seed=43, dtype=torch.float32).requires_grad_()
    c = _randn(4, 4, seed=44, dtype=torch.float32).requires_grad_()
    sx_r, c_r = (t.detach().double().requires_grad_() for t in (sx, c))
    y, y_r = st.ssm_conv(sx, c), ref_ssm_conv(sx_r, c_r)
    assert y.dtype == torch.float32
    # against the float64 torch reference on the same float32 values. Measured max |err|: y 1.9e-7
    # (max |ref| 2.9), d_sx 1.0e-6 (19), d_c 2.0e-6 (15); bound 5e-7 * (1 + max |ref|): 4-10x those
    def close(got, want, name):
        assert_close(got, want, 5e-7 * (1 + np.abs(want).max()), 0, name)

    close(y.detach().numpy(), y_r.detach().numpy(), "conv y f32")
    y.square().sum().backward()
    y_r.square().sum().backward()
    assert sx.grad.dtype == torch.float32 and c.grad.dtype == torch.float32
    close(sx.grad.numpy(), sx_r.grad.numpy(), "conv d_sx f32")
    close(c.grad.numpy(), c_r.grad.numpy(), "conv d_c f32")


# ----------------------------------------------------------------------------------------------
# llama.cpp's views: the gradient of the base tensor is the sum of its views' gradients

def test_mamba2_xbc_views():
    n_seqs, n_t, n_head, head_dim, d_state, n_group, d_conv = 2, 4, 4, 2, 3, 2, 4
    d_inner, G = n_head * head_dim, n_group * d_state
    conv_dim = d_inner + 2 * G

    def block(ops_conv, ops_scan, zxbc, conv_state, c, s, dt, A):
        # sx = concat(conv state, tokens) along time, then transposed: a view like llama.cpp's
        tokens = torch.cat([conv_state, zxbc], dim=1)                     # (n_s, d_conv-1+n_t, conv_dim)
        xBC = ops_conv(tokens.transpose(1, 2), c)                         # (n_s, n_t, conv_dim)
        x = xBC[..., :d_inner].reshape(n_seqs, n_t, n_head, head_dim)
        B = xBC[..., d_inner:d_inner + G].reshape(n_seqs, n_t, n_group, d_state)
        C = xBC[..., d_inner + G:].reshape(n_seqs, n_t, n_group, d_state)
        return ops_scan(s, x, dt, A, B, C, torch.tensor([0, 1]), K=2)

    args = [_randn(n_seqs, n_t, conv_dim, seed=51), _randn(n_seqs, d_conv - 1, conv_dim, seed=52),
            _randn(conv_dim, d_conv, seed=53), _randn(n_seqs, n_head, head_dim, d_state, seed=54),
            _randn(n_seqs, n_t, n_head, seed=55), -torch.exp(_randn(n_head, 1, seed=56))]
    args = [a.requires_grad_() for a in args]
    ref_args = clones(args)
    out = block(st.ssm_conv, st.ssm_scan, *args)
    want = block(ref_ssm_conv, ref_ssm_scan, *ref_args)
    assert_close(out.detach().numpy(), want.detach().numpy(), 1e-12, 1e-12, "out")
    g = _randn(*out.shape, seed=57)
    (out * g).sum().backward()
    (want * g).sum().backward()
    _compare_grads([a.grad for a in args], [a.grad for a in ref_args], "xbc conv_state c s dt A".split())


def test_mamba1_x_db_views():
    # B and C are views into the x_proj output x_db (n_seqs, n_t, dt_rank + 2*d_state).
    n_seqs, n_t, d_inner, d_state, dt_rank = 2, 3, 4, 3, 2
    x = _randn(n_seqs, n_t, d_inner, 1, seed=61).requires_grad_()
    x_db = _randn(n_seqs, n_t, dt_rank + 2 * d_state, seed=62).requires_grad_()
    dt_w = _randn(d_inner, dt_rank, seed=63).requires_grad_()
    s = _randn(3, d_inner, 1, d_state, seed=64).requires_grad_()
    A = (-torch.exp(_randn(d_inner, d_state, seed=65))).requires_grad_()
    ids = torch.tensor([2, 0], dtype=torch.int64)

    def run(scan, x, x_db, dt_w, s, A):
        dt = x_db[..., :dt_rank] @ dt_w.T
        B = x_db[..., dt_rank:dt_rank + d_state].unsqueeze(2)
        C = x_db[..., dt_rank + d_state:].unsqueeze(2)
        return scan(s, x, dt, A, B, C, ids)

    leaves = [x, x_db, dt_w, s, A]
    ref_leaves = clones(leaves)
    out, want = run(st.ssm_scan, *leaves), run(ref_ssm_scan, *ref_leaves)
    g = _randn(*out.shape, seed=66)
    (out * g).sum().backward()
    (want * g).sum().backward()
    _compare_grads([t.grad for t in leaves], [t.grad for t in ref_leaves], "x x_db dt_w s A".split())


def test_overlapping_xbc_views(one_thread):
    # ggml's "xbc_overlap": B, x, C are overlapping slices of one tensor; their gradients add up.
    n_seqs, n_t, n_head, d_state = 2, 3, 2, 3
    xbc = _randn(2 * n_seqs, n_t, n_head, d_state, seed=71).requires_grad_()
    s = _randn(n_seqs, n_head, d_state, d_state, seed=72).requires_grad_()
    dt = _randn(n_seqs, n_t, n_head, seed=73).requires_grad_()
    A = (-torch.exp(_randn(n_head, 1, seed=74))).requires_grad_()
    ids = [1, 0]

    def run(scan, xbc, s, dt, A):
        return scan(s, xbc[1:1 + n_seqs], dt, A, xbc[0:n_seqs], xbc[2:2 + n_seqs], ids)

    leaves = [xbc, s, dt, A]
    ref_leaves = clones(leaves)
    out, want = run(st.ssm_scan, *leaves), run(ref_ssm_scan, *ref_leaves)
    assert_close(out.detach().numpy(), want.detach().numpy(), 1e-12, 1e-12, "out")
    g = _randn(*out.shape, seed=75)
    (out * g).sum().backward()
    (want * g).sum().backward()
    _compare_grads([t.grad for t in leaves], [t.grad for t in ref_leaves], "xbc s dt A".split())
    assert torch.autograd.gradcheck(lambda *a: run(st.ssm_scan, *a), tuple(leaves))


# ----------------------------------------------------------------------------------------------
# only what is asked for is computed

class Recorder:
    def __init__(self, monkeypatch):
        self.calls = []
        for name in ("ssm_conv", "ssm_conv_back", "ssm_conv_back_weight", "ssm_scan", "ssm_scan_back"):
            monkeypatch.setattr(ssmgrad, name, self._wrap(name, getattr(ssmgrad, name)))

    def _wrap(self, name, fn):
        def wrapper(*args, **kwargs):
            self.calls.append((name, args, kwargs))
            return fn(*args, **kwargs)
        return wrapper

    def names(self):
        return [c[0] for c in self.calls]


def test_conv_backward_only_what_is_needed(monkeypatch):
    rec = Recorder(monkeypatch)
    sx, c = _randn(1, 3, 6, seed=81), _randn(3, 4, seed=82)

    st.ssm_conv(sx.clone().requires_grad_(), c).sum().backward()
    assert rec.names() == ["ssm_conv", "ssm_conv_back"]

    rec.calls.clear()
    cw = c.clone().requires_grad_()
    st.ssm_conv(sx, cw).sum().backward()
    assert rec.names() == ["ssm_conv", "ssm_conv_back_weight"]
    assert cw.grad is not None

    rec.calls.clear()
    y = st.ssm_conv(sx, c)
    assert not y.requires_grad
    assert rec.names() == ["ssm_conv"]


def test_scan_backward_only_what_is_needed(monkeypatch):
    rec = Recorder(monkeypatch)
    (s, x, dt, A, B, C), ids = scan_inputs(seed=91)

    # LoRA path: A frozen -> no d_A requested
    A0 = A.detach()
    st.ssm_scan(s, x, dt, A0, B, C, ids).sum().backward()
    assert rec.names() == ["ssm_scan", "ssm_scan_back"]
    assert rec.calls[1][2].get("return_dA") is False
    assert all(t.grad is not None for t in (s, x, dt, B, C))

    # full fine-tuning: A trainable -> d_A from the same reverse pass
    rec.calls.clear()
    st.ssm_scan(s.detach(), x.detach(), dt.detach(), A, B.detach(), C.detach(), ids, K=2).sum().backward()
    assert rec.names() == ["ssm_scan", "ssm_scan_back"]
    assert rec.calls[1][2].get("return_dA") is True and rec.calls[1][2].get("K") == 2
    assert A.grad is not None and A.grad.shape == A.shape

    rec.calls.clear()
    out = st.ssm_scan(*(t.detach() for t in (s, x, dt, A, B, C)), ids)
    assert not out.requires_grad and rec.names() == ["ssm_scan"]


def test_zero_copy_handoff(monkeypatch):
    rec = Recorder(monkeypatch)
    base = _randn(2, 3 + 5, 4, seed=101)
    sx = base.transpose(1, 2)                              # non-contiguous, passed as is
    c = _randn(4, 4, seed=102)
    st.ssm_conv(sx, c)
    arr = rec.calls[0][1][0]
    assert isinstance(arr, np.ndarray)
    assert arr.ctypes.data == sx.data_ptr()
    assert arr.strides == tuple(s * sx.element_size() for s in sx.stride())

    rec.calls.clear()
    (s, x, dt, A, B, C), ids = scan_inputs(seed=103)
    xe = x.detach()[:, :, :1].expand(x.shape)              # stride-0 axis
    st.ssm_scan(s, xe, dt, A, B, C, ids)
    for arr, t in zip(rec.calls[0][1], (s, xe, dt, A, B, C)):
        assert arr.ctypes.data == t.data_ptr() and arr.shape == tuple(t.shape)


def test_inputs_unchanged_and_no_grad_mode():
    leaves, ids = scan_inputs(seed=111)
    before = [t.detach().clone() for t in leaves]
    with torch.no_grad():
        out = st.ssm_scan(*leaves, ids)
    assert not out.requires_grad
    np_out = ssmgrad.ssm_scan(*(t.detach().numpy() for t in leaves), ids.numpy())
    assert np.array_equal(out.numpy(), np_out)
    st.ssm_scan(*leaves, ids).square().sum().backward()
    for t, b in zip(leaves, before):
        assert torch.equal(t.detach(), b)


def test_split():
    (s, x, dt, A, B, C), ids = scan_inputs(seed=121)
    out = st.ssm_scan(s, x, dt, A, B, C, ids, K=2)
    y, states = st.split(out, x.shape, (2, x.shape[0]) + tuple(s.shape[1:]))
    assert y.shape == x.shape and states.shape == (2, 2, 4, 2, 3)
    ref_leaves = clones([s, x, dt, A, B, C])
    ref = ref_ssm_scan(*ref_leaves, ids, K=2)
    assert torch.equal(torch.cat([y.reshape(-1), states.reshape(-1)]), out)   # views of out, in its order
    n_y = x.numel()
    ref_states = ref[n_y:].reshape(states.shape)
    assert_close(states.detach().numpy(), ref_states.detach().numpy(), 1e-12, 1e-12, "states (K=2)")
    states[0].sum().backward()                             # a loss on the final state only
    ref_states[0].sum().backward()
    _compare_grads([t.grad for t in (s, x, dt, A, B, C)], [t.grad for t in ref_leaves], "s x dt A B C".split())
    with pytest.raises(ValueError):
        st.split(out, x.shape)


# ----------------------------------------------------------------------------------------------
# errors

def test_errors():
    sx, c = _randn(1, 2, 5, seed=131), _randn(2, 3, seed=132)
    with pytest.raises((ValueError, TypeError), match="device"):
        st.ssm_conv(sx.to("meta"), c)                      # stands in for a CUDA tensor
    with pytest.raises(TypeError, match=r"sx has dtype torch.float16; .*convert it with sx\.float\(\)"):
        st.ssm_conv(sx.half(), c.half())
    with pytest.raises(TypeError, match=r"sx has dtype torch.bfloat16; .*convert it with sx\.float\(\)"):
        st.ssm_conv(sx.to(torch.bfloat16), c)
    with pytest.raises(TypeError, match="dtype"):
        st.ssm_conv(sx.to(torch.int32), c)
    with pytest.raises(TypeError, match="same dtype"):
        st.ssm_conv(sx.float(), c)
    with pytest.raises(TypeError):
        st.ssm_conv(sx.numpy(), c)

    (s, x, dt, A, B, C), ids = scan_inputs(seed=133)
    with pytest.raises((ValueError, TypeError), match="device"):
        st.ssm_scan(s, x.detach().to("meta"), dt, A, B, C, ids)
    with pytest.raises(TypeError, match="dtype"):
        st.ssm_scan(s, x, dt.float(), A, B, C, ids)
    with pytest.raises(TypeError, match=r"s has dtype torch.bfloat16; .*convert it with s\.float\(\)"):
        st.ssm_scan(*(t.detach().to(torch.bfloat16) for t in (s, x, dt, A, B, C)), ids)
    with pytest.raises(TypeError, match="integer"):
        st.ssm_scan(s, x, dt, A, B, C, ids.double())
    with pytest.raises(ValueError):                        # shape errors come from ssmgrad
        st.ssm_scan(s, x[:, :, :3], dt, A, B, C, ids)
    with pytest.raises(ValueError):
        st.ssm_scan(s, x, dt, A, B, C, torch.tensor([0, 3]))
