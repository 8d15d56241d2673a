"""ssmgrad.torch.gated_delta_net: the custom operators torch.ops.ssmgrad.gated_delta_net / gated_delta_net_back.

* ``torch.library.opcheck`` on the three operators (gated_delta_net_keep too, and the backward given its
  chunk states; test_schema, test_autograd_registration, test_faketensor,
  test_aot_dispatch_dynamic, each required to pass) over: scalar gate and per-channel gate (KDA), both head
  broadcasts with H_v / H_k = 2, key sequences shared by value sequences, K > 1 and K > n_t, the state as a
  transposed view (transformers' layout), float32 and float64, each form (auto, recurrence forced where
  auto takes the chunked form, chunked forced where auto takes the recurrence).
* Values: the public function must give the NumPy API's results bitwise (forward, and each gradient region
  of ``ssmgrad.gated_delta_net_back``), and torch.autograd of the torch reference (tests/reference.py) to
  1e-10 in float64.
* torch.compile(fullgraph=True) of a small delta-rule block: torch._dynamo.explain sees one graph and no
  break, with the operator in it; the compiled forward and every gradient equal eager (float64, 1e-12),
  each kernel runs once per step; torch.export of the block holds the operator and matches eager.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import ssmgrad
import ssmgrad.torch as st
from reference import GDN_NAMES, assert_close, make_gdn_inputs, ref_gdn_grads, ref_gdn_np

# .ci's sanitizer and compiler passes skip these; every test runs on one thread (tests/conftest.py's
# one_thread): opcheck makes many calls on tiny inputs, and results do not depend on the thread count
pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("one_thread")]

OPS = torch.ops.ssmgrad
SUBTESTS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")

# name -> (make_gdn_inputs arguments, K, head_bcast, state as a transposed view, form)
CASES = {
    "scalar_tiled": (dict(n_t=3, H_v=4, H_k=2, S=3), 1, "tiled", False, "auto"),
    "scalar_interleaved_K3": (dict(n_t=3, H_v=4, H_k=2, S=3), 3, "interleaved", False, "auto"),
    "kda_interleaved": (dict(n_t=3, H_v=4, H_k=2, S=3, kda=True), 2, "interleaved", False, "auto"),
    "kda_K_gt_n_t": (dict(n_t=2, H_v=2, H_k=2, S=3, kda=True), 4, "tiled", False, "auto"),
    "seqs_broadcast": (dict(n_seqs=2, n_seqs_k=1, n_t=3, H_v=2, H_k=1, S=3), 1, "tiled", False, "auto"),
    "state_transposed_view": (dict(n_t=3, H_v=4, H_k=2, S=3), 1, "interleaved", True, "auto"),
    "f32": (dict(n_t=3, H_v=4, H_k=2, S=3, kda=True, dtype=np.float32), 2, "interleaved", False, "auto"),
    "chunked_forced": (dict(n_t=5, H_v=4, H_k=2, S=3), 1, "interleaved", False, "chunked"),
    "recurrence_forced": (dict(n_t=40, H_v=2, H_k=1, S=3), 1, "tiled", False, "recurrence"),
}


def case(name, rng, grad=True):
    kw, K, head_bcast, transposed, _ = CASES[name]
    inp = make_gdn_inputs(rng, **kw)
    tensors = [torch.from_numpy(inp[k]) for k in GDN_NAMES]
    if transposed:     # the state of transformers' cache, (n, H_v, S_k, S_v), seen transposed: not contiguous
        tensors[-1] = tensors[-1].transpose(-1, -2).contiguous().transpose(-1, -2)
    return [t.requires_grad_(grad) for t in tensors], K, head_bcast


def check(op, args):
    res = opcheck(op, args, test_utils=SUBTESTS)
    assert res == {k: "SUCCESS" for k in SUBTESTS}, res


@pytest.mark.parametrize("name", list(CASES))
def test_opcheck(rng, name):
    tensors, K, head_bcast = case(name, rng)
    form = CASES[name][4]
    check(OPS.gated_delta_net.default, (*tensors, K, head_bcast, form))
    out = st.gated_delta_net(*tensors, K=K, head_bcast=head_bcast, form=form)
    grad = torch.from_numpy(rng.standard_normal(out.shape).astype(out.detach().numpy().dtype))
    check(OPS.gated_delta_net_back.default, (*(t.detach() for t in tensors), grad, K, head_bcast, form))
    # the forward keeping its chunks and the backward reading them (zeros where the call keeps none)
    check(OPS.gated_delta_net_keep.default, (*tensors, K, head_bcast, form))
    kept = OPS.gated_delta_net_keep(*(t.detach() for t in tensors), K, head_bcast, form)[1]
    S, kda = tensors[0].shape[-1], tensors[3].shape[-1] != 1
    n_c = -(-tensors[0].shape[1] // 64)
    want = (tensors[2].shape[0], tensors[2].shape[2], n_c, 16 * 16 + 128 * 16 + (8192 if kda else 12288))
    assert kept.shape == (want if K == 1 and form != "recurrence" else (0,)), kept.shape
    check(OPS.gated_delta_net_back.default, (*(t.detach() for t in tensors), grad, K, head_bcast, form, kept))


@pytest.mark.parametrize("name", list(CASES))
def test_bitwise_numpy_api_and_reference(rng, name):
    tensors, K, head_bcast = case(name, rng)
    form = CASES[name][4]
    arrays = [t.detach().numpy() for t in tensors]
    out = st.gated_delta_net(*tensors, K=K, head_bcast=head_bcast, form=form)
    assert np.array_equal(out.detach().numpy(),
                          ssmgrad.gated_delta_net(*arrays, K=K, head_bcast=head_bcast, form=form))
    g = torch.from_numpy(rng.standard_normal(out.shape).astype(arrays[0].dtype))
    grads = torch.autograd.grad(out, tensors, g)
    gin = ssmgrad.gated_delta_net_back(*arrays, g.numpy(), K=K, head_bcast=head_bcast, form=form)
    want = ssmgrad.split(gin, *(a.shape for a in arrays))
    for n, got, w in zip(GDN_NAMES, grads, want):
        assert got.shape == w.shape and np.array_equal(got.numpy(), w), f"d_{n} differs from the NumPy API"
    if arrays[0].dtype == np.float64:   # and the gradients are the reference's (torch.autograd of the recurrence)
        ref = ref_gdn_grads(*arrays, g.numpy(), K=K, head_bcast=head_bcast)
        for n, got in zip(GDN_NAMES, grads):
            assert_close(got.numpy(), ref[n], 1e-10, 1e-10, f"{name}: d_{n} vs reference")


@pytest.mark.parametrize("name", ["scalar_interleaved_K3", "f32"])
def test_eager_path_equals_operator_bitwise(rng, name, monkeypatch):
    """Outside tracing the public function skips the dispatcher (an autograd.Function with the operator's
    own autograd formula; the kernel alone under no_grad): the operator's results and gradients, bitwise.
    Under FakeTensor mode (as compile and export trace) it takes the operator."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    tensors, K, head_bcast = case(name, rng)
    op_in = [t.detach().clone().requires_grad_() for t in tensors]
    out_op = OPS.gated_delta_net(*op_in, K, head_bcast, "auto")
    with monkeypatch.context() as mp:
        def refuse(*args, **kwargs):
            raise AssertionError("the custom operator was called on the eager path")
        mp.setattr(st, "_gdn_op", refuse)
        out = st.gated_delta_net(*tensors, K=K, head_bcast=head_bcast)
        assert type(out.grad_fn).__name__ == "_GdnFnBackward"
        assert torch.equal(out.detach(), out_op.detach())
        g = torch.from_numpy(rng.standard_normal(out.shape).astype(out.detach().numpy().dtype))
        for a, b in zip(torch.autograd.grad(out, tensors, g), torch.autograd.grad(out_op, op_in, g)):
            assert a.dtype == b.dtype and torch.equal(a, b)
        with torch.no_grad():
            assert torch.equal(st.gated_delta_net(*tensors, K=K, head_bcast=head_bcast), out_op.detach())
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in tensors]
        assert not st._eager(*fake)
        v, state = tensors[2], tensors[5]
        assert st.gated_delta_net(*fake, K=K, head_bcast=head_bcast).shape == (v.numel() + K * state.numel(),)


