"""llama-finetune's gradients at real size, element by element, against stock transformers: one SGD step.

The AdamW check of bench_finetune.py (the second loss, after one AdamW step) cannot tell a wrong gradient
from float32 rounding that AdamW's first step amplifies (it moves every weight with a nonzero gradient by
about lr, whatever the gradient's size). This one does not go through AdamW's normalization:
  1. gradients: one plain SGD step of llama-finetune (-opt sgd -wd 0, lr 1024, a power of two so that
     lr g is exact) on a text of exactly one window of 256 tokens; (w_before - w_after) / lr is llama's
     gradient, up to half an ulp of w_after / lr (the bound column). Against it, the gradients of that
     window in stock transformers and in transformers + ssmgrad (ggml/grad_check.py maps each to its
     GGUF tensor), per tensor the relative L2 error ||g - g_stock|| / ||g_stock||, and over all tensors;
  2. the second loss after one SGD step: the loss of the same window after one step with lr the power of
     two nearest 1 / ||g_stock||^2 (a first-order decrease of about 1), for llama-finetune (2 epochs of the
     one window: the second epoch's loss is the forward after the first step), stock transformers and
     transformers + ssmgrad (torch.optim.SGD's update, w - lr g, on the same gradients).
Models: bench_finetune.py's (random 130m-shaped, f32, transformers' init). One thread.

    python benchmarks/sgd_check_real.py --model mamba2 --workdir /tmp/real-sgd --out benchmarks/results_sgd_real.md
"""

import argparse
import gc
import json
import os
import resource
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(ROOT / "ggml"), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

import bench_finetune as bf     # noqa: E402
import finetune_check as fc     # noqa: E402
import grad_check as gck        # noqa: E402

GRAD_LR = 1024.0
ARCH = {"mamba2": "mamba2", "mamba1": "mamba", "nemotron_h": "nemotron_h"}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def torch_peer(name, hf_dir, x, y, patch, lr_sgd=None, float64=False):
    """(gradients by GGUF name as float32, first loss, gradient norm, second loss after SGD at lr_sgd);
    float64: the model in float64 (stock), its gradients kept in float64."""
    import torch
    import transformers
    torch.set_num_threads(1)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    if float64:
        model = model.double()
    grads, loss = gck.torch_grads_by_gguf_name(model, x, y, ARCH[name], patch=patch)
    if not float64:
        grads = {k: v.astype(np.float32) for k, v in grads.items()}
    gnorm = float(np.sqrt(sum(float(np.dot(g.astype(np.float64), g)) for g in grads.values())))
    loss2 = None
    if lr_sgd is not None:
        with torch.no_grad():
            for p in model.parameters():
                if p.grad is not None:
                    p.add_(p.grad, alpha=-lr_sgd)
            import contextlib
            import torch.nn.functional as F
            ctx = contextlib.nullcontext()
            if patch:
                import ssmgrad.transformers as st
                ctx = st.patched()
            with ctx:
                loss2 = float(F.cross_entropy(model(input_ids=x[None], use_cache=False).logits[0].float(), y))
    del model
    gc.collect()
    return grads, loss, gnorm, loss2


