"""llama.cpp's llama-finetune on the hybrid SSM families, checked step by step against stock transformers.

The delta-rule families (GDN_FAMILIES: Qwen3.5 dense and MoE, Qwen3-Next dense and MoE, Kimi-Linear) are
checked the same way (tests/ggml/test_llama_finetune_gdn.py): a Gated DeltaNet (or KDA) layer and an attention
layer, the DeltaNet's v projection scaled and its decay rate A drawn in [0.02, 0.2] (transformers' init,
A in [0, 16], forgets the state within a token), and, besides A = -exp(A_log), Qwen's (1 + weight)
RMSNorms trained as 1 + weight, the form the GGUF stores.

For each family a random tiny transformers 5.24 model with at least one SSM (Mamba-1, Mamba-2) or
short-conv layer and one attention layer (and, for the MoE configurations, a mixture of experts) is
saved with save_pretrained, converted by ggml/convert.py (llama.cpp's convert_hf_to_gguf.py with the
series' converter patch, f32, the bundled GPT-NeoX vocab) and fine-tuned by build/ggml/bin/llama-finetune
(AdamW, -c = -b = -ub 256). The same model is fine-tuned in PyTorch by STOCK transformers (no
ssmgrad.transformers.patch(): the oracle shares no kernel with llama.cpp's SSM backward, which runs
ssmgrad's C kernels) on the same tokens, windows and order, with torch.optim.AdamW, training every
parameter in the form the GGUF stores it:
  - A: the GGUF holds A = -exp(A_log) (Mamba-1 and Mamba-2 mixers alike), so the torch run trains A
    through a parametrization A_log = log(-A);
  - Falcon-H1's multipliers are folded into the weights by the converter (an AdamW step on a scaled
    weight is not the scaled step): the configs keep them at transformers' default 1, so both forms
    are the same tensors. Granite's multipliers are GGUF hyperparameters, not folded;
  - everything else is stored as transformers has it, up to a layout (transposes, reshapes, experts
    stacked into one tensor, Granite's fused expert input split into gate and up), which an
    elementwise optimizer does not see.
What llama-finetune computes (windows, ubatches, AdamW, the printed running mean) is in
ggml/finetune_check.py's docstring; its helpers are used here.

The Mamba mixers get Mamba's own init (in_proj std MAMBA_INIT_STD, conv1d PyTorch's default), the SSM input
projections are scaled up (IN_PROJ_SCALE) and the time steps get Mamba's own init, so that the recurrent states are large and remembered: a backward that starts from the
wrong state (the series' recurrent start-state copy removed) then moves every Mamba hybrid's losses past
TOL (6.0e-5 to 1.1e-3). With the families' own init (std 0.02) only Jamba's moved (docs/ggml.md).
The transformers models compute llama.cpp's model: transformers' Nemotron-H mixer clamps its time steps
softplus(dt + dt_bias) from below at time_step_min (1e-3), llama.cpp's does not, and with Mamba's init that
clamp moves every gradient by 5.6e-3, so make_model drops it (drop_time_step_limits; docs/ggml.md).

    python ggml/finetune_hybrid.py                          # the table, every family that trains
    python ggml/finetune_hybrid.py --family lfm2 --workdir DIR   # keep DIR/lfm2/ (checkpoint), DIR/lfm2.gguf, DIR/text.txt
    python ggml/finetune_hybrid.py --family lfm2 --workdir DIR --prepare-only   # only write those
    python ggml/finetune_hybrid.py --spread                 # also: stock vs ssmgrad-patched torch
"""

import argparse
import contextlib
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import convert                  # noqa: E402  (ggml/convert.py)
import finetune_check as fc     # noqa: E402  (ggml/finetune_check.py: tokens, windows, llama-finetune runs)

