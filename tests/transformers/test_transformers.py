"""ssmgrad.transformers against stock transformers: every Mamba-family model, loss and every gradient.

The oracle is the stock transformers CPU path of the same model, same weights, same batch. Tiny random-init
models from config (no downloads). Stock transformers casts to float32 inside the scan functions and the
norms (``.float()``, ``.to(torch.float32)``): in float64 those casts are neutralised (``keep_float64``) so
that both paths compute in float64 and must agree to 1e-10; in float32 the models run as shipped.

transformers and peft come with the test extra; without them this file fails at collection (never skips).
"""

import contextlib
import importlib
import inspect
import logging

import pytest
import torch

try:
    import transformers
    import peft
except ImportError as exc:   # an oracle comparison is never skipped: a missing dependency is an error
    raise RuntimeError(
        "tests/transformers/test_transformers.py needs transformers and peft; install the test extra: pip install '.[test]'"
    ) from exc

import ssmgrad.transformers as sht

VOCAB = 40

pytestmark = pytest.mark.integration   # .ci's sanitizer and compiler passes skip it

# family -> (config class, model class, tiny config). Hybrid families get one attention layer besides
# their Mamba layers so that the whole model runs; MoE sizes are tiny too.
FAMILY_MODELS = {
    "mamba": ("MambaConfig", "MambaForCausalLM",
              dict(hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, time_step_rank=4)),
    "falcon_mamba": ("FalconMambaConfig", "FalconMambaForCausalLM",
                     dict(hidden_size=16, state_size=4, num_hidden_layers=2, expand=2, time_step_rank=4)),
    "jamba": ("JambaConfig", "JambaForCausalLM",
              dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, num_experts=2, num_experts_per_tok=1, expert_layer_period=2,
                   expert_layer_offset=1, attn_layer_period=2, attn_layer_offset=1, mamba_d_state=4,
                   mamba_dt_rank=4, use_mamba_kernels=False)),
    "zamba": ("ZambaConfig", "ZambaForCausalLM",
              dict(hidden_size=16, attention_hidden_size=32, intermediate_size=24, num_hidden_layers=4,
                   layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                   num_attention_heads=2, num_key_value_heads=2, n_mamba_heads=2, attn_layer_period=2,
                   attn_layer_offset=1, mamba_d_state=4, mamba_dt_rank=4, use_mamba_kernels=False)),
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM",
               dict(hidden_size=16, state_size=8, num_hidden_layers=2, expand=2, num_heads=4, head_dim=8,
                    n_groups=2, chunk_size=8)),
    "bamba": ("BambaConfig", "BambaForCausalLM",
              dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                   num_key_value_heads=1, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=8,
                   mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8)),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM",
                  dict(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=2,
                       num_key_value_heads=1, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=2,
                       mamba_d_state=8, mamba_chunk_size=8)),
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM",
                         dict(hidden_size=16, intermediate_size=24, shared_intermediate_size=24, num_hidden_layers=2,
                              num_attention_heads=2, num_key_value_heads=1, num_local_experts=2,
                              num_experts_per_tok=2,   # top-1 of 2 experts leaves the router without gradient
                              layer_types=["mamba", "attention"], mamba_n_heads=4,
                              mamba_d_head=8, mamba_n_groups=2, mamba_d_state=8, mamba_chunk_size=8)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM",
                   dict(hidden_size=16, intermediate_size=24, layers_block_type=["mamba", "attention", "mlp"],
                        num_attention_heads=2, num_key_value_heads=1, head_dim=8, ssm_state_size=8,
                        mamba_num_heads=4, mamba_head_dim=8, n_groups=2, chunk_size=8, use_mamba_kernels=False)),
    "zamba2": ("Zamba2Config", "Zamba2ForCausalLM",
               dict(hidden_size=16, num_hidden_layers=2, layers_block_type=["mamba", "hybrid"], mamba_d_state=8,
                    mamba_ngroups=2, n_mamba_heads=4, mamba_headdim=8, chunk_size=8, intermediate_size=24,
                    num_attention_heads=2, num_key_value_heads=2, use_mamba_kernels=False)),
}
MAMBA1 = ("mamba", "falcon_mamba", "jamba", "zamba")


