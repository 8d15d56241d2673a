"""Training inside ggml, checked against ssmgrad.torch: same model, same weights, same batches.

examples/train.py builds a small model (embedding -> Mamba block (residual) -> layer norm -> head)
and a selective-copying task. This driver takes that model's seeded initial weights and its batches
(``make_model`` and ``batches`` of examples/train.py), writes them to a binary file, and runs
``build/ggml/bin/train_mamba``, which builds the same model from ggml ops (ggml/train_mamba.c) and
trains it with ggml-opt's AdamW. It then trains the same model in float32 with ssmgrad.torch's
ops and torch.optim.AdamW (the same hyperparameters), and compares the two loss curves step by
step: |loss_ggml - loss_torch| <= 1e-3 * |loss_torch| at every step, and the loss must fall (mean of
the last 10% of steps below 0.9x the mean of the first 10%), as examples/train.py requires.

The two optimizers are the same algorithm: ggml_opt_step_adamw computes
    m = b1 m + (1-b1) g;  v = b2 v + (1-b2) g^2
    w = w (1 - lr wd) - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
and torch.optim.AdamW (default, non-amsgrad, non-foreach-specific) the same: decoupled weight decay
applied to the weight before the step, both moments bias-corrected, eps added after the square
root of the corrected second moment. Here wd = 0 as in examples/train.py, betas (0.9, 0.999),
eps 1e-8 (torch's defaults, passed explicitly to both).

    python ggml/train_check.py                       # 300 steps, both blocks, writes ggml/train.png
    python ggml/train_check.py --quick --steps 40    # the small configuration (tests/ggml/test_ggml_train.py)
    python ggml/train_check.py --forward-only        # step 0's loss only (works on an unpatched ggml)
"""

import argparse
import importlib.util
import math
import os
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import ssmgrad              # noqa: E402


