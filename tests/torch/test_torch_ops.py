"""ssmgrad.torch's custom operators (torch.ops.ssmgrad.*).

* ``torch.library.opcheck`` on every operator over representative inputs: both scan branches
  (Mamba-1 A (n_head, d_state), Mamba-2 A (n_head, 1)), n_group > 1, ids with duplicates and spare
  state rows, K > 1 and K > n_t, x/B/C as views of one xBC tensor, llama.cpp's transposed conv input,
  float32 and float64. Every sub-test must pass: test_schema, test_autograd_registration,
  test_faketensor, test_aot_dispatch_dynamic.
* Plumbing, not an oracle: the public functions go through the operators and must give the NumPy
  API's results bitwise (forward, and each gradient against ssm_conv_back / ssm_conv_back_weight /
  ssm_scan_back); both run the same kernels, so this shows the operators pass everything through
  unchanged. The values' oracles are tests/reference.py's torch recurrence and NumPy loops
  (tests/kernels/test_scan.py, test_conv.py, test_torch_adapter.py).
* The in-place one-token update ``ssm_scan_update_`` (a mutating operator) against ``ssmgrad.ssm_scan``.
"""

import numpy as np
import pytest
import torch
from torch.library import opcheck

import ssmgrad
import ssmgrad.torch as st
from reference import make_scan_inputs

# .ci's sanitizer and compiler passes skip these; every test runs on one thread (tests/conftest.py's
# one_thread): opcheck makes many calls on tiny inputs, and results do not depend on the thread count
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

OPS = torch.ops.ssmgrad
SUBTESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def check(op, args):
    """opcheck with every sub-test, each required to pass."""
    res = opcheck(op, args, test_utils=SUBTESTS)
    assert res == {k: "SUCCESS" for k in SUBTESTS}, res


def _t(a, grad=True):
    return torch.from_numpy(np.array(a)).requires_grad_(grad)


# ------------------------------------------------------------------------------------------------
# cases: name -> (scan tensors s, x, dt, A, B, C requiring grad, ids, K)

SCAN_CASES = {
    # n_group 2, ids with a duplicate and a spare state row, K = 3 snapshots
    "mamba2_groups_dup_ids_K3": dict(n_head=4, head_dim=2, d_state=3, n_group=2, n_seqs=3, n_t=4,
                                     ids=[2, 0, 2], n_rs=4, K=3),
    "mamba2_K_gt_n_t": dict(n_head=2, head_dim=3, d_state=2, n_group=1, n_seqs=2, n_t=2, ids=[1, 0], K=4),
    "mamba2_f32": dict(n_head=4, head_dim=2, d_state=3, n_group=2, n_seqs=2, n_t=3, ids=[1, 1], n_rs=2,
                       K=2, dtype=np.float32),
    # llama.cpp's Mamba-1: head_dim 1, n_group 1, A (n_head, d_state)
    "mamba1": dict(n_head=4, head_dim=1, d_state=3, n_group=1, n_seqs=2, n_t=3, ids=[0, 0], n_rs=2,
                   mamba2=False, K=1),
    "mamba1_grouped": dict(n_head=4, head_dim=2, d_state=2, n_group=2, n_seqs=2, n_t=3, mamba2=False, K=1),
    "mamba1_f32": dict(n_head=3, head_dim=1, d_state=4, n_group=1, n_seqs=1, n_t=3, mamba2=False, K=1,
                       dtype=np.float32),
    # both kernels chunked (the automatic rules): ssm_scan_keep keeps the states after each 64 tokens
    "mamba2_chunked": dict(n_head=2, head_dim=32, d_state=128, n_group=1, n_seqs=1, n_t=70, ids=[0], K=1),
}


def scan_case(name, rng):
    kw = dict(SCAN_CASES[name])
    K = kw.pop("K")
    inp = make_scan_inputs(rng, **kw)
    tensors = [_t(inp[k]) for k in ("s", "x", "dt", "A", "B", "C")]
    return tensors, torch.from_numpy(inp["ids"]), K


def xbc_case(rng, dtype=np.float64, K=2):
    """Mamba-2 with x, B, C as views of one (n_seqs, n_t, d_inner + 2 n_group d_state) tensor."""
    n_seqs, n_t, n_head, head_dim, d_state, n_group = 2, 3, 4, 2, 3, 2
    d_inner, G = n_head * head_dim, n_group * d_state
    inp = make_scan_inputs(rng, n_head=n_head, head_dim=head_dim, d_state=d_state, n_group=n_group,
                           n_seqs=n_seqs, n_t=n_t, ids=[1, 0], dtype=dtype)
    xbc = _t(rng.standard_normal((n_seqs, n_t, d_inner + 2 * G)).astype(dtype))
    x = xbc[..., :d_inner].unflatten(-1, (n_head, head_dim))
    B = xbc[..., d_inner:d_inner + G].unflatten(-1, (n_group, d_state))
    C = xbc[..., d_inner + G:].unflatten(-1, (n_group, d_state))
    return [_t(inp["s"]), x, _t(inp["dt"]), _t(inp["A"]), B, C], torch.from_numpy(inp["ids"]), K