def f64_report(args, argv, started, p, x, y, gl, l_llama):
    """Each float32 gradient (llama, stock, + ssmgrad) against stock transformers' in float64."""
    gl = {k: v.astype(np.float32) for k, v in gl.items()}        # (exact to 6e-8: far below what is measured)
    gc.collect()
    out = {}
    for peer, kw in (("stock", dict(patch=False)), ("ssmgrad", dict(patch=True))):
        log(f"torch {peer}: gradients (float32)")
        out[peer] = torch_peer(args.model, p["hf_dir"], x, y, **kw)[:2]
    log("torch stock in float64: gradients")
    g64, l64, _, _ = torch_peer(args.model, p["hf_dir"], x, y, patch=False, float64=True)
    res = {"llama": gck.compare(gl, g64)}
    for peer in out:
        res[peer] = gck.compare(out[peer][0], g64)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    md = [f"# One SGD step at real size: float32 gradients against the float64 gradient", "",
          f"Written by `python benchmarks/sgd_check_real.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
          f"({started}, 1 thread; this process's peak RSS {peak:.2f} GiB).", "",
          f"- model: {args.model}, {p['n_params'] / 1e6:.1f}M parameters, one window of {fc.N_CTX} tokens; losses: "
          f"llama {l_llama:.5f}, stock float32 {out['stock'][1]:.6f}, + ssmgrad {out['ssmgrad'][1]:.6f}, "
          f"stock float64 {l64:.7f}",
          "- relative L2 error against stock transformers in float64, over all tensors: " + ", ".join(
              f"**{peer} {res[peer][1]:.2e}**" for peer in ("llama", "stock", "ssmgrad")), "",
          "| tensor | llama | stock float32 | + ssmgrad float32 |", "|---|---|---|---|"]
    for k in sorted(g64, key=lambda k: -res["llama"][0][k][0]):
        md.append(f"| `{k}` | {res['llama'][0][k][0]:.2e} | {res['stock'][0][k][0]:.2e} | {res['ssmgrad'][0][k][0]:.2e} |")
    text = "\n".join(md) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(ARCH), default="mamba2")
    ap.add_argument("--workdir", type=Path, required=True)
    ap.add_argument("--llama", type=Path, default=ROOT / "build" / "ggml", help="build directory")
    ap.add_argument("--lr-sgd", type=float, help="default: the power of two nearest 1 / ||g_stock||^2")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--f64", action="store_true",
                    help="only the gradients, each against stock transformers run in float64 (the exact gradient "
                         "up to float64 rounding)")
    args = ap.parse_args(argv)
    bin_dir = args.llama / "bin"
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    p = bf.prepare(args.model, args.workdir / args.model, 1, bin_dir)
    x, y = fc.windows(p["tokens"])
    x, y = x[0], y[0]
    log(f"{args.model}: {p['n_params'] / 1e6:.1f}M parameters, {len(p['tokens'])} tokens, one window")

    log("llama-finetune: one SGD step, lr 1024")
    gl, bound, l_llama = gck.llama_grads(p["gguf"], p["text"], args.workdir / "sgd-grad.gguf", lr=GRAD_LR,
                                         bin_dir=bin_dir)
    bound_n = {k: float(np.linalg.norm(v)) for k, v in bound.items()}
    del bound
    gc.collect()
    if args.f64:
        return f64_report(args, argv, started, p, x, y, gl, l_llama)
    log("torch stock: gradients")
    gs, l_stock, gnorm, _ = torch_peer(args.model, p["hf_dir"], x, y, patch=False)
    lr_sgd = args.lr_sgd or float(2.0 ** np.round(np.log2(1.0 / gnorm ** 2)))
    log(f"||g_stock|| = {gnorm:.4g}, SGD lr for the second loss {lr_sgd:g}")
    rows_l, tot_l = gck.compare(gl, gs)
    del gl
    gc.collect()
    log("torch + ssmgrad: gradients")
    gp, l_patch, _, _ = torch_peer(args.model, p["hf_dir"], x, y, patch=True)
    rows_p, tot_p = gck.compare(gp, gs)
    norms = {k: float(np.linalg.norm(v.astype(np.float64))) for k, v in gs.items()}
    del gp, gs
    gc.collect()

    log(f"second loss: llama-finetune, 2 epochs of the window, SGD lr {lr_sgd:g}")
    ft = fc.run_finetune(p["gguf"], p["text"], args.workdir / "sgd-2.gguf", epochs=2, lr=lr_sgd, wd=0.0,
                         bin_dir=bin_dir, opt="sgd")
    if ft["proc"].returncode != 0:
        raise RuntimeError(f"llama-finetune failed:\n{ft['proc'].stderr[-3000:]}")
    ll = [e[0] for e in ft["losses"]]
    log("second loss: torch stock, torch + ssmgrad")
    _, s1, _, s2 = torch_peer(args.model, p["hf_dir"], x, y, patch=False, lr_sgd=lr_sgd)
    _, p1, _, p2 = torch_peer(args.model, p["hf_dir"], x, y, patch=True, lr_sgd=lr_sgd)

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    md = [f"# One SGD step at real size: llama-finetune's gradients against stock transformers", "",
          f"Written by `python benchmarks/sgd_check_real.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
          f"({started}, 1 thread; this process's peak RSS {peak:.2f} GiB).", "",
          f"- model: {args.model}, {p['n_params'] / 1e6:.1f}M parameters (bench_finetune.py's), one window of "
          f"{fc.N_CTX} tokens; llama build `{args.llama}`",
          f"- the window's loss: llama {l_llama:.5f}, stock {l_stock:.6f}, + ssmgrad {l_patch:.6f}",
          f"- gradients, relative L2 error over all tensors: **llama vs stock {tot_l:.2e}**, "
          f"**transformers + ssmgrad vs stock {tot_p:.2e}**; ||g_stock|| = {gnorm:.5g}",
          f"- second loss after one SGD step (lr {lr_sgd:g}) on the same window: llama {ll[1]:.5f}, stock "
          f"{s2:.6f}, + ssmgrad {p2:.6f}: **llama vs stock {abs(ll[1] - s2) / abs(s2):.1e}**, **+ ssmgrad vs "
          f"stock {abs(p2 - s2) / abs(s2):.1e}** relative (first loss {ll[0]:.5f} / {s1:.6f} / {p1:.6f}; "
          f"llama prints 5 decimals, {5e-6 / abs(s2):.1e} relative)", "",
          "| tensor | norm of g_stock | llama vs stock: rel. L2 | max abs / max | rounding bound (rel. L2) "
          "| + ssmgrad vs stock: rel. L2 | max abs / max |", "|---|---|---|---|---|---|---|"]
    for k in sorted(rows_l, key=lambda k: -rows_l[k][0]):
        md.append(f"| `{k}` | {norms[k]:.3g} | {rows_l[k][0]:.2e} | {rows_l[k][1]:.2e} | "
                  f"{bound_n[k] / norms[k] if norms[k] else float('nan'):.1e} | {rows_p[k][0]:.2e} | {rows_p[k][1]:.2e} |")
    text = "\n".join(md) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)
    json.dump(dict(tot_llama=tot_l, tot_patch=tot_p, loss2=[ll[1], s2, p2], lr_sgd=lr_sgd,
                   rows_llama=rows_l, rows_patch=rows_p), open(args.workdir / f"{args.model}-sgd.json", "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