# relative, every step. The printed running mean has 5 decimals, so the k-th loss of an epoch is exact to
# (2k-1) 5e-6 absolute: with 4 windows (k <= 4) and losses near 6, 5.9e-6 relative; the runs agree to
# <= 5.5e-6 measured. 1.5e-5 catches every Mamba hybrid without the recurrent start-state copy (>= 6.0e-5).
TOL = 1.5e-5
EPOCHS = 2
LR, WD = 1e-3, 0.01
BETAS, EPS = (0.9, 0.999), 1e-8
IN_PROJ_SCALE = 5.0
# The SSM mixers of the Mamba hybrids (not the delta-rule ones) get Mamba's own init before that scaling: in_proj
# drawn with std 0.1 (transformers' Mamba / Mamba-2 initializer_range) and conv1d PyTorch's default, as
# ggml/finetune_check.py's plain Mamba models have them. The hybrid configs' init (std 0.02 for both) left
# x, B and C near 0.01 after the conv's SiLU and the final SSM states near 6e-6 (mean |s|, Mamba-2 hybrids),
# too small for a wrong start state to show in any loss; with Mamba's init near 0.27 (Falcon-H1).
MAMBA_INIT_STD = 0.1
N_WORDS = 220                   # about 790 tokens of fc.make_text: 4 windows of 256 at stride 128
SGD_WORDS = 120                 # about 430 tokens: exactly one window

_V = 512                        # vocab (the bundled GPT-NeoX vocab cut to it)
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2)
_M2 = dict(mamba_n_heads=8, mamba_d_head=8, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_expand=2,
           mamba_chunk_size=64)

# family -> (transformers config class, model class, config kwargs). Every one: 2-3 layers of width 32,
# an SSM or short-conv layer and an attention layer; the MoE ones 4 experts, 2 per token.
FAMILIES = {
    # Falcon-H1: every layer runs attention and a Mamba-2 mixer side by side
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        vocab_size=_V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, head_dim=8, mamba_d_ssm=64,
        **_ATTN, **_M2, tie_word_embeddings=False)),
    # Granite-4.0-H: Mamba-2 layer, attention layer, each with a shared MLP (dense) or experts + shared MLP
    "granitemoehybrid": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=_V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, layer_types=["mamba", "attention"],
        num_local_experts=0, shared_intermediate_size=48, **_ATTN, **_M2, tie_word_embeddings=False)),
    "granitemoehybrid_moe": ("GraniteMoeHybridConfig", "GraniteMoeHybridForCausalLM", dict(
        vocab_size=_V, hidden_size=32, intermediate_size=24, num_hidden_layers=2, layer_types=["mamba", "attention"],
        num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48, **_ATTN, **_M2,
        tie_word_embeddings=False)),
    # Nemotron-H: one mixer per layer: Mamba-2, attention, then an MLP (relu^2) or experts + shared expert
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=_V, hidden_size=32, num_hidden_layers=3, layers_block_type=["mamba", "attention", "mlp"], **_ATTN,
        head_dim=8, intermediate_size=48, ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=8, n_groups=2,
        chunk_size=64, expand=2, tie_word_embeddings=False)),
    "nemotron_h_moe": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=_V, hidden_size=32, num_hidden_layers=3, layers_block_type=["mamba", "attention", "moe"], **_ATTN,
        head_dim=8, intermediate_size=48, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=24, moe_shared_expert_intermediate_size=24, ssm_state_size=16, mamba_num_heads=8,
        mamba_head_dim=8, n_groups=2, chunk_size=64, expand=2, tie_word_embeddings=False)),
    # Jamba: a Mamba-1 layer (dt, B, C norms) with an MLP, an attention layer with an MLP (1 expert) or experts
    "jamba": ("JambaConfig", "JambaForCausalLM", dict(
        vocab_size=_V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, **_ATTN, attn_layer_period=2,
        attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=1, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, tie_word_embeddings=False)),
    "jamba_moe": ("JambaConfig", "JambaForCausalLM", dict(
        vocab_size=_V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, **_ATTN, attn_layer_period=2,
        attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4, tie_word_embeddings=False)),
    # LFM2: a gated short-conv layer and an attention layer (q/k norms), tied embeddings
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        vocab_size=_V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, **_ATTN,
        layer_types=["conv", "full_attention"], block_auto_adjust_ff_dim=False, tie_word_embeddings=True)),
    "lfm2_moe": ("Lfm2MoeConfig", "Lfm2MoeForCausalLM", dict(
        vocab_size=_V, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2, **_ATTN,
        layer_types=["conv", "full_attention"], num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=True)),
}