def build_model(spec, dtype=torch.float32, seed=0, **overrides):
    """A tiny random model from ``spec`` = (config class, model class, config kwargs) with every parameter
    perturbed (so that no gradient is trivially zero or structured), in train mode, without dropout.
    A composite config (``text_config`` in the kwargs) gets the token settings in its text config."""
    config_name, model_name, kwargs = spec
    tokens = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if "text_config" in kwargs:
        kwargs = dict(kwargs, text_config=dict(kwargs["text_config"], **tokens))
    else:
        kwargs = dict(kwargs, **tokens)
    kwargs = dict(kwargs, experts_implementation="eager", **overrides)    # eager MoE: grouped_mm has no float64
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).to(dtype)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64).to(dtype))
    model.train()
    return model


def make_model(family, dtype=torch.float32, seed=0, **overrides):
    """A tiny random model of one of the ten Mamba families (build_model)."""
    model = build_model(FAMILY_MODELS[family], dtype, seed, **overrides)
    if family in ("nemotron_h", "zamba2"):
        # these mixers clamp softplus(dt) from below at time_step_min (0.001); keep the time steps of the
        # tiny random model above it, as in a trained model, so that the clamp is the identity
        with torch.no_grad():
            for m in mixers(model):
                m.dt_bias.clamp_(min=-3.0)
    return model


def mixers(model):
    return [m for m in model.modules() if hasattr(m, "dt_bias") or hasattr(m, "dt_proj") or hasattr(m, "dt_proj_bias")]


def set_dt_bias_both_sides_of_20(model):
    """dt biases that put softplus inputs on both sides of the threshold 20 (half of the channels far
    above, where softplus(v) = v and its derivative is 1)."""
    with torch.no_grad():
        for m in mixers(model):
            bias = m.dt_bias if hasattr(m, "dt_bias") else (m.dt_proj.bias if hasattr(m, "dt_proj")
                                                             else m.dt_proj_bias)
            flat = bias.view(-1)
            flat[::2] = 24.0 + torch.arange(flat[::2].numel(), dtype=flat.dtype) * 0.01
            # large dt means strong decay of the state: keep A small so the states stay informative
            m.A_log.sub_(4.0)


@contextlib.contextmanager
def keep_float64():
    """Neutralise the float32 casts inside stock transformers for float64 tensors (``.float()``,
    ``.to(torch.float32)`` and ``torch.zeros_like(t, dtype=torch.float32)`` give float64), so that the stock
    path computes in float64 throughout."""
    mp = pytest.MonkeyPatch()
    orig_float, orig_to = torch.Tensor.float, torch.Tensor.to

    def float_(self, *args, **kwargs):
        return self if self.dtype == torch.float64 else orig_float(self, *args, **kwargs)

    def to(self, *args, **kwargs):
        if self.dtype == torch.float64:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return orig_to(self, *args, **kwargs)

    orig_zeros_like = torch.zeros_like

    def zeros_like(t, *args, **kwargs):      # inkling2's experts accumulate in zeros_like(..., dtype=float32)
        if t.dtype == torch.float64 and kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        return orig_zeros_like(t, *args, **kwargs)

    mp.setattr(torch.Tensor, "float", float_)
    mp.setattr(torch.Tensor, "to", to)
    mp.setattr(torch, "zeros_like", zeros_like)
    try:
        yield
    finally:
        mp.undo()


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.loss.detach(), grads


def batch(n_seqs=2, n_t=13, seed=3):
    return torch.randint(3, VOCAB, (n_seqs, n_t), generator=torch.Generator().manual_seed(seed))


def compare(model, ids, tol, nonzero=False):
    """Stock vs patched: the loss and every parameter gradient (none missing); with ``nonzero`` every stock
    gradient must have a nonzero entry (so that the comparison compares something)."""
    assert not sht.is_patched()
    loss0, g0 = loss_and_grads(model, ids)
    before = dict(sht.call_counts)
    with sht.patched():
        loss1, g1 = loss_and_grads(model, ids)
    called = {k: v - before.get(k, 0) for k, v in sht.call_counts.items() if v != before.get(k, 0)}
    assert set(g0) == set(g1) == {n for n, p in model.named_parameters() if p.requires_grad}
    scale = max(1.0, float(loss0.abs()))
    assert abs(float(loss1 - loss0)) <= tol * scale, (float(loss0), float(loss1))
    worst = {}
    for name in g0:
        ref, got = g0[name], g1[name]
        assert not nonzero or ref.abs().max() > 0, f"{name}: the stock gradient is all zero"
        err = float((got - ref).abs().max()) / (1.0 + float(ref.abs().max()))
        worst[name] = err
        assert err <= tol, f"{name}: relative error {err:.3g} > {tol:g}"
    return called, worst


