"""llama-finetune trains a LoRA adapter on a frozen Mamba GGUF (the series' 0027), checked against PEFT.

The tiny random Mamba-2 of test_llama_finetune.py (ggml/finetune_check.py: 2 layers, 8 heads, 2 groups,
in_proj scaled 5x, untied), converted by ggml/convert.py:

- `llama-finetune --lora-rank 4 --lora-alpha 8 --lora-out OUT.gguf` trains a new adapter for 2 epochs:
  the loss falls, only the adapter's tensors have gradients in ggml-opt, OUT.gguf is a standard GGUF LoRA
  adapter on every ssm_in / ssm_out (the default targets), llama-perplexity loads it with --lora and its
  perplexity of the text falls, and the base GGUF's bytes are unchanged. `-epochs 0` writes the new
  adapter as drawn: A uniform in +-1/sqrt(n_in) (PEFT's Kaiming-uniform), B zero.
- PEFT on STOCK transformers (never ssmgrad-patched) is the oracle, for Mamba-2 and for the tiny Mamba-1
  of the same script: a PEFT adapter on in_proj (and Mamba-1's x_proj; r 4, alpha 8; PEFT refuses
  out_proj on Mamba models, and Mamba-1's dt_proj adapter does nothing in transformers), its B made
  non-zero so that A has a gradient from the first step, written for llama.cpp by `ggml/lora_peft.py
  to-gguf`, trained by `llama-finetune --lora-init` and by PEFT with torch's AdamW on the same windows
  in the same order: every step's loss within TOL (AdamW, lr 1e-2, wd 0.01, 2 epochs of 5 windows), and
  the trained adapters equal; llama's,
  written back by `lora_peft.py to-peft`, loads in PEFT and gives the logits of PEFT's; llama-perplexity
  --lora with llama's trained adapter gives the perplexity of PEFT's trained model.
- a Q8_0 base (convert.py --outtype q8_0): the same --lora-init run trains, its steps follow PEFT on the
  dequantized weights and the F32 base's run.
- the errors: rank 0, alpha <= 0, a target pattern that matches no adaptable weight, an adapter that does
  not match the base, --lora (a frozen adapter) given to llama-finetune, full fine-tuning of a q8_0 model:
  exit 1, the message, nothing written; and lora_peft.py's own errors.

Needs `bash ggml/build.sh` (llama-finetune, llama-tokenize, llama-perplexity) and peft; without them the
module skips, except under CI=true, where that is an error.
"""

import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ggml_build import ROOT, built_script, once_per_key, import_lora_peft, import_peft, sha256 as _sha256  # noqa: E402

pytestmark = pytest.mark.integration   # .ci's sanitizer and compiler passes skip it

# Every step's loss, relative. Measured (1 thread, lr 1e-2): at most 6.9e-6 (Mamba-2) and 2.6e-6 (Mamba-1)
# over the 10 steps of the PEFT runs, which is the 5-decimal print (the k-th loss of an epoch is exact to
# (2k-1) 5e-6); the full
# fine-tuning tests hold the same 1e-4. With lora_a left out of the parameters (a broken 0027): 2.8e-4 at
# step 2, 1.3e-2 at step 10.
TOL = 1e-4
# The trained adapters, relative L2 error per tensor. Measured: at most 1.8e-6 (Mamba-2's lora_B after 10
# AdamW steps at lr 1e-2; 7.0e-7 at 1e-3) and 2.1e-6 (Mamba-1's ssm_x lora_A); 9.5x margin. lora_a left
# out of the parameters: 0.45.
ADAPTER_TOL = 2e-5
# The logits of PEFT's trained model and of llama's trained adapter back in PEFT (to-peft), relative L2.
# Measured: 1.8e-6 (Mamba-2), 8.5e-7 (Mamba-1): the adapters' own difference carried through; 11x margin.
# The base model's logits
# differ from PEFT's trained ones by far more (the test checks 100x the tolerance).
LOGITS_TOL = 2e-5
# llama-perplexity --lora against the same estimate of PEFT's trained model in torch, relative. Measured:
# Mamba-2 436.4880 against 436.48790 (base 570.4681), Mamba-1 470.4426 against 470.44252 (base 573.8243):
# 2.4e-7, the 4-decimal print; 1e-5 leaves room for the float32 logits (2e-6 apart).
PPL_TOL = 1e-5
RANK, ALPHA = 4, 8.0
EPOCHS = 2
LR = 1e-2         # at 1e-3 the adapter moves little: lora_a left out of the parameters stayed within 8.7e-5