# The delta-rule families (llama.cpp's GATED_DELTA_NET and its backward, GATED_DELTA_NET_BACK): a Gated
# DeltaNet layer (4 value heads of 16 reading 2 key heads: H_v = 2 H_k, as Qwen3-Next) and an attention
# layer; the MoE ones 4 experts, 2 per token, and a gated shared expert.
_GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4)
_QATTN = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=8)
# Qwen3.5 runs interleaved multimodal RoPE; without mrope_section in the checkpoint the converter writes the
# released models' [11, 11, 10] (64 rotary dims), which llama.cpp's ROPE rejects for 8-dim heads
# (sect_dims <= ne0). With text only the three position streams are equal, so any split is plain RoPE.
_MROPE = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                   mrope_section=[1, 1, 0], mrope_interleaved=True))
GDN_FAMILIES = {
    # Qwen3.5 (dense): Gated DeltaNet layer + MLP, gated attention layer + MLP
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        vocab_size=_V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], **_QATTN, **_MROPE, **_GDN, tie_word_embeddings=False)),
    "qwen3_5_moe": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", dict(
        vocab_size=_V, hidden_size=32, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=24,
        **_QATTN, **_MROPE, **_GDN, tie_word_embeddings=False)),
    # Qwen3-Next: dense (no experts: a plain MLP in every layer) and MoE in every layer (as the released model)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        vocab_size=_V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_experts=0, **_QATTN, **_GDN, tie_word_embeddings=False)),
    "qwen3_next_moe": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        vocab_size=_V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=24, **_QATTN, **_GDN, tie_word_embeddings=False)),
    # Qwen3-Next with a dense layer among MoE ones (transformers' mlp_only_layers): the DeltaNet layer dense
    "qwen3_next_mixed": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(
        vocab_size=_V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], mlp_only_layers=[0], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=24, shared_expert_intermediate_size=24, **_QATTN, **_GDN, tie_word_embeddings=False)),
    # Kimi-Linear: a KDA layer (per-channel gate; 4 heads of 16) with a dense MLP, an MLA attention layer with
    # 4 experts (sigmoid router with a score-correction bias, 2 per token) and a shared expert
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM", dict(
        vocab_size=_V, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], mlp_layer_types=["dense", "sparse"],
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_token=2, num_shared_experts=1, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False)),
}
FAMILIES.update(GDN_FAMILIES)

# the SSM / short-conv / Gated DeltaNet input projections (scaled by IN_PROJ_SCALE; for a Gated DeltaNet q and k
# are L2-normalized, so this scales v and the output gate z; Kimi-Linear's KDA layer: its v_proj, the only one)
_IN_PROJ_SUFFIXES = ("mamba.in_proj", "mixer.in_proj", "conv.in_proj", "linear_attn.in_proj_qkvz",
                     "linear_attn.in_proj_qkv", "linear_attn.in_proj_z")
# RMSNorms that scale by (1 + weight): the GGUF stores 1 + weight (the converter adds 1), and that is what
# llama-finetune trains (weight decay pulls it to 0, not weight)
_ONE_PLUS_NORMS = ("Qwen3NextRMSNorm", "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm")