def conv_case(rng, layout, dtype=np.float64):
    n_s, d_inner, d_conv, n_t = 2, 5, 4, 6
    c = _t(rng.standard_normal((d_inner, d_conv)).astype(dtype))
    if layout == "transposed":       # llama.cpp: the (n_s, n_cols, d_inner) token matrix, transposed
        sx = _t(rng.standard_normal((n_s, d_conv - 1 + n_t, d_inner)).astype(dtype)).transpose(1, 2)
    else:
        sx = _t(rng.standard_normal((n_s, d_inner, d_conv - 1 + n_t)).astype(dtype))
    return sx, c


def detached(tensors):
    return [t.detach() for t in tensors]


# ------------------------------------------------------------------------------------------------
# opcheck

@pytest.mark.parametrize("layout,dtype", [("contiguous", np.float64), ("transposed", np.float64),
                                          ("contiguous", np.float32)])
def test_opcheck_conv(rng, layout, dtype):
    sx, c = conv_case(rng, layout, dtype)
    check(OPS.ssm_conv.default, (sx, c))
    y = st.ssm_conv(sx, c)
    g = torch.from_numpy(rng.standard_normal(y.shape).astype(dtype))
    for grad in (g, g[:, :1].expand(y.shape), g.transpose(0, 1).contiguous().transpose(0, 1)):
        check(OPS.ssm_conv_back.default, (sx.detach(), c.detach(), grad))
        check(OPS.ssm_conv_back_weight.default, (sx.detach(), c.detach(), grad))


@pytest.mark.parametrize("name", [*SCAN_CASES, "xbc_views", "xbc_views_f32"])
def test_opcheck_scan(rng, name):
    if name.startswith("xbc_views"):
        tensors, ids, K = xbc_case(rng, np.float32 if name.endswith("f32") else np.float64)
    else:
        tensors, ids, K = scan_case(name, rng)
    check(OPS.ssm_scan.default, (*tensors, ids, K))
    check(OPS.ssm_scan_keep.default, (*tensors, ids, K))
    out = st.ssm_scan(*tensors, ids, K=K)
    grad = torch.from_numpy(rng.standard_normal(out.shape).astype(out.numpy(force=True).dtype))
    kept = OPS.ssm_scan_keep(*detached(tensors), ids, K)[1]
    assert kept.shape == ((1, 2, 2, 32, 128) if name == "mamba2_chunked" else (0,))   # the others: K > 1, Mamba-1
    for return_dA in (False, True):
        check(OPS.ssm_scan_back.default, (*detached(tensors), ids, grad, K, return_dA))
        check(OPS.ssm_scan_back.default, (*detached(tensors), ids, grad, K, return_dA, kept))


@pytest.mark.parametrize("path", ["decode", "general"])
def test_opcheck_scan_update(rng, path):
    n_t = 1 if path == "decode" else 3            # the decode kernel takes one token per call
    inp = make_scan_inputs(rng, n_head=4, head_dim=2, d_state=3, n_group=2, n_seqs=2, n_t=n_t, ids=[0, 1])
    tensors = [torch.from_numpy(inp[k]) for k in ("s", "x", "dt", "A", "B", "C")]
    check(OPS.ssm_scan_update_.default, tuple(tensors))


# ------------------------------------------------------------------------------------------------
# bitwise the NumPy API's results: plumbing checks (ssmgrad.torch against ssmgrad, the same kernels:
# they show the adapter passes arguments, strides and gradients through, not that the values are
# right). The oracles are tests/reference.py's torch recurrence (tests/torch/test_torch_adapter.py,
# tests/kernels/test_scan.py, tests/kernels/test_conv.py) and its NumPy loops.

def _np(t):
    return t.detach().numpy()


@pytest.mark.parametrize("layout,dtype", [("contiguous", np.float64), ("transposed", np.float32)])
def test_conv_bitwise_numpy_api(rng, layout, dtype):
    sx, c = conv_case(rng, layout, dtype)
    y = st.ssm_conv(sx, c)
    assert np.array_equal(y.detach().numpy(), ssmgrad.ssm_conv(_np(sx), _np(c)))
    g = torch.from_numpy(rng.standard_normal(y.shape).astype(dtype))
    d_sx, d_c = torch.autograd.grad(y, (sx, c), g)
    assert np.array_equal(d_sx.numpy(), ssmgrad.ssm_conv_back(_np(sx), _np(c), g.numpy()))
    assert np.array_equal(d_c.numpy(), ssmgrad.ssm_conv_back_weight(_np(sx), _np(c), g.numpy()))