@pytest.fixture(scope="module")
def fc():
    return built_script("finetune_check",
                        lambda fc: [fc.BIN / n for n in ("llama-finetune", "llama-tokenize", "llama-perplexity")])


@pytest.fixture(scope="module")
def peft():
    return import_peft()


@pytest.fixture(scope="module")
def lp(fc):
    return import_lora_peft()


@pytest.fixture(scope="module")
def models(fc, tmp_path_factory):
    """kind -> the converted tiny model (untied), its text, tokens, and the sha256 of the GGUF's bytes."""
    def prepare(kind, workdir):
        p = fc.prepare(kind, False, workdir)
        p["sha256"] = _sha256(p["gguf"])
        return p
    return once_per_key(prepare, tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def prepared(models):
    return models("mamba2")


def finetune(fc, p, *args, epochs=EPOCHS, lr=1e-3, wd=0.01, model=None):
    """llama-finetune on p's text with ARGS, -v (so libllama's log shows); (process, losses per epoch)."""
    cmd = [str(fc.BIN / "llama-finetune"), "-m", str(model or p["gguf"]), "-f", str(p["text"]),
           "-c", "256", "-b", "256", "-ub", "256", "-epochs", str(epochs), "-opt", "adamw", "-lr", repr(lr),
           "-wd", repr(wd), "-val-split", "0", "-t", "1", "-v", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return proc, (fc.parse_progress(proc.stderr) if proc.returncode == 0 else [])


def perplexity(fc, p, *args):
    cmd = [str(fc.BIN / "llama-perplexity"), "-m", str(p["gguf"]), "-f", str(p["text"]), "-c", "256", "-b", "256",
           "-t", "1", "-v", *map(str, args)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"llama-perplexity {args} failed:\n{proc.stderr[-3000:]}"
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", proc.stderr + proc.stdout)
    assert m, (proc.stderr + proc.stdout)[-3000:]
    return float(m.group(1)), proc


def opt_params(stderr):
    """(tensors, parameters) that ggml-opt holds gradients for, as the first training step logs them."""
    m = re.search(r"ggml-opt holds gradients for (\d+) tensors, (\d+) parameters", stderr)
    assert m, stderr[-3000:]
    return int(m.group(1)), int(m.group(2))


def test_new_adapter_trains_loads_and_leaves_the_base(fc, lp, prepared, tmp_path):
    p = prepared
    out = tmp_path / "adapter.gguf"
    proc, losses = finetune(fc, p, "--lora-rank", RANK, "--lora-alpha", ALPHA, "--lora-out", out, lr=LR)
    assert proc.returncode == 0, proc.stderr[-4000:]
    n_windows = len(fc.windows(p["tokens"])[0])
    assert [len(e) for e in losses] == [n_windows] * EPOCHS and n_windows >= 4
    first, last = np.mean(losses[0]), np.mean(losses[-1])
    assert last < first - 0.05, f"epoch mean loss {first:.5f} -> {last:.5f}"

    alpha, ad = lp.read_gguf_adapter(out)
    assert alpha == ALPHA
    # the default targets: every weight of a matrix product but the head: Mamba-2's in and out projections
    assert sorted(ad) == [f"blk.{i}.{w}.weight" for i in range(2) for w in ("ssm_in", "ssm_out")]
    cfg = fc.CONFIGS["mamba2"]
    d_in_proj = 2 * 2 * cfg["hidden_size"] + 2 * cfg["n_groups"] * cfg["state_size"] + cfg["num_heads"]
    for name, (a, b) in ad.items():
        d = cfg["hidden_size"]
        n_in, n_out = (d, d_in_proj) if "ssm_in" in name else (2 * d, d)
        assert a.shape == (RANK, n_in) and b.shape == (n_out, RANK), (name, a.shape, b.shape)
        assert np.abs(b).max() > 0, f"{name}: lora_b did not train"
    # only the adapter has gradients (and AdamW moments) in ggml-opt: its 8 tensors, not the model's 21
    n_elements = sum(a.size + b.size for a, b in ad.values())
    assert opt_params(proc.stderr) == (2 * len(ad), n_elements)
    assert "training a LoRA adapter: 8 tensors" in proc.stderr
    assert _sha256(p["gguf"]) == p["sha256"], "llama-finetune --lora-rank changed the base GGUF"

    # llama.cpp's own --lora loads it; it was trained on this text, so the perplexity falls
    ppl_base, _ = perplexity(fc, p)
    ppl_lora, pproc = perplexity(fc, p, "--lora", out)
    assert "loaded 8 tensors from lora file" in pproc.stderr, pproc.stderr[-3000:]
    assert ppl_lora < 0.95 * ppl_base, (ppl_base, ppl_lora)


def test_llama_perplexity_prints_its_whole_log_to_a_slow_reader(fc, prepared, tmp_path):
    """llama.cpp's log is written by a thread of its own, and its logger is never destroyed: without the
    drain at exit (0036) a tool that returns right after its last line loses what the thread has not yet
    written. A pipe of 4 KiB read only after the tool has filled it: unpatched, 10 of 41 KB arrived, no
    final estimate, exit 0 (and CI once lost the last chunk this way with an ordinary pipe)."""
    import fcntl
    import time
    p = prepared
    cmd = [str(fc.BIN / "llama-perplexity"), "-m", str(p["gguf"]), "-f", str(p["text"]), "-c", "256", "-b", "256",
           "-t", "1", "-v"]
    with open(tmp_path / "log.txt", "wb") as f:     # a file never makes the log's thread wait
        assert subprocess.run(cmd, stdout=f, stderr=f).returncode == 0
    whole = (tmp_path / "log.txt").read_text(errors="replace")
    r, w = os.pipe()
    fcntl.fcntl(w, getattr(fcntl, "F_SETPIPE_SZ", 1031), 4096)
    proc = subprocess.Popen(cmd, stdout=w, stderr=w)
    os.close(w)
    time.sleep(1.0)                  # the tool runs on until its log's queue is full behind the full pipe
    chunks = []
    while chunk := os.read(r, 65536):
        chunks.append(chunk)
    os.close(r)
    assert proc.wait() == 0
    got = b"".join(chunks).decode(errors="replace")
    assert "Final estimate: PPL" in whole and "Final estimate: PPL" in got, got[-2000:]
    assert len(got.splitlines()) == len(whole.splitlines()), (len(got), len(whole), got[-2000:])


def test_new_adapter_is_drawn_as_peft_does(fc, lp, prepared, tmp_path):
    """-epochs 0: the adapter as made. A uniform in +-1/sqrt(n_in) (nn.init.kaiming_uniform_(a=sqrt(5)),
    PEFT's reset_lora_parameters), B zero; alpha defaults to the rank; --lora-seed chooses the draw."""
    p = prepared
    draws = {}
    for seed in (1, 1, 2):
        out = tmp_path / f"drawn-{seed}-{len(draws)}.gguf"
        proc, _ = finetune(fc, p, "--lora-rank", 8, "--lora-targets", "ssm_in", "--lora-seed", seed, "--lora-out", out,
                           epochs=0)
        assert proc.returncode == 0, proc.stderr[-3000:]
        alpha, ad = lp.read_gguf_adapter(out)
        assert alpha == 8.0 and sorted(ad) == ["blk.0.ssm_in.weight", "blk.1.ssm_in.weight"]
        draws.setdefault(seed, []).append(ad)
    for ad in draws[1][0], draws[2][0]:
        for name, (a, b) in ad.items():
            bound = 1 / np.sqrt(a.shape[1])
            assert np.all(np.abs(a) <= bound) and np.abs(a).max() > 0.95 * bound, name
            # uniform: mean |a| is bound / 2 (256 draws: its standard error is 0.018 bound)
            assert abs(np.abs(a).mean() / bound - 0.5) < 0.08, name
            assert not b.any(), name
    assert all(np.array_equal(draws[1][0][k][0], draws[1][1][k][0]) for k in draws[1][0])
    assert not any(np.array_equal(draws[1][0][k][0], draws[2][0][k][0]) for k in draws[1][0])


# What PEFT adapts in the oracle runs, and the GGUF names of those modules. Not out_proj or conv1d (PEFT refuses
# them on Mamba models), nor Mamba-1's dt_proj: transformers 5.24's Mamba-1 mixer multiplies by
# dt_proj.weight directly (modeling_mamba.py, slow_forward), so a PEFT adapter there changes nothing in
# transformers (its loss stayed the base model's), while llama.cpp applies it (ssm_dt goes through build_lora_mm).
PEFT_TARGETS = {"mamba2": {"in_proj": "ssm_in"}, "mamba1": {"in_proj": "ssm_in", "x_proj": "ssm_x"}}


def _peft_adapter(fc, peft, p, out_dir):
    """A PEFT adapter on PEFT_TARGETS of p's model (stock transformers), its B drawn non-zero; saved to OUT_DIR."""
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=sorted(PEFT_TARGETS[p["kind"]]), lora_dropout=0.0)
    pm = peft.get_peft_model(fc.make_model(p["kind"], False), cfg)
    torch.manual_seed(1)
    with torch.no_grad():
        for n, w in pm.named_parameters():
            if "lora_B" in n:
                w.normal_(0, 0.02)
    pm.save_pretrained(out_dir)
    return out_dir


def _peft_train(fc, peft, p, peft_dir, inputs, labels, epochs=EPOCHS, lr=LR, wd=0.01, model=None):
    """PEFT fine-tuning as llama-finetune does it (a step per window, in order; AdamW on the adapter only), of
    PEFT_DIR's adapter on p's model, or of MODEL (a PeftModel)."""
    import torch.nn.functional as F
    torch.set_num_threads(1)
    pm = model or peft.PeftModel.from_pretrained(fc.make_model(p["kind"], False), peft_dir, is_trainable=True)
    params = [w for w in pm.parameters() if w.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, betas=fc.BETAS, eps=fc.EPS, weight_decay=wd)
    pm.train()
    losses = []
    for _ in range(epochs):
        losses.append([])
        for x, y in zip(inputs, labels):
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(pm(input_ids=x[None], use_cache=False).logits[0].float(), y)
            loss.backward()
            opt.step()
            losses[-1].append(loss.item())
    return pm, losses


def _perplexity_torch(model, tokens, n_ctx=256):
    """llama-perplexity's estimate (tools/perplexity/perplexity.cpp, perplexity()): chunks of n_ctx tokens that do
    not overlap, each from a zero state (this vocab adds no BOS, so no token is replaced), and the negative
    log-likelihood of each token of a chunk's second half but its first, averaged over all chunks."""
    import torch.nn.functional as F
    t = torch.tensor(tokens)
    first = n_ctx // 2
    nll, count = 0.0, 0
    with torch.no_grad():
        for c in range(len(t) // n_ctx):
            x = t[c * n_ctx:(c + 1) * n_ctx]
            lp = F.log_softmax(model.eval()(input_ids=x[None], use_cache=False).logits[0].double(), -1)
            nll -= float(lp[torch.arange(first, n_ctx - 1), x[first + 1:]].sum())
            count += n_ctx - 1 - first
    return float(np.exp(nll / count))


@pytest.mark.parametrize("kind", ["mamba2", "mamba1"])
def test_lora_init_matches_peft_on_stock_transformers(fc, peft, lp, models, tmp_path, kind):
    p = models(kind)
    targets = PEFT_TARGETS[kind]
    peft_dir = _peft_adapter(fc, peft, p, tmp_path / "peft")
    init = tmp_path / "init.gguf"
    written = lp.to_gguf(peft_dir, p["hf_dir"], init, base_gguf=p["gguf"])
    gguf_name = {f"backbone.layers.{i}.mixer.{m}": f"blk.{i}.{g}.weight" for i in range(2) for m, g in targets.items()}
    assert sorted(written) == sorted(gguf_name.values())
    init_bytes = open(init, "rb").read()
    out = tmp_path / "trained.gguf"
    proc, lg = finetune(fc, p, "--lora-init", init, "--lora-out", out, lr=LR)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert open(init, "rb").read() == init_bytes, "--lora-init changed its file"
    assert opt_params(proc.stderr) == (2 * len(written), sum(a.size + b.size for a, b in written.values()))

    inputs, labels = fc.windows(p["tokens"])
    pm, lt = _peft_train(fc, peft, p, peft_dir, inputs, labels)
    assert [len(e) for e in lg] == [len(e) for e in lt] == [len(inputs)] * EPOCHS
    lg, lt = np.concatenate(lg), np.concatenate(lt)
    rel = fc.rel_diff(lg, lt)
    worst = int(np.argmax(rel))
    assert rel[worst] <= TOL, (f"step {worst + 1}: llama-finetune {lg[worst]:.6f} vs PEFT {lt[worst]:.6f} "
                               f"(relative {rel[worst]:.2e}); all steps:\n{np.c_[lg, lt]}")
    assert lt[-len(inputs):].mean() < lt[:len(inputs)].mean(), f"the loss did not fall: {lt}"

    # the trained adapters are the same
    alpha, ad = lp.read_gguf_adapter(out)
    assert alpha == ALPHA and sorted(ad) == sorted(written)
    sd = {n: w.detach().numpy() for n, w in pm.named_parameters() if w.requires_grad}
    for mod, name in gguf_name.items():
        for got, part in zip(ad[name], "AB"):
            want = sd[f"base_model.model.{mod}.lora_{part}.default.weight"]
            moved = np.linalg.norm(want - written[name]["AB".index(part)])
            err = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert err <= ADAPTER_TOL and moved > 100 * np.linalg.norm(got - want), (name, part, err, moved)

    # and back: `lora_peft.py to-peft` of llama's trained adapter loads in PEFT and gives PEFT's logits
    back_dir = tmp_path / "back"
    back = lp.to_peft(out, p["hf_dir"], back_dir, base_gguf=p["gguf"])
    assert sorted(back) == sorted(gguf_name)
    back_model = peft.PeftModel.from_pretrained(fc.make_model(kind, False), back_dir)
    with torch.no_grad():
        want = pm.eval()(input_ids=inputs[:2], use_cache=False).logits
        got = back_model.eval()(input_ids=inputs[:2], use_cache=False).logits
        base = fc.make_model(kind, False)(input_ids=inputs[:2], use_cache=False).logits
    err = float((got - want).norm() / want.norm())
    assert err <= LOGITS_TOL and float((base - want).norm() / want.norm()) > 100 * LOGITS_TOL, err

    # llama-perplexity --lora with llama's trained adapter: the perplexity of PEFT's trained model, computed as
    # llama-perplexity does, and below the base model's
    ppl_llama, _ = perplexity(fc, p, "--lora", out)
    ppl_base, _ = perplexity(fc, p)
    ppl_peft = _perplexity_torch(pm, p["tokens"])
    assert abs(ppl_llama - ppl_peft) <= PPL_TOL * ppl_peft and ppl_llama < ppl_base, (ppl_llama, ppl_peft, ppl_base)


def _write_adapter(lp, path, tensors, arch="mamba2", alpha=8.0):
    gguf, _ = lp._converter()
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def q8_model(fc, prepared):
    return fc.convert.convert(prepared["hf_dir"], prepared["workdir"] / "mamba2-q8_0.gguf", outtype="q8_0")


def _error_cases(lp, tmp_path, q8_model):
    z = lambda *s: np.zeros(s, dtype=np.float32)     # noqa: E731
    bad_shape = _write_adapter(lp, tmp_path / "bad-shape.gguf", {"blk.0.ssm_in.weight.lora_a": z(4, 31),
                                                                  "blk.0.ssm_in.weight.lora_b": z(168, 4)})
    bad_name = _write_adapter(lp, tmp_path / "bad-name.gguf", {"blk.7.ssm_in.weight.lora_a": z(4, 32),
                                                                "blk.7.ssm_in.weight.lora_b": z(168, 4)})
    bad_arch = _write_adapter(lp, tmp_path / "bad-arch.gguf", {"blk.0.ssm_in.weight.lora_a": z(4, 32),
                                                                "blk.0.ssm_in.weight.lora_b": z(168, 4)}, arch="mamba")
    conv = _write_adapter(lp, tmp_path / "conv.gguf", {"blk.0.ssm_conv1d.weight.lora_a": z(4, 4),
                                                        "blk.0.ssm_conv1d.weight.lora_b": z(96, 4)})
    return {
        "rank 0": (["--lora-rank", 0], "--lora-rank must be > 0, got 0"),
        "alpha 0": (["--lora-rank", 4, "--lora-alpha", 0], "--lora-alpha must be > 0, got 0"),
        "alpha < 0": (["--lora-rank", 4, "--lora-alpha", -2], "--lora-alpha must be > 0, got -2"),
        "no such tensor": (["--lora-rank", 4, "--lora-targets", "ssm_in,attn_q"],
                           "LoRA target pattern 'attn_q' matches no weight the graph multiplies through build_lora_mm "
                           "(it matches no tensor of the model)"),
        "not a matmul": (["--lora-rank", 4, "--lora-targets", "ssm_conv1d"],
                         "LoRA target pattern 'ssm_conv1d' matches no weight the graph multiplies through build_lora_mm "
                         "(it matches only blk.0.ssm_conv1d.weight, blk.0.ssm_conv1d.bias, blk.1.ssm_conv1d.weight, "
                         "blk.1.ssm_conv1d.bias)"),
        "token_embd": (["--lora-rank", 4, "--lora-targets", "token_embd"],
                       "training an adapter of token_embd is not supported"),
        "init shape": (["--lora-init", bad_shape], "tensor 'blk.0.ssm_in.weight' has incorrect shape"),
        "init name": (["--lora-init", bad_name], "LoRA tensor 'blk.7.ssm_in.weight' does not exist in base model"),
        "init arch": (["--lora-init", bad_arch], "model arch and LoRA arch mismatch"),
        "init not a matmul": (["--lora-init", conv], "'blk.0.ssm_conv1d.weight' is not a weight the graph multiplies"),
        "init and rank": (["--lora-init", conv, "--lora-rank", 4], "give --lora-rank (a new adapter) or --lora-init"),
        "no --lora-out": (["--lora-rank", 4], "training an adapter needs --lora-out FNAME"),
        # the optimizer's (ggml-opt asserted them at the first step: an abort with a backtrace)
        "lr 0": (["--lora-rank", 4, "-lr", 0], "-lr must be > 0, got 0"),
        "wd > 1": (["--lora-rank", 4, "-wd", 2], "-wd must be in [0, 1], got 2"),
        "lr-min > lr": (["--lora-rank", 4, "-lr-min", 1], "-lr-min must be at most -lr (0.001), got 1"),
        "val-split 1": (["--lora-rank", 4, "-val-split", 1], "-val-split must be in [0, 1), got 1"),
        "--lora": (["--lora", bad_shape],
                   "--lora applies an adapter that stays frozen while llama-finetune trains the model"),
        "full q8_0": (["-o", tmp_path / "out.gguf", "MODEL", q8_model],
                      "full fine-tuning trains F32 tensors only, and "),
    }


ERROR_CASES = ["rank 0", "alpha 0", "alpha < 0", "no such tensor", "not a matmul", "token_embd", "init shape",
               "init name", "init arch", "init not a matmul", "init and rank", "no --lora-out", "--lora", "full q8_0",
               "lr 0", "wd > 1", "lr-min > lr", "val-split 1"]


@pytest.mark.parametrize("case", ERROR_CASES)
def test_bad_input_is_a_clear_error_and_writes_nothing(fc, lp, prepared, q8_model, tmp_path, case):
    args, message = _error_cases(lp, tmp_path, q8_model)[case]
    model = None
    if "MODEL" in args:
        model = args[args.index("MODEL") + 1]
        args = args[:args.index("MODEL")]
    out = tmp_path / "adapter-out.gguf"
    if "-o" not in args and case != "no --lora-out":
        args = [*args, "--lora-out", out]
    before = set(os.listdir(tmp_path))
    proc, _ = finetune(fc, prepared, *args, epochs=1, model=model)
    assert proc.returncode == 1, f"{case}: exit {proc.returncode}:\n{proc.stderr[-3000:]}"
    assert message in proc.stderr, f"{case}: no {message!r} in:\n{proc.stderr[-3000:]}"
    assert set(os.listdir(tmp_path)) == before, f"{case}: wrote {set(os.listdir(tmp_path)) - before}"
    assert _sha256(prepared["gguf"]) == prepared["sha256"]


def test_lora_peft_bad_input(fc, peft, lp, prepared, q8_model, tmp_path):
    """lora_peft.py names what is wrong: no PEFT adapter, a --base that is not the F32 conversion, an
    adapter for a weight the base does not have; the command line exits 1 with the message."""
    p = prepared
    with pytest.raises(lp.LoraConvertError, match="has no adapter_config.json"):
        lp.to_gguf(tmp_path, p["hf_dir"], tmp_path / "x.gguf")
    peft_dir = _peft_adapter(fc, peft, p, tmp_path / "peft")
    with pytest.raises(lp.LoraConvertError, match=r"--base: blk\.0\.ssm_in\.weight is Q8_0"):
        lp.to_gguf(peft_dir, p["hf_dir"], tmp_path / "x.gguf", base_gguf=q8_model)
    z = lambda *s: np.zeros(s, dtype=np.float32)     # noqa: E731
    stray = _write_adapter(lp, tmp_path / "stray.gguf", {"blk.7.ssm_in.weight.lora_a": z(4, 32),
                                                         "blk.7.ssm_in.weight.lora_b": z(168, 4)})
    with pytest.raises(lp.LoraConvertError, match=r"blk\.7\.ssm_in\.weight: no weights of .* map to it"):
        lp.to_peft(stray, p["hf_dir"], tmp_path / "back")
    # PEFT refuses out_proj on Mamba models (the default targets' ssm_out): to-peft says so, nothing written
    out_proj = _write_adapter(lp, tmp_path / "out-proj.gguf", {"blk.0.ssm_out.weight.lora_a": z(4, 64),
                                                               "blk.0.ssm_out.weight.lora_b": z(32, 4)})
    with pytest.raises(lp.LoraConvertError, match=r"PEFT would not load this adapter: .*'out_proj' is incompatible"):
        lp.to_peft(out_proj, p["hf_dir"], tmp_path / "back")
    proc = subprocess.run([sys.executable, str(ROOT / "ggml" / "lora_peft.py"), "to-gguf", str(peft_dir),
                           str(p["hf_dir"]), str(tmp_path / "y.gguf"), "--base", str(q8_model)],
                          capture_output=True, text=True)
    assert proc.returncode == 1, proc.stderr
    assert "lora_peft.py: error: --base: blk.0.ssm_in.weight is Q8_0" in proc.stderr, proc.stderr
    assert not any((tmp_path / f).exists() for f in ("x.gguf", "y.gguf", "back"))


# A Q8_0 base (ggml/convert.py --outtype q8_0: the 2-D weights, token_embd and the head in Q8_0), relative per
# step: against PEFT on the DEQUANTIZED weights in torch, measured at most 2.1e-4 (ggml's Q8_0 matrix product
# also rounds the activations to 8 bits, torch does not): 5e-4 held (2.4x; no more, so that the oracle on the
# original F32 weights, 9.1e-4 away like the F32 run, fails it); against the same run on the F32 base,
# measured at most 9.1e-4: 3e-3 held (3.3x).
Q8_TOL_DEQUANT = 5e-4
Q8_TOL_F32 = 3e-3


def _dequantized_model(fc, lp, p, q8_gguf):
    """p's transformers model with each Q8_0 tensor of Q8_GGUF dequantized into its weight (the others are the
    F32 ones the converter copied); returns the model and how many tensors were replaced."""
    gguf, _ = lp._converter()
    from gguf import quants
    _, name_map = lp._name_map(p["hf_dir"])
    model = fc.make_model(p["kind"], False)
    params = dict(model.named_parameters())
    hf_name = {name_map.get_name(k, try_suffixes=(".weight",)): k for k in params if k.endswith(".weight")}
    n = 0
    with torch.no_grad():
        for t in gguf.GGUFReader(str(q8_gguf)).tensors:
            if t.tensor_type == gguf.GGMLQuantizationType.Q8_0:
                w = quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(x) for x in t.shape])))
                params[hf_name[t.name]].copy_(torch.from_numpy(np.ascontiguousarray(w)))
                n += 1
    return model, n


