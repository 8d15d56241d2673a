"""ssmgrad.transformers on the delta-rule families of transformers 5.24 against stock transformers.

Six families call the gated delta rule (``torch_chunk_gated_delta_rule`` / ``torch_recurrent_gated_delta_rule``:
qwen3_next, qwen3_5, qwen3_5_moe, qwen4_exp, olmo_hybrid, lara_mini) and three Kimi delta attention, the
same rule with a gate per key channel (``chunk_kimi_delta_attention`` / ``recurrent_kimi_delta_attention``:
kimi_linear, bailing_hybrid, glm5_next). patch() replaces those functions (and the conv, tested in
test_transformers_conv.py). Oracle: the stock transformers CPU path (the torch bodies; flash-linear-attention
is not installed) of the same tiny random model or the same function call:

* each function, called directly: output, final state and the gradient of every input (initial state
  included), float64 with the stock float32 casts neutralised, to 1e-10; key heads shared by 2 value heads;
  n_t 70 (two of stock's 64-token chunks), with and without initial state and L2 norm;
* every family's model: loss and every parameter gradient (float64, 1e-10; float32 as shipped, within the
  measured float32 error), greedy generate (tokens equal, scores close), and the cache after a prefill, a
  three-token continuation (the chunked path from a cached state) and one token (the recurrent path);
* key and value head dims that differ (OLMo-hybrid's default), run zero-padded to a square state;
* what falls back (a ``scale``, packed sequences): the stock result, counted and logged; torch._dynamo
  traces the patched function in one graph with ssmgrad's operator.

Each model is tiny (hidden 16, one delta-rule layer and one attention layer).
"""

import importlib
import logging
import os
from collections import Counter

import pytest
import torch

import transformers
from test_transformers import batch, build_model, keep_float64, loss_and_grads
from test_transformers_conv import CONV_MODELS, make

import ssmgrad.transformers as sht

pytestmark = pytest.mark.integration   # .ci's sanitizer and compiler passes skip it

GDN = ["qwen3_next", "qwen3_5", "qwen3_5_moe", "qwen4_exp", "olmo_hybrid", "lara_mini"]
KDA = ["kimi_linear", "bailing_hybrid", "glm5_next"]
DELTA = GDN + KDA
CHUNK = {f: "torch_chunk_gated_delta_rule" for f in GDN} | {f: "chunk_kimi_delta_attention" for f in KDA}
RECURRENT = {f: "torch_recurrent_gated_delta_rule" for f in GDN} | {f: "recurrent_kimi_delta_attention" for f in KDA}


def _modeling(family):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


@pytest.fixture(autouse=True)
def always_unpatched():
    sht.unpatch()
    yield
    sht.unpatch()


def test_table_is_every_delta_rule_family():
    """The families patched for the delta rule are exactly the modeling files of the installed transformers
    that define it (none left out), each with the functions its kind calls."""
    models = os.path.dirname(transformers.models.__file__)
    found = set()
    for family in os.listdir(models):
        path = os.path.join(models, family, f"modeling_{family}.py")
        if os.path.exists(path):
            src = open(path, encoding="utf-8").read()
            if "def torch_chunk_gated_delta_rule" in src or "def chunk_kimi_delta_attention" in src:
                found.add(family)
    assert found == set(DELTA)
    assert {f for f, names in sht.FAMILIES.items() if names == sht.GDN_FUNCTIONS} == set(GDN)
    assert {f for f, names in sht.FAMILIES.items() if names == sht.KDA_FUNCTIONS} == set(KDA)


def test_patch_needs_the_files_l2norm(monkeypatch):
    """The replacements call the modeling file's own ``l2norm``: a file without it is not patched (named
    explicitly: RuntimeError naming it; with all families: left stock, the others patched)."""
    mod = _modeling("kimi_linear")
    stock = mod.chunk_kimi_delta_attention
    monkeypatch.delattr(mod, "l2norm")
    with pytest.raises(RuntimeError, match=r"modeling_kimi_linear has no function `l2norm`"):
        sht.patch(["kimi_linear"])
    assert mod.chunk_kimi_delta_attention is stock
    done = sht.patch()
    assert "kimi_linear" not in done and "bailing_hybrid" in done and mod.chunk_kimi_delta_attention is stock


