"""llama-finetune trains a LoRA adapter on frozen bases of the formats people download: F16, BF16, Q8_0, Q4_0
and Q4_K, each made from the F32 GGUF by the built `llama-quantize`.

The model: the tiny random Mamba-2 of test_llama_finetune_lora.py (ggml/finetune_check.py's CONFIGS["mamba2"],
2 layers, 2 groups, in_proj scaled 5x, untied) with hidden_size 256 (8 heads of 64) instead of 32. Q4_K (and
the Q6_K that llama-quantize's Q4_K, i.e. Q4_K_M, gives the head) packs a row in blocks of 256: a row whose
length is no multiple of 256 gets a fallback type (tensor_type_fallback in src/llama-quant.cpp: Q4_K -> Q5_0,
Q6_K -> Q8_0, with a warning), so at hidden_size 32 every weight of a "Q4_K" file is Q5_0 (the head Q8_0) and
nothing would run Q4_K (seen with llama-quantize: "blk.0.ssm_in.weight - ncols 32 not divisible by 256 (required for type
q4_K) -> falling back to q5_0"). At 256, ssm_in (rows of 256), ssm_out (512) and token_embd are Q4_K, the head Q6_K;
the test asserts every tensor's type in each GGUF with gguf-py.

On each base the same PEFT adapter (on in_proj, r 4, alpha 8, its B drawn non-zero so that A has a gradient
from the first step; PEFT refuses out_proj on Mamba models) is trained by `llama-finetune --lora-init` for 2
epochs of 5 windows (AdamW, lr 1e-3: see TOL_DEQUANT; 1 thread), and:
- the loss falls, the repacking of Q4_0 / Q4_K is turned off (the series' 0031: a repacked weight has no
  OUT_PROD, and llama-finetune aborted on both), ggml-opt holds gradients for the adapter only;
- every step's loss is within a measured bound of the F32 base's run (TOL_F32 below);
- the oracle: PEFT on STOCK transformers (never ssmgrad-patched) running the base's weights DEQUANTIZED by
  gguf-py (gguf.quants.dequantize: every tensor that is not F32 in the GGUF, the embedding and the head
  included), the input of each frozen product rounded as ggml's MUL_MAT rounds it (round_inputs_as_ggml),
  trained on the same windows in the same order: every step within TOL_DEQUANT, and the same oracle on the
  F32 weights outside it;
- the base GGUF's bytes (and the F32 GGUF's) are unchanged, and every GGUF holds the types it should (gguf-py);
- `llama-completion --lora` loads the adapter trained on the Q4_K base ("loaded 4 tensors from lora file")
  and generates.

Needs `bash ggml/build.sh` (llama-finetune, llama-tokenize, llama-quantize, llama-completion) and peft; without
them the module skips, except under CI=true, where that is an error.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ggml_build import built_script, once_per_key, import_lora_peft, import_peft, sha256 as _sha256  # noqa: E402
import test_llama_finetune_lora as lora_test  # noqa: E402  (its llama-finetune runner and PEFT training loop)

pytestmark = pytest.mark.integration   # .ci's sanitizer and compiler passes skip it

BASES = ["F16", "BF16", "Q8_0", "Q4_0", "Q4_K"]
CONFIG = dict(hidden_size=256, num_heads=8, head_dim=64)       # over finetune_check.CONFIGS["mamba2"]
# what llama-quantize makes of each 2-D weight kind (all other tensors stay F32: norms, ssm_a, ssm_d, the conv)
TYPES = {
    "F16": dict(ssm_in="F16", ssm_out="F16", token_embd="F16", output="F16"),
    "BF16": dict(ssm_in="BF16", ssm_out="BF16", token_embd="BF16", output="BF16"),
    "Q8_0": dict(ssm_in="Q8_0", ssm_out="Q8_0", token_embd="Q8_0", output="Q8_0"),
    "Q4_0": dict(ssm_in="Q4_0", ssm_out="Q4_0", token_embd="Q4_0", output="Q6_K"),
    "Q4_K": dict(ssm_in="Q4_K", ssm_out="Q4_K", token_embd="Q4_K", output="Q6_K"),
}
# Every step's loss (2 epochs of 5 windows, lr 1e-3), relative, against PEFT on the dequantized weights with
# the inputs of the frozen products rounded as ggml's MUL_MAT rounds them (round_inputs_as_ggml). Measured:
# F16 1.1e-5, BF16 5.6e-5, Q8_0 2.3e-4, Q4_0 1.6e-3, Q4_K 6.4e-4; held at about 2.5x. The same oracle on the
# F32 weights is 2.1e-4, 1.35e-3, 2.7e-3, 9.7e-3, 2.45e-2 away (the test checks that it fails the bound).
# The first step (the forward alone) agrees to 6e-6, 4e-7, 6e-7, 1.1e-3, 1.4e-5. Q4_0's is the embedding's: a
# Q4_0 row is a grid of 16 levels a block, and so is its RMS-normed copy that layer 0's ssm_in reads, so
# 10.8% of those inputs land within 1e-4 of a tie of the Q8_0 rounding (x 127/amax = k + 1/2; none with the
# Q8_0 or Q4_K embedding), where the last bits of the two RMSNorms decide (gguf-py's Q4_0 rows are ggml's
# to_float's, bit for bit).
# Without the rounding (only the weights dequantized) the first step is already 1.1e-3 (Q8_0) to 1.4e-3
# (Q4_K) away, and at lr 1e-2 float32 differences grow to 2e-3 (F16) .. 1.1e-2 (Q4_0) over the 10 steps
# (roundings of the quantized inputs flip, AdamW normalizes the differences), which no longer separates
# the dequantized weights from the F32 ones: hence lr 1e-3 here.
TOL_DEQUANT = {"F16": 3e-5, "BF16": 1.5e-4, "Q8_0": 6e-4, "Q4_0": 4e-3, "Q4_K": 1.5e-3}
# ... and against llama-finetune's run of the same adapter on the F32 base. Measured: F16 2.1e-4, BF16 1.34e-3,
# Q8_0 2.5e-3, Q4_0 9.3e-3, Q4_K 2.4e-2 (the head in Q6_K, the embedding in Q4_K); held at about 2.5x.
TOL_F32 = {"F16": 6e-4, "BF16": 4e-3, "Q8_0": 6e-3, "Q4_0": 2.5e-2, "Q4_K": 6e-2}
RANK, ALPHA, EPOCHS = lora_test.RANK, lora_test.ALPHA, lora_test.EPOCHS
LR = 1e-3          # see TOL_DEQUANT


@pytest.fixture(scope="module")
def fc():
    return built_script("finetune_check", lambda fc: [fc.BIN / n for n in (
        "llama-finetune", "llama-tokenize", "llama-quantize", "llama-completion")])


@pytest.fixture(scope="module")
def peft():
    return import_peft()


@pytest.fixture(scope="module")
def lp(fc):
    return import_lora_peft()


def make_model(fc, seed=0):
    """finetune_check's tiny Mamba-2 at hidden_size 256 (float32, in_proj scaled as there)."""
    import transformers
    torch.manual_seed(seed)
    cfg = transformers.Mamba2Config(tie_word_embeddings=False, **dict(fc.CONFIGS["mamba2"], **CONFIG))
    model = transformers.Mamba2ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.backbone.layers:
            layer.mixer.in_proj.weight.mul_(fc.IN_PROJ_SCALE)
    return model.float()