def test_lora_on_a_q8_0_base(fc, peft, lp, prepared, q8_model, tmp_path):
    """The frozen base in Q8_0: the gradient reaches the adapters of earlier layers through the quantized
    weights (OUT_PROD of a Q8_0 source); the loss falls and follows PEFT on the dequantized weights."""
    p = prepared
    peft_dir = _peft_adapter(fc, peft, p, tmp_path / "peft")
    init = tmp_path / "init.gguf"
    lp.to_gguf(peft_dir, p["hf_dir"], init, base_gguf=p["gguf"])
    runs = {}
    for name, model in (("q8_0", q8_model), ("f32", p["gguf"])):
        proc, losses = finetune(fc, p, "--lora-init", init, "--lora-out", tmp_path / f"{name}.gguf", lr=LR, model=model)
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs[name] = np.concatenate(losses)
    deq, n = _dequantized_model(fc, lp, p, q8_model)
    assert n == 6, n          # ssm_in, ssm_out of both layers, token_embd, output
    inputs, labels = fc.windows(p["tokens"])
    peft_model = peft.PeftModel.from_pretrained(deq, peft_dir, is_trainable=True)
    _, lt = _peft_train(fc, peft, p, None, inputs, labels, model=peft_model)
    lt = np.concatenate(lt)
    lq = runs["q8_0"]
    assert len(lq) == len(lt) == EPOCHS * len(inputs)
    assert np.max(fc.rel_diff(lq, lt)) <= Q8_TOL_DEQUANT, np.c_[lq, lt]
    assert np.max(fc.rel_diff(lq, runs["f32"])) <= Q8_TOL_F32, np.c_[lq, runs["f32"]]
    n_w = len(inputs)
    assert lq[-n_w:].mean() < lq[:n_w].mean() - 0.05, lq
    assert _sha256(p["gguf"]) == p["sha256"]
