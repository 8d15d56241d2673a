"""ssmgrad.torch's eager path: outside tracing the public functions call the operators' implementations
directly (an autograd.Function with the operators' own autograd formula when a gradient is wanted, the
kernel alone under no_grad), skipping the dispatcher's cost per call.

Oracle: the custom operators (torch.ops.ssmgrad.*, themselves held to ssmgrad's NumPy API and opcheck
in tests/torch/test_torch_ops.py) and, for the values, the float64 torch reference (tests/reference.py).
The eager path must give the operators' results and gradients bitwise, and must not be taken while
tracing (FakeTensor mode, torch.compile: tests/torch/test_compile.py), where the operators are the contract.
"""

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import ssmgrad.torch as st
from reference import make_scan_inputs, ref_ssm_conv, ref_ssm_scan

pytestmark = pytest.mark.integration   # as tests/torch/test_torch_ops.py

OPS = torch.ops.ssmgrad
NAMES = ("s", "x", "dt", "A", "B", "C")

SCAN_CASES = {
    "mamba2_groups_dup_ids_K3": dict(n_head=4, head_dim=2, d_state=3, n_group=2, n_seqs=3, n_t=4, ids=[2, 0, 2],
                                     n_rs=4, K=3),
    "mamba2_decode_f32": dict(n_head=4, head_dim=8, d_state=16, n_group=1, n_seqs=2, n_t=1, ids=[1, 0], K=1,
                              dtype=np.float32),
    "mamba1": dict(n_head=6, head_dim=1, d_state=5, n_group=2, n_seqs=2, n_t=3, ids=[0, 0], n_rs=2,
                   mamba2=False, K=1),
    "mamba1_decode_f32": dict(n_head=32, head_dim=1, d_state=16, n_group=1, n_seqs=1, n_t=1, ids=[0],
                              mamba2=False, K=1, dtype=np.float32),
}


@pytest.fixture
def no_ops(monkeypatch):
    """The operators made unusable, to show that a call does not reach them (the eager path)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the custom operator was called on the eager path")
    for name in ("_conv_op", "_scan_op", "_scan_update_op"):
        monkeypatch.setattr(st, name, refuse)


def scan_case(rng, name):
    kw = dict(SCAN_CASES[name])
    K = kw.pop("K")
    inp = make_scan_inputs(rng, **kw)
    return [torch.from_numpy(inp[k]) for k in NAMES], torch.from_numpy(inp["ids"]), K


def leaves(tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("name", list(SCAN_CASES))
def test_scan_eager_equals_op_bitwise(rng, name, no_ops):
    tensors, ids, K = scan_case(rng, name)
    eager_in, op_in = leaves(tensors), leaves(tensors)
    out = st.ssm_scan(*eager_in, ids, K=K)                       # the eager path (the operators refuse)
    assert type(out.grad_fn).__name__ == "_ScanFnBackward"
    out_op = OPS.ssm_scan(*op_in, ids, K)
    assert same(out.detach(), out_op.detach())
    g = torch.from_numpy(rng.standard_normal(out.shape).astype(out.detach().numpy().dtype))
    for grad in (g, g[:1].expand(out.shape)):                    # a dense and an expanded upstream gradient
        got = torch.autograd.grad(out, eager_in, grad, retain_graph=True)
        want = torch.autograd.grad(out_op, op_in, grad, retain_graph=True)
        for n, a, b in zip(NAMES, got, want):
            assert same(a, b), f"d_{n} differs between the eager path and the operator"
    # only what is asked for: a frozen A gets no gradient on either path
    part = leaves(tensors)
    part[3].requires_grad_(False)
    (d_x,) = torch.autograd.grad(st.ssm_scan(*part, ids, K=K), part[1], g)
    assert same(d_x, torch.autograd.grad(out_op, op_in[1], g)[0])
    # the values: the float64 torch reference
    ref = ref_ssm_scan(*(t.double() for t in tensors), ids, K)
    tol = 1e-12 if tensors[0].dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out.detach().double(), ref, atol=tol, rtol=tol)
    # under no_grad: the kernel alone, the same bits
    with torch.no_grad():
        assert same(st.ssm_scan(*tensors, ids, K=K), out_op.detach())


@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_conv_eager_equals_op_bitwise(rng, layout, no_ops):
    n_s, d_inner, d_conv, n_t = 2, 5, 4, 6
    c = torch.from_numpy(rng.standard_normal((d_inner, d_conv)))
    if layout == "transposed":       # llama.cpp's token matrix, transposed
        sx = torch.from_numpy(rng.standard_normal((n_s, d_conv - 1 + n_t, d_inner))).transpose(1, 2)
    else:
        sx = torch.from_numpy(rng.standard_normal((n_s, d_inner, d_conv - 1 + n_t)))
    (sx_e, c_e), (sx_o, c_o) = leaves((sx, c)), leaves((sx, c))
    y = st.ssm_conv(sx_e, c_e)
    assert type(y.grad_fn).__name__ == "_ConvFnBackward"
    y_op = OPS.ssm_conv(sx_o, c_o)
    assert same(y.detach(), y_op.detach())
    torch.testing.assert_close(y.detach(), ref_ssm_conv(sx, c), atol=1e-12, rtol=1e-12)
    g = torch.from_numpy(rng.standard_normal(y.shape))
    for a, b in zip(torch.autograd.grad(y, (sx_e, c_e), g), torch.autograd.grad(y_op, (sx_o, c_o), g)):
        assert same(a, b)
    with torch.no_grad():
        assert same(st.ssm_conv(sx, c), y_op.detach())


@pytest.mark.parametrize("n_t", [1, 3])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_update_eager_equals_op_bitwise(rng, n_t, dtype, no_ops):
    inp = make_scan_inputs(rng, n_head=4, head_dim=2, d_state=16, n_group=2, n_seqs=3, n_t=n_t, ids=[0, 1, 2],
                           dtype=dtype)
    tensors = [torch.from_numpy(inp[k]) for k in NAMES]
    s_e, s_o = tensors[0].clone(), tensors[0].clone()
    v = s_e._version
    with torch.no_grad():
        y = st.ssm_scan_update_(s_e, *tensors[1:])                # the eager path (the operators refuse)
        y_op = OPS.ssm_scan_update_(s_o, *tensors[1:])
    assert same(y, y_op) and same(s_e, s_o)
    assert s_e._version > v                                      # the write is visible to autograd
    out = ref_ssm_scan(*(t.double() for t in tensors), torch.arange(3))
    tol = 1e-12 if dtype == np.float64 else 2e-5
    torch.testing.assert_close(y.double().reshape(-1), out[:y.numel()], atol=tol, rtol=tol)
    torch.testing.assert_close(s_e.double().reshape(-1), out[y.numel():], atol=tol, rtol=tol)


def test_tracing_takes_the_operators(rng):
    """Under FakeTensor mode (as torch.compile and torch.export trace) the public functions reach the
    operators (their fake implementations give the shapes); the eager path is never taken there."""
    tensors, ids, K = scan_case(rng, "mamba2_groups_dup_ids_K3")
    assert st._eager(*tensors, ids)
    s_rows = tensors[0][:3].contiguous()          # one state row per sequence, for the update
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in tensors]
        assert not st._eager(*fake, mode.from_tensor(ids))
        out = st.ssm_scan(*fake, mode.from_tensor(ids), K=K)
        assert out.shape == (tensors[1].numel() + K * 3 * 4 * 2 * 3,)
        s = mode.from_tensor(s_rows)
        with torch.no_grad():
            y = st.ssm_scan_update_(s, *fake[1:])
        assert y.shape == tensors[1].shape
