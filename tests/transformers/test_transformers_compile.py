"""ssmgrad.transformers under torch.compile: the patched model keeps ssmgrad's kernels when compiled.

While dynamo traces, the replacements call ssmgrad.torch's custom operators (torch.ops.ssmgrad.*) and change
no Python state (no counter, no cache, no log: a value dynamo saw change would be guarded on and recompile
every call). Oracles: the eager patched run (itself tested against stock in test_transformers.py) and stock
generate. The ssmgrad operators that ran are counted with torch.profiler (no mock: the profiler records each
dispatched operator by name).

Tiny models; each compile still takes from ten seconds to about a minute on a busy 2-core machine.
"""

import contextlib
from collections import Counter

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.profiler import profile

from test_transformers import batch, keep_float64, make_model

import ssmgrad.transformers as sht

pytestmark = pytest.mark.integration   # .ci's sanitizer and compiler passes skip it

# a training step's operators: with a gradient wanted the scan's forward is ssm_scan_keep (it keeps the chunk
# states that the backward reads)
OPS = ("ssmgrad::ssm_conv", "ssmgrad::ssm_scan_keep", "ssmgrad::ssm_scan_back", "ssmgrad::ssm_conv_back",
       "ssmgrad::ssm_conv_back_weight")


@pytest.fixture(autouse=True)
def fresh():
    sht.unpatch()
    torch._dynamo.reset()
    counters.clear()
    yield
    sht.unpatch()
    torch._dynamo.reset()


def ssmgrad_ops(prof):
    return Counter(e.name for e in prof.events() if e.name.startswith("ssmgrad::"))


def train_step(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    params = getattr(model, "_orig_mod", model).named_parameters()      # the compiled wrapper's names get a prefix
    return loss.detach(), {n: p.grad.clone() for n, p in params if p.grad is not None}


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_compiled_training_agrees_with_eager(family):
    """torch.compile(model) of a patched model (float64, stock casts neutralised): loss and every gradient
    equal the eager patched run to 1e-10; each step runs ssmgrad's forward and backward operators once per
    layer; nothing falls back, no Python counter moves, and later steps compile nothing new."""
    model = make_model(family, torch.float64, seed=3)
    ids = batch(seed=4)
    n_layers = model.config.num_hidden_layers
    with keep_float64(), sht.patched([family]):
        loss0, g0 = train_step(model, ids)                      # eager, patched
        compiled = torch.compile(model)
        calls, fallbacks = dict(sht.call_counts), dict(sht.fallback_counts)
        train_step(compiled, ids)                               # compiles
        graphs = counters["stats"]["unique_graphs"]
        with profile() as prof:
            loss1, g1 = train_step(compiled, ids)
        assert counters["stats"]["unique_graphs"] == graphs     # no recompilation
    assert ssmgrad_ops(prof) == {op: n_layers for op in OPS}
    assert dict(sht.call_counts) == calls and dict(sht.fallback_counts) == fallbacks
    assert not any("compile" in k for k in sht.fallback_counts)
    assert set(g1) == set(g0)
    assert abs(float(loss1 - loss0)) <= 1e-10 * max(1.0, abs(float(loss0)))
    for name, ref in g0.items():
        err = float((g1[name] - ref).abs().max()) / (1.0 + float(ref.abs().max()))
        assert err <= 1e-10, f"{name}: {err:.3g}"


def test_compiled_generate_static_cache_compiles_once():
    """generate with a static cache and a compiled forward (fullgraph) on a patched Mamba-2 model: the same
    tokens as stock eager generate; the first generate compiles one graph, the second compiles nothing new
    and runs ssmgrad's scan and conv operators in every compiled one-token step."""
    from transformers import CompileConfig
    family, n_new = "mamba2", 4
    model = make_model(family, torch.float32, seed=7).eval()
    ids = batch(n_seqs=2, n_t=6, seed=8)
    config = CompileConfig(fullgraph=True, mode=None)
    config._compile_all_devices = True                          # transformers compiles on CUDA only otherwise

    def generate(**kw):
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                              do_sample=False, pad_token_id=0, **kw)

    ref = generate()
    with sht.patched([family]):
        first = generate(cache_implementation="static", compile_config=config)
        graphs = counters["stats"]["unique_graphs"]
        with profile() as prof:
            second = generate(cache_implementation="static", compile_config=config)
    assert graphs == 1 and counters["stats"]["unique_graphs"] == graphs
    assert torch.equal(first, ref) and torch.equal(second, ref)
    # the prefill runs eagerly (ssmgrad's NumPy path without autograd); each of the n_new - 1 compiled
    # one-token steps calls the scan and the conv operator once per layer
    ops = ssmgrad_ops(prof)
    n_layers = model.config.num_hidden_layers
    assert ops["ssmgrad::ssm_scan"] == ops["ssmgrad::ssm_conv"] == n_layers * (n_new - 1), ops
    assert not any("compile" in k for k in sht.fallback_counts)


# ---------------------------------------------------------------------------------------------------
# the data-dependent cases: a time_step_limit that clamps, a one-token update not expanded per head