@pytest.fixture(autouse=True)
def always_unpatched():
    sht.unpatch()
    yield
    sht.unpatch()


@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_family_float64_exact(family):
    """float64 with the stock float32 casts neutralised: loss and every gradient to 1e-10, and the ssmgrad
    scan and conv really ran (the counters moved) while no call fell back."""
    model = make_model(family, torch.float64)
    fallbacks = dict(sht.fallback_counts)
    with keep_float64():
        called, _ = compare(model, batch(), 1e-10, nonzero=True)      # every gradient is non-trivial
    scan = "mamba_selective_scan" if family in MAMBA1 else "mamba2_chunk_scan"
    assert called.get(scan, 0) >= 1 and called.get("causal_conv1d_fn", 0) >= 1, called
    assert dict(sht.fallback_counts) == fallbacks


@pytest.mark.parametrize("family", ["mamba", "zamba", "mamba2", "nemotron_h"])
def test_family_float64_softplus_threshold(family):
    """dt biases on both sides of the softplus threshold 20 (float64, casts neutralised)."""
    model = make_model(family, torch.float64, seed=5)
    set_dt_bias_both_sides_of_20(model)
    seen = []
    scan = sht.st.ssm_scan

    def recording_scan(s, x, dt, *args, **kwargs):
        seen.append(dt.detach().clone())
        return scan(s, x, dt, *args, **kwargs)

    with keep_float64(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(sht.st, "ssm_scan", recording_scan)
        compare(model, batch(seed=4), 1e-10)
    dts = torch.cat([d.flatten() for d in seen])
    assert (dts > 20).any() and (dts < 20).any()      # the kernels saw both sides of the threshold


@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_family_float32_as_shipped(family):
    """float32, stock transformers as shipped: loss and every gradient within float32 tolerance."""
    model = make_model(family, torch.float32, seed=1)
    called, _ = compare(model, batch(seed=2), 2e-4)
    assert called, "no ssmgrad kernel ran"


def test_gradients_are_not_trivial():
    """The perturbed tiny models give every parameter a gradient with nonzero entries (so that the
    comparisons above compare something) — checked on one model per style."""
    for family in ("mamba", "mamba2"):
        model = make_model(family, torch.float64)
        _, grads = loss_and_grads(model, batch())
        for name, g in grads.items():
            assert g.abs().max() > 0, f"{family}: {name} has an all-zero gradient"


@pytest.mark.parametrize("family", ["mamba", "mamba2", "falcon_h1"])
def test_bfloat16_model_trains_close_to_stock(family):
    """A bfloat16 model: the kernels run in float32 (cast around them), as the stock Mamba-2 body does;
    loss and every gradient close to the stock bf16 path at bfloat16 resolution (measured: loss within
    3e-4 relative, gradients within 4.4% of each tensor's largest entry, median 1%)."""
    model = make_model(family, torch.bfloat16, seed=2)
    ids = batch(seed=6)
    loss0, g0 = loss_and_grads(model, ids)
    n0 = sum(sht.call_counts.values())
    with sht.patched():
        loss1, g1 = loss_and_grads(model, ids)
    assert sum(sht.call_counts.values()) > n0
    assert abs(float(loss1) - float(loss0)) <= 2e-3 * abs(float(loss0))
    for name in g0:
        assert g1[name].dtype == torch.bfloat16
        ref, got = g0[name].float(), g1[name].float()
        err = float((got - ref).abs().max()) / float(ref.abs().max())
        assert err <= 0.1, f"{name}: {err:.3g}"


def _generate(model, ids, n_new=8):
    return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new,
                          do_sample=False, output_scores=True, return_dict_in_generate=True,
                          pad_token_id=0)


