"""llama-finetune trains a LoRA adapter on a frozen delta-rule model, checked against PEFT on stock transformers.

The tiny random Qwen3.5, Qwen3-Next (dense), Kimi-Linear, Qwen3.5-MoE and Qwen3-Next MoE (routed experts
frozen) of test_llama_finetune_gdn.py
(ggml/finetune_hybrid.py's GDN_FAMILIES: a Gated DeltaNet or KDA layer and an attention layer, Kimi's with
experts), converted by ggml/convert.py. For each: a PEFT adapter (r 4, alpha 8) on every projection PEFT
accepts there (adapted(); its lora_B drawn non-zero, so that lora_A has a gradient from the first step), written
for llama.cpp by `ggml/lora_peft.py to-gguf --base` (which checks each adapted weight against the GGUF's, so the
converter's reorderings are proven on the model: Qwen3.5's V heads, Qwen3-Next's in_proj_qkvz split into
attn_qkv + attn_gate), trained by `llama-finetune --lora-init` and by PEFT with torch's AdamW on the same windows
in the same order (lr 1e-2, wd 0.01, 2 epochs of 3 windows):

- every step's loss within TOL, and the loss falls;
- only the adapter's tensors have gradients in ggml-opt; the base GGUF's bytes are unchanged;
- the trained adapters equal PEFT's (ADAPTER_TOL per tensor, after moving far more than that);
- llama's trained adapter written back by `lora_peft.py to-peft` loads in PEFT on the stock model and gives the
  logits of PEFT's trained model (LOGITS_TOL).

Qwen3-Next's in_proj_qkvz: llama.cpp adapts the two GGUF tensors it becomes, each with its own lora_A (to-gguf
copies PEFT's one lora_A into both), so after a step they differ, and PEFT's training of one shared lora_A is a
different problem from the second step on. The oracle for that family is therefore PEFT on the stock model
whose in_proj_qkvz Linear is replaced by the same two Linear (the converter's rows, _SplitQkvz: the mixer's
code is transformers' own; measured: the same logits, bit for bit), adapted as llama.cpp adapts them; `to-peft`
then writes in_proj_qkvz's adapter at rank 2r (the two lora_A stacked, lora_B block by block: exactly llama's
product) for the unmodified model, and the logits check holds it to PEFT's trained split model.

Kimi-Linear needs the series' 0029 (its builder multiplied the KDA and MLA projections without build_lora_mm, so
--lora-init refused an adapter on them). Its MLA kv_b_proj (split per head into k_b / v_b, 3-D) and the MoE
experts stay out: PEFT's adapter covers neither here (the experts are fused 3-D parameters in transformers 5:
test_llama_finetune_lora_hybrid.py::test_fused_expert_adapters checks their adapters, Qwen3.5-MoE's, Qwen3-Next
MoE's and Kimi-Linear's among them).

Needs `bash ggml/build.sh` and peft; without them the module skips, except under CI=true, where that is an error.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from finetune_common import finetune_hybrid  # noqa: E402
from ggml_build import import_lora_peft, import_peft, once_per_key, sha256 as _sha256  # noqa: E402

pytestmark = pytest.mark.integration

FAMILIES = ["qwen3_5", "qwen3_next", "kimi_linear", "qwen3_5_moe", "qwen3_next_moe"]
RANK, ALPHA = 4, 8.0
EPOCHS = 2
LR, WD = 1e-2, 0.01
N_WORDS = 185           # about 670 tokens: 3 windows of 256 at stride 128 (CI time)
# Every step's loss, relative. Measured (1 thread, lr 1e-2, 6 steps): at most 3.1e-6 (Qwen3.5), 1.5e-6
# (Qwen3-Next), 2.0e-6 (Kimi-Linear), 2.2e-6 (Qwen3.5-MoE), 2.2e-6 (Qwen3-Next MoE), the 5-decimal print
# (the k-th loss of an epoch exact to (2k-1) 5e-6); the full fine-tuning and Mamba LoRA tests hold the same
# 1e-4. Qwen3.5's V-head order left out of lora_B (the weight check still passing): 1.2e-3 at step 5.
TOL = 1e-4
# The trained adapters, relative L2 per tensor. Measured: at most 2.7e-5 (Qwen3.5), 5.3e-5 (Qwen3-Next),
# 6.0e-6 (Kimi-Linear), 3.1e-6 (Qwen3.5-MoE), 1.1e-6 (Qwen3-Next MoE) after 6 AdamW steps at lr 1e-2
# (float32 AdamW on the tensors with the smallest gradients); 3.8x margin. Each tensor moved by far more
# (checked: > 100x its error).
ADAPTER_TOL = 2e-4
# PEFT's trained model vs llama's trained adapter back in PEFT (to-peft), logits relative L2. Measured: 2.0e-6
# (Qwen3.5), 4.7e-6 (Qwen3-Next, in_proj_qkvz at rank 2r), 7.8e-7 (Kimi-Linear): the adapters' own difference
# carried through; 4.3x margin. The base model's logits are far further (checked: > 100x); to-peft keeping one
# lora_A for in_proj_qkvz's two parts: 7.6e-2.
LOGITS_TOL = 2e-5


@pytest.fixture(scope="module")
def fh():
    fh = finetune_hybrid()
    for n in ("llama-finetune", "llama-tokenize"):
        if not (fh.fc.BIN / n).is_file():
            pytest.fail(f"bash ggml/build.sh built no {fh.fc.BIN / n}")
    return fh


@pytest.fixture(scope="module")
def peft():
    return import_peft()


@pytest.fixture(scope="module")
def lp(fh):
    return import_lora_peft()


@pytest.fixture(scope="module")
def prepared(fh, tmp_path_factory):
    def prepare(family, workdir):
        p = fh.prepare(family, workdir, n_words=N_WORDS)
        p["sha256"] = _sha256(p["gguf"])
        return p
    return once_per_key(prepare, tmp_path_factory.mktemp("lora_gdn"))


def adapted(model):
    """The modules PEFT's adapter covers: every Linear but the head, the MoE routers (not Linear here) and
    Kimi-Linear's kv_b_proj (see the docstring). PEFT 0.21 drops Qwen3-Next's MLP projections from
    target_modules whatever they are called (it takes gate/up/down_proj there for fused experts, which the
    dense model does not have), so for Qwen3-Next the MLPs stay out, in both runs."""
    names = []
    for n, m in model.named_modules():
        if not isinstance(m, torch.nn.Linear) or n == "lm_head" or n.endswith(".kv_b_proj"):
            continue
        if type(model).__name__.startswith("Qwen3Next") and ".mlp." in n:
            continue
        names.append(n)
    return sorted(names)


def finetune(fh, p, init, out, epochs=EPOCHS):
    """llama-finetune --lora-init INIT --lora-out OUT on p's text, -v; (process, losses per epoch)."""
    cmd = [str(fh.fc.BIN / "llama-finetune"), "-m", str(p["gguf"]), "-f", str(p["text"]), "-c", "256", "-b", "256",
           "-ub", "256", "-epochs", str(epochs), "-opt", "adamw", "-lr", repr(LR), "-wd", repr(WD), "-val-split", "0",
           "-t", "1", "-v", "--lora-init", str(init), "--lora-out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc, (fh.fc.parse_progress(proc.stderr) if proc.returncode == 0 else [])


class _SplitQkvz(torch.nn.Module):
    """Qwen3-Next's in_proj_qkvz as the converter writes it (lora_peft's _qwen3next_parts): a Linear per GGUF
    tensor (attn_qkv, attn_gate) holding its rows, their outputs put back in the checkpoint's row order, so the
    stock mixer reads what it reads from the one Linear."""

    def __init__(self, linear, parts):
        super().__init__()
        self.names = [n for n, _ in parts]
        for n, rows in parts:
            sub = torch.nn.Linear(linear.in_features, len(rows), bias=False)
            with torch.no_grad():
                sub.weight.copy_(linear.weight[torch.as_tensor(rows)])
            setattr(self, n, sub)
        self.register_buffer("order", torch.as_tensor(np.argsort(np.concatenate([r for _, r in parts]))),
                             persistent=False)

    def forward(self, x):
        return torch.cat([getattr(self, n)(x) for n in self.names], dim=-1)[..., self.order]


def _split_qkvz(lp, p, model):
    """Replaces each in_proj_qkvz of MODEL by _SplitQkvz; returns {split module: (gguf name, rows)}."""
    hf_cfg = lp._hf_config(p["hf_dir"])
    out = {}
    for name, mod in list(model.named_modules()):
        if not name.endswith(".in_proj_qkvz"):
            continue
        parts = lp._qwen3next_parts(hf_cfg, name + ".weight", None, mod.weight.shape[0], None)
        short = [(part.name.split(".")[2], part.rows) for part in parts]    # blk.0.attn_qkv.weight -> attn_qkv
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, _SplitQkvz(mod, short))
        for part, (s, _) in zip(parts, short):
            out[f"{name}.{s}"] = (part.name, part.rows)
    return out