def quantize(fc, src, dst, qtype):
    """`llama-quantize SRC DST QTYPE 1`; returns its log."""
    proc = subprocess.run([str(fc.BIN / "llama-quantize"), str(src), str(dst), qtype, "1"], capture_output=True,
                          text=True)
    assert proc.returncode == 0, f"llama-quantize {qtype} failed:\n{proc.stderr[-3000:]}"
    return proc.stderr + proc.stdout


def tensor_types(lp, path):
    gguf, _ = lp._converter()
    return {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}


@pytest.fixture(scope="module")
def model(fc, tmp_path_factory):
    """The F32 GGUF of the 256-wide Mamba-2, its text and tokens, each base quantized from it, the sha256s."""
    workdir = tmp_path_factory.mktemp("lora-quant")
    hf_dir = workdir / "mamba2-256"
    make_model(fc).save_pretrained(hf_dir)
    gguf = fc.convert.convert(hf_dir, workdir / "mamba2-256-f32.gguf")
    text = workdir / "text.txt"
    text.write_bytes(fc.make_text(260, 0).encode())
    p = dict(kind="mamba2", hf_dir=hf_dir, gguf=gguf, text=text, tokens=fc.tokenize(gguf, text), workdir=workdir,
             bases={}, logs={})
    for q in BASES:
        p["bases"][q] = workdir / f"mamba2-256-{q}.gguf"
        p["logs"][q] = quantize(fc, gguf, p["bases"][q], q)
    p["sha256"] = {q: _sha256(path) for q, path in [("F32", gguf), *p["bases"].items()]}
    return p