@pytest.mark.parametrize("family", list(FAMILY_MODELS))
def test_generate_with_cache(family):
    """Greedy generate with the cache: same tokens and scores as stock, the one-token updates ran on
    ssmgrad, and the cache after a prefill + 1 token step holds the same conv and recurrent states."""
    model = make_model(family, torch.float32, seed=7).eval()
    ids = batch(n_seqs=2, n_t=6, seed=8)
    ref = _generate(model, ids)
    before = dict(sht.call_counts)
    with sht.patched():
        got = _generate(model, ids)
    assert torch.equal(ref.sequences, got.sequences)
    for a, b in zip(ref.scores, got.scores):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4)
    update = "mamba_selective_state_update" if family in MAMBA1 else "mamba2_selective_state_update"
    assert sht.call_counts[update] > before.get(update, 0)
    assert sht.call_counts["causal_conv1d_update"] > before.get("causal_conv1d_update", 0)


def prefill_and_steps(model, ids):
    """Prefill ids[:, :-2], then the last two tokens one at a time through the cache (no autograd):
    (logits of the three calls, the cached conv states, the cached recurrent states), cloned."""
    # Mamba / Mamba-2 models take the cache as `cache`, the hybrids as `past_key_values`
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    n_t = ids.shape[1]
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids[:, :n_t - 2], use_cache=True)
        cache = getattr(out, name)
        logits.append(out.logits)
        for t in (n_t - 2, n_t - 1):
            out = model(input_ids=ids[:, t:t + 1], use_cache=True, **{name: cache})
            logits.append(out.logits)
    conv, recurrent = [], []
    for layer in cache.layers:                                    # dicts state_idx -> tensor (or None)
        conv += [t.clone() for t in getattr(layer, "conv_states", {}).values() if t is not None]
        recurrent += [t.clone() for t in getattr(layer, "recurrent_states", {}).values() if t is not None]
    return logits, conv, recurrent


@pytest.mark.parametrize("family", ["mamba", "mamba2", "falcon_h1"])
def test_cache_contents_match_stock(family):
    """Prefill, then two single-token steps through the cache: logits and every cached conv / recurrent
    state equal stock (float64, casts neutralised, 1e-10)."""
    model = make_model(family, torch.float64, seed=9).eval()
    ids = batch(n_seqs=2, n_t=7, seed=10)
    update = "mamba_selective_state_update" if family in MAMBA1 else "mamba2_selective_state_update"
    with keep_float64():
        l0, c0, r0 = prefill_and_steps(model, ids)
        n0 = sht.call_counts[update]
        with sht.patched():
            l1, c1, r1 = prefill_and_steps(model, ids)
    assert sht.call_counts[update] == n0 + 2 * sum(1 for m in mixers(model))   # the one-token path ran
    assert len(c0) == len(c1) > 0 and len(r0) == len(r1) > 0
    for a, b in zip(l0 + c0 + r0, l1 + c1 + r1):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-10)


def test_time_step_limit_runs_on_ssmgrad():
    """nemotron_h passes (time_step_min, inf), and a limit that really clamps (here from both sides) runs on
    ssmgrad too: the loss and every gradient equal stock (float64, 1e-10), nothing falls back. The kernel
    gets dt where the clamp keeps softplus(dt) and, where it clamps, the input whose softplus is the limit."""
    model = make_model("nemotron_h", torch.float64, seed=11)
    ids = batch(seed=12)
    seen = []
    stock = _modeling("nemotron_h").mamba2_chunk_scan

    def recording(hidden_states, dt, *args, dt_bias=None, **kwargs):        # the stock function, recorded
        seen.append(torch.nn.functional.softplus(dt + dt_bias).detach().clone())
        return stock(hidden_states, dt, *args, dt_bias=dt_bias, **kwargs)

    for limit in (None, (0.03, 0.06)):
        if limit is not None:
            for m in mixers(model):
                m.time_step_limit = limit        # clamps on both sides for these weights (checked below)
        fallbacks = dict(sht.fallback_counts)
        with keep_float64():
            called, _ = compare(model, ids, 1e-10, nonzero=True)
        assert called.get("mamba2_chunk_scan", 0) >= 1 and dict(sht.fallback_counts) == fallbacks
    with keep_float64(), pytest.MonkeyPatch.context() as mp:
        mp.setattr(_modeling("nemotron_h"), "mamba2_chunk_scan", recording)
        loss_and_grads(model, ids)
    sp = torch.cat([v.flatten() for v in seen])
    assert (sp < 0.03).any() and (sp > 0.06).any() and ((sp >= 0.03) & (sp <= 0.06)).any()