def _chunk_scan_inputs(dtype, seed=0):
    """Mamba-2 chunk-scan inputs (batch 2, 11 tokens, 4 heads of 3, 2 groups, d_state 5) whose
    softplus(dt + dt_bias) spans about 0.01 to 10, with head 0 of sequence 0 running from 18.5 to 21.5 (both
    sides of the softplus threshold 20)."""
    gen = torch.Generator().manual_seed(seed)
    b, t, h, p, g, n = 2, 11, 4, 3, 2, 5

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    dt = 2.0 * randn(b, t, h)
    bias = 0.5 * randn(h)
    bias[0] = 0.0
    dt[0, :, 0] = torch.linspace(18.5, 21.5, t, dtype=torch.float64)
    inputs = dict(x=randn(b, t, h, p), dt=dt, A=-0.5 * torch.rand(h, generator=gen, dtype=torch.float64),
                  B=randn(b, t, g, n), C=randn(b, t, g, n), D=randn(h), dt_bias=bias, initial_states=randn(b, h, p, n))
    return {k: v.to(dtype) for k, v in inputs.items()}


def _softplus_values(inputs):
    return torch.nn.functional.softplus(inputs["dt"] + inputs["dt_bias"])


def _edge_limits():
    """(dt_limit, on_edge) cases: clamping from both sides; at the threshold 20 (a limit of 20, limits
    around it); limits equal to softplus values (those elements sit on the clamp's edges, where torch.clamp
    keeps the gradient); an upper limit only."""
    sp = _softplus_values(_chunk_scan_inputs(torch.float64))
    ordered = sp.flatten().sort().values
    edges = (float(ordered[len(ordered) // 4]), float(ordered[len(ordered) // 2]))
    return [((0.3, 0.8), False), ((0.5, 20.0), False), ((19.5, 20.5), False), (edges, True), ((0.0, 1.5), False)]


def _chunk_scan_loss(fn, inputs, dt_limit, wy, wf):
    """sum(y * wy) + sum(final states * wf) of one chunk-scan call (random weights: every output counts)."""
    y, final = fn(inputs["x"], inputs["dt"], inputs["A"], inputs["B"], inputs["C"], 4, D=inputs["D"],
                  dt_bias=inputs["dt_bias"], initial_states=inputs["initial_states"], dt_softplus=True,
                  dt_limit=dt_limit, return_final_states=True)
    return (y * wy).sum() + (final * wf).sum()


def _loss_and_grads(fn, inputs, dt_limit):
    leaves = {k: v.clone().requires_grad_() for k, v in inputs.items()}
    loss = fn(leaves, dt_limit)
    loss.backward()
    return loss.detach(), {k: v.grad for k, v in leaves.items()}


def _assert_close(got, ref, tol):
    (loss1, g1), (loss0, g0) = got, ref
    assert abs(float(loss1 - loss0)) <= tol * max(1.0, abs(float(loss0))), (float(loss0), float(loss1))
    for name, r in g0.items():
        err = float((g1[name] - r).abs().max()) / (1.0 + float(r.abs().max()))
        assert err <= tol, f"{name}: {err:.3g}"


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 2e-4)])
@pytest.mark.parametrize("dt_limit, on_edge", _edge_limits())
def test_compiled_time_step_limit_runs_on_ssmgrad(dt_limit, on_edge, dtype, tol):
    """mamba2_chunk_scan with a dt_limit that clamps, compiled with fullgraph=True: one graph, no break,
    ssmgrad's scan and scan backward operators run once each (no fallback), and the loss and every
    gradient (x, dt, A, B, C, D, dt_bias, initial_states) equal the stock function in eager mode (float64
    with stock's float32 casts neutralised: 1e-10; float32 as shipped: 2e-4). The limits clamp these inputs
    (checked), at and around the threshold 20 and exactly on a softplus value."""
    from transformers.models.mamba2 import modeling_mamba2 as mod
    inputs = _chunk_scan_inputs(dtype)
    lo, hi = dt_limit
    sp = _softplus_values(inputs)
    assert bool((sp < lo).any() or (sp > hi).any()), "the limit clamps nothing"
    if on_edge and dtype == torch.float64:
        assert bool((sp == lo).any()) and bool((sp == hi).any())

    gen = torch.Generator().manual_seed(99)
    wy = torch.randn(inputs["x"].shape, generator=gen, dtype=torch.float64).to(dtype)
    wf = torch.randn(inputs["initial_states"].shape, generator=gen, dtype=torch.float64).to(dtype)

    def loss(leaves, limit):
        return _chunk_scan_loss(mod.mamba2_chunk_scan, leaves, limit, wy, wf)

    with keep_float64() if dtype == torch.float64 else contextlib.nullcontext():
        ref = _loss_and_grads(loss, inputs, dt_limit)               # stock, eager
    with sht.patched(["mamba2"]):
        calls, fallbacks = dict(sht.call_counts), dict(sht.fallback_counts)
        compiled = torch.compile(loss, fullgraph=True)
        _loss_and_grads(compiled, inputs, dt_limit)                # compiles
        with profile() as prof:
            got = _loss_and_grads(compiled, inputs, dt_limit)
        explained = torch._dynamo.explain(loss)({k: v.clone().requires_grad_() for k, v in inputs.items()}, dt_limit)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    # with a gradient wanted the forward is ssm_scan_keep: it keeps the chunk states for the backward
    assert ssmgrad_ops(prof) == {"ssmgrad::ssm_scan_keep": 1, "ssmgrad::ssm_scan_back": 1}
    assert dict(sht.call_counts) == calls and dict(sht.fallback_counts) == fallbacks
    _assert_close(got, ref, tol)


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("expanded", ["none", "dt"])
def test_compiled_one_token_update_not_per_head(expanded, dtype, tol):
    """The Mamba-2 one-token update with dt, dt_bias and A varying inside a head (or dt expanded per head and
    A not), compiled with fullgraph=True: one graph, no break, ssmgrad's scan operator runs (no fallback),
    and y and the state written in place equal the stock function in eager mode (dt across the softplus
    threshold 20)."""
    from transformers.models.mamba2 import modeling_mamba2 as mod
    gen = torch.Generator().manual_seed(5)
    b, h, p, g, n = 2, 4, 3, 2, 5

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    x, B, C, z, D = randn(b, h, p), randn(b, g, n), randn(b, g, n), randn(b, h, p), randn(h, p)
    A = -torch.rand(h, p, n, generator=gen, dtype=torch.float64).to(dtype)
    bias = randn(h, p)
    dt = randn(b, h, p)
    dt[0, 0] += 21.0                                                # sequence 0, head 0 above the threshold 20
    if expanded == "dt":
        dt = dt[:, :, :1].expand(-1, -1, p)                         # one value per head, as the mixers pass it
    bias[1] += 19.5                                                 # head 1 on both sides of the threshold
    state0 = randn(b, h, p, n)

    def update(state, x, dt, A, B, C, D, bias, z):
        return mod.mamba2_selective_state_update(state, x, dt, A, B, C, D, dt_bias=bias, dt_softplus=True, z=z)

    args = (x, dt, A, B, C, D, bias, z)
    s_ref = state0.clone()
    with keep_float64() if dtype == torch.float64 else contextlib.nullcontext():
        ref = update(s_ref, *args)                                  # stock, eager
    with sht.patched(["mamba2"]):
        calls, fallbacks = dict(sht.call_counts), dict(sht.fallback_counts)
        compiled = torch.compile(update, fullgraph=True)
        compiled(state0.clone(), *args)                             # compiles
        s_got = state0.clone()
        with profile() as prof:
            got = compiled(s_got, *args)
        explained = torch._dynamo.explain(update)(state0.clone(), *args)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    assert ssmgrad_ops(prof) == {"ssmgrad::ssm_scan": 1}
    assert dict(sht.call_counts) == calls and dict(sht.fallback_counts) == fallbacks
    torch.testing.assert_close(got, ref, rtol=tol, atol=tol)
    torch.testing.assert_close(s_got, s_ref, rtol=tol, atol=tol)
    assert not torch.equal(s_got, state0)