@pytest.fixture(scope="module")
def adapter(fc, peft, lp, model):
    """The PEFT adapter (in_proj, B drawn non-zero) of the 256-wide model, and its GGUF for --lora-init."""
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=["in_proj"], lora_dropout=0.0)
    pm = peft.get_peft_model(make_model(fc), cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, w in pm.named_parameters():
            if "lora_B" in n:
                w.normal_(0, 0.02)
    peft_dir = model["workdir"] / "peft"
    pm.save_pretrained(peft_dir)
    init = model["workdir"] / "init.gguf"
    written = lp.to_gguf(peft_dir, model["hf_dir"], init, base_gguf=model["gguf"])
    assert sorted(written) == ["blk.0.ssm_in.weight", "blk.1.ssm_in.weight"]
    return dict(peft_dir=peft_dir, init=init, n_elements=sum(a.size + b.size for a, b in written.values()))


@pytest.fixture(scope="module")
def runs(fc, model, adapter):
    """base -> (the llama-finetune process, its 10 losses, the trained adapter), each base trained once."""
    def train(base, workdir):
        out = workdir / f"trained-{base}.gguf"
        path = model["gguf"] if base == "F32" else model["bases"][base]
        proc, losses = lora_test.finetune(fc, model, "--lora-init", adapter["init"], "--lora-out", out, lr=LR,
                                          model=path)
        assert proc.returncode == 0, f"{base}:\n{proc.stderr[-4000:]}"
        return proc, np.concatenate(losses), out
    return once_per_key(train, model["workdir"])


def dequantized_model(fc, lp, p, gguf_path):
    """The transformers model with every tensor of GGUF_PATH that is not F32 dequantized by gguf-py into its
    weight (the others are the F32 ones the converter copied); returns the model and the types replaced."""
    gguf, _ = lp._converter()
    from gguf import quants
    _, name_map = lp._name_map(p["hf_dir"])
    m = make_model(fc)
    params = dict(m.named_parameters())
    hf_name = {name_map.get_name(k, try_suffixes=(".weight",)): k for k in params if k.endswith(".weight")}
    replaced = {}
    with torch.no_grad():
        for t in gguf.GGUFReader(str(gguf_path)).tensors:
            if t.tensor_type == gguf.GGMLQuantizationType.F32:
                continue
            w = quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(x) for x in t.shape])))
            target = params[hf_name[t.name]]
            assert target.shape == w.shape, (t.name, target.shape, w.shape)
            target.copy_(torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)))
            replaced[t.name] = t.tensor_type.name
    return m, replaced