@pytest.mark.parametrize("name", [*SCAN_CASES, "xbc_views"])
def test_scan_bitwise_numpy_api(rng, name):
    tensors, ids, K = xbc_case(rng) if name == "xbc_views" else scan_case(name, rng)
    arrays = [_np(t) for t in tensors]
    out = st.ssm_scan(*tensors, ids, K=K)
    assert np.array_equal(out.detach().numpy(), ssmgrad.ssm_scan(*arrays, ids.numpy(), K=K))
    g = torch.from_numpy(rng.standard_normal(out.shape).astype(arrays[0].dtype))
    grads = torch.autograd.grad(out, tensors, g)
    gin, d_A = ssmgrad.ssm_scan_back(*arrays, ids.numpy(), g.numpy(), K=K, return_dA=True)
    want = list(ssmgrad.split(gin, *(a.shape for i, a in enumerate(arrays) if i != 3)))
    want.insert(3, d_A)
    for name_, got, w in zip("s x dt A B C".split(), grads, want):
        assert got.shape == w.shape and np.array_equal(got.numpy(), w), f"d_{name_} differs"


# ------------------------------------------------------------------------------------------------
# the in-place update

@pytest.mark.parametrize("path", ["decode", "several_tokens", "strided_state"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_scan_update_matches_scan(rng, path, dtype):
    n_t = 1 if path != "several_tokens" else 3
    inp = make_scan_inputs(rng, n_head=4, head_dim=2, d_state=3, n_group=2, n_seqs=3, n_t=n_t, ids=[0, 1, 2],
                           dtype=dtype)
    arrays = [inp[k] for k in ("s", "x", "dt", "A", "B", "C")]
    tensors = [torch.from_numpy(a.copy()) for a in arrays]
    if path == "strided_state":          # a (head_dim, d_state)-transposed buffer: s is a strided view
        tensors[0] = tensors[0].transpose(2, 3).contiguous().transpose(2, 3)
    s = tensors[0]
    # the oracle sees the same layouts (a contiguous s lets ssm_scan take its decode path too)
    out = ssmgrad.ssm_scan(s.numpy(), *arrays[1:], np.arange(3))
    y_want, s_want = ssmgrad.split(out, inp["x"].shape, inp["s"].shape)
    version = s._version
    y = st.ssm_scan_update_(*tensors)
    assert np.array_equal(y.numpy(), y_want)
    assert np.array_equal(s.numpy(), s_want)
    assert s._version > version            # autograd and compiled graphs see the mutation
    assert [np.array_equal(t.numpy(), a) for t, a in zip(tensors[1:], arrays[1:])] == [True] * 5


def test_scan_update_errors(rng):
    inp = make_scan_inputs(rng, n_head=2, head_dim=2, d_state=3, n_seqs=2, n_t=1, ids=[0, 1])
    s, x, dt, A, B, C = (torch.from_numpy(inp[k]) for k in ("s", "x", "dt", "A", "B", "C"))
    with pytest.raises(ValueError, match="x requires grad"):
        st.ssm_scan_update_(s, x.clone().requires_grad_(), dt, A, B, C)
    with torch.no_grad():                  # inference mode is what it is for
        st.ssm_scan_update_(s, x.clone().requires_grad_(), dt, A, B, C)
    with pytest.raises(ValueError, match="lazily negated"):
        st.ssm_scan_update_(torch._neg_view(s), x, dt, A, B, C)
    with pytest.raises(ValueError, match="one state per sequence"):
        st.ssm_scan_update_(s[:1], x, dt, A, B, C)
    with pytest.raises(TypeError, match="same dtype"):
        st.ssm_scan_update_(s, x.float(), dt, A, B, C)
    with pytest.raises(TypeError, match="dt must be a torch.Tensor"):
        st.ssm_scan_update_(s, x, inp["dt"], A, B, C)
    with pytest.raises(ValueError):        # shapes are checked by the kernels' glue
        st.ssm_scan_update_(s, x, dt[:, :, :1], A, B, C)


def test_double_backward_says_so(rng):
    # the backward operators have no autograd formula: a second backward must fail loudly, not return zeros
    sx, c = conv_case(rng, "contiguous")
    (d_sx,) = torch.autograd.grad(st.ssm_conv(sx, c).square().sum(), sx, create_graph=True)
    with pytest.raises(RuntimeError, match="ssm_conv_back.*no autograd formula"):
        d_sx.sum().backward()
    tensors, ids, K = scan_case("mamba1", rng)
    (d_x,) = torch.autograd.grad(st.ssm_scan(*tensors, ids, K=K).square().sum(), tensors[1], create_graph=True)
    with pytest.raises(RuntimeError, match="ssm_scan_back.*no autograd formula"):
        d_x.sum().backward()
