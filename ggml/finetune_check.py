"""llama.cpp's llama-finetune on a Mamba GGUF, checked step by step against PyTorch.

A random tiny Mamba-1 or Mamba-2 model is made with transformers (untied or tied embeddings; Mamba-2
with 2 groups), its in_proj scaled up so that the recurrent states are large (at transformers' default
init they are small enough to hide a wrong start state), saved with save_pretrained, converted with
ggml/convert.py (llama.cpp's convert_hf_to_gguf.py, f32), and fine-tuned by build/ggml/bin/llama-finetune
(AdamW, several epochs, -c = -b = -ub). The same model is fine-tuned in PyTorch: transformers with
ssmgrad.transformers.patch(), on the same tokens, windows, order and tensors, with the same AdamW.

What llama-finetune computes (examples/training/finetune.cpp, common_opt_dataset_init, llama_context::
opt_epoch / opt_epoch_iter, ggml-opt.cpp of the llama-cpp-python 0.3.36 sdist), and the torch run mirrors:
  - tokens: common_tokenize(text, add_special=true, parse_special=false) of the -f file, read with its
    one trailing newline stripped and no escape processing. Here the file has no trailing newline and
    the tokens come from `llama-tokenize --no-escape --no-parse-special --ids`, which tokenizes the
    file's bytes the same way;
  - n_ctx is padded up to a multiple of 256 (llama_context), so -c is 256 here;
  - windows: ndata = (n_tokens - n_ctx - 1) // stride with stride = n_ctx // 2; window i is tokens
    [i*stride, i*stride + n_ctx), its labels the same shifted by one; no shuffling (the dataset's
    permutation stays the identity); -val-split 0 here, so every window trains;
  - each window starts from a zero recurrent state (memory->clear), is cut into ubatches of -ub
    tokens; each ubatch is one ggml_opt_eval: loss = mean cross-entropy over its tokens (scaled by
    1/opt_period, opt_period = n_batch / n_ubatch), one optimizer step every opt_period ubatches;
  - AdamW (ggml_opt_step_adamw): m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2,
    w = w (1 - lr wd) - lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps), betas (0.9, 0.999),
    eps 1e-8 (ggml_opt_get_default_optimizer_params), lr = -lr (constant: no -lr-min), wd = -wd;
    t counts optimizer steps over all epochs. torch.optim.AdamW is the same algorithm;
  - trained tensors: every F32 tensor of the model (llama_set_param), token_embd included with the
    patch (stock llama.cpp skips it, a FIXME); so with tied embeddings the head trains through
    token_embd. A is trained as stored: the GGUF holds A = -exp(A_log), so the torch run trains A
    directly (a parametrization A_log = log(-A) of each mixer; nothing keeps A negative in either);
  - the printed loss is the running mean over the epoch's ubatches, to 5 decimals; the per-step loss
    is recovered as k m_k - (k-1) m_{k-1}, exact to (2k-1) * 5e-6.

-ub < -c (-b = -c): the window is processed in n_ctx / n_ubatch ubatches in order; the recurrent state
(conv and SSM) at the end of one ubatch is the start state of the next (the forward is the full
window's), but each ubatch's backward stops at its start state (truncated BPTT); the gradients of the
ubatches add up (each loss scaled by 1/opt_period) and one AdamW step is taken per window.

    python ggml/finetune_check.py              # the table: both models, untied and tied
    python ggml/finetune_check.py --plot ggml/finetune.png --time
"""

import argparse
import contextlib
import json
import re
import subprocess
import sys
import tempfile
import time
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

BIN = ROOT / "build" / "ggml" / "bin"
UNPATCHED_BIN = ROOT / "build" / "ggml-unpatched" / "bin"
TOL = 1e-4                      # relative, every step
N_CTX = 256                     # llama.cpp pads n_ctx to a multiple of 256
EPOCHS = 3
LR, WD = 1e-3, 0.01
BETAS, EPS = (0.9, 0.999), 1e-8
IN_PROJ_SCALE = 5.0
THREADS = 1                     # this loaded 2-core machine: 2 threads of torch (OpenMP) or ggml spin 10-100x slower