def test_seq_idx_falls_back_to_stock():
    """Packed sequences (seq_idx / cu_seqlens) are handed to the stock function, counted. Without
    mamba_ssm / causal_conv1d the stock function raises its own error; patched, the same one."""
    from transformers.models.mamba2 import modeling_mamba2 as mod
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1, 6, 5, generator=gen)
    w = torch.randn(6, 4, generator=gen)
    seq_idx = torch.tensor([[0, 0, 1, 1, 1]], dtype=torch.int32)

    def run(fn, **kw):
        with pytest.raises(Exception) as info:
            fn(x, w, None, "silu", **kw)
        return type(info.value), str(info.value)

    for kw in (dict(seq_idx=seq_idx), dict(cu_seqlens=torch.tensor([0, 2, 5]))):
        ref = run(mod.causal_conv1d_fn, **kw)
        key = "causal_conv1d_fn: seq_idx / cu_seqlens (packed sequences)"
        n0 = sht.fallback_counts[key]
        with sht.patched():
            assert run(mod.causal_conv1d_fn, **kw) == ref
            # without them the same call runs on ssmgrad and equals stock
            got = mod.causal_conv1d_fn(x, w, None, "silu")
        assert sht.fallback_counts[key] == n0 + 1
        torch.testing.assert_close(got, mod.causal_conv1d_fn(x, w, None, "silu"), rtol=1e-6, atol=1e-6)


def test_dt_softplus_false_falls_back_to_stock():
    """A call ssmgrad cannot express (no softplus) gives exactly the stock function's result, counted."""
    from transformers.models.mamba2 import modeling_mamba2 as mod
    gen = torch.Generator().manual_seed(1)
    b, t, h, p, g, n = 2, 5, 4, 3, 2, 6
    x, dt = torch.randn(b, t, h, p, generator=gen), torch.rand(b, t, h, generator=gen)
    A, D = -torch.rand(h, generator=gen), torch.randn(h, generator=gen)
    B, C = torch.randn(b, t, g, n, generator=gen), torch.randn(b, t, g, n, generator=gen)
    ref = mod.mamba2_chunk_scan(x, dt, A, B, C, 4, D=D, dt_softplus=False)
    key = "mamba2_chunk_scan: dt_softplus=False (ssmgrad's scan always applies softplus)"
    n0 = sht.fallback_counts[key]
    with sht.patched():
        got = mod.mamba2_chunk_scan(x, dt, A, B, C, 4, D=D, dt_softplus=False)
    assert torch.equal(got, ref) and sht.fallback_counts[key] == n0 + 1


def test_one_token_update_per_head_or_per_channel():
    """The Mamba-2 one-token update runs on ssmgrad whether dt / A / dt_bias are expanded per head (as the
    mixers pass them: the scan's Mamba-2 form) or vary inside a head (the Mamba-1 form, one head per channel,
    B and C by group), and equals stock: y, the state updated in place, and the gradients of x, B, C, D and
    z (stock cannot differentiate dt, A or dt_bias here: it overwrites the state its backward needs)."""
    from transformers.models.mamba2 import modeling_mamba2 as mod
    gen = torch.Generator().manual_seed(2)
    b, h, p, g, n = 2, 4, 3, 2, 5

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, B, C, z, state0 = randn(b, h, p), randn(b, g, n), randn(b, g, n), randn(b, h, p), randn(b, h, p, n)
    D = randn(h)[:, None].expand(-1, p)
    A_head = (-torch.rand(h, generator=gen, dtype=torch.float64))[:, None, None].expand(-1, p, n)
    A_full = -torch.rand(h, p, n, generator=gen, dtype=torch.float64)
    bias_head, bias_full = randn(h)[:, None].expand(-1, p), randn(h, p)
    dt_head, dt_full = randn(b, h, 1).expand(-1, -1, p), randn(b, h, p)
    cases = ((dt_head, A_head, bias_head), (dt_full, A_head, bias_head), (dt_head, A_full, bias_head),
             (dt_head, A_head, bias_full), (dt_full, A_full, bias_full))
    weights = randn(b, h, p)
    for dt, A, bias in cases:
        results = []
        for patched in (False, True):
            leaves = [t.clone().requires_grad_() for t in (x, B, C, D, z)]
            state = state0.clone()
            with keep_float64(), sht.patched() if patched else contextlib.nullcontext():
                n_calls, fallbacks = sht.call_counts["mamba2_selective_state_update"], dict(sht.fallback_counts)
                y = mod.mamba2_selective_state_update(state, leaves[0], dt, A, leaves[1], leaves[2], leaves[3],
                                                      dt_bias=bias, dt_softplus=True, z=leaves[4])
                (y * weights).sum().backward()
            assert sht.call_counts["mamba2_selective_state_update"] - n_calls == int(patched)
            assert dict(sht.fallback_counts) == fallbacks
            results.append([y.detach(), state] + [t.grad for t in leaves])
        for ref, got in zip(*results):
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        assert not torch.equal(results[1][1], state0)