def make_model(family, seed=0, in_proj_scale=IN_PROJ_SCALE, mamba_init=True, time_step_floor=False, overrides=None):
    """A random float32 transformers model of FAMILIES[family] (its config kwargs updated by OVERRIDES), its
    SSM / conv in_proj scaled (the Mamba mixers first drawn with Mamba's own init if mamba_init, else with the
    family's), computing what llama.cpp computes: without a time-step limit (drop_time_step_limits) unless
    time_step_floor (transformers' own Nemotron-H, whose mixer clamps softplus(dt) at time_step_min)."""
    import transformers
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {', '.join(FAMILIES)}, got {family!r}")
    cfg_name, model_name, kw = FAMILIES[family]
    kw = {**kw, **(overrides or {})}
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kw)).float()
    scaled = 0
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, mod in model.named_modules():
            # (a mixer comes before its in_proj in named_modules, so this init is then scaled below)
            if (mamba_init and family not in GDN_FAMILIES and isinstance(mod._parameters.get("A_log"), torch.nn.Parameter)
                    and isinstance(getattr(mod, "conv1d", None), torch.nn.Conv1d)):
                mod.in_proj.weight.normal_(0.0, MAMBA_INIT_STD, generator=gen)
                mod.conv1d.reset_parameters()
            if name.endswith(_IN_PROJ_SUFFIXES) or (family == "kimi_linear" and name.endswith("self_attn.v_proj")):
                mod.weight.mul_(in_proj_scale)
                scaled += 1
            # the time steps of Mamba's own init (log-uniform in [1e-3, 1e-1], through softplus^-1), so
            # that the states remember: Falcon-H1's and Granite's transformers init sets dt_bias to 1
            # (dt 1.3, every state forgotten within a few tokens) and Jamba's dt_proj bias to 0
            bias = mod._parameters.get("dt_bias")
            if bias is None and name.endswith("dt_proj") and isinstance(mod, torch.nn.Linear):
                bias = mod.bias
            if family in GDN_FAMILIES:
                # a Gated DeltaNet's decay is exp(-A softplus(a + dt_bias)) per token; transformers' init draws
                # A in [0, 16] (the state forgotten within a token or two): A in [0.02, 0.2] keeps it
                a_log = mod._parameters.get("A_log")
                if a_log is not None:
                    a_log.copy_(torch.log(0.02 + 0.18 * torch.rand(a_log.shape, generator=gen)))
            elif bias is not None:
                dt = torch.exp(torch.rand(bias.shape, generator=gen) * (np.log(1e-1) - np.log(1e-3)) + np.log(1e-3))
                bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    if scaled == 0:
        raise RuntimeError(f"{family}: no SSM / conv in_proj found to scale")
    if not time_step_floor:
        drop_time_step_limits(model)
    return model


def drop_time_step_limits(model):
    """Sets every Mamba-2 mixer's time-step limit to (0, inf), the model llama.cpp computes: its Mamba-2 layer
    (build_mamba2_layer) feeds softplus(dt + dt_bias) to SSM_SCAN as it is, and the GGUF carries no limit.
    transformers' Nemotron-H mixer clamps it from below at config.time_step_min (its time_step_limit is
    (time_step_min, inf), whatever config.time_step_limit says: 1e-3 by default, which in the Mamba init is
    the lower end of the dt_bias init range, not a bound of the model); Falcon-H1's and Granite-4.0-H's
    take config.time_step_limit, (0, inf). Returns the number of mixers whose limit was changed."""
    changed = 0
    for m in model.modules():
        limit = getattr(m, "time_step_limit", None)
        if isinstance(limit, (tuple, list)) and tuple(limit) != (0.0, float("inf")):
            m.time_step_limit = (0.0, float("inf"))
            changed += 1
    return changed