def test_compiled_mamba2_model_with_clamping_time_step_limit():
    """A Mamba-2 model whose time_step_limit clamps softplus(dt) from both sides (limits taken from the
    model's own values: some below, some above, some between), compiled with fullgraph=True and trained
    patched: one graph, no break, ssmgrad's forward and backward operators once per layer, nothing falls
    back, and the loss and every gradient equal the stock model in eager mode (float64, 1e-10)."""
    from transformers.models.mamba2 import modeling_mamba2 as mod
    family = "mamba2"
    model = make_model(family, torch.float64, seed=3)
    ids = batch(seed=4)
    n_layers = model.config.num_hidden_layers
    seen = []
    stock = mod.mamba2_chunk_scan

    def recording(hidden_states, dt, *args, dt_bias=None, **kwargs):        # the stock function, recorded
        seen.append(torch.nn.functional.softplus(dt + dt_bias).detach().flatten())
        return stock(hidden_states, dt, *args, dt_bias=dt_bias, **kwargs)

    with keep_float64(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(mod, "mamba2_chunk_scan", recording)
        train_step(model, ids)
    ordered = torch.cat(seen).sort().values
    limit = (float(ordered[len(ordered) // 4]), float(ordered[3 * len(ordered) // 4]))
    for m in model.modules():
        if hasattr(m, "time_step_limit"):
            m.time_step_limit = limit
    with keep_float64():
        loss0, g0 = train_step(model, ids)                      # stock, eager
        with sht.patched([family]):
            calls, fallbacks = dict(sht.call_counts), dict(sht.fallback_counts)
            compiled = torch.compile(model, fullgraph=True)
            train_step(compiled, ids)                           # compiles
            with profile() as prof:
                loss1, g1 = train_step(compiled, ids)
            explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    assert ssmgrad_ops(prof) == {op: n_layers for op in OPS}
    assert dict(sht.call_counts) == calls and dict(sht.fallback_counts) == fallbacks
    assert set(g1) == set(g0)
    _assert_close((loss1, g1), (loss0, g0), 1e-10)