def _modeling(family):
    return importlib.import_module(f"transformers.models.{family}.modeling_{family}")


def test_unpatch_restores_the_same_objects():
    modules = {f: _modeling(f) for f in sht.FAMILIES}
    stock = {(f, n): getattr(modules[f], n) for f, names in sht.FAMILIES.items()
             for n in names + sht.FUSED_FUNCTIONS if hasattr(modules[f], n)}
    assert len({f for f, n in stock}) == 25
    assert not sht.is_patched()
    sht.patch()
    sht.patch()                                                  # idempotent: patched once
    assert sht.is_patched()
    for (f, n), obj in stock.items():
        new = getattr(modules[f], n)
        assert new is not obj and new.__wrapped__ is obj         # functools.wraps keeps the stock object
    sht.unpatch()
    assert not sht.is_patched()
    for (f, n), obj in stock.items():
        assert getattr(modules[f], n) is obj
    with sht.patched():
        assert sht.is_patched()
    assert not sht.is_patched()
    for (f, n), obj in stock.items():
        assert getattr(modules[f], n) is obj


def test_patch_names_a_missing_function(monkeypatch, caplog):
    """A transformers whose modeling file lacks an expected function: patch() leaves that family stock with a
    warning naming it and patches the others; named explicitly, patch() raises naming it and patches none of
    the named families."""
    mamba2, mamba = _modeling("mamba2"), _modeling("mamba")
    stock_scan, stock_conv = mamba.mamba_selective_scan, mamba2.causal_conv1d_fn
    monkeypatch.delattr(mamba2, "mamba2_chunk_scan")
    with pytest.raises(RuntimeError, match=r"modeling_mamba2 has no function `mamba2_chunk_scan`"):
        sht.patch(["mamba", "mamba2"])
    assert not sht.is_patched() and mamba.mamba_selective_scan is stock_scan
    with caplog.at_level(logging.WARNING, logger="ssmgrad.transformers"):
        done = sht.patch()
    assert "mamba2" not in done and "mamba2" not in sht.patched_families() and not sht.is_patched("mamba2")
    assert mamba2.causal_conv1d_fn is stock_conv                 # the renamed family is left whole
    assert set(done) == set(sht.FAMILIES) - {"mamba2"} == set(sht.patched_families())
    assert mamba.mamba_selective_scan is not stock_scan and mamba.mamba_selective_scan.__wrapped__ is stock_scan
    assert any("mamba2 left stock" in r.getMessage() and "mamba2_chunk_scan" in r.getMessage()
               for r in caplog.records)