def clamped_time_steps(model, x):
    """How many of the time steps softplus(dt + dt_bias) of model's Mamba-2 mixers on the tokens x fall
    outside the mixer's time_step_limit (the mixer's own forward, read by a hook on its in_proj, whose
    output ends with the n_head dt columns): (clamped, total)."""
    counts, hooks = [0, 0], []

    def hook_for(mixer):
        def hook(mod, args, out):
            lo, hi = mixer.time_step_limit
            dt = F.softplus(out[..., -mixer.num_heads:].float() + mixer.dt_bias.float())
            counts[0] += int(((dt < lo) | (dt > hi)).sum())
            counts[1] += dt.numel()
        return hook
    for m in model.modules():
        if hasattr(m, "time_step_limit") and isinstance(getattr(m, "in_proj", None), torch.nn.Linear):
            hooks.append(m.in_proj.register_forward_hook(hook_for(m)))
    if not hooks:
        raise ValueError("model: no Mamba-2 mixer with a time_step_limit")
    try:
        with torch.no_grad():
            model(input_ids=x[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return counts[0], counts[1]


def train_gguf_form(model):
    """Every mixer's A_log becomes a function of a parameter A = -exp(A_log), the form the GGUF stores
    and llama-finetune trains (nothing keeps A negative in either); a (1 + weight) RMSNorm's weight a
    function of the parameter 1 + weight. Returns the number of mixers."""
    from torch.nn.utils import parametrize

    class NegLog(torch.nn.Module):
        def forward(self, A):
            return torch.log(-A)

        def right_inverse(self, A_log):
            return -torch.exp(A_log)

    class OnePlus(torch.nn.Module):
        def forward(self, w1):
            return w1 - 1

        def right_inverse(self, w):
            return w + 1

    mods = [m for m in model.modules() if isinstance(m._parameters.get("A_log"), torch.nn.Parameter)]
    for m in mods:
        parametrize.register_parametrization(m, "A_log", NegLog())
    # (1 + weight) norms: the parameter is 1 + weight, as the GGUF stores it
    for m in model.modules():
        if type(m).__name__ in _ONE_PLUS_NORMS:
            parametrize.register_parametrization(m, "weight", OnePlus())
    return len(mods)


def run_torch(model, inputs, labels, epochs=EPOCHS, lr=LR, wd=WD, opt="adamw", patch=False, threads=fc.THREADS):
    """Fine-tunes model in place as llama-finetune does with -c = -b = -ub (one optimizer step per window,
    from a zero state), in the GGUF's form; stock transformers unless patch (ssmgrad.transformers).
    Returns the per-epoch lists of losses."""
    torch.set_num_threads(threads)
    train_gguf_form(model)
    model.train()
    if opt == "adamw":
        optim = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=wd)
    elif opt == "sgd":
        optim = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=wd)
    else:
        raise ValueError(f"opt: expected 'adamw' or 'sgd', got {opt!r}")
    if patch:
        import ssmgrad.transformers as st
        ctx = st.patched()
    else:
        ctx = contextlib.nullcontext()
    losses = []
    with ctx:
        for _ in range(epochs):
            losses.append([])
            for x, y in zip(inputs, labels):
                optim.zero_grad(set_to_none=True)
                logits = model(input_ids=x[None], use_cache=False).logits[0]
                loss = F.cross_entropy(logits.float(), y)
                loss.backward()
                losses[-1].append(loss.item())
                optim.step()
    return losses