@pytest.mark.parametrize("head_bcast", ["tiled", "interleaved"])
def test_forced_forms_match_reference(rng, head_bcast):
    """form= reaches the forward and its backward: each forced form gives the NumPy API's bits for that
    form (forward and every gradient), and torch.autograd of the float64 reference recurrence to 1e-10;
    the two forms round differently, so equal bits would mean the form was not passed."""
    inp = make_gdn_inputs(rng, n_seqs=2, n_t=70, H_v=4, H_k=2, S=8)    # two 64-token chunks
    arrays = [inp[n] for n in GDN_NAMES]
    g = rng.standard_normal(inp["v"].size + inp["state"].size)
    ref = ref_gdn_grads(*arrays, g, head_bcast=head_bcast)
    want_out = ref_gdn_np(*arrays, head_bcast=head_bcast)
    got = {}
    for form in ("recurrence", "chunked"):
        tensors = [torch.from_numpy(a).requires_grad_() for a in arrays]
        out = st.gated_delta_net(*tensors, head_bcast=head_bcast, form=form)
        grads = torch.autograd.grad(out, tensors, torch.from_numpy(g))
        assert np.array_equal(out.detach().numpy(),
                              ssmgrad.gated_delta_net(*arrays, head_bcast=head_bcast, form=form)), form
        gin = ssmgrad.gated_delta_net_back(*arrays, g, head_bcast=head_bcast, form=form)
        for n, d, w in zip(GDN_NAMES, grads, ssmgrad.split(gin, *(a.shape for a in arrays))):
            assert np.array_equal(d.numpy(), w), f"{form}: d_{n} differs from the NumPy API's"
        assert_close(out.detach().numpy(), want_out, 1e-10, 1e-10, f"{form}: out vs reference")
        for n, d in zip(GDN_NAMES, grads):
            assert_close(d.numpy(), ref[n], 1e-10, 1e-10, f"{form}: d_{n} vs reference")
        got[form] = (out.detach().numpy(), [d.numpy() for d in grads])
    assert not np.array_equal(got["recurrence"][0], got["chunked"][0])
    assert not all(np.array_equal(a, b) for a, b in zip(got["recurrence"][1], got["chunked"][1]))
    with pytest.raises(ValueError, match="form must be 'auto', 'recurrence' or 'chunked'"):
        st.gated_delta_net(*(torch.from_numpy(a) for a in arrays), form="wy")