def _load_bench():
    # loaded by path: examples/ is a folder of scripts, not a package
    spec = importlib.util.spec_from_file_location("ssmgrad_example_train", ROOT / "examples" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _load_bench()       # examples/train.py: make_model, batches, CONFIGS, OPS

DEFAULT_BIN = ROOT / "build" / "ggml" / "bin" / "train_mamba"
TOL = 1e-3                  # relative, every step, float32
BETAS, EPS, WD = (0.9, 0.999), 1e-8, 0.0
EPS_LN = 1e-5               # torch F.layer_norm's default eps


def model_tensors(model, kind):
    """(name, trainable, float32 array) for every tensor the ggml graph needs, NumPy order.

    On the LoRA path A_log is frozen: the scan's A = -exp(A_log) is exported as a constant
    ("block.A"), the same float32 value torch computes in each forward. When A_log trains (--full),
    A_log itself is exported and ggml computes -exp(A_log) in the graph."""
    out = []
    for name, p in model.named_parameters():
        t = p.detach()
        if name == "block.A_log" and not p.requires_grad:
            name, t = "block.A", -torch.exp(t)
        if name == "block.D" and kind == "mamba2":
            t = t.reshape(-1, 1)                      # (n_head, 1): ggml ne [1, n_head] broadcasts over head_dim
        out.append((name, bool(p.requires_grad), t.to(torch.float32).contiguous().numpy()))
    return out


def write_input(path, kind, cfg, model, steps, seed, full):
    block = model.block
    vocab = cfg["n_colors"] + 2
    conf = {
        "kind": 2 if kind == "mamba2" else 1, "full": int(full),
        "d_model": cfg["d_model"], "d_inner": block.d_inner, "d_state": block.d_state,
        "head_dim": getattr(block, "head_dim", 1), "n_head": getattr(block, "n_head", block.d_inner),
        "n_group": getattr(block, "n_group", 1), "d_conv": block.d_conv,
        "dt_rank": getattr(block, "dt_rank", 0), "vocab": vocab, "n_t": cfg["body"] + cfg["n_mem"],
        "n_mem": cfg["n_mem"], "batch": cfg["batch"], "steps": steps,
        "lora_scale": block.in_proj.scale, "eps_ln": EPS_LN,
        "lr": lr_of(kind, cfg), "beta1": BETAS[0], "beta2": BETAS[1], "eps": EPS, "weight_decay": WD,
    }
    tensors = model_tensors(model, kind)
    data = bench.batches(cfg, seed)
    toks, tgts = zip(*(next(data) for _ in range(steps)))
    with open(path, "wb") as f:
        f.write(b"SSMTRAIN")
        f.write(struct.pack("<i", len(conf)))
        for k, v in conf.items():
            f.write(struct.pack("<32sd", k.encode(), float(v)))
        f.write(struct.pack("<i", len(tensors)))
        for name, trainable, a in tensors:
            shape = list(a.shape) + [1] * (4 - a.ndim)
            f.write(struct.pack("<64sii4q", name.encode(), int(trainable), a.ndim, *shape))
            f.write(a.astype("<f4").tobytes())
        f.write(torch.stack(toks).to(torch.int32).numpy().astype("<i4").tobytes())
        f.write(torch.stack(tgts).to(torch.int32).numpy().astype("<i4").tobytes())


def read_weights(path):
    out = {}
    with open(path, "rb") as f:
        (n,) = struct.unpack("<i", f.read(4))
        for _ in range(n):
            name, _tr, ndim, *shape = struct.unpack("<64sii4q", f.read(64 + 8 + 32))
            shape = shape[:ndim]
            a = np.frombuffer(f.read(4 * math.prod(shape)), dtype="<f4").reshape(shape)
            out[name.rstrip(b"\0").decode()] = a
    return out


def lr_of(kind, cfg):
    return cfg["lr"][kind] if isinstance(cfg["lr"], dict) else cfg["lr"]


def run_ggml(binary, kind, cfg, steps, seed, full, threads, forward_only=False):
    """Train in ggml; returns (losses, (wall seconds, CPU seconds), final weights or None)."""
    model = bench.make_model(kind, cfg, torch.float32, full, seed)
    with tempfile.TemporaryDirectory(prefix="ssmgrad-ggml-train-") as tmp:
        inp, wout = os.path.join(tmp, "in.bin"), os.path.join(tmp, "w.bin")
        write_input(inp, kind, cfg, model, steps, seed, full)
        cmd = [str(binary), inp, "--threads", str(threads)]
        cmd += ["--forward-only"] if forward_only else ["--weights-out", wout]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        losses, secs, cpu = [], None, None
        for line in proc.stdout.splitlines():
            parts = line.split()
            if parts and parts[0] == "loss":
                assert int(parts[1]) == len(losses), line
                losses.append(float(parts[2]))
            elif parts and parts[0] == "seconds":
                secs = float(parts[1])
            elif parts and parts[0] == "cpu_seconds":
                cpu = float(parts[1])
        weights = None if forward_only else read_weights(wout)
    return losses, (secs, cpu), weights


def run_torch(kind, cfg, steps, seed, full, threads):
    """The ssmgrad.torch float32 run of examples/train.py (one copy), with the same AdamW settings."""
    model = bench.make_model(kind, cfg, torch.float32, full, seed)
    vocab, n_mem = cfg["n_colors"] + 2, cfg["n_mem"]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr_of(kind, cfg),
                            betas=BETAS, eps=EPS, weight_decay=WD)
    data = bench.batches(cfg, seed)
    saved = torch.get_num_threads(), ssmgrad.get_num_threads()
    torch.set_num_threads(threads)
    ssmgrad.set_num_threads(threads)
    losses = []
    t0, c0 = time.perf_counter(), time.process_time()
    try:
        for _ in range(steps):
            tokens, target = next(data)
            logits = model(tokens, bench.OPS["ssmgrad"])[:, -n_mem:]
            loss = F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    finally:
        torch.set_num_threads(saved[0])
        ssmgrad.set_num_threads(saved[1])
    return losses, (time.perf_counter() - t0, time.process_time() - c0), model