CONFIGS = {
    # Mamba-1: the converter requires intermediate_size == 2 * hidden_size
    "mamba1": dict(vocab_size=512, hidden_size=16, state_size=8, num_hidden_layers=2, expand=2,
                   conv_kernel=4, time_step_rank=4),
    # Mamba-2 with 2 groups (B, C shared by 4 heads each), chunk 64 in torch's SSD form
    "mamba2": dict(vocab_size=512, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2,
                   num_heads=8, head_dim=8, n_groups=2, conv_kernel=4, chunk_size=64),
}

WORDS = ("the state of a selective scan moves with every token it reads and the model learns "
         "which tokens to keep in its state and which to forget so that the next token is easy "
         "to predict from what came before").split()

# the tail of a progress line. Not its head: llama's logger runs on a thread of its own, and a log line
# ("epoch 0 lr=...") can land inside the bar, which ggml prints with several fprintf calls. With
# -val-split 0 every progress line is a training one.
PROGRESS = re.compile(r"\] data=(\d+)/(\d+) loss=([-+0-9.naif]+)")


def make_text(n_words, seed=0):
    """Deterministic English-like text, no trailing newline, no backslash (nothing to escape)."""
    rng = np.random.default_rng(seed)
    # a Markov chain over WORDS that mostly follows the sentence, so there is something to learn
    out, i = [], 0
    for _ in range(n_words):
        out.append(WORDS[i])
        i = (i + 1) % len(WORDS) if rng.random() < 0.8 else int(rng.integers(len(WORDS)))
    # sentences of 12 words
    return ". ".join(" ".join(out[k:k + 12]) for k in range(0, len(out), 12))


def make_model(kind, tied, seed=0, in_proj_scale=IN_PROJ_SCALE):
    """A random transformers model of CONFIGS[kind], float32, in_proj scaled by in_proj_scale."""
    import transformers
    if kind not in CONFIGS:
        raise ValueError(f"kind: expected one of {', '.join(CONFIGS)}, got {kind!r}")
    torch.manual_seed(seed)
    if kind == "mamba1":
        cfg = transformers.MambaConfig(tie_word_embeddings=tied, **CONFIGS[kind])
        model = transformers.MambaForCausalLM(cfg)
    else:
        cfg = transformers.Mamba2Config(tie_word_embeddings=tied, **CONFIGS[kind])
        model = transformers.Mamba2ForCausalLM(cfg)
    with torch.no_grad():
        for layer in model.backbone.layers:
            layer.mixer.in_proj.weight.mul_(in_proj_scale)
    return model.float()


def llama_bin(name, bin_dir=BIN):
    path = Path(bin_dir) / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: run `bash ggml/build.sh`")
    return path