# ------------------------------------------------------------------------------------------------
# the functions, called directly

def _inputs(kda, n_t, H_k, H_v, S, initial, seed, d_v=None):
    """Inputs as the mixers pass them (transformers' layouts): key head dim S, value head dim d_v (S)."""
    gen = torch.Generator().manual_seed(seed)
    d_v = S if d_v is None else d_v

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    b = 2
    q, k, v = randn(b, n_t, H_k, S), randn(b, n_t, H_k, S), randn(b, n_t, H_v, d_v)
    g = -torch.rand(*((b, n_t, H_v, S) if kda else (b, n_t, H_v)), generator=gen, dtype=torch.float64)
    beta = torch.rand(b, n_t, H_v, generator=gen, dtype=torch.float64)
    state = randn(b, H_v, S, d_v) if initial else None
    return [q, k, v, g, beta, state]


def _call(fn, tensors, l2norm, seed):
    """fn's output and final state, and the gradients of every input under fixed random weights of both."""
    leaves = [t.clone().requires_grad_() if t is not None else None for t in tensors]
    q, k, v, g, beta, state = leaves
    o, final = fn(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                  use_qk_l2norm_in_kernel=l2norm)
    gen = torch.Generator().manual_seed(seed)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() \
        + (final * torch.randn(final.shape, generator=gen, dtype=final.dtype)).sum()
    grads = torch.autograd.grad(loss, [t for t in leaves if t is not None])
    return [o.detach(), final.detach(), *grads]


CASES = [  # (kind, path, n_t, H_k, H_v, initial state, l2norm, key head dim, value head dim)
    ("gdn", "chunk", 70, 2, 4, True, True, 8, 8),
    ("gdn", "chunk", 70, 2, 4, False, False, 8, 8),
    ("gdn", "chunk", 5, 3, 3, True, True, 8, 8),
    ("gdn", "chunk", 6, 2, 4, True, True, 4, 8),          # OLMo-hybrid's default: d_v = 2 d_k (padded)
    ("gdn", "chunk", 6, 2, 4, True, True, 8, 4),
    ("gdn", "recurrent", 1, 2, 4, True, True, 8, 8),
    ("gdn", "recurrent", 3, 1, 4, True, False, 8, 8),
    ("gdn", "recurrent", 1, 2, 4, True, True, 4, 8),
    ("kda", "chunk", 70, 2, 2, True, True, 8, 8),
    ("kda", "chunk", 5, 3, 3, False, True, 8, 8),
    ("kda", "chunk", 5, 2, 2, True, True, 4, 8),
    ("kda", "recurrent", 1, 2, 2, True, True, 8, 8),
    ("kda", "recurrent", 3, 2, 2, True, False, 8, 8),
]


@pytest.mark.parametrize("kind, path, n_t, H_k, H_v, initial, l2norm, d_k, d_v", CASES)
def test_function_matches_stock(kind, path, n_t, H_k, H_v, initial, l2norm, d_k, d_v):
    """Output, final state and every input's gradient equal the stock function's (float64, 1e-10)."""
    family = "qwen3_next" if kind == "gdn" else "kimi_linear"
    name = {("gdn", "chunk"): "torch_chunk_gated_delta_rule", ("gdn", "recurrent"): "torch_recurrent_gated_delta_rule",
            ("kda", "chunk"): "chunk_kimi_delta_attention", ("kda", "recurrent"): "recurrent_kimi_delta_attention"}
    name = name[kind, path]
    mod = _modeling(family)
    tensors = _inputs(kind == "kda", n_t, H_k, H_v, d_k, initial, seed=n_t + H_k, d_v=d_v)
    with keep_float64():
        ref = _call(getattr(mod, name), tensors, l2norm, seed=1)
        n0, fallbacks = sht.call_counts[name], dict(sht.fallback_counts)
        with sht.patched([family]):
            got = _call(getattr(mod, name), tensors, l2norm, seed=1)
    assert sht.call_counts[name] == n0 + 1 and dict(sht.fallback_counts) == fallbacks
    assert len(got) == len(ref) == 7 + int(initial)        # o, final state, d_q .. d_beta (, d_state)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert b.shape == a.shape and b.dtype == a.dtype, i
        err = float((b - a).abs().max()) / (1.0 + float(a.abs().max()))
        assert err <= 1e-10, f"{name}: output {i} differs by {err:.3g}"