def _peft_adapter(fh, peft, p, out_dir):
    """A PEFT adapter on adapted() of p's model (stock transformers), lora_B drawn non-zero; saved to OUT_DIR."""
    torch.manual_seed(0)
    model = fh.make_model(p["family"])
    pm = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=adapted(model),
                                                    lora_dropout=0.0))
    torch.manual_seed(1)
    with torch.no_grad():
        for n, w in pm.named_parameters():
            if "lora_B" in n:
                w.normal_(0, 0.02)
    pm.save_pretrained(out_dir)
    return {n: w.detach().clone() for n, w in pm.named_parameters() if "lora_" in n}


def _oracle(fh, peft, lp, p, init):
    """The PEFT model the oracle trains, holding the adapter INIT (PEFT's state dict of _peft_adapter) and
    {PEFT module: gguf name} of its adapted modules. Qwen3-Next: the split model (see the docstring)."""
    model = fh.make_model(p["family"])
    split = _split_qkvz(lp, p, model) if p["family"].startswith("qwen3_next") else {}
    targets = [m for m in adapted(model) if not m.endswith(".in_proj_qkvz")]
    pm = peft.get_peft_model(model, peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets + sorted(split),
                                                    lora_dropout=0.0))
    params = dict(pm.named_parameters())
    with torch.no_grad():
        for n, w in init.items():
            mod, _, part = n.partition(".lora_")
            if mod.endswith(".in_proj_qkvz"):
                for s, (_, rows) in split.items():
                    if s.startswith(mod[len("base_model.model."):] + "."):
                        dst = params[f"base_model.model.{s}.lora_{part}"]
                        dst.copy_(w if part.startswith("A") else w[torch.as_tensor(rows)])
            else:
                params[n].copy_(w)
    return pm, {s: g for s, (g, _) in split.items()}