def tokenize(gguf, text_path, bin_dir=BIN):
    """The tokens llama-finetune trains on (see the module docstring), from llama-tokenize."""
    cmd = [str(llama_bin("llama-tokenize", bin_dir)), "-m", str(gguf), "-f", str(text_path), "--ids",
           "--no-escape", "--no-parse-special", "--log-disable"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-tokenize failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def windows(tokens, n_ctx=N_CTX):
    """common_opt_dataset_init: (inputs, labels), each [ndata, n_ctx] int64, stride n_ctx // 2."""
    stride = n_ctx // 2
    ndata = (len(tokens) - n_ctx - 1) // stride
    if ndata < 1:
        raise ValueError(f"tokens: {len(tokens)} tokens make no window of n_ctx {n_ctx} (need >= {n_ctx + 1 + stride})")
    t = torch.tensor(tokens, dtype=torch.int64)
    inputs = torch.stack([t[i * stride:i * stride + n_ctx] for i in range(ndata)])
    labels = torch.stack([t[i * stride + 1:i * stride + n_ctx + 1] for i in range(ndata)])
    return inputs, labels


def parse_progress(stderr):
    """Per-ubatch losses from ggml_opt_epoch_callback_progress_bar's lines: a list per epoch.

    Each line prints the running mean m_k of the epoch's first k ubatch losses; the k-th loss is
    k m_k - (k-1) m_{k-1}."""
    epochs, prev_k, prev_mean = [], None, 0.0
    for line in re.split(r"[\r\n]", stderr):
        m = PROGRESS.search(line)
        if not m:
            continue
        k_line, mean = int(m.group(1)), float(m.group(3))
        if prev_k is None or k_line <= prev_k:          # a new epoch: the running mean restarts
            epochs.append([])
            k, prev_mean, unit = 0, 0.0, k_line
        k = len(epochs[-1]) + 1
        if k_line != k * unit:
            raise ValueError(f"progress line out of order: {line.strip()!r} (expected data={k * unit})")
        epochs[-1].append(k * mean - (k - 1) * prev_mean)
        prev_k, prev_mean = k_line, mean
    return epochs


def run_finetune(gguf, text_path, out_path, n_ctx=N_CTX, n_batch=None, n_ubatch=None, epochs=EPOCHS, lr=LR,
                 wd=WD, threads=THREADS, bin_dir=BIN, opt="adamw"):
    """Runs llama-finetune (-opt adamw or sgd); returns dict(proc, losses (per epoch, per ubatch), seconds)."""
    n_batch = n_batch or n_ctx
    n_ubatch = n_ubatch or n_batch
    cmd = [str(llama_bin("llama-finetune", bin_dir)), "-m", str(gguf), "-f", str(text_path), "-o", str(out_path),
           "-c", str(n_ctx), "-b", str(n_batch), "-ub", str(n_ubatch), "-epochs", str(epochs),
           "-opt", opt, "-lr", repr(lr), "-wd", repr(wd), "-val-split", "0", "-t", str(threads)]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    losses = parse_progress(proc.stderr) if proc.returncode == 0 else []
    return dict(proc=proc, cmd=cmd, losses=losses, seconds=seconds)


def train_A_as_stored(model):
    """Each mixer's A_log becomes a function of a parameter A = -exp(A_log) (what the GGUF stores and
    llama.cpp trains): torch then trains A, as llama-finetune does."""
    from torch.nn.utils import parametrize

    class NegLog(torch.nn.Module):
        def forward(self, A):
            return torch.log(-A)

        def right_inverse(self, A_log):
            return -torch.exp(A_log)

    for layer in model.backbone.layers:
        parametrize.register_parametrization(layer.mixer, "A_log", NegLog())
    return model


def _tbptt_cache_class():
    from transformers import DynamicCache

    class TruncatedCache(DynamicCache):
        """transformers' cache, carrying the state from one ubatch to the next as llama.cpp does, with the
        gradient cut there. The cache updates its tensors in place (copy_) after the scan has read them;
        the scan therefore gets a detached copy of the start state, and cut() detaches the conv state."""

        def get_recurrent_state(self, layer_idx, state_idx=0):
            s = super().get_recurrent_state(layer_idx, state_idx=state_idx)
            return None if s is None else s.detach().clone()

        def cut(self):
            for layer in self.layers:
                for i, ok in layer.is_conv_states_initialized.items():
                    if ok:
                        layer.conv_states[i] = layer.conv_states[i].detach()
    return TruncatedCache


def run_torch(model, inputs, labels, epochs=EPOCHS, lr=LR, wd=WD, threads=THREADS, n_ubatch=None, n_batch=None,
              patch=True):
    """Fine-tunes model in place as llama-finetune does; returns per-epoch lists of ubatch losses and the
    median seconds per window.

    n_ubatch < n_ctx (Mamba-2 only: transformers' Mamba-1 full-sequence scan always starts from a zero
    state): each window runs in ubatches carrying the state (truncated BPTT), each ubatch's loss scaled
    by 1/opt_period (opt_period = n_batch / n_ubatch) before its backward, one AdamW step every
    opt_period ubatches (n_batch defaults to n_ctx: one step per window)."""
    import ssmgrad.transformers as st
    n_ctx = inputs.shape[1]
    n_batch = n_batch or n_ctx
    n_ubatch = n_ubatch or n_batch
    if n_ctx % n_batch or n_batch % n_ubatch:
        raise ValueError(f"n_batch, n_ubatch: {n_batch}, {n_ubatch} must divide n_ctx {n_ctx} in turn")
    period = n_batch // n_ubatch
    if n_ubatch < n_ctx and model.config.model_type != "mamba2":
        raise ValueError(f"n_ubatch: a start state per ubatch needs Mamba-2 in transformers, got {model.config.model_type}")
    torch.set_num_threads(threads)
    train_A_as_stored(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=wd)
    losses, times = [], []
    with (st.patched() if patch else contextlib.nullcontext()):
        for _ in range(epochs):
            losses.append([])
            for x, y in zip(inputs, labels):
                t0 = time.perf_counter()
                cache = _tbptt_cache_class()(config=model.config) if n_ubatch < n_ctx else None
                for u in range(n_ctx // n_ubatch):
                    if u % period == 0:
                        opt.zero_grad(set_to_none=True)
                    sl = slice(u * n_ubatch, (u + 1) * n_ubatch)
                    if cache is None:
                        logits = model(input_ids=x[None, sl], use_cache=False).logits[0]
                    else:
                        cache.cut()
                        logits = model(input_ids=x[None, sl], cache=cache, use_cache=True).logits[0]
                    loss = F.cross_entropy(logits.float(), y[sl])
                    (loss / period).backward()
                    losses[-1].append(loss.item())
                    if u % period == period - 1:
                        opt.step()
                times.append(time.perf_counter() - t0)
    return dict(losses=losses, step_seconds=float(np.median(times)))


def prepare(kind, tied, workdir, n_words=260, seed=0, bin_dir=BIN):
    """Model -> save_pretrained -> GGUF; the text file and its tokens. Returns a dict of them."""
    workdir = Path(workdir)
    model = make_model(kind, tied, seed)
    hf_dir = workdir / f"{kind}-{'tied' if tied else 'untied'}"
    model.save_pretrained(hf_dir)
    gguf = convert.convert(hf_dir, workdir / f"{hf_dir.name}.gguf")
    text_path = workdir / "text.txt"
    if not text_path.is_file():
        text_path.write_bytes(make_text(n_words, seed).encode())
    tokens = tokenize(gguf, text_path, bin_dir)
    return dict(kind=kind, tied=tied, model=model, hf_dir=hf_dir, gguf=gguf, text=text_path, tokens=tokens,
                workdir=workdir)


def rel_diff(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.abs(a - b) / np.abs(b)


def compare(p, epochs=EPOCHS, threads=THREADS, bin_dir=BIN):
    """One row of the table: llama-finetune vs torch on the same prepared model, text and schedule."""
    kind, tied = p["kind"], p["tied"]
    inputs, labels = windows(p["tokens"])
    ft = run_finetune(p["gguf"], p["text"], p["workdir"] / f"{p['hf_dir'].name}-tuned.gguf", epochs=epochs,
                      threads=threads, bin_dir=bin_dir)
    if ft["proc"].returncode != 0:
        raise RuntimeError(f"llama-finetune failed ({ft['proc'].returncode}):\n{ft['proc'].stderr[-4000:]}")
    tr = run_torch(make_model(kind, tied), inputs, labels, epochs=epochs, threads=threads)
    lg = [x for e in ft["losses"] for x in e]
    lt = [x for e in tr["losses"] for x in e]
    if [len(e) for e in ft["losses"]] != [len(e) for e in tr["losses"]]:
        raise RuntimeError(f"{kind}: llama-finetune ran {[len(e) for e in ft['losses']]} steps per epoch, "
                           f"torch {[len(e) for e in tr['losses']]} ({len(p['tokens'])} tokens)")
    rel = rel_diff(lg, lt)
    worst = int(np.argmax(rel))
    return dict(kind=kind, tied=tied, n_tokens=len(p["tokens"]), ndata=len(inputs), llama=lg, torch=lt,
                max_rel=float(rel[worst]), worst_step=worst, steps_per_epoch=len(inputs),
                llama_seconds=ft["seconds"], torch_step_seconds=tr["step_seconds"])


def step_times(p, threads=THREADS, bin_dir=BIN):
    """Seconds per optimizer step (one window of N_CTX tokens, forward + backward + AdamW) of
    llama-finetune (the wall time of a 3-epoch run minus a 1-epoch run, over the extra steps: start-up
    and loading cancel), of torch with stock transformers, and of torch with ssmgrad.transformers
    (the median step of a 3-epoch run each)."""
    kind, tied = p["kind"], p["tied"]
    inputs, labels = windows(p["tokens"])
    wall = {}
    for e in (1, 3):
        ft = run_finetune(p["gguf"], p["text"], p["workdir"] / "timing.gguf", epochs=e, threads=threads,
                          bin_dir=bin_dir)
        if ft["proc"].returncode != 0:
            raise RuntimeError(f"llama-finetune failed:\n{ft['proc'].stderr[-3000:]}")
        wall[e] = ft["seconds"]
    out = dict(kind=kind, tied=tied, llama=(wall[3] - wall[1]) / (2 * len(inputs)))
    for name, patch in (("torch_stock", False), ("torch_ssmgrad", True)):
        out[name] = run_torch(make_model(kind, tied), inputs, labels, threads=threads, patch=patch)["step_seconds"]
    return out


def table(rows):
    lines = ["| model | embeddings | tokens | steps | first loss (llama / torch) | last loss (llama / torch) | max rel. diff |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['kind']} | {'tied' if r['tied'] else 'untied'} | {r['n_tokens']} | {len(r['llama'])} "
                     f"| {r['llama'][0]:.5f} / {r['torch'][0]:.5f} | {r['llama'][-1]:.5f} / {r['torch'][-1]:.5f} "
                     f"| {r['max_rel']:.1e} (step {r['worst_step'] + 1}) |")
    return "\n".join(lines)


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ncol = 2 if len(rows) > 1 else 1
    nrow = (len(rows) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.6 * ncol, 3.3 * nrow), squeeze=False)
    for ax, r in zip(axes.flat, rows):
        steps = np.arange(1, len(r["llama"]) + 1)
        ax.plot(steps, r["torch"], "-", lw=3, alpha=0.4, label="PyTorch + ssmgrad")
        ax.plot(steps, r["llama"], "k.--", lw=1, label="llama-finetune")
        for e in range(1, len(r["llama"]) // r["steps_per_epoch"]):
            ax.axvline(e * r["steps_per_epoch"] + 0.5, color="0.8", lw=0.8)
        ax.set_title(f"{r['kind']}, {'tied' if r['tied'] else 'untied'} (max rel. {r['max_rel']:.0e})", fontsize=9)
        ax.set_xlabel(f"AdamW step (window of {N_CTX} tokens)", fontsize=8)
        ax.set_ylabel("cross-entropy", fontsize=8)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--epochs", type=int, default=EPOCHS)
    ap.add_argument("--threads", type=int, default=THREADS)
    ap.add_argument("--kind", choices=sorted(CONFIGS), action="append", help="default: both")
    ap.add_argument("--plot", type=Path, help="write the loss curves to this PNG")
    ap.add_argument("--workdir", type=Path, help="keep the checkpoints, GGUFs and text here")
    ap.add_argument("--time", action="store_true", help="also time a step of llama-finetune, torch, torch + ssmgrad")
    args = ap.parse_args(argv)
    kinds = args.kind or sorted(CONFIGS)
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        prepared = [prepare(k, tied, workdir) for k in kinds for tied in (False, True)]
        rows = [compare(p, args.epochs, args.threads) for p in prepared]
        times = [step_times(p, args.threads) for p in prepared if not p["tied"]] if args.time else []
    print(table(rows))
    if times:
        print("\n| model | llama-finetune | torch (stock transformers) | torch + ssmgrad.transformers |\n|---|---|---|---|")
        for t in times:
            print(f"| {t['kind']} | {1e3 * t['llama']:.1f} ms | {1e3 * t['torch_stock']:.1f} ms "
                  f"| {1e3 * t['torch_ssmgrad']:.1f} ms |")
    if args.plot:
        plot(rows, args.plot)
        print(f"wrote {args.plot}")
    bad = [r for r in rows if not r["max_rel"] <= TOL]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