def test_patch_some_families():
    """patch(families) patches the named families only; unpatch(families) and patched(families) likewise."""
    mamba, mamba2, lfm2 = _modeling("mamba"), _modeling("mamba2"), _modeling("lfm2")
    stock = {m: m.causal_conv1d_fn for m in (mamba, mamba2, lfm2)}
    assert sht.patch(["mamba2", "lfm2"]) == ["mamba2", "lfm2"]
    assert sht.patched_families() == ["mamba2", "lfm2"]
    assert mamba.causal_conv1d_fn is stock[mamba]
    assert mamba2.causal_conv1d_fn is not stock[mamba2] and lfm2.causal_conv1d_fn is not stock[lfm2]
    assert sht.patch("mamba2") == [] and sht.patch(["mamba", "mamba2"]) == ["mamba"]     # only what is new
    with sht.patched(["zamba", "lfm2"]):
        assert sht.is_patched("zamba")
    assert not sht.is_patched("zamba") and sht.is_patched("lfm2")   # patched() undid only what it patched
    sht.unpatch(["mamba2"])
    assert mamba2.causal_conv1d_fn is stock[mamba2] and sht.patched_families() == ["mamba", "lfm2"]
    sht.unpatch()
    assert all(m.causal_conv1d_fn is f for m, f in stock.items()) and not sht.is_patched()


def test_patch_bad_families():
    for fn in (sht.patch, sht.unpatch):
        with pytest.raises(ValueError, match=r"unknown family 'mamba3' in families; known: mamba, "):
            fn(["mamba", "mamba3"])
        with pytest.raises(TypeError, match=r"families must be None, a family name or an iterable"):
            fn(3)
        with pytest.raises(TypeError, match=r"families must hold family names \(str\), got int 2"):
            fn(["mamba", 2])
    with pytest.raises(ValueError, match=r"is_patched: unknown family 'lfm9'"):
        sht.is_patched("lfm9")
    assert not sht.is_patched()                                  # nothing was patched on the way


@pytest.mark.parametrize("family, fused", [("mamba", "mamba_inner_fn"),
                                           ("mamba2", "mamba_split_conv1d_scan_combined")])
def test_no_misleading_fallback_log(family, fused, caplog):
    """Stock transformers logs that the fused entry point "is falling back to its reference PyTorch
    implementation ... much slower"; patched, that log is gone (the kernels are ssmgrad's) and ssmgrad's
    own notice says which families run on ssmgrad."""
    from transformers.utils import logging as hf_logging
    model = make_model(family, torch.float32, seed=3)
    ids = batch(seed=4)

    def records():
        logging.Logger.warning_once.cache_clear()               # transformers logs each message once a process
        caplog.clear()
        with caplog.at_level(logging.INFO):
            model(input_ids=ids, labels=ids).loss.backward()
        return [r.getMessage() for r in caplog.records]

    hf_logging.enable_propagation()
    try:
        stock = records()
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ssmgrad.transformers"):
            sht.patch([family])
        notice = [r.getMessage() for r in caplog.records if r.name == "ssmgrad.transformers"]
        got = records()
    finally:
        sht.unpatch()
        hf_logging.disable_propagation()
    slow = f"`{fused}` is falling back to its reference PyTorch implementation"
    assert any(slow in m for m in stock)                          # the log the test looks for exists
    assert not any("falling back to its reference" in m for m in got), got
    assert notice == [f"ssmgrad.transformers: patched {family} (the Mamba scan, the delta rule and the causal "
                      f"conv of these models run on ssmgrad's CPU kernels)"]


def test_import_ssmgrad_does_not_import_transformers():
    import subprocess
    import sys
    code = "import sys, ssmgrad, ssmgrad.transformers; print('transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("family", ["mamba", "mamba2"])
def test_peft_lora_trains_like_stock(family):
    """PEFT LoRA on the projections of a patched model: a few AdamW steps give the stock run's losses."""
    # PEFT refuses LoRA on conv1d / out_proj of Mamba models; it adapts the input-side projections
    targets = ["in_proj", "x_proj", "dt_proj"] if family == "mamba" else ["in_proj"]

    def train():
        model = make_model(family, torch.float32, seed=13)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets,
                                                           lora_dropout=0.0))
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        losses = []
        ids = batch(seed=20)                                     # one batch, fitted: the loss must fall
        for step in range(5):
            loss = model(input_ids=ids, labels=ids).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        return losses

    ref = train()
    n0 = sht.call_counts["causal_conv1d_fn"]
    with sht.patched():
        got = train()
    assert sht.call_counts["causal_conv1d_fn"] > n0
    assert ref[-1] < ref[0]                                      # it trains
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-5)