def compare(kind, cfg, steps, seed=0, full=False, threads=1, binary=None):
    binary = binary or DEFAULT_BIN
    g_losses, g_secs, g_w = run_ggml(binary, kind, cfg, steps, seed, full, threads)
    t_losses, t_secs, t_model = run_torch(kind, cfg, steps, seed, full, threads)
    assert len(g_losses) == len(t_losses) == steps, (len(g_losses), len(t_losses), steps)
    rel = [abs(a - b) / abs(b) for a, b in zip(g_losses, t_losses)]
    tail = max(1, steps // 10)
    dw = {}
    for name, p in t_model.named_parameters():
        if p.requires_grad:
            want = p.detach().numpy()
            got = g_w[name].reshape(want.shape)
            dw[name] = float(np.max(np.abs(got - want)) / max(1e-30, float(np.max(np.abs(want)))))
    return {
        "kind": kind, "lr": lr_of(kind, cfg), "losses": {"ggml": g_losses, "torch": t_losses}, "rel": rel,
        "max_rel": max(rel), "worst_step": int(np.argmax(rel)),
        "initial": sum(t_losses[:tail]) / tail, "final": sum(t_losses[-tail:]) / tail,
        "initial_ggml": sum(g_losses[:tail]) / tail, "final_ggml": sum(g_losses[-tail:]) / tail,
        "seconds": {"ggml": g_secs[0], "torch": t_secs[0]}, "cpu_seconds": {"ggml": g_secs[1], "torch": t_secs[1]}, "max_rel_weight_diff": max(dw.values()),
        "worst_weight": max(dw, key=dw.get),
    }


def ok(r):
    return (r["max_rel"] <= TOL and r["final"] < 0.9 * r["initial"]
            and r["final_ggml"] < 0.9 * r["initial_ggml"])


def plot(results, path, title):
    bench.plot_curves([dict(ref=r["losses"]["torch"], ref_label="torch + ssmgrad.torch ops, torch AdamW",
                            new=r["losses"]["ggml"], new_label="ggml graph + ggml-opt AdamW",
                            title=f"{bench.block_name(r['kind'])} block (lr {r['lr']:g}): max relative loss "
                                  f"difference {r['max_rel']:.1e}\nCPU time of {len(r['rel'])} steps: ggml "
                                  f"{r['cpu_seconds']['ggml']:.1f} s, torch {r['cpu_seconds']['torch']:.1f} s",
                            diff=r["rel"], diff_label="|relative loss\ndifference|\n(0 drawn at 1e-9)",
                            floor=1e-9, tol=TOL)
                       for r in results], path, title)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="training steps (default 300, --quick 40)")
    p.add_argument("--quick", action="store_true", help="examples/train.py's small configuration")
    p.add_argument("--full", action="store_true", help="train everything, incl. A and the conv weight")
    p.add_argument("--threads", type=int, default=1, help="ggml, torch and ssmgrad threads (default 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", default=None,
                   help="learning rate: one value for every block, or one per block of --blocks, comma-separated "
                        "(default: examples/train.py's per-block rates)")
    p.add_argument("--blocks", default="mamba2,mamba1", help="comma-separated: mamba2, mamba1")
    p.add_argument("--bin", default=None, help="the train_mamba binary (bash ggml/build.sh)")
    p.add_argument("--forward-only", action="store_true",
                   help="compare only step 0's forward loss (needs no backward ops in ggml)")
    p.add_argument("--out", default=str(ROOT / "ggml" / "train.png"), help="figure path ('' for none)")
    args = p.parse_args(argv)
    args.bin = args.bin or str(DEFAULT_BIN)
    cfg = dict(bench.CONFIGS["quick" if args.quick else "default"])
    steps = args.steps if args.steps is not None else (40 if args.quick else 300)
    blocks = [b.strip() for b in args.blocks.split(",") if b.strip()]
    if not blocks or set(blocks) - {"mamba2", "mamba1"}:
        p.error(f"--blocks: expected a comma-separated subset of mamba2,mamba1, got {args.blocks!r}")
    if args.lr:
        try:
            lrs = [float(v) for v in args.lr.split(",")]
        except ValueError:
            p.error(f"--lr: expected numbers, got {args.lr!r}")
        if len(lrs) not in (1, len(blocks)):
            p.error(f"--lr: expected 1 or {len(blocks)} values, got {len(lrs)}")
        cfg["lr"] = dict(zip(blocks, lrs * len(blocks) if len(lrs) == 1 else lrs))
    if not Path(args.bin).is_file():
        p.error(f"{args.bin} not found: run `bash ggml/build.sh` first")
    mode = "full fine-tuning" if args.full else "LoRA (frozen base weights, conv weight and A)"

    if args.forward_only:
        good = True
        for kind in blocks:
            g, _, _ = run_ggml(args.bin, kind, cfg, 1, args.seed, args.full, args.threads, forward_only=True)
            model = bench.make_model(kind, cfg, torch.float32, args.full, args.seed)
            tokens, target = next(bench.batches(cfg, args.seed))
            with torch.no_grad():
                logits = model(tokens, bench.OPS["ssmgrad"])[:, -cfg["n_mem"]:]
                t = F.cross_entropy(logits.reshape(-1, cfg["n_colors"] + 2), target.reshape(-1)).item()
            rel = abs(g[0] - t) / abs(t)
            print(f"{kind}: step-0 loss ggml {g[0]:.9g}  torch {t:.9g}  relative difference {rel:.2e}")
            good &= rel <= 2e-6
        print("OK" if good else "FAILED")
        return 0 if good else 1

    print(f"ggml train_mamba vs ssmgrad.torch: {steps} steps, float32, {mode}, {args.threads} thread(s)"
          f"{', quick' if args.quick else ''}", flush=True)
    results = []
    for kind in blocks:
        r = compare(kind, cfg, steps, args.seed, args.full, args.threads, args.bin)
        results.append(r)
    print(f"\n{'block':8} {'lr':>7} {'max rel dloss':>13} {'at step':>7} {'max rel dW':>10} {'loss[0] ggml':>13} "
          f"{'loss[0] torch':>13} {'loss[-1] ggml':>13} {'loss[-1] torch':>14} {'ggml s':>7} {'torch s':>8} "
          f"{'ggml cpu':>7} {'torch cpu':>8}")
    good = True
    for r in results:
        lg, lt = r["losses"]["ggml"], r["losses"]["torch"]
        print(f"{r['kind']:8} {r['lr']:7.0e} {r['max_rel']:13.2e} {r['worst_step']:7d} {r['max_rel_weight_diff']:10.2e} "
              f"{lg[0]:13.6f} {lt[0]:13.6f} {lg[-1]:13.6f} {lt[-1]:14.6f} {r['seconds']['ggml']:7.2f} "
              f"{r['seconds']['torch']:8.2f} {r['cpu_seconds']['ggml']:7.2f} {r['cpu_seconds']['torch']:8.2f}")
        print(f"{'':8} mean loss, first/last 10% of steps: ggml {r['initial_ggml']:.4f} -> {r['final_ggml']:.4f}, "
              f"torch {r['initial']:.4f} -> {r['final']:.4f}")
        good &= ok(r)
    print(f"(max rel dloss: max over steps of |loss_ggml - loss_torch| / loss_torch, tolerance {TOL:g}; "
          f"max rel dW: largest |w_ggml - w_torch| / max|w_torch| over the trained tensors after the last step; "
          f"time: forward + backward + optimizer steps of each run, wall clock (s) and CPU time of the process (cpu))")
    if args.out:
        plot(results, args.out, f"ggml graph + ggml-opt AdamW vs torch + ssmgrad.torch ops\n"
             f"{mode}, float32, same initial weights and batches")
        print(f"wrote {os.path.relpath(args.out)}")
    print("OK" if good else "FAILED: losses disagree or did not fall")
    return 0 if good else 1


if __name__ == "__main__":
    sys.exit(main())