def torch_grads(model, x, y):
    """{name: gradient} of one window's mean cross-entropy, in the GGUF's form (stock transformers)."""
    train_gguf_form(model)
    model.train()
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(input_ids=x[None], use_cache=False).logits[0].float(), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def expert_use(model, inputs):
    """{router: how many tokens each expert got} over the windows: transformers' own routing, read by a
    forward hook on each MoE block's top-k router (the integer tensor it returns: the chosen experts)."""
    counts, hooks = {}, []

    def hook_for(name, n_expert):
        def hook(mod, args, out):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            idx = [t for t in outs if torch.is_tensor(t) and not t.is_floating_point()]
            if len(idx) != 1:
                raise RuntimeError(f"{name}: expected one integer tensor (the chosen experts) among its outputs")
            c = counts.setdefault(name, torch.zeros(n_expert, dtype=torch.int64))
            c += torch.bincount(idx[0].flatten().long(), minlength=n_expert)
        return hook
    for name, mod in model.named_modules():
        if type(mod).__name__.endswith("TopKRouter") or type(mod).__name__.endswith("TopkRouter"):
            hooks.append(mod.register_forward_hook(hook_for(name, mod.weight.shape[0])))
    try:
        with torch.no_grad():
            for x in inputs:
                model(input_ids=x[None], use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return {n: c.tolist() for n, c in counts.items()}


def prepare(family, workdir, n_words=N_WORDS, seed=0, bin_dir=fc.BIN, text_name="text.txt", overrides=None):
    """Model -> save_pretrained -> GGUF; the text and its tokens. Returns a dict of them."""
    workdir = Path(workdir)
    model = make_model(family, seed, overrides=overrides)
    hf_dir = workdir / family
    model.save_pretrained(hf_dir)
    gguf = convert.convert(hf_dir, workdir / f"{family}.gguf")
    text_path = workdir / text_name
    if not text_path.is_file():
        text_path.write_bytes(fc.make_text(n_words, seed).encode())
    tokens = fc.tokenize(gguf, text_path, bin_dir)
    return dict(family=family, hf_dir=hf_dir, gguf=gguf, text=text_path, tokens=tokens, workdir=workdir)


def compare(p, epochs=EPOCHS, lr=LR, wd=WD, threads=fc.THREADS, bin_dir=fc.BIN):
    """llama-finetune vs stock transformers on the prepared model: dict with both loss lists and the
    largest relative difference (raises if llama-finetune fails)."""
    inputs, labels = fc.windows(p["tokens"])
    ft = fc.run_finetune(p["gguf"], p["text"], p["workdir"] / f"{p['family']}-tuned.gguf", epochs=epochs, lr=lr,
                         wd=wd, threads=threads, bin_dir=bin_dir)
    if ft["proc"].returncode != 0:
        raise RuntimeError(f"{p['family']}: llama-finetune failed ({ft['proc'].returncode}):\n"
                           f"{ft['proc'].stderr[-3000:]}")
    tr = run_torch(make_model(p["family"]), inputs, labels, epochs=epochs, lr=lr, wd=wd, threads=threads)
    if [len(e) for e in ft["losses"]] != [len(e) for e in tr]:
        raise RuntimeError(f"{p['family']}: llama-finetune ran {[len(e) for e in ft['losses']]} steps per epoch, "
                           f"torch {[len(e) for e in tr]}")
    lg, lt = np.concatenate(ft["losses"]), np.concatenate(tr)
    rel = fc.rel_diff(lg, lt)
    worst = int(np.argmax(rel))
    return dict(family=p["family"], llama=lg, torch=lt, rel=rel, max_rel=float(rel[worst]), worst_step=worst,
                steps_per_epoch=len(inputs), n_tokens=len(p["tokens"]))


def spread(p, epochs=EPOCHS, lr=LR, wd=WD, threads=fc.THREADS):
    """The largest relative loss difference between the same torch run on stock transformers and with
    ssmgrad.transformers.patch() (float32 rounding as AdamW amplifies it)."""
    inputs, labels = fc.windows(p["tokens"])
    a = np.concatenate(run_torch(make_model(p["family"]), inputs, labels, epochs, lr, wd, threads=threads))
    b = np.concatenate(run_torch(make_model(p["family"]), inputs, labels, epochs, lr, wd, patch=True, threads=threads))
    return float(fc.rel_diff(b, a).max())


def gguf_tensors(path):
    """{name: float64 array} of a GGUF file (gguf-py of the converter the sdist carries)."""
    sys.path.insert(0, str(convert.converter_dir() / "gguf-py"))
    try:
        import gguf
        return {t.name: np.array(t.data, dtype=np.float64) for t in gguf.GGUFReader(path).tensors}
    finally:
        sys.path.pop(0)


def sgd_step_norms(p, text_path, lr=1.0, threads=fc.THREADS, bin_dir=fc.BIN):
    """One plain SGD step (weight decay 0) of llama-finetune on a one-window text: the per-tensor norms
    of (w_before - w_after) / lr, i.e. of llama's gradients, and of torch's gradients of the same window
    (stock transformers, GGUF form), each sorted (the layouts differ; norms do not). A gradient off by a
    constant factor, which AdamW's per-element normalisation hides, shows here."""
    tokens = fc.tokenize(p["gguf"], text_path, bin_dir)
    inputs, labels = fc.windows(tokens)
    if len(inputs) != 1:
        raise ValueError(f"text_path: {len(tokens)} tokens make {len(inputs)} windows, expected 1")
    out = p["workdir"] / f"{p['family']}-sgd.gguf"
    ft = fc.run_finetune(p["gguf"], text_path, out, epochs=1, lr=lr, wd=0.0, threads=threads, bin_dir=bin_dir,
                         opt="sgd")
    if ft["proc"].returncode != 0:
        raise RuntimeError(f"{p['family']}: llama-finetune -opt sgd failed:\n{ft['proc'].stderr[-3000:]}")
    before, after = gguf_tensors(p["gguf"]), gguf_tensors(out)
    llama = sorted(float(np.linalg.norm(before[n] - after[n])) / lr for n in before)
    grads = torch_grads(make_model(p["family"]), inputs[0], labels[0])
    torch_n = sorted(float(g.double().norm()) for g in grads.values())
    return np.array(llama), np.array(torch_n), len(before), len(grads)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=sorted(FAMILIES), action="append", help="default: every family")
    ap.add_argument("--epochs", type=int, default=EPOCHS)
    ap.add_argument("--workdir", type=Path, help="keep the checkpoints, GGUFs and text here")
    ap.add_argument("--spread", action="store_true", help="also the stock vs ssmgrad-patched torch difference")
    ap.add_argument("--prepare-only", action="store_true",
                    help="only write the checkpoints, GGUFs and text into --workdir (what llama-finetune needs)")
    args = ap.parse_args(argv)
    fams = args.family or list(FAMILIES)
    if args.prepare_only:
        if not args.workdir:
            ap.error("--prepare-only needs --workdir")
        args.workdir.mkdir(parents=True, exist_ok=True)
        for f in fams:
            p = prepare(f, args.workdir)
            print(f"{f}: checkpoint {p['hf_dir']}, GGUF {p['gguf']}, text {p['text']} ({len(p['tokens'])} tokens)")
        return 0
    rows, bad = [], []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        print("| family | tokens | steps | first loss (llama / torch) | last loss (llama / torch) | max rel. diff |"
              + (" torch stock vs ssmgrad |" if args.spread else "") + "\n|---|---|---|---|---|---|"
              + ("---|" if args.spread else ""), flush=True)
        for f in fams:
            p = prepare(f, workdir)
            try:
                r = compare(p, args.epochs)
            except RuntimeError as exc:
                print(f"| {f} | {len(p['tokens'])} | fails: {str(exc).splitlines()[-1][:150]} |", flush=True)
                bad.append(f)
                continue
            sp = f" {spread(p, args.epochs):.1e} |" if args.spread else ""
            print(f"| {f} | {r['n_tokens']} | {len(r['llama'])} | {r['llama'][0]:.5f} / {r['torch'][0]:.5f} "
                  f"| {r['llama'][-1]:.5f} / {r['torch'][-1]:.5f} | {r['max_rel']:.1e} (step {r['worst_step'] + 1}) |"
                  + sp, flush=True)
            rows.append(r)
            if not r["max_rel"] <= TOL:
                bad.append(f)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
