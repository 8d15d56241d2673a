"""ssmgrad.transformers under torch.compile: the patched model keeps ssmgrad's kernels when compiled.

While dynamo traces, the replacements call ssmgrad.torch's custom operators (torch.ops.ssmgrad.*) and change
no Python state (no counter, no cache, no log: a value dynamo saw change would be guarded on and recompile
every call). Oracles: the eager patched run (itself tested against stock in test_transformers.py) and stock
generate. The ssmgrad operators that ran are counted with torch.profiler (no mock: the profiler records each
dispatched operator by name).

Tiny models; each compile still takes from ten seconds to about a minute on a busy 2-core machine.
"""

from collections import Counter

import pytest
import torch
import torch._dynamo
from torch._dynamo.utils import counters
from torch.profiler import profile

from test_transformers import batch, keep_float64, make_model

import ssmgrad.transformers as sht

pytestmark = pytest.mark.integration   # .ci's sanitizer and compiler passes skip it

OPS = ("ssmgrad::ssm_conv", "ssmgrad::ssm_scan", "ssmgrad::ssm_scan_back", "ssmgrad::ssm_conv_back",
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