def test_function_dtypes_as_stock():
    """A bfloat16 call: the output in bfloat16 and the state in float32, as stock (which computes in float32)."""
    mod = _modeling("qwen3_next")
    q, k, v, g, beta, state = _inputs(False, 5, 2, 4, 8, True, seed=3)
    args = [t.to(torch.bfloat16) for t in (q, k, v)]
    ref = mod.torch_chunk_gated_delta_rule(*args, g=g.float(), beta=beta.bfloat16(), initial_state=state.float(),
                                           output_final_state=True, use_qk_l2norm_in_kernel=True)
    with sht.patched(["qwen3_next"]):
        got = mod.torch_chunk_gated_delta_rule(*args, g=g.float(), beta=beta.bfloat16(), initial_state=state.float(),
                                               output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert [t.dtype for t in got] == [t.dtype for t in ref] == [torch.bfloat16, torch.float32]
    torch.testing.assert_close(got[0], ref[0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(got[1], ref[1], rtol=1e-4, atol=1e-4)
    got = mod.torch_chunk_gated_delta_rule(*args, g=g.float(), beta=beta.bfloat16())
    assert got[1] is None


# ------------------------------------------------------------------------------------------------
# the models

def _delta_params(model):
    return {n for n, p in model.named_parameters() if any(s in n for s in ("A_log", "dt_bias", "b_proj", "in_proj_ba"))}


@pytest.mark.parametrize("family", DELTA)
def test_family_float64_exact(family):
    """Loss and every parameter gradient equal stock to 1e-10 (float64, casts neutralised, n_t 70: two of
    stock's 64-token chunks); the delta rule ran on ssmgrad, nothing fell back, the gate parameters have
    nonzero gradients."""
    model = make(family, torch.float64, seed=21)
    ids = batch(n_seqs=2, n_t=70, seed=22)
    fallbacks = dict(sht.fallback_counts)
    with keep_float64():
        loss0, g0 = loss_and_grads(model, ids)
        n0 = sht.call_counts[CHUNK[family]]
        with sht.patched([family]):
            loss1, g1 = loss_and_grads(model, ids)
        ran = sht.call_counts[CHUNK[family]] - n0
    assert ran >= 1 and dict(sht.fallback_counts) == fallbacks
    assert set(g0) == set(g1)
    gates = _delta_params(model) & set(g0)
    assert gates, "no delta-rule gate parameter found"
    for name in gates:
        assert g0[name].abs().max() > 0, f"{name}: all-zero gradient"
    assert abs(float(loss1 - loss0)) <= 1e-10 * max(1.0, float(loss0.abs()))
    for name in g0:
        ref = g0[name]
        err = float((g1[name] - ref).abs().max()) / (1.0 + float(ref.abs().max()))
        assert err <= 1e-10, f"{name}: relative error {err:.3g}"


# float32 as shipped (stock computes the delta rule in float32 too): the largest difference measured over the
# nine families, relative to each gradient's largest entry, was 3.9e-7 (olmo_hybrid; loss 2.0e-7, lara_mini);
# the bound has ~10x margin. (float64: loss <= 2.4e-16, gradients <= 6e-16 measured.)
F32_TOL = 4e-6
# greedy generate, float32: the largest score difference measured was 7.3e-7 (olmo_hybrid); ~7x margin
SCORE_TOL = 5e-6


@pytest.mark.parametrize("family", DELTA)
def test_family_float32_as_shipped(family):
    model = make(family, torch.float32, seed=23)
    ids = batch(n_seqs=2, n_t=20, seed=24)
    loss0, g0 = loss_and_grads(model, ids)
    n0 = sht.call_counts[CHUNK[family]]
    with sht.patched([family]):
        loss1, g1 = loss_and_grads(model, ids)
    assert sht.call_counts[CHUNK[family]] > n0
    assert abs(float(loss1 - loss0)) <= F32_TOL * max(1.0, float(loss0.abs()))
    for name in g0:
        ref = g0[name]
        err = float((g1[name] - ref).abs().max()) / (1.0 + float(ref.abs().max()))
        assert err <= F32_TOL, f"{name}: relative error {err:.3g}"


def _generate(model, ids, n_new=6):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                          do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)


@pytest.mark.parametrize("family", DELTA)
def test_family_generate(family):
    """Greedy generate with the cache (float32 as shipped): the same tokens and scores as stock; the
    prefill took the chunked function and every new token the recurrent one, on ssmgrad."""
    model = make(family, torch.float32, seed=25).eval()
    ids = batch(n_seqs=2, n_t=6, seed=26)
    ref = _generate(model, ids)
    n_chunk, n_rec = sht.call_counts[CHUNK[family]], sht.call_counts[RECURRENT[family]]
    with sht.patched([family]):
        got = _generate(model, ids)
    assert sht.call_counts[CHUNK[family]] > n_chunk and sht.call_counts[RECURRENT[family]] > n_rec
    assert torch.equal(ref.sequences, got.sequences)
    for a, b in zip(ref.scores, got.scores):
        torch.testing.assert_close(b, a, rtol=SCORE_TOL, atol=SCORE_TOL)


def _prefill_continue_step(model, ids):
    """Prefill ids[:, :-4], continue with the next three tokens in one call (the chunked function from the
    cached state), then the last token (the recurrent function); the logits of the three calls and the
    cached recurrent states, cloned."""
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids[:, :-4], use_cache=True)
        cache = out.past_key_values
        logits.append(out.logits)
        for part in (ids[:, -4:-1], ids[:, -1:]):
            out = model(input_ids=part, use_cache=True, past_key_values=cache)
            logits.append(out.logits)
    states = [t.clone() for layer in cache.layers
              for t in getattr(layer, "recurrent_states", {}).values() if t is not None]
    return logits, states


@pytest.mark.parametrize("family", DELTA)
def test_family_cache_continuation(family):
    """Logits and cached recurrent states after a prefill, a three-token continuation and one token equal
    stock (float64, casts neutralised, 1e-10): the initial state reaches the chunked path too."""
    model = make(family, torch.float64, seed=27).eval()
    ids = batch(n_seqs=2, n_t=9, seed=28)
    with keep_float64():
        l0, s0 = _prefill_continue_step(model, ids)
        n_chunk, n_rec = sht.call_counts[CHUNK[family]], sht.call_counts[RECURRENT[family]]
        with sht.patched([family]):
            l1, s1 = _prefill_continue_step(model, ids)
    assert sht.call_counts[CHUNK[family]] - n_chunk == 2 and sht.call_counts[RECURRENT[family]] - n_rec == 1
    assert len(s0) == len(s1) == 1
    for a, b in zip(l0 + s0, l1 + s1):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------------------------------------
# what falls back

def test_unequal_head_dims_run_padded():
    """OLMo-hybrid's default value head dim is twice the key head dim; ggml's state is square, so ssmgrad
    pads the key channels with zeros: loss and every gradient equal stock (float64, 1e-10), nothing falls back."""
    config, model_class, kwargs = CONV_MODELS["olmo_hybrid"]
    model = build_model((config, model_class, dict(kwargs, linear_value_head_dim=16)), torch.float64, seed=29)
    ids = batch(seed=30)
    fallbacks = dict(sht.fallback_counts)
    with keep_float64():
        loss0, g0 = loss_and_grads(model, ids)
        n0 = sht.call_counts["torch_chunk_gated_delta_rule"]
        with sht.patched(["olmo_hybrid"]):
            loss1, g1 = loss_and_grads(model, ids)
    assert sht.call_counts["torch_chunk_gated_delta_rule"] > n0 and dict(sht.fallback_counts) == fallbacks
    assert abs(float(loss1 - loss0)) <= 1e-10 * float(loss0.abs())
    for name in g0:
        err = float((g1[name] - g0[name]).abs().max()) / (1.0 + float(g0[name].abs().max()))
        assert err <= 1e-10, f"{name}: relative error {err:.3g}"


def test_scale_and_packed_sequences_fall_back(caplog, monkeypatch):
    """A ``scale`` (flash-linear-attention's argument; the stock torch body ignores it) gives the stock result;
    packed sequences (``cu_seqlens``) the stock function's own error; both counted, each reason logged once."""
    mod = _modeling("qwen3_next")
    q, k, v, g, beta, state = _inputs(False, 5, 2, 4, 8, True, seed=5)
    kw = dict(g=g, beta=beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    ref = mod.torch_chunk_gated_delta_rule(q, k, v, scale=0.5, **kw)
    with pytest.raises(ValueError) as stock_err:
        mod.torch_chunk_gated_delta_rule(q, k, v, cu_seqlens=torch.tensor([0, 2, 5]), **kw)
    why = ["scale passed (the stock torch body ignores it, flash-linear-attention applies it)",
           "seq_idx / cu_seqlens (packed sequences)"]
    monkeypatch.setattr(sht, "fallback_counts", Counter())      # a fresh count: the first fallback logs
    with caplog.at_level(logging.WARNING, logger="ssmgrad.transformers"), sht.patched(["qwen3_next"]):
        got = mod.torch_chunk_gated_delta_rule(q, k, v, scale=0.5, **kw)
        got2 = mod.torch_chunk_gated_delta_rule(q, k, v, scale=0.5, **kw)
        with pytest.raises(ValueError) as err:
            mod.torch_chunk_gated_delta_rule(q, k, v, cu_seqlens=torch.tensor([0, 2, 5]), **kw)
    assert str(err.value) == str(stock_err.value)
    assert sht.fallback_counts == Counter({f"torch_chunk_gated_delta_rule: {why[0]}": 2,
                                           f"torch_chunk_gated_delta_rule: {why[1]}": 1})
    assert [r.getMessage() for r in caplog.records] == [
        f"ssmgrad.transformers: torch_chunk_gated_delta_rule falls back to the stock function ({w})" for w in why]
    assert all(torch.equal(a, b) and torch.equal(a, c) for a, b, c in zip(ref, got, got2))


@pytest.mark.parametrize("family, hub_name", [("qwen3_next", "chunk_gated_delta_rule"), ("kimi_linear", "chunk_kda")])
def test_no_misleading_fallback_log(family, hub_name, caplog):
    """Stock transformers logs that the delta rule "is falling back to its reference PyTorch implementation";
    patched, the call never reaches that wrapper and the log is gone."""
    from transformers.utils import logging as hf_logging
    model = make(family, torch.float32, seed=31)
    ids = batch(seed=32)

    def records():
        logging.Logger.warning_once.cache_clear()               # transformers logs each message once a process
        caplog.clear()
        with caplog.at_level(logging.INFO):
            model(input_ids=ids, labels=ids).loss.backward()
        return [r.getMessage() for r in caplog.records]

    hf_logging.enable_propagation()
    try:
        stock = records()
        with sht.patched([family]):
            got = records()
    finally:
        hf_logging.disable_propagation()
    slow = f"`{hub_name}` is falling back to its reference PyTorch implementation"
    assert any(slow in m for m in stock)                          # the log the test looks for exists
    assert not any(slow in m for m in got), got


# ------------------------------------------------------------------------------------------------
# torch.compile

def test_dynamo_traces_the_patched_function_in_one_graph():
    """While dynamo traces, the replacement calls ssmgrad's operator: one graph, no break, the operator in it,
    and the compiled values (aot_eager) equal eager, gradients included."""
    torch.compiler.reset()
    mod = _modeling("qwen3_next")
    tensors = _inputs(False, 7, 2, 4, 8, True, seed=7)
    with sht.patched(["qwen3_next"]):
        def f(q, k, v, g, beta, state):
            return mod.torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)

        explained = torch._dynamo.explain(f)(*tensors)
        assert explained.graph_break_count == 0, explained.break_reasons
        assert len(explained.graphs) == 1
        assert "ssmgrad.gated_delta_net" in explained.graphs[0].code
        n0 = sht.call_counts["torch_chunk_gated_delta_rule"]
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        got = _call(lambda q, k, v, **kw: compiled(q, k, v, kw["g"], kw["beta"], kw["initial_state"]), tensors, True, 2)
        assert sht.call_counts["torch_chunk_gated_delta_rule"] == n0          # no Python state changed in it
        want = _call(mod.torch_chunk_gated_delta_rule, tensors, True, 2)
    torch.compiler.reset()
    for a, b in zip(want, got):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