def test_only_asked_gradients_and_errors(rng):
    tensors, K, head_bcast = case("scalar_tiled", rng, grad=False)
    tensors[2].requires_grad_()
    out = st.gated_delta_net(*tensors, K=K, head_bcast=head_bcast)
    (d_v,) = torch.autograd.grad(out.sum(), tensors[2])
    assert d_v.shape == tensors[2].shape
    with pytest.raises(ValueError, match="head_bcast must be 'tiled' or 'interleaved'"):
        st.gated_delta_net(*tensors, head_bcast="grouped")
    with pytest.raises(TypeError, match="same dtype"):
        st.gated_delta_net(tensors[0].float(), *tensors[1:])
    with pytest.raises(TypeError, match="beta must be a torch.Tensor"):
        st.gated_delta_net(*tensors[:4], tensors[4].numpy(), tensors[5])
    with pytest.raises(ValueError, match="K must be >= 1"):
        st.gated_delta_net(*tensors, K=0)
    with pytest.raises(ValueError):            # shapes are checked by the kernels' glue
        st.gated_delta_net(*tensors[:4], tensors[4][:, :1], tensors[5])


def test_double_backward_says_so(rng):
    tensors, K, head_bcast = case("scalar_tiled", rng)
    (d_q,) = torch.autograd.grad(st.gated_delta_net(*tensors).square().sum(), tensors[0], create_graph=True)
    with pytest.raises(RuntimeError, match="gated_delta_net_back.*no autograd formula"):
        d_q.sum().backward()