# the type ggml's CPU MUL_MAT rounds its F32 input to before the dot products (vec_dot_type of the weight's
# type in ggml-cpu.c's type_traits_cpu): the forward of a frozen weight W x in ggml is W_dequantized x_rounded
VEC_DOT_TYPE = {"F16": "F16", "BF16": "BF16", "Q8_0": "Q8_0", "Q4_0": "Q8_0", "Q4_K": "Q8_K", "Q6_K": "Q8_K"}


def ggml_rounded(x, vec_dot_type):
    """X (float32, rows along the last dimension) as ggml's CPU MUL_MAT sees it after quantizing it to
    VEC_DOT_TYPE, written from ggml's code: Q8_0 (quantize_row_q8_0, arch/x86/quants.c): blocks of 32,
    q = round-half-even(x * 127/amax), value q * fp16(amax/127); Q8_K (quantize_row_q8_K_ref): blocks of
    256, iscale = -127/m where m is the element of largest magnitude, q = min(127, nearest(iscale x)),
    value q / iscale; F16, BF16: rounded to nearest even."""
    if vec_dot_type in ("F16", "BF16"):
        return x.to(torch.float16 if vec_dot_type == "F16" else torch.bfloat16).float()
    n = 32 if vec_dot_type == "Q8_0" else 256
    b = x.reshape(*x.shape[:-1], x.shape[-1] // n, n)
    amax = b.abs().amax(-1, keepdim=True)
    if vec_dot_type == "Q8_0":
        q = torch.round(b * torch.where(amax > 0, 127.0 / amax, 0.0))
        r = q * (amax / 127.0).half().float()
    else:
        m = torch.gather(b, -1, b.abs().argmax(-1, keepdim=True))
        iscale = torch.where(amax > 0, -127.0 / m, 0.0)
        q = torch.clamp(torch.round(iscale * b), max=127.0)
        r = torch.where(amax > 0, q * (1.0 / iscale), 0.0)
    return r.reshape(x.shape)


def round_inputs_as_ggml(model, lp, p, types):
    """Forward pre-hooks on the transformers model's Linear modules whose GGUF weight is of a type in TYPES
    (GGUF name -> type): each rounds its input as ggml's MUL_MAT does (ggml_rounded), the gradient passing
    through unchanged (ggml's input gradient is OUT_PROD(W, d_y), in F32). PEFT's adapter on a wrapped
    module reads the input unrounded, as llama.cpp's F32 adapter product does. Returns the hooked names."""
    _, name_map = lp._name_map(p["hf_dir"])
    modules = dict(model.named_modules())
    hooked = []
    for name, t in types.items():
        if t not in VEC_DOT_TYPE or name == "token_embd.weight":      # the embedding is a GET_ROWS
            continue
        hf = next(k for k in modules if name_map.get_name(k + ".weight", try_suffixes=(".weight",)) == name)
        vdt = VEC_DOT_TYPE[t]
        modules[hf].register_forward_pre_hook(
            lambda mod, args, vdt=vdt: (args[0] + (ggml_rounded(args[0].detach(), vdt) - args[0]).detach(),))
        hooked.append(hf)
    return hooked


def peft_losses(fc, peft, p, adapter, base_model):
    inputs, labels = fc.windows(p["tokens"])
    pm = peft.PeftModel.from_pretrained(base_model, adapter["peft_dir"], is_trainable=True)
    _, lt = lora_test._peft_train(fc, peft, p, None, inputs, labels, lr=LR, model=pm)
    return np.concatenate(lt)


def test_llama_quantize_types(lp, model):
    """Each base holds the types it claims (gguf-py): the 2-D weights in the target type (the head Q6_K in the
    4-bit files, as llama-quantize chooses), the rest F32, and llama-quantize fell back for no tensor."""
    for q in BASES:
        types = tensor_types(lp, model["bases"][q])
        want = {name: "F32" for name in types}
        for name in types:
            kind = re.sub(r"^blk\.\d+\.", "", name).removesuffix(".weight")
            want[name] = TYPES[q].get(kind, "F32")
        assert types == want, (q, {n: t for n, t in types.items() if want[n] != t})
        assert "falling back" not in model["logs"][q] and "fallback" not in model["logs"][q], model["logs"][q][-3000:]


@pytest.mark.parametrize("base", BASES)
def test_lora_on_a_quantized_base(fc, peft, lp, model, adapter, runs, base):
    proc, lq, _ = runs(base)
    _, lf, _ = runs("F32")
    n_w = len(fc.windows(model["tokens"])[0])
    assert len(lq) == len(lf) == EPOCHS * n_w and n_w >= 4
    # the epoch mean falls by 0.032 (Q4_0) to 0.043 (F16) at lr 1e-3, as on F32 (0.044)
    assert lq[-n_w:].mean() < lq[:n_w].mean() - 0.02, f"{base}: the loss did not fall: {lq}"
    assert "turning weight repacking off" in proc.stderr
    assert lora_test.opt_params(proc.stderr) == (4, adapter["n_elements"])
    rel_f32 = fc.rel_diff(lq, lf)
    assert rel_f32.max() <= TOL_F32[base], (f"{base} vs the F32 base: {rel_f32.max():.2e} > {TOL_F32[base]}\n"
                                            f"{np.c_[lq, lf]}")

    deq, replaced = dequantized_model(fc, lp, model, model["bases"][base])
    assert replaced == {n: t for n, t in tensor_types(lp, model["bases"][base]).items() if t != "F32"}
    assert len(replaced) == 6, replaced            # ssm_in and ssm_out of both layers, token_embd, output
    hooked = round_inputs_as_ggml(deq, lp, model, replaced)
    assert len(hooked) == 5, hooked                # the products: ssm_in, ssm_out of both layers, the head
    lt = peft_losses(fc, peft, model, adapter, deq)
    rel = fc.rel_diff(lq, lt)
    assert rel.max() <= TOL_DEQUANT[base], (f"{base} vs PEFT on the dequantized weights: {rel.max():.2e} > "
                                            f"{TOL_DEQUANT[base]}\n{np.c_[lq, lt]}")
    # the same oracle on the F32 weights does not pass: the bound sees the quantization
    f32 = make_model(fc)
    round_inputs_as_ggml(f32, lp, model, replaced)
    rel_f32 = fc.rel_diff(lq, peft_losses(fc, peft, model, adapter, f32))
    assert rel_f32.max() > 2 * TOL_DEQUANT[base], (base, rel_f32.max())
    for q, digest in model["sha256"].items():
        assert _sha256(model["gguf"] if q == "F32" else model["bases"][q]) == digest, f"the {q} GGUF changed"


def test_completion_loads_the_adapter(fc, model, runs):
    """llama-completion (llama.cpp's non-interactive generation) with --lora on the Q4_K base: the adapter
    trained there loads and the program generates."""
    _, _, out = runs("Q4_K")
    cmd = [str(fc.BIN / "llama-completion"), "-m", str(model["bases"]["Q4_K"]), "--lora", str(out), "-p",
           "the state of a selective scan", "-n", "12", "--temp", "0", "-t", "1", "-no-cnv", "--no-warmup",
           "-c", "256", "-v"]
    proc = subprocess.run(cmd, capture_output=True, timeout=120, stdin=subprocess.DEVNULL)
    out, err = (proc.stdout.decode(errors="replace"), proc.stderr.decode(errors="replace"))  # a random model's bytes
    assert proc.returncode == 0, err[-3000:]
    assert "loaded 4 tensors from lora file" in err, err[-3000:]
    # the prompt echoed and 12 tokens generated: the prompt's evaluation gives the first, 11 runs the rest
    assert out.startswith("thestate"), out       # (the bundled vocab's detokenizer drops the spaces here)
    m = re.search(r"eval time =.*/\s+(\d+) runs", err)
    assert m and int(m.group(1)) == 11, err[-2000:]
