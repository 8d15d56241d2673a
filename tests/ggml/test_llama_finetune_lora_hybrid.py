"""llama-finetune trains a LoRA adapter on a frozen hybrid GGUF, checked against PEFT on STOCK transformers.

The tiny random models of ggml/finetune_hybrid.py (an SSM or short-conv layer and an attention layer, width
32, Mamba's init, in_proj scaled 5x), converted by ggml/convert.py, for each case of CASES (Granite-4.0-H,
Jamba, their MoE configurations, LFM2, LFM2-MoE, Falcon-H1 with its multipliers, Nemotron-H, Nemotron-H's MoE
with a latent space):

- a PEFT adapter (r 4, alpha 8) on the attention, SSM and MLP projections PEFT accepts for that family
  (PEFT refuses out_proj on the models it calls Mamba-based: Falcon-H1, Nemotron-H), its B drawn non-zero
  so that A has a gradient from the first step, written for llama.cpp by `ggml/lora_peft.py to-gguf`
  (--base: every adapted weight is checked to be what the converter made of it);
- trained by `llama-finetune --lora-init` and by PEFT with torch's AdamW on the same windows in the same
  order (lr 1e-2, wd 0.01, 2 epochs of 4 windows): every step's loss within TOL; llama's trained adapter,
  back through `to-peft`, equal to PEFT's trained one (ADAPTER_TOL per tensor), and loaded in PEFT it
  gives the logits of PEFT's trained model; the base GGUF's bytes unchanged.

What the converter does to a weight its adapter must follow (lora_peft.py's _Part): Granite-4.0-H's and
Nemotron-H's q / k rows are permuted (LlamaModel.permute), Granite's shared MLP input split into gate and
up, Falcon-H1's multipliers folded into the weights (the case draws them away from transformers' default
1, so that the folding shows). An AdamW step on a scaled weight is not the scaled step, so the PEFT run
trains Falcon-H1's adapter in the GGUF's form (lora_B = B' / row scale, lora_A = A' / column scale, the
parameters B', A'), as test_llama_finetune_hybrid.py trains A = -exp(A_log): the same model, the optimizer
on the tensors llama-finetune updates. Nemotron-H's latent projections (ffn_latent_down / up) train only
with the series' 0028 (without it llama-finetune refuses their adapters: not multiplied through
build_lora_mm). Not adapted: Jamba's dt_proj (transformers multiplies by dt_proj.weight directly, so a
PEFT adapter there changes nothing), Granite's fused shared MLP input in the training check (llama.cpp
trains its two halves' adapters, each with its own A, PEFT one A: test_granite_fused_mlp_input checks it
forward and back), the MoE experts (3-D: frozen here; test_fused_expert_adapters adapts them, checked by
perplexity before and after llama-finetune) and routers, the heads.

Needs `bash ggml/build.sh` (llama-finetune, llama-tokenize, llama-perplexity) and peft; without them the
module skips, except under CI=true, where that is an error.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ggml_build import built_script, import_lora_peft, import_peft, sha256 as _sha256  # noqa: E402

pytestmark = pytest.mark.integration

RANK, ALPHA = 4, 8.0
EPOCHS = 2
LR, WD = 1e-2, 0.01
# Every step's loss, relative. Measured over the 8 steps (1 thread): at most 4.3e-6 (LFM2), 2.0e-6 to 3.0e-6 for
# the others: the 5-decimal print of the running mean (the k-th loss of an epoch is exact to (2k-1) 5e-6). With
# Falcon-H1's output multipliers left out of lora_b (lora_peft.py's B rows unscaled): 2.2e-5 at step 1,
# 3.4e-4 at step 8.
TOL = 1e-4
# llama's trained adapters back in PEFT against PEFT's, relative L2 per tensor. Measured: at most 6.0e-6
# (Nemotron-H latent MoE), 1.5e-5 for Falcon-H1 (layer 0's in_proj lora_B, where PEFT's own run in float32
# differs from the same run in float64 by 3.2e-5: the float32 spread of AdamW, not a difference of the
# models), hence 5e-5. With Granite's q / k rows left unpermuted in lora_b: 1.4e-3 (in_proj's lora_A: the
# loss moved less than TOL, the gradients did not).
ADAPTER_TOL = 5e-5
# The MoE cases' adapters differ more: measured 1.7e-4 (LFM2-MoE, layer 0's conv out_proj lora_B; its other
# tensors <= 1.6e-5), 3.5e-5 (Granite-4.0-H MoE, the expert layer's v_proj lora_B), 2.8e-5 (Jamba MoE, the
# expert layer's q_proj lora_B), while their losses agree within 2.8e-6 and their logits within 2.8e-6. The
# same tensors are sensitive in PEFT alone: its initial adapter perturbed by 1.2e-7 relative (float32
# rounding) moves LFM2-MoE's by 5.1e-5 after the 8 AdamW steps, Granite MoE's by 9.8e-6, Jamba MoE's by
# 2.4e-6 (LFM2 dense: 6.1e-7); llama's and PEFT's float32 differences at every step (the experts' weighting
# sums in another order) move them by 3 to 12 times that. Held at 3 to 7 times the measured figure.
ADAPTER_TOL_CASE = {"lfm2_moe": 5e-4, "granitemoehybrid_moe": 2e-4, "jamba_moe": 2e-4}
# The logits of PEFT's trained model and of llama's trained adapter back in PEFT, relative L2. Measured: at most
# 2.5e-6 (LFM2-MoE's too), Falcon-H1 1.1e-5 (its adapters' float32 spread carried through).
LOGITS_TOL = 5e-5
# llama-perplexity --lora against the same estimate of PEFT's model in torch, relative. Measured (Granite's
# fused MLP input): 515.4822 against 515.48219 as converted (base 513.7099), 505.4314 against 505.43144 trained:
# the 4-decimal print.
PPL_TOL = 1e-5

# Falcon-H1's multipliers (transformers' defaults are all 1), each a different value, so that a multiplier
# folded into the wrong weight, or not into the adapter, shows
FALCON_H1_MUP = dict(attention_in_multiplier=0.8, attention_out_multiplier=1.3, key_multiplier=0.7,
                     ssm_in_multiplier=1.25, ssm_out_multiplier=0.9, mlp_multipliers=[1.2, 0.85],
                     ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3], embedding_multiplier=1.1, lm_head_multiplier=0.9)

_ATTN = ("attn_q", "attn_k", "attn_v", "attn_output")
# case -> (finetune_hybrid family, config overrides, PEFT target_modules, the GGUF tensors they must become
# {block: names}, whether PEFT trains the adapter in the GGUF's form)
CASES = {
    "granitemoehybrid": ("granitemoehybrid", None,
                         ["in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "output_linear"],
                         {0: ("ssm_in", "ssm_out", "ffn_down"), 1: (*_ATTN, "ffn_down")}, False),
    # Granite-4.0-H's MoE: the shared MLP's output is ffn_down_shexp (experts and router frozen)
    "granitemoehybrid_moe": ("granitemoehybrid_moe", None,
                             ["in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "output_linear"],
                             {0: ("ssm_in", "ssm_out", "ffn_down_shexp"), 1: (*_ATTN, "ffn_down_shexp")}, False),
    # Jamba's MoE: the Mamba layer's MLP is dense, the attention layer's experts frozen
    "jamba_moe": ("jamba_moe", None,
                  ["in_proj", "x_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                   "down_proj"],
                  {0: ("ssm_in", "ssm_x", "ssm_out", "ffn_gate", "ffn_up", "ffn_down"), 1: _ATTN}, False),
    "jamba": ("jamba", None,
              ["in_proj", "x_proj", "out_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
               "down_proj"],
              {0: ("ssm_in", "ssm_x", "ssm_out", "ffn_gate", "ffn_up", "ffn_down"),
               1: (*_ATTN, "ffn_gate", "ffn_up", "ffn_down")}, False),
    "lfm2": ("lfm2", None, ["in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "w1", "w2", "w3"],
             {0: ("shortconv.in_proj", "shortconv.out_proj", "ffn_gate", "ffn_up", "ffn_down"),
              1: (*_ATTN, "ffn_gate", "ffn_up", "ffn_down")}, False),
    # LFM2-MoE: a dense first layer, then experts (frozen: 3-D, not adapted) under the attention layer
    "lfm2_moe": ("lfm2_moe", None, ["in_proj", "out_proj", "q_proj", "k_proj", "v_proj", "w1", "w2", "w3"],
                 {0: ("shortconv.in_proj", "shortconv.out_proj", "ffn_gate", "ffn_up", "ffn_down"), 1: _ATTN}, False),
    "falcon_h1_mup": ("falcon_h1", FALCON_H1_MUP,
                      ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
                      {i: ("ssm_in", *_ATTN, "ffn_gate", "ffn_up", "ffn_down") for i in range(2)}, True),
    "nemotron_h": ("nemotron_h", None, ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"],
                   {0: ("ssm_in",), 1: _ATTN, 2: ("ffn_up", "ffn_down")}, False),
    # Nemotron-H's MoE with a latent space (Nemotron 3 Super's form: the experts run in moe_latent_size,
    # fc1 / fc2_latent_proj around them, the shared expert at full width): the latent projections are
    # ffn_latent_down / up, which llama.cpp multiplies through build_lora_mm with the series' 0028 only
    "nemotron_h_latent": ("nemotron_h_moe", dict(moe_latent_size=16),
                          ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj", "fc1_latent_proj",
                           "fc2_latent_proj"],
                          {0: ("ssm_in",), 1: _ATTN,
                           2: ("ffn_up_shexp", "ffn_down_shexp", "ffn_latent_down", "ffn_latent_up")}, False),
}


@pytest.fixture(scope="module")
def fh():
    """ggml/finetune_hybrid.py, with the patched llama-finetune, llama-tokenize and llama-perplexity built."""
    return built_script("finetune_hybrid", lambda fh: [fh.fc.BIN / n for n in
                                                       ("llama-finetune", "llama-tokenize", "llama-perplexity")])


@pytest.fixture(scope="module")
def peft():
    return import_peft()


@pytest.fixture(scope="module")
def lp(fh):
    return import_lora_peft()


@pytest.fixture(scope="module")
def prepared(fh, tmp_path_factory):
    """case -> the converted model, its text and tokens, the sha256 of the GGUF's bytes. Every case, and every
    family of FUSED_EXPERTS that is not one, is converted on the first call, in one converter process
    (convert.convert_many: a conversion of these tiny models is mostly the converter's imports)."""
    workdir = tmp_path_factory.mktemp("lora_hybrid")
    cache = {}
    models = {c: (family, overrides) for c, (family, overrides, *_) in CASES.items()}
    models.update({f: (f, None) for f in FUSED_EXPERTS if f not in CASES})

    def get(case):
        if not cache:
            text = workdir / "text.txt"
            text.write_bytes(fh.fc.make_text(fh.N_WORDS, 0).encode())
            jobs = []
            for c, (family, overrides) in models.items():
                fh.make_model(family, overrides=overrides).save_pretrained(workdir / c)
                jobs.append((workdir / c, workdir / f"{c}.gguf"))
            fh.convert.convert_many(jobs)
            for c, (family, overrides) in models.items():
                gguf = workdir / f"{c}.gguf"
                cache[c] = dict(family=family, case=c, overrides=overrides, hf_dir=workdir / c, gguf=gguf, text=text,
                                tokens=fh.fc.tokenize(gguf, text), workdir=workdir, sha256=_sha256(gguf))
        return cache[case]
    return get


def _model(fh, p):
    return fh.make_model(p["family"], overrides=p["overrides"])


def finetune(fh, p, *args, epochs=EPOCHS, lr=LR, wd=WD):
    """llama-finetune --lora-* on p's text; (process, losses per epoch)."""
    fc = fh.fc
    cmd = [str(fc.BIN / "llama-finetune"), "-m", str(p["gguf"]), "-f", str(p["text"]), "-c", "256", "-b", "256",
           "-ub", "256", "-epochs", str(epochs), "-opt", "adamw", "-lr", repr(lr), "-wd", repr(wd), "-val-split", "0",
           "-t", "1", "-v", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc, (fc.parse_progress(proc.stderr) if proc.returncode == 0 else [])


def _peft_adapter(fh, peft, p, targets, out_dir):
    """A PEFT adapter on TARGETS of p's model (stock transformers), its B drawn non-zero; saved to OUT_DIR."""
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets, lora_dropout=0.0)
    pm = peft.get_peft_model(_model(fh, p), cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, w in pm.named_parameters():
            if "lora_B" in n:
                w.normal_(0, 0.02)
    pm.save_pretrained(out_dir)
    return sorted(n[len("base_model.model."):-len(".lora_A.default.weight")] for n, _ in pm.named_parameters()
                  if n.endswith(".lora_A.default.weight"))


class _Unscale(torch.nn.Module):
    """weight = parameter / scale: PEFT's lora_A / lora_B from the GGUF adapter's tensor (the parameter)."""

    def __init__(self, scale):
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, p):
        return p / self.scale

    def right_inverse(self, w):
        return w * self.scale


def _train_in_gguf_form(pm, written, names):
    """Each adapted module of PM trains its (A', B') = (A * col scale, row scale * B), the tensors the GGUF
    adapter holds (WRITTEN: to-gguf's, NAMES: module -> GGUF name); the scales read off the two. Returns
    the number of scaled tensors."""
    from torch.nn.utils import parametrize
    mods = dict(pm.named_modules())
    n = 0
    for mod, name in names.items():
        a_gguf, b_gguf = (torch.from_numpy(t).double() for t in written[name])
        lin_a, lin_b = mods[f"base_model.model.{mod}.lora_A.default"], mods[f"base_model.model.{mod}.lora_B.default"]
        a, b = lin_a.weight.detach().double(), lin_b.weight.detach().double()
        col = float((a_gguf * a).sum() / (a * a).sum())
        row = (b_gguf * b).sum(1, keepdim=True) / (b * b).sum(1, keepdim=True)
        assert torch.allclose(a_gguf, a * col, rtol=1e-6) and torch.allclose(b_gguf, b * row, rtol=1e-6), mod
        for lin, scale in ((lin_a, torch.tensor(col)), (lin_b, row)):
            if not torch.allclose(scale, torch.ones_like(scale), rtol=0, atol=1e-7):
                parametrize.register_parametrization(lin, "weight", _Unscale(scale.float()))
                n += 1
    return n


def _peft_train(fh, peft, p, peft_dir, inputs, labels, written=None, names=None):
    """PEFT fine-tuning as llama-finetune does it (a step per window, in order; AdamW on the adapter only);
    in the GGUF's form if WRITTEN (to-gguf's tensors, NAMES module -> GGUF name). (model, losses, n scaled)."""
    import torch.nn.functional as F
    torch.set_num_threads(1)
    pm = peft.PeftModel.from_pretrained(_model(fh, p), peft_dir, is_trainable=True)
    n_scaled = _train_in_gguf_form(pm, written, names) if written is not None else 0
    params = [w for w in pm.parameters() if w.requires_grad]
    opt = torch.optim.AdamW(params, lr=LR, betas=fh.BETAS, eps=fh.EPS, weight_decay=WD)
    pm.train()
    losses = []
    for _ in range(EPOCHS):
        losses.append([])
        for x, y in zip(inputs, labels):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(pm(input_ids=x[None], use_cache=False).logits[0].float(), y)
            loss.backward()
            opt.step()
            losses[-1].append(loss.item())
    return pm, losses, n_scaled


@pytest.mark.parametrize("case", sorted(CASES))
def test_lora_init_matches_peft_on_stock_transformers(fh, peft, lp, prepared, tmp_path, case):
    p = prepared(case)
    _, _, targets, expect, gguf_form = CASES[case]
    peft_dir = tmp_path / "peft"
    modules = _peft_adapter(fh, peft, p, targets, peft_dir)
    init = tmp_path / "init.gguf"
    written = lp.to_gguf(peft_dir, p["hf_dir"], init, base_gguf=p["gguf"])
    want_names = sorted(f"blk.{i}.{n}.weight" for i, ns in expect.items() for n in ns)
    assert sorted(written) == want_names and len(modules) == len(want_names), (sorted(written), sorted(modules))

    out = tmp_path / "trained.gguf"
    proc, lg = finetune(fh, p, "--lora-init", init, "--lora-out", out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert f"training a LoRA adapter: {2 * len(written)} tensors" in proc.stderr, proc.stderr[-3000:]
    assert _sha256(p["gguf"]) == p["sha256"], "llama-finetune --lora-init changed the base GGUF"

    # PEFT's adapter as drawn, and which GGUF tensor each module became (lora_peft's map: a wrong one fails
    # the losses)
    from safetensors.numpy import load_file
    st = load_file(str(peft_dir / "adapter_model.safetensors"))
    start = {mod: (st[f"{lp.PEFT_PREFIX}{mod}.lora_A.weight"], st[f"{lp.PEFT_PREFIX}{mod}.lora_B.weight"])
             for mod in modules}
    arch, name_map = lp._name_map(p["hf_dir"])
    cfg = lp._hf_config(p["hf_dir"])
    names = {}
    for mod, (a, b) in start.items():
        parts = lp._weight_parts(arch, cfg, name_map, mod + ".weight", b.shape[0])
        assert len(parts) == 1, (mod, [q.name for q in parts])
        names[mod] = parts[0].name

    inputs, labels = fh.fc.windows(p["tokens"])
    pm, lt, n_scaled = _peft_train(fh, peft, p, peft_dir, inputs, labels,
                                   *((written, names) if gguf_form else (None, None)))
    assert [len(e) for e in lg] == [len(e) for e in lt] == [len(inputs)] * EPOCHS
    lg, lt = np.concatenate(lg), np.concatenate(lt)
    rel = fh.fc.rel_diff(lg, lt)
    worst = int(np.argmax(rel))
    assert rel[worst] <= TOL, (f"{case}: step {worst + 1}: llama-finetune {lg[worst]:.6f} vs PEFT {lt[worst]:.6f} "
                               f"(relative {rel[worst]:.2e}); all steps:\n{np.c_[lg, lt]}")
    assert lt[-len(inputs):].mean() < lt[:len(inputs)].mean(), f"the loss did not fall: {lt}"
    # Falcon-H1: every adapted module has a multiplier on its A or B (the PEFT run trained them in the GGUF's form)
    assert not gguf_form or n_scaled >= len(modules), n_scaled

    # the trained adapters are the same (in PEFT's form: to-peft of llama's against PEFT's)
    back_dir = tmp_path / "back"
    back = lp.to_peft(out, p["hf_dir"], back_dir, base_gguf=p["gguf"])
    assert sorted(back) == modules, (sorted(back), modules)
    with torch.no_grad():
        trained = {n: m.weight.detach().numpy().copy() for n, m in pm.named_modules()
                   if n.endswith((".lora_A.default", ".lora_B.default"))}
    for mod in modules:
        for got, part, drawn in zip(back[mod], "AB", start[mod]):
            want = trained[f"base_model.model.{mod}.lora_{part}.default"]
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            moved = np.linalg.norm(want - drawn)
            tol = ADAPTER_TOL_CASE.get(case, ADAPTER_TOL)
            assert err <= tol and moved > 100 * np.linalg.norm(got - want), (mod, part, err, moved)

    # and llama's, back in PEFT, gives PEFT's logits
    back_model = peft.PeftModel.from_pretrained(_model(fh, p), back_dir)
    with torch.no_grad():
        want = pm.eval()(input_ids=inputs[:2], use_cache=False).logits
        got = back_model.eval()(input_ids=inputs[:2], use_cache=False).logits
        base = _model(fh, p)(input_ids=inputs[:2], use_cache=False).logits
    err = float((got - want).norm() / want.norm())
    assert err <= LOGITS_TOL and float((base - want).norm() / want.norm()) > 100 * LOGITS_TOL, err



def _perplexity(fh, p, adapter):
    """llama-perplexity -c 256 --lora ADAPTER of p's text: its final estimate."""
    import re
    cmd = [str(fh.fc.BIN / "llama-perplexity"), "-m", str(p["gguf"]), "-f", str(p["text"]), "-c", "256", "-b", "256",
           "-t", "1", "--lora", str(adapter)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stderr + proc.stdout)
    assert m, (proc.stderr + proc.stdout)[-3000:]
    return float(m.group(1))


def test_granite_fused_mlp_input(fh, peft, lp, prepared, tmp_path):
    """Granite-4.0-H's shared MLP input (input_linear, gate and up in one weight) is two GGUF tensors,
    ffn_gate and ffn_up. to-gguf gives each PEFT's A and its half of B's rows; to-peft joins them back
    (the same adapter, exactly). llama-finetune trains each half with its own A, so after training the two
    are one PEFT adapter of rank 2r (A stacked, B block-diagonal, alpha 2 alpha: the same product), which
    PEFT loads: llama-perplexity --lora of llama's adapter is the perplexity of PEFT with its conversion,
    before training and after."""
    from test_llama_finetune_lora import _perplexity_torch
    p = prepared("granitemoehybrid")
    torch.manual_seed(0)
    pm = peft.get_peft_model(_model(fh, p), peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["input_linear"],
                                                             lora_dropout=0.0))
    torch.manual_seed(1)
    with torch.no_grad():
        for n, w in pm.named_parameters():
            if "lora_B" in n:
                w.normal_(0, 0.2)        # large enough to move the perplexity
    pm.save_pretrained(tmp_path / "peft")
    init = tmp_path / "init.gguf"
    written = lp.to_gguf(tmp_path / "peft", p["hf_dir"], init, base_gguf=p["gguf"])
    assert sorted(written) == [f"blk.{i}.{n}.weight" for i in range(2) for n in ("ffn_gate", "ffn_up")]
    sd = {n: w.detach().numpy() for n, w in pm.named_parameters() if "lora_" in n}
    for i in range(2):
        a = sd[f"base_model.model.model.layers.{i}.shared_mlp.input_linear.lora_A.default.weight"]
        b = sd[f"base_model.model.model.layers.{i}.shared_mlp.input_linear.lora_B.default.weight"]
        ffn = b.shape[0] // 2
        for name, half in (("ffn_gate", b[:ffn]), ("ffn_up", b[ffn:])):
            assert np.array_equal(written[f"blk.{i}.{name}.weight"][0], a)
            assert np.array_equal(written[f"blk.{i}.{name}.weight"][1], half)
    back = lp.to_peft(init, p["hf_dir"], tmp_path / "init-back", base_gguf=p["gguf"])
    for i in range(2):
        mod = f"model.layers.{i}.shared_mlp.input_linear"
        assert np.array_equal(back[mod][0], sd[f"base_model.model.{mod}.lora_A.default.weight"])
        assert np.array_equal(back[mod][1], sd[f"base_model.model.{mod}.lora_B.default.weight"])

    # the forward: llama.cpp with the converted adapter against PEFT (and the base model, far from both)
    ppl_base = _perplexity_torch(_model(fh, p), p["tokens"])
    ppl_peft = _perplexity_torch(pm, p["tokens"])
    ppl_llama = _perplexity(fh, p, init)
    assert abs(ppl_llama - ppl_peft) <= PPL_TOL * ppl_peft and abs(ppl_base - ppl_peft) > 1e-3 * ppl_peft, (
        ppl_llama, ppl_peft, ppl_base)

    # trained by llama-finetune: the halves' A part; to-peft writes the rank-2r adapter, which PEFT loads
    out = tmp_path / "trained.gguf"
    proc, _ = finetune(fh, p, "--lora-init", init, "--lora-out", out, epochs=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _, ad = lp.read_gguf_adapter(out)
    assert not np.array_equal(ad["blk.0.ffn_gate.weight"][0], ad["blk.0.ffn_up.weight"][0])
    trained = lp.to_peft(out, p["hf_dir"], tmp_path / "back", base_gguf=p["gguf"])
    a, b = trained["model.layers.0.shared_mlp.input_linear"]
    assert a.shape == (2 * RANK, a.shape[1]) and b.shape == (b.shape[0], 2 * RANK)
    assert not b[:b.shape[0] // 2, RANK:].any() and not b[b.shape[0] // 2:, :RANK].any()
    back_model = peft.PeftModel.from_pretrained(_model(fh, p), tmp_path / "back")
    ppl_back = _perplexity_torch(back_model, p["tokens"])
    ppl_trained = _perplexity(fh, p, out)
    assert abs(ppl_trained - ppl_back) <= PPL_TOL * ppl_back and abs(ppl_trained - ppl_llama) > 1e-3 * ppl_llama, (
        ppl_trained, ppl_back, ppl_llama)
    # and back again: to-gguf of that rank-2r adapter (its rank_pattern, B block-diagonal) is llama's adapter
    again = lp.to_gguf(tmp_path / "back", p["hf_dir"], tmp_path / "again.gguf", base_gguf=p["gguf"])
    assert sorted(again) == sorted(ad) and all(
        np.array_equal(again[n][0], ad[n][0]) and np.array_equal(again[n][1], ad[n][1]) for n in ad)


def test_rank_and_alpha_patterns_to_gguf(fh, peft, lp, prepared, tmp_path):
    """A PEFT adapter whose rank_pattern and alpha_pattern give Granite's fused input_linear rank 2r and its own
    alpha (scale alpha_m / 2r), beside q_proj at the adapter's r and alpha: to-gguf keeps each module's rank in
    its GGUF tensors (both halves of input_linear take its whole A, B dense) and multiplies B by the ratio of
    PEFT's scale to llama.cpp's (alpha over the tensor's rank), so llama-perplexity --lora is PEFT's perplexity.
    Measured: 511.2742 against 511.27425 (base 513.70986). Broken on purpose (B left unscaled): the halves' B are
    not PEFT's B / 2."""
    from test_llama_finetune_lora import _perplexity_torch
    p = prepared("granitemoehybrid")
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["input_linear", "q_proj"], lora_dropout=0.0,
                          rank_pattern={"input_linear": 2 * RANK}, alpha_pattern={"input_linear": ALPHA / 2})
    pm = peft.get_peft_model(_model(fh, p), cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, w in pm.named_parameters():
            if "lora_B" in n:
                w.normal_(0, 2.0)        # Granite's perplexity moves little: 0.5 moved it by 3.5e-4
    pm.save_pretrained(tmp_path / "peft")
    written = lp.to_gguf(tmp_path / "peft", p["hf_dir"], tmp_path / "ad.gguf", base_gguf=p["gguf"])
    sd = {n: w.detach().numpy() for n, w in pm.named_parameters() if "lora_" in n}
    mod = "base_model.model.model.layers.0.shared_mlp.input_linear"
    a, b = sd[f"{mod}.lora_A.default.weight"], sd[f"{mod}.lora_B.default.weight"]
    ffn = b.shape[0] // 2
    # PEFT scales input_linear by (ALPHA / 2) / (2 RANK), llama.cpp a rank-2r tensor by ALPHA / (2 RANK): B / 2
    assert np.array_equal(written["blk.0.ffn_gate.weight"][0], a)
    assert np.array_equal(written["blk.0.ffn_up.weight"][1], b[ffn:] / 2)
    # q_proj at the adapter's own rank and alpha (its rows in the converter's RoPE order: the perplexity checks it)
    (q_key,) = [n for n in sd if n.endswith("q_proj.lora_B.default.weight")]
    layer = int(q_key.split(".layers.")[1].split(".")[0])
    assert written[f"blk.{layer}.attn_q.weight"][1].shape == sd[q_key].shape == (sd[q_key].shape[0], RANK)
    ppl_base = _perplexity_torch(_model(fh, p), p["tokens"])
    ppl_peft = _perplexity_torch(pm, p["tokens"])
    ppl_llama = _perplexity(fh, p, tmp_path / "ad.gguf")
    print(f"rank/alpha patterns: llama {ppl_llama}, PEFT {ppl_peft}, base {ppl_base}")
    assert abs(ppl_llama - ppl_peft) <= PPL_TOL * ppl_peft and abs(ppl_base - ppl_peft) > 1e-3 * ppl_peft, (
        ppl_llama, ppl_peft, ppl_base)


# the experts' parameters targeted, per family: transformers 5.24 holds every one as 3-D parameters of an experts
# module, gate and up fused (experts.gate_up_proj (E, 2 I, H), experts.down_proj (E, H, I)), only the module's
# path differs. Prepared here, not a CASE: Qwen3.5-MoE (every layer's experts), Qwen3-Next MoE (every layer's,
# beside a gated shared expert), Kimi-Linear (the MLA layer's, beside a shared expert and a sigmoid router with a
# score-correction bias); Granite-4.0-H MoE (every layer's, beside the shared MLP) and Jamba MoE (the attention
# layer's) are the CASES' models.
FUSED_EXPERTS = {"lfm2_moe": ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"],
                 "qwen3_5_moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                 "granitemoehybrid_moe": ["block_sparse_moe.experts.gate_up_proj",
                                          "block_sparse_moe.experts.down_proj"],
                 "jamba_moe": ["feed_forward.experts.gate_up_proj", "feed_forward.experts.down_proj"],
                 "qwen3_next_moe": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                 "kimi_linear": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]}


# lora_B's spread where 0.2 does not move the perplexity by the 1e-3 the test asks (measured at 0.2: Granite-4.0-H
# MoE 523.3541 against its base's 522.86819, 0.93e-3; Jamba MoE 500.1982 against 500.54744, 0.70e-3)
B_STD = {"granitemoehybrid_moe": 1.0, "jamba_moe": 1.0}


@pytest.mark.parametrize("family", sorted(FUSED_EXPERTS))
def test_fused_expert_adapters(fh, peft, lp, prepared, tmp_path, family):
    """Adapters on the experts of every MoE family but Nemotron-H (test_llama_finetune_lora_moe.py's): LFM2-MoE,
    Qwen3.5-MoE, Granite-4.0-H MoE, Jamba MoE, Qwen3-Next MoE, Kimi-Linear. transformers 5.24 holds each family's
    experts as 3-D parameters, gate and up fused (experts.gate_up_proj (E, 2 I, H), experts.down_proj; none has
    per-expert Linear modules), which PEFT 0.21 adapts through target_parameters (ParamWrapper: lora_A (E r, in),
    lora_B (out, r E)); the converter writes ffn_gate_exps, ffn_up_exps and ffn_down_exps. to-gguf gives the gate
    and up experts' adapters the parameter's lora_A and their halves of its lora_B rows (per expert), to-peft joins
    them back exactly; llama-finetune trains each half with its own lora_a, after which to-peft writes
    gate_up_proj's adapter at rank 2r (per expert: the two lora_a stacked, lora_b block-diagonal), which PEFT
    loads: llama-perplexity --lora of llama's adapter is PEFT's perplexity of its conversion, before training and
    after. Measured (llama against PEFT, converted (base) / trained; the 4-decimal print):
        LFM2-MoE          513.0073 / 513.00749 (515.44945), 462.0120 / 462.01193
        Qwen3.5-MoE       514.8114 / 514.81141 (511.30508), 442.9358 / 442.93578
        Granite-4.0-H MoE 520.3496 / 520.34961 (522.86819), 476.7152 / 476.71516
        Jamba MoE         513.6519 / 513.65187 (500.54744), 457.0865 / 457.08655
        Qwen3-Next MoE    516.4216 / 516.42162 (507.94648), 445.2412 / 445.24116
        Kimi-Linear       520.0795 / 520.07951 (519.18892), 462.9623 / 462.96227
    Broken on purpose: lora_peft.py taking the up rows first: to-gguf --base refuses ffn_up_exps (every family);
    lora_peft.py reading PEFT's lora_B as expert-major (out, E, r) both ways (to-peft gives back the same tensors,
    so only PEFT's forward shows it): llama 510.6717 against PEFT 520.34961 (Granite), 521.0656 / 513.65187
    (Jamba), 514.7666 / 516.42162 (Qwen3-Next), 513.2771 / 520.07951 (Kimi-Linear)."""
    from test_llama_finetune_lora import _perplexity_torch
    p = prepared(family)
    targets = FUSED_EXPERTS[family]
    b_std = B_STD.get(family, 0.2)
    torch.manual_seed(0)
    pm = peft.get_peft_model(_model(fh, p), peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["q_proj"],
                                                             target_parameters=targets, lora_dropout=0.0))
    torch.manual_seed(1)
    with torch.no_grad():
        for n, w in pm.named_parameters():
            if "lora_B" in n:
                w.normal_(0, b_std)      # large enough to move the perplexity
    pm.save_pretrained(tmp_path / "peft")
    init = tmp_path / "init.gguf"
    written = lp.to_gguf(tmp_path / "peft", p["hf_dir"], init, base_gguf=p["gguf"])
    # every MoE layer's gate, up and down experts, per expert lora_a (r, in) and lora_b (out, r)
    params = {n: tuple(w.shape) for n, w in _model(fh, p).named_parameters() if n.endswith(targets[0])}
    moe_layers = sorted(int(n.split(".")[2]) for n in params)
    assert len(set(params.values())) == 1, params
    n_exp, ff2, hidden = params.popitem()[1]
    ff = ff2 // 2
    assert n_exp == 4 and hidden == 32, (n_exp, hidden)
    assert moe_layers and {n: (a.shape, b.shape) for n, (a, b) in written.items() if "_exps" in n} == {
        f"blk.{i}.{t}.weight": s_ for i in moe_layers for t, s_ in (
            ("ffn_gate_exps", ((n_exp, RANK, hidden), (n_exp, ff, RANK))),
            ("ffn_up_exps", ((n_exp, RANK, hidden), (n_exp, ff, RANK))),
            ("ffn_down_exps", ((n_exp, RANK, ff), (n_exp, hidden, RANK))))}
    from safetensors.numpy import load_file
    want = load_file(str(tmp_path / "peft" / "adapter_model.safetensors"))
    lp.to_peft(init, p["hf_dir"], tmp_path / "init-back", base_gguf=p["gguf"])
    got = load_file(str(tmp_path / "init-back" / "adapter_model.safetensors"))
    assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in want)

    ppl_base = _perplexity_torch(_model(fh, p), p["tokens"])
    ppl_peft = _perplexity_torch(pm, p["tokens"])
    ppl_llama = _perplexity(fh, p, init)
    assert abs(ppl_llama - ppl_peft) <= PPL_TOL * ppl_peft and abs(ppl_base - ppl_peft) > 1e-3 * ppl_peft, (
        ppl_llama, ppl_peft, ppl_base)

    out = tmp_path / "trained.gguf"
    proc, _ = finetune(fh, p, "--lora-init", init, "--lora-out", out, epochs=1)
    assert proc.returncode == 0, proc.stderr[-4000:]
    _, ad = lp.read_gguf_adapter(out)
    i = moe_layers[0]
    assert not np.array_equal(ad[f"blk.{i}.ffn_gate_exps.weight"][0], ad[f"blk.{i}.ffn_up_exps.weight"][0])
    lp.to_peft(out, p["hf_dir"], tmp_path / "back", base_gguf=p["gguf"])
    cfg = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert list(cfg["rank_pattern"].values()) == [2 * RANK] * len(moe_layers), cfg["rank_pattern"]
    back_model = peft.PeftModel.from_pretrained(_model(fh, p), tmp_path / "back")
    ppl_back = _perplexity_torch(back_model, p["tokens"])
    ppl_trained = _perplexity(fh, p, out)
    print(f"{family}: perplexity {ppl_llama} / {ppl_peft} (base {ppl_base}), trained {ppl_trained} / {ppl_back}")
    assert abs(ppl_trained - ppl_back) <= PPL_TOL * ppl_back and abs(ppl_trained - ppl_llama) > 1e-3 * ppl_llama, (
        ppl_trained, ppl_back, ppl_llama)
    # and back again: to-gguf of the rank-2r experts' adapter (per expert block-diagonal) is llama's adapter
    again = lp.to_gguf(tmp_path / "back", p["hf_dir"], tmp_path / "again.gguf", base_gguf=p["gguf"])
    assert sorted(again) == sorted(ad) and all(
        np.array_equal(again[n][0], ad[n][0]) and np.array_equal(again[n][1], ad[n][1]) for n in ad)


def test_lora_peft_split_weight_errors(fh, lp, prepared, tmp_path):
    """An adapter with one half of Granite's fused MLP input (ffn_gate without ffn_up) has no PEFT form: to-peft
    says so and writes nothing (the command line's exit 1 with the message is test_llama_finetune_lora.py's)."""
    p = prepared("granitemoehybrid")
    gguf, _ = lp._converter()
    path = tmp_path / "half.gguf"
    w = gguf.GGUFWriter(str(path), arch="granitehybrid")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, ALPHA)
    w.add_tensor("blk.0.ffn_gate.weight.lora_a", np.zeros((RANK, 32), np.float32))
    w.add_tensor("blk.0.ffn_gate.weight.lora_b", np.zeros((48, RANK), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    message = ("model.layers.0.shared_mlp.input_linear: the adapter has blk.0.ffn_gate.weight but not "
               "blk.0.ffn_up.weight: PEFT adapts the weight whole")
    with pytest.raises(lp.LoraConvertError, match=message.replace(".", r"\.")):
        lp.to_peft(path, p["hf_dir"], tmp_path / "back")
    assert not (tmp_path / "back").exists()