# ------------------------------------------------------------------------------------------------
# torch.compile and torch.export

class DeltaBlock(torch.nn.Module):
    """A gated delta-rule token mixer as the transformers families build it: projections, L2-normalized
    q and k with H_k key heads shared interleaved by H_v value heads, g = -exp(A_log) softplus(a + dt_bias),
    beta = sigmoid(b), from a zero state; the output projection."""

    def __init__(self, d=8, H_k=1, H_v=2, S=4):
        super().__init__()
        self.H_k, self.H_v, self.S = H_k, H_v, S
        self.qk = torch.nn.Linear(d, 2 * H_k * S, bias=False)
        self.v = torch.nn.Linear(d, H_v * S, bias=False)
        self.ab = torch.nn.Linear(d, 2 * H_v, bias=False)
        self.A_log = torch.nn.Parameter(torch.rand(H_v))
        self.dt_bias = torch.nn.Parameter(torch.randn(H_v))
        self.out = torch.nn.Linear(H_v * S, d, bias=False)

    def forward(self, h):                                      # h (batch, L, d)
        n, L, _ = h.shape
        q, k = F.normalize(self.qk(h).view(n, L, 2, self.H_k, self.S), dim=-1).unbind(2)
        v = self.v(h).view(n, L, self.H_v, self.S)
        a, b = self.ab(h).view(n, L, 2, self.H_v).unbind(2)
        g = (-self.A_log.exp() * F.softplus(a + self.dt_bias)).unsqueeze(-1)
        state = h.new_zeros(n, self.H_v, self.S, self.S)
        out = st.gated_delta_net(q, k, v, g, b.sigmoid().unsqueeze(-1), state, head_bcast="interleaved")
        return self.out(out[: v.numel()].view(n, L, -1))


def _block():
    torch.manual_seed(0)
    return DeltaBlock().double()


def _run(fn, block, h):
    h = h.detach().clone().requires_grad_()
    y = fn(h)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=y.dtype)
    grads = torch.autograd.grad(y, [h, *block.parameters()], g)
    return [y.detach(), *grads]


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = {"gated_delta_net": 0, "gated_delta_net_back": 0}
    for name in calls:
        def counted(*a, _fn=getattr(ssmgrad, name), _name=name, **kw):
            calls[_name] += 1
            return _fn(*a, **kw)
        monkeypatch.setattr(ssmgrad, name, counted)
    return calls


def test_compile_fullgraph_matches_eager(kernel_calls):
    torch.compiler.reset()
    block = _block()
    h = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    eager = _run(block, block, h)
    explained = torch._dynamo.explain(block)(h)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert len(explained.graphs) == 1 and "ssmgrad.gated_delta_net" in explained.graphs[0].code
    for k in kernel_calls:
        kernel_calls[k] = 0
    got = _run(torch.compile(block, fullgraph=True), block, h)
    assert kernel_calls == {"gated_delta_net": 1, "gated_delta_net_back": 1}, kernel_calls
    torch.compiler.reset()
    for i, (a, b) in enumerate(zip(eager, got)):
        assert_close(b.numpy(), a.numpy(), 1e-12, 1e-12, f"compiled vs eager, output {i}")


def test_export_runs_and_matches():
    block = _block()
    h = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    with torch.no_grad():
        want = block(h)
    ep = torch.export.export(block, (h,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "ssmgrad.gated_delta_net.default" in targets, targets
    assert_close(ep.module()(h).detach().numpy(), want.numpy(), 1e-12, 1e-12, "exported vs eager")
