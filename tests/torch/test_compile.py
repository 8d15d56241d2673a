"""torch.compile(fullgraph=True) and torch.export of Mamba-1 and Mamba-2 blocks written on ssmgrad.torch.

Oracles: the same block in eager mode (forward and every parameter gradient, float64 to 1e-12), itself
checked against the block on the torch reference ops (tests/reference.py). The compiled and exported
graphs must hold the ssmgrad operators (no graph break, no fallback), and the kernels must be called.
Compiling costs seconds (inductor generates and builds C++), so the blocks are tiny and each is compiled once.
"""

import pytest
import torch

import ssmgrad
import ssmgrad.torch as st
from reference import assert_close, make_scan_inputs
from torch_blocks import Mamba1Block, Mamba2Block

pytestmark = pytest.mark.integration   # .ci's sanitizer and compiler passes skip it

F64 = torch.float64
BLOCKS = {"mamba1": Mamba1Block, "mamba2": Mamba2Block}
KERNELS = ("ssm_conv", "ssm_conv_back", "ssm_conv_back_weight", "ssm_scan", "ssm_scan_back")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


@pytest.fixture
def kernel_calls(monkeypatch):
    """Counts the calls of ssmgrad's NumPy-level kernels (the custom ops look them up at call time)."""
    calls = {k: 0 for k in KERNELS}
    for name in KERNELS:
        def counted(*a, _fn=getattr(ssmgrad, name), _name=name, **kw):
            calls[_name] += 1
            return _fn(*a, **kw)
        monkeypatch.setattr(ssmgrad, name, counted)
    return calls


def _block(kind, ref=False):
    torch.manual_seed(0)                     # the same parameters for every copy of a block
    return BLOCKS[kind](ref=ref).double()


def _run(fn, block, h):
    """Output and the gradients of every parameter and of h under a fixed random upstream gradient."""
    h = h.detach().clone().requires_grad_()
    y = fn(h)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(1), dtype=F64)
    grads = torch.autograd.grad(y, [h, *block.parameters()], g)
    names = ["h", *(n for n, _ in block.named_parameters())]
    return y.detach(), dict(zip(names, grads))


def _assert_same(got, want, tol, what):
    y, grads = got
    y_w, grads_w = want
    assert_close(y.numpy(), y_w.numpy(), tol, tol, f"{what}: y")
    assert grads.keys() == grads_w.keys()
    for name in grads:
        assert_close(grads[name].numpy(), grads_w[name].numpy(), tol, tol, f"{what}: d_{name}")


@pytest.mark.parametrize("kind", ["mamba1", "mamba2"])
def test_compile_fullgraph_matches_eager(kind, kernel_calls):
    block = _block(kind)
    h = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2), dtype=F64)
    eager = _run(block, block, h)
    ref_block = _block(kind, ref=True)
    _assert_same(_run(ref_block, ref_block, h), eager, 1e-12, f"{kind} reference ops vs ssmgrad, eager")

    explained = torch._dynamo.explain(block)(h)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert len(explained.graphs) == 1
    code = explained.graphs[0].code
    assert "ssmgrad.ssm_conv" in code and "ssmgrad.ssm_scan" in code, code

    for k in kernel_calls:
        kernel_calls[k] = 0
    compiled = torch.compile(block, fullgraph=True)
    got = _run(compiled, block, h)
    _assert_same(got, eager, 1e-12, f"{kind} compiled vs eager")
    # the compiled forward and backward ran ssmgrad's kernels, once each per call
    assert kernel_calls == {k: 1 for k in KERNELS}, kernel_calls


@pytest.mark.parametrize("kind", ["mamba1", "mamba2"])
def test_export_runs_and_matches(kind):
    block = _block(kind)
    h = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(3), dtype=F64)
    with torch.no_grad():
        want = block(h)
    ep = torch.export.export(block, (h,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"ssmgrad.ssm_conv.default", "ssmgrad.ssm_scan.default"} <= targets, targets
    got = ep.module()(h)
    assert_close(got.detach().numpy(), want.numpy(), 1e-12, 1e-12, f"{kind} exported vs eager")


def test_compile_in_place_update():
    # a generation step: the one-token update writes the cache in place, inside a compiled graph
    rng = __import__("numpy").random.default_rng(4)
    inp = make_scan_inputs(rng, n_head=4, head_dim=2, d_state=3, n_group=2, n_seqs=2, n_t=1, ids=[0, 1])
    s, x, dt, A, B, C = (torch.from_numpy(inp[k]) for k in ("s", "x", "dt", "A", "B", "C"))

    def step(state, x, dt, A, B, C):
        return st.ssm_scan_update_(state, x, dt, A, B, C) * 2.0

    s_eager, s_comp = s.clone(), s.clone()
    want = step(s_eager, x, dt, A, B, C)
    got = torch.compile(step, fullgraph=True)(s_comp, x, dt, A, B, C)
    assert torch.equal(got, want) and torch.equal(s_comp, s_eager)
    assert not torch.equal(s_comp, s)


def test_dynamic_shapes_compile_once():
    # one graph for every batch size and length (symbolic shapes through the fake implementations)
    from torch._dynamo.testing import CompileCounterWithBackend
    block = _block("mamba2")
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(block, backend=counter, fullgraph=True, dynamic=True)
    for b, L in ((2, 5), (3, 7), (4, 9)):        # sizes 0 and 1 are specialised by design
        h = torch.randn(b, L, 8, generator=torch.Generator().manual_seed(L), dtype=F64)
        _assert_same(_run(compiled, block, h), _run(block, block, h), 1e-12, f"dynamic b={b} L={L}")
    assert counter.frame_count == 1, f"compiled {counter.frame_count} times"