def _peft_train(pm, inputs, labels):
    """PEFT fine-tuning as llama-finetune does it: a step per window, in order, AdamW on the adapter only."""
    import torch.nn.functional as F
    torch.set_num_threads(1)
    opt = torch.optim.AdamW([w for w in pm.parameters() if w.requires_grad], lr=LR, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=WD)
    pm.train()
    losses = []
    for _ in range(EPOCHS):
        for x, y in zip(inputs, labels):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(pm(input_ids=x[None], use_cache=False).logits[0].float(), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return np.array(losses)


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_init_matches_peft_on_stock_transformers(fh, peft, lp, prepared, tmp_path, family):
    p = prepared(family)
    init = _peft_adapter(fh, peft, p, tmp_path / "peft")
    init_gguf = tmp_path / "init.gguf"
    written = lp.to_gguf(tmp_path / "peft", p["hf_dir"], init_gguf, base_gguf=p["gguf"])
    n_modules = len(adapted(fh.make_model(family)))
    assert len(written) == n_modules + (2 - 1) * family.startswith("qwen3_next"), sorted(written)
    # and back as written: to-peft gives PEFT's adapter again, exactly (in_proj_qkvz's two lora_A are copies: rank r)
    round_trip = lp.to_peft(init_gguf, p["hf_dir"], tmp_path / "round-trip", base_gguf=p["gguf"])
    assert sorted(round_trip) == adapted(fh.make_model(family))
    for mod, ab in round_trip.items():
        for got, part in zip(ab, "AB"):
            assert np.array_equal(got, init[f"base_model.model.{mod}.lora_{part}.default.weight"].numpy()), (mod, part)
    out = tmp_path / "trained.gguf"
    proc, lg = finetune(fh, p, init_gguf, out)
    assert proc.returncode == 0, proc.stderr[-4000:]
    m = re.search(r"ggml-opt holds gradients for (\d+) tensors, (\d+) parameters", proc.stderr)
    assert m and (int(m.group(1)), int(m.group(2))) == (2 * len(written),
                                                        sum(a.size + b.size for a, b in written.values())), m
    assert _sha256(p["gguf"]) == p["sha256"], "llama-finetune --lora-init changed the base GGUF"

    inputs, labels = fh.fc.windows(p["tokens"])
    pm, split = _oracle(fh, peft, lp, p, init)
    if split:
        # the split model is the stock one (measured: the same logits, bit for bit)
        with torch.no_grad(), pm.disable_adapter():
            ours = pm(input_ids=inputs[:1], use_cache=False).logits
        stock = fh.make_model(family)(input_ids=inputs[:1], use_cache=False).logits.detach()
        assert float((ours - stock).norm() / stock.norm()) <= 1e-6
    lt = _peft_train(pm, inputs, labels)
    lg = np.concatenate(lg)
    assert len(lg) == len(lt) == EPOCHS * len(inputs)
    rel = fh.fc.rel_diff(lg, lt)
    worst = int(np.argmax(rel))
    print(f"\n{family}: loss max rel {rel[worst]:.2e} (step {worst + 1}); first {lg[0]:.5f} last {lg[-1]:.5f}")
    assert rel[worst] <= TOL, (f"{family}: step {worst + 1}: llama-finetune {lg[worst]:.6f} vs PEFT {lt[worst]:.6f} "
                               f"(relative {rel[worst]:.2e}); all steps:\n{np.c_[lg, lt]}")
    n = len(inputs)
    assert lt[-n:].mean() < lt[:n].mean() - 0.05, f"the loss did not fall: {lt}"

    # the trained adapters are the same: PEFT's trained one through to-gguf (the split modules: their GGUF names)
    peft_out = tmp_path / "peft-trained"
    _, ad = lp.read_gguf_adapter(out)
    sd = {k: w.detach().numpy() for k, w in pm.named_parameters() if w.requires_grad}
    want = {}
    for k, w in sd.items():
        mod, _, part = k[len("base_model.model."):].partition(".lora_")
        want.setdefault(mod, {})[part[0]] = w
    if not split:
        pm.save_pretrained(peft_out)
        trained = lp.to_gguf(peft_out, p["hf_dir"], tmp_path / "peft-trained.gguf", base_gguf=p["gguf"])
    else:
        # the unsplit modules through to-gguf, the split ones by their GGUF names
        trained = {}
        for mod, g in split.items():
            trained[g] = (want[mod]["A"], want[mod]["B"])
        rest = {k: v for k, v in want.items() if k not in split}
        from safetensors.numpy import save_file
        peft_out.mkdir()
        (peft_out / "adapter_config.json").write_text((tmp_path / "peft" / "adapter_config.json").read_text())
        save_file({f"base_model.model.{mod}.lora_{x}.weight": np.ascontiguousarray(v[x])
                   for mod, v in rest.items() for x in "AB"}, str(peft_out / "adapter_model.safetensors"))
        trained.update(lp.to_gguf(peft_out, p["hf_dir"], tmp_path / "peft-trained.gguf", base_gguf=p["gguf"]))
    assert sorted(trained) == sorted(ad) == sorted(written)
    worst_err = 0.0
    for name in ad:
        for got, w, w0 in zip(ad[name], trained[name], written[name]):
            err = np.linalg.norm(got - w) / np.linalg.norm(w)
            moved = np.linalg.norm(w - w0)
            worst_err = max(worst_err, err)
            assert err <= ADAPTER_TOL and moved > 100 * np.linalg.norm(got - w), (name, err, moved)
    print(f"{family}: adapters max rel {worst_err:.2e}")

    # and back: to-peft of llama's trained adapter on the stock model gives PEFT's trained model's logits
    back_dir = tmp_path / "back"
    back = lp.to_peft(out, p["hf_dir"], back_dir, base_gguf=p["gguf"])
    assert sorted(back) == adapted(fh.make_model(family))
    if split:
        # in_proj_qkvz's two lora_A trained apart: rank 2r
        assert all(back[m][0].shape[0] == (2 * RANK if m.endswith(".in_proj_qkvz") else RANK) for m in back)
    back_model = peft.PeftModel.from_pretrained(fh.make_model(family), back_dir)
    with torch.no_grad():
        want_l = pm.eval()(input_ids=inputs[:2], use_cache=False).logits
        got_l = back_model.eval()(input_ids=inputs[:2], use_cache=False).logits
        base_l = fh.make_model(family)(input_ids=inputs[:2], use_cache=False).logits
    err = float((got_l - want_l).norm() / want_l.norm())
    print(f"{family}: logits rel {err:.2e}")
    assert err <= LOGITS_TOL and float((base_l - want_l).norm() / want_l.norm()) > 100 * LOGITS_TOL, err


def test_lora_peft_refuses_what_it_cannot_map(fh, peft, lp, prepared, tmp_path):
    """Kimi-Linear's kv_b_proj (the converter splits it per head into a transposed k_b and v_b, which llama.cpp
    multiplies head by head) and a Qwen3-Next adapter PEFT would load in part: errors that name them, nothing
    written."""
    p = prepared("kimi_linear")
    torch.manual_seed(0)
    model = fh.make_model("kimi_linear")
    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["model.layers.1.self_attn.kv_b_proj"],
                          lora_dropout=0.0)
    peft.get_peft_model(model, cfg).save_pretrained(tmp_path / "kv_b")
    with pytest.raises(lp.LoraConvertError, match=r"self_attn\.kv_b_proj\.weight: the converter splits kv_b_proj per "
                                                  r"head into k_b \(transposed\) and v_b"):
        lp.to_gguf(tmp_path / "kv_b", p["hf_dir"], tmp_path / "kv_b.gguf", base_gguf=p["gguf"])
    # to-peft of a Qwen3-Next adapter on a dense MLP (llama-finetune's default targets include it): PEFT would drop
    # it on loading (see adapted()), so to-peft refuses rather than write an adapter PEFT loads in part
    q = prepared("qwen3_next")
    gguf, _ = lp._converter()
    w = gguf.GGUFWriter(str(tmp_path / "ffn.gguf"), arch="qwen3next")
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, ALPHA)
    for name, shape in (("blk.0.ffn_gate.weight.lora_a", (RANK, 32)), ("blk.0.ffn_gate.weight.lora_b", (48, RANK)),
                        ("blk.0.ssm_out.weight.lora_a", (RANK, 64)), ("blk.0.ssm_out.weight.lora_b", (32, RANK))):
        w.add_tensor(name, np.zeros(shape, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(lp.LoraConvertError, match=r"PEFT would not load this adapter: on a 'qwen3_next' model PEFT "
                                                  r"\S+ takes \*\.gate_proj / \*\.up_proj"):
        lp.to_peft(tmp_path / "ffn.gguf", q["hf_dir"], tmp_path / "ffn-peft", base_gguf=q["gguf"])
    assert not any((tmp_path / f).exists() for f in ("kv_b.gguf", "ffn-peft"))
