#!/usr/bin/env python
"""Hugging Face transformers on the CPU: stock against ssmgrad.transformers.patch(), in one run.

    python benchmarks/hf_train.py              # full run (~20 min on 2 cores): results_hf.md, results_hf.png
    python benchmarks/hf_train.py --quick      # smoke test (~1 min): small sizes, writes to a temp dir

Models: random-init from config (no downloads), float32, batch 1, two Mamba layers at the real widths of
mamba-130m (hidden 768, d_inner 1536, state 16) and mamba2-130m (hidden 768, 24 heads x 64, state 128,
chunk 256), vocabulary 1024 (a 50k-word LM head would be a large matmul that is the same on both sides).

1. Validate: at L = 128, the loss and every parameter gradient of the patched model against stock
   (same weights, same batch). A model that fails is reported and not timed.
2. Training step (forward, backward, AdamW step), L = 256, 512, 1024, 1 and 2 threads
   (torch.set_num_threads and ssmgrad.set_num_threads). Stock and patched steps alternate within each
   cell (a shared machine's load falls on both alike); medians. Stock Mamba-1 (a Python token loop
   whose backward is quadratic in L) gets fewer repeats, and at L = 1024 one run with 2 threads only.
3. generate: greedy, 16-token prompt, 64 new tokens, with the cache; tokens/s of the new tokens (prefill
   included), alternating stock / patched; the tokens must be identical.
4. Where the time goes: the time inside ssmgrad's kernels (ssm_scan, ssm_scan_back, ssm_conv,
   ssm_conv_back, ssm_conv_back_weight) as a share of the patched Mamba-2 training step at L = 512, the
   torch.profiler's top operators of that step, and the share of a patched generate spent in the
   replaced functions.
5. Conv families (only the causal conv is ssmgrad's): LFM2 and Qwen3-Next, two layers (one conv or
   linear-attention layer, one attention layer) at real widths, MoE cut to 4 experts: validated, then
   the training step at L = 512 and generate, stock vs patched, and the conv's share of the stock and of
   the patched step (torch.profiler, self CPU time of the conv operators).
6. torch.compile: the patched Mamba-1 and Mamba-2 training step at L = 512, eager vs torch.compile(model)
   (compile time given apart), alternating.
"""

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time

os.environ.setdefault("OMP_WAIT_POLICY", "passive")    # spin-waiting costs more than it gains on a shared machine

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(1, ROOT)

import torch                                            # noqa: E402
import transformers                                     # noqa: E402

import ssmgrad                                          # noqa: E402
import ssmgrad.transformers as sht                      # noqa: E402

transformers.logging.set_verbosity_error()              # the "falling back to torch" notices, once per function

VOCAB = 1024
MODELS = {
    "Mamba-1": ("MambaConfig", "MambaForCausalLM",
                dict(hidden_size=768, state_size=16, num_hidden_layers=2, expand=2, conv_kernel=4)),
    "Mamba-2": ("Mamba2Config", "Mamba2ForCausalLM",
                dict(hidden_size=768, num_heads=24, head_dim=64, state_size=128, n_groups=1, expand=2,
                     conv_kernel=4, chunk_size=256, num_hidden_layers=2)),
}
def conv_models(quick):
    """LFM2 at LFM2-350M widths (the real model has 10 conv and 6 attention layers) and Qwen3-Next at
    Qwen3-Next-80B-A3B widths (gated delta rule: 16 key heads, 32 value heads of 128, the conv over 8192
    channels) with 4 experts of 512 (top 2) instead of 512 (top 10); two layers each, one conv /
    linear-attention layer and one attention layer. ``quick``: small widths."""
    def w(real, small):
        return small if quick else real
    lfm2 = dict(hidden_size=w(1024, 64), intermediate_size=w(4608, 128), block_auto_adjust_ff_dim=False,
                num_attention_heads=w(16, 4), num_key_value_heads=w(8, 2), conv_L_cache=3, num_hidden_layers=2,
                layer_types=["conv", "full_attention"])
    qwen = dict(hidden_size=w(2048, 64), num_attention_heads=w(16, 4), num_key_value_heads=2, head_dim=w(256, 16),
                linear_key_head_dim=w(128, 16), linear_value_head_dim=w(128, 16), linear_num_key_heads=w(16, 2),
                linear_num_value_heads=w(32, 4), linear_conv_kernel_dim=4, moe_intermediate_size=w(512, 32),
                shared_expert_intermediate_size=w(512, 32), num_experts=4, num_experts_per_tok=2,
                num_hidden_layers=2, layer_types=["linear_attention", "full_attention"])
    return {"LFM2": ("Lfm2Config", "Lfm2ForCausalLM", lfm2),
            "Qwen3-Next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", qwen)}


QUICK_MODELS = {
    "Mamba-1": ("MambaConfig", "MambaForCausalLM",
                dict(hidden_size=64, state_size=16, num_hidden_layers=2, expand=2, conv_kernel=4)),
    "Mamba-2": ("Mamba2Config", "Mamba2ForCausalLM",
                dict(hidden_size=64, num_heads=4, head_dim=32, state_size=32, n_groups=1, expand=2,
                     conv_kernel=4, chunk_size=32, num_hidden_layers=2)),
}


def make_model(spec, seed=0):
    config_name, model_name, kwargs = spec
    config = getattr(transformers, config_name)(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1,
                                                eos_token_id=2, **kwargs)
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(config).float()


def tokens(n_t, seed):
    return torch.randint(3, VOCAB, (1, n_t), generator=torch.Generator().manual_seed(seed))


def set_threads(n):
    torch.set_num_threads(n)
    ssmgrad.set_num_threads(n)


@contextlib.contextmanager
def mode(patched):
    if patched:
        sht.patch()
    else:
        sht.unpatch()
    try:
        yield
    finally:
        sht.unpatch()


# ---------------------------------------------------------------------------------------------------
# 1. validation

def validate(spec, n_t):
    model = make_model(spec)
    model.train()
    ids = tokens(n_t, 1)
    res = {}
    for patched in (False, True):
        with mode(patched):
            model.zero_grad(set_to_none=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            res[patched] = (loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()})
    (l0, g0), (l1, g1) = res[False], res[True]
    worst_name, worst = None, 0.0
    for name in g0:
        err = float((g1[name] - g0[name]).abs().max()) / max(float(g0[name].abs().max()), 1e-30)
        if err > worst:
            worst_name, worst = name, err
    ok = abs(l1 - l0) <= 1e-5 * abs(l0) and worst <= 1e-3 and sht.call_counts
    return dict(n_t=n_t, loss_stock=l0, loss_patched=l1, worst_grad=worst, worst_param=worst_name, ok=bool(ok))


# ---------------------------------------------------------------------------------------------------
# 2. training step

def train_step(model, opt, ids):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def train_setup(spec, n_t, threads):
    """A fresh model in train mode, its AdamW and a batch of n_t tokens, on ``threads`` threads."""
    set_threads(threads)
    model = make_model(spec)
    model.train()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5), tokens(n_t, 2)


def time_train_cell(spec, n_t, threads, reps_stock, reps_patched, warm_stock):
    model, opt, ids = train_setup(spec, n_t, threads)
    with mode(True):
        train_step(model, opt, ids)                      # warm-up
    if warm_stock:
        with mode(False):
            train_step(model, opt, ids)
    times = {False: [], True: []}
    for r in range(max(reps_stock, reps_patched)):
        for patched, reps in ((False, reps_stock), (True, reps_patched)):
            if r < reps:
                with mode(patched):
                    t0 = time.perf_counter()
                    train_step(model, opt, ids)
                    times[patched].append(time.perf_counter() - t0)
    return times


# ---------------------------------------------------------------------------------------------------
# 3. generate

def time_generate(spec, threads, reps, n_prompt, n_new):
    set_threads(threads)
    model = make_model(spec)
    model.eval()
    ids = tokens(n_prompt, 3)
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
              do_sample=False, pad_token_id=0)
    seqs, times = {}, {False: [], True: []}
    with torch.no_grad():
        for patched in (False, True):                    # warm-up, and the tokens to compare
            with mode(patched):
                seqs[patched] = model.generate(**kw)
        for _ in range(reps):
            for patched in (False, True):
                with mode(patched):
                    t0 = time.perf_counter()
                    model.generate(**kw)
                    times[patched].append(time.perf_counter() - t0)
    return times, bool(torch.equal(seqs[False], seqs[True]))


# ---------------------------------------------------------------------------------------------------
# 4. where the time goes

KERNELS = ("ssm_scan", "ssm_scan_back", "ssm_conv", "ssm_conv_back", "ssm_conv_back_weight")


@contextlib.contextmanager
def timed_attributes(module, names, acc):
    """Wrap module.<name> for each name with a timer adding into acc[name] (seconds)."""
    saved = {n: getattr(module, n) for n in names}

    def wrap(name, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                acc[name] = acc.get(name, 0.0) + time.perf_counter() - t0
        return timed

    for n, fn in saved.items():
        setattr(module, n, wrap(n, fn))
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(module, n, fn)


def kernel_share(spec, n_t, threads, reps):
    """Share of the patched training step spent inside ssmgrad's C kernels (ssmgrad.torch calls them as
    attributes of the ssmgrad module, so wrapping those attributes times every call)."""
    model, opt, ids = train_setup(spec, n_t, threads)
    shares, per_kernel = [], []
    with mode(True):
        train_step(model, opt, ids)
        for _ in range(reps):
            acc = {}
            with timed_attributes(ssmgrad, KERNELS, acc):
                t0 = time.perf_counter()
                train_step(model, opt, ids)
                total = time.perf_counter() - t0
            shares.append(sum(acc.values()) / total)
            per_kernel.append({k: v / total for k, v in acc.items()})
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            train_step(model, opt, ids)
    events = prof.key_averages()
    total_self = sum(e.self_cpu_time_total for e in events)
    top = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:8]
    top = [(e.key, e.self_cpu_time_total / total_self) for e in top]
    median_kernels = {k: statistics.median(d.get(k, 0.0) for d in per_kernel) for k in KERNELS}
    return dict(share=statistics.median(shares), shares=shares, kernels=median_kernels, top=top)


def generate_share(spec, threads, n_prompt, n_new):
    """Share of a patched generate spent in the replaced functions of the modeling file (one-token
    updates, conv, prefill scan) and inside ssmgrad's kernels."""
    set_threads(threads)
    model = make_model(spec)
    model.eval()
    ids = tokens(n_prompt, 3)
    module = sys.modules[type(model).__module__]
    kw = dict(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n_new, min_new_tokens=n_new,
              do_sample=False, pad_token_id=0)
    names = list(sht.FAMILIES[module.__name__.split(".")[-2]])
    out = {}
    for patched in (False, True):
        with torch.no_grad(), mode(patched):
            model.generate(**kw)
            acc_fn, acc_k = {}, {}
            with timed_attributes(module, names, acc_fn), timed_attributes(ssmgrad, KERNELS, acc_k):
                t0 = time.perf_counter()
                model.generate(**kw)
                total = time.perf_counter() - t0
        key = "patched" if patched else "stock"
        out[key] = dict(replaced=sum(acc_fn.values()) / total, kernels=sum(acc_k.values()) / total,
                        per_function={k: v / total for k, v in acc_fn.items()})
    # what the rest is: the stock run's matrix products (projections, LM head), by torch.profiler
    with torch.no_grad(), mode(False), torch.profiler.profile() as prof:
        model.generate(**kw)
    ev = prof.key_averages()
    tot = sum(e.self_cpu_time_total for e in ev)
    out["stock"]["matmul"] = sum(e.self_cpu_time_total for e in ev if e.key in ("aten::mm", "aten::addmm")) / tot
    return out


# ---------------------------------------------------------------------------------------------------
# 5. conv families: the conv's share of the step

def is_conv_op(key):
    """torch.profiler keys of the causal conv: stock's aten convolution operators (forward and backward)
    and ssmgrad's conv operators."""
    return key.startswith("ssmgrad::ssm_conv") or (key.startswith("aten::") and "conv" in key and "convert" not in key)


def conv_share(spec, n_t, threads, patched):
    """Share of one training step's self CPU time (torch.profiler) spent in the conv operators."""
    model, opt, ids = train_setup(spec, n_t, threads)
    with mode(patched):
        train_step(model, opt, ids)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            train_step(model, opt, ids)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    conv = {e.key: e.self_cpu_time_total / total for e in events if is_conv_op(e.key) and e.self_cpu_time_total}
    return dict(share=sum(conv.values()), ops=conv)


# ---------------------------------------------------------------------------------------------------
# 6. torch.compile

def time_compile_cell(spec, n_t, threads, reps):
    """Patched training step, eager vs torch.compile(model) (same model and optimizer), alternating; the
    first compiled step (compilation) is timed apart."""
    import torch._dynamo
    torch._dynamo.reset()
    model, opt, ids = train_setup(spec, n_t, threads)
    times = {"eager": [], "compiled": []}
    with mode(True):
        compiled = torch.compile(model)
        train_step(model, opt, ids)
        t0 = time.perf_counter()
        train_step(compiled, opt, ids)
        compile_s = time.perf_counter() - t0
        for _ in range(reps):
            for name, m in (("eager", model), ("compiled", compiled)):
                t0 = time.perf_counter()
                train_step(m, opt, ids)
                times[name].append(time.perf_counter() - t0)
    torch._dynamo.reset()
    return dict(times, compile_s=compile_s)


# ---------------------------------------------------------------------------------------------------
# report

def machine_lines():
    from common import lscpu
    info = lscpu()
    return [
        f"- CPU: {info.get('Model name', platform.processor() or '?')}, {info.get('CPU(s)', os.cpu_count())} CPUs"
        + (f", hypervisor {info['Hypervisor vendor']}" if "Hypervisor vendor" in info else ""),
        f"- Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
        f"peft {_version_or('peft')}, ssmgrad {ssmgrad.__version__}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}",
    ]


def _version_or(name):
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def med(xs):
    return statistics.median(xs) if xs else float("nan")


def fmt_s(x):
    if x != x:
        return "—"
    return f"{x:.3g} s" if x >= 0.1 else f"{x * 1e3:.3g} ms"


def plot(results, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, name in zip(axes, MODELS):
        for threads, style in ((1, "--"), (2, "-")):
            cells = [c for c in results["train"] if c["model"] == name and c["threads"] == threads]
            for patched, color, label in ((False, "tab:red", "stock"), (True, "tab:blue", "patched")):
                key = "patched" if patched else "stock"
                pts = [(c["n_t"], med(c[key])) for c in cells if c[key]]
                if pts:
                    ax.plot(*zip(*pts), style, marker="o", color=color, label=f"{label}, {threads} thread(s)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length L")
        ax.set_ylabel("training step (s), median")
        ax.set_title(f"{name}-130m-like, 2 layers")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("transformers on CPU: stock vs ssmgrad.transformers.patch() (forward + backward + AdamW)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def new_sections_md(results):
    """Sections 5 and 6 of the report (markdown lines)."""
    md = []
    if results.get("conv"):
        md += ["## Conv families: LFM2 and Qwen3-Next (only the causal conv is ssmgrad's)", ""]
        md.append("Two layers at real widths (LFM2-350M: hidden 1024, conv over 1024 channels, kernel 3; "
                  "Qwen3-Next-80B-A3B: hidden 2048, gated-delta-rule conv over 8192 channels, kernel 4, "
                  "4 experts instead of 512), one conv / linear-attention layer and one attention layer, "
                  "float32, batch 1, vocabulary 1024. Conv share: self CPU time of the conv operators "
                  "(stock: aten convolution forward and backward; patched: ssmgrad's conv operators) over "
                  "the whole step's, torch.profiler, one step.")
        md.append("")
        md.append("| model | validated (loss, worst gradient) | L | stock step | patched step | speed-up | "
                  "conv share stock | conv share patched | generate stock tok/s | patched tok/s | same tokens |")
        md.append("|---|---|---|---|---|---|---|---|---|---|---|")
        g = results["generate_spec"]
        for c in results["conv"]:
            v = c["validate"]
            val = f"{'yes' if v['ok'] else 'NO'} ({abs(v['loss_patched'] - v['loss_stock']):.1e}, {v['worst_grad']:.1e})"
            if "stock" not in c:
                md.append(f"| {c['model']} | {val} | — | — | — | — | — | — | — | — | — |")
                continue
            s, p = med(c["stock"]), med(c["patched"])
            gs, gp = g["n_new"] / med(c["gen_stock"]), g["n_new"] / med(c["gen_patched"])
            md.append(f"| {c['model']} | {val} | {c['n_t']} | {fmt_s(s)} | {fmt_s(p)} | {s / p:.2f}x | "
                      f"{100 * c['share_stock']['share']:.1f}% | {100 * c['share_patched']['share']:.1f}% | "
                      f"{gs:.1f} | {gp:.1f} | {'yes' if c['same'] else 'NO'} |")
        md.append("")
        md.append("Conv operators in the stock step: " + "; ".join(
            f"{c['model']}: " + ", ".join(f"`{k}` {100 * v:.1f}%" for k, v in c["share_stock"]["ops"].items())
            for c in results["conv"] if "share_stock" in c) + ".")
        md.append("")
    if results.get("compile"):
        md += ["## torch.compile: the patched training step, eager vs compiled", ""]
        md.append("| model | L | threads | eager | compiled | compiled / eager | first compiled step (compiles) |")
        md.append("|---|---|---|---|---|---|---|")
        for c in results["compile"]:
            e, k = med(c["eager"]), med(c["compiled"])
            md.append(f"| {c['model']} | {c['n_t']} | {c['threads']} | {fmt_s(e)} | {fmt_s(k)} | {k / e:.2f} | "
                      f"{fmt_s(c['compile_s'])} |")
        md.append("")
    return md


def run_new_sections(results, conv_specs, quick, n_prompt, n_new, log):
    """Sections 5 and 6 into results["conv"], results["compile"]."""
    n_t = 64 if quick else 512
    reps = 2 if quick else 3
    results["conv"] = []
    for name, spec in conv_specs.items():
        set_threads(2)
        c = dict(model=name, validate=validate(spec, 16 if quick else 128))
        log(f"validate {name}: {c['validate']}")
        if c["validate"]["ok"]:
            times = time_train_cell(spec, n_t, 2, reps, reps, warm_stock=True)
            gen, same = time_generate(spec, 2, reps, n_prompt, n_new)
            c.update(n_t=n_t, threads=2, stock=times[False], patched=times[True], gen_stock=gen[False],
                     gen_patched=gen[True], same=same, share_stock=conv_share(spec, n_t, 2, False),
                     share_patched=conv_share(spec, n_t, 2, True))
            log(f"conv {name} L={n_t}: stock {times[False]} patched {times[True]} generate {gen} same={same} "
                f"conv share stock {c['share_stock']['share']:.3f} patched {c['share_patched']['share']:.3f}")
        results["conv"].append(c)
    results["compile"] = []
    for name in MODELS:
        r = time_compile_cell(MODELS[name], n_t, 2, 2 if quick else 5)
        results["compile"].append(dict(model=name, n_t=n_t, threads=2, **r))
        log(f"compile {name} L={n_t}: {r}")


def write_report(results, out_dir, argv, quick):
    md = ["# Hugging Face transformers on CPU: stock vs `ssmgrad.transformers.patch()`", ""]
    md.append(f"`python benchmarks/hf_train.py{' ' + ' '.join(argv) if argv else ''}`, "
              f"{results['started']} to {results['finished']} (UTC).")
    md.append("")
    md += machine_lines()
    busy = results["load"][0] >= 0.5
    md.append(f"- Threads: 1 and 2 (torch.set_num_threads and ssmgrad.set_num_threads). Load average "
              f"(1 min) at start {results['load'][0]:.1f}, at end {results['load'][1]:.1f}"
              + (": the machine's 2 cores were shared with other processes during the run, so absolute times are "
                 "inflated and noisy" if busy else
                 " (this run's own threads; the machine was otherwise idle)")
              + "; stock and patched steps alternate inside each cell, and the table gives medians and their ratio.")
    md.append("- Models: random-init from config, float32, batch 1, 2 layers, vocabulary 1024; Mamba-1: hidden 768, "
              "d_inner 1536, state 16 (mamba-130m widths); Mamba-2: hidden 768, 24 heads x 64, state 128, "
              "1 group, chunk 256 (mamba2-130m widths)." if not quick else "- --quick: small models.")
    md.append("")
    md.append("## Validation (before timing)")
    md.append("")
    md.append("| model | L | loss stock | loss patched | worst gradient (max abs diff / max abs) | ok |")
    md.append("|---|---|---|---|---|---|")
    for name, v in results["validate"].items():
        md.append(f"| {name} | {v['n_t']} | {v['loss_stock']:.7f} | {v['loss_patched']:.7f} | "
                  f"{v['worst_grad']:.2e} ({v['worst_param']}) | {'yes' if v['ok'] else 'NO'} |")
    md.append("")
    md.append("## Training step (forward, backward, AdamW)")
    md.append("")
    if results.get("train_from"):
        md.append(f"This table is from the run of {results['train_from']} (UTC), same machine and load; its "
                  "stock Mamba-1 at L = 1024 alone took 6 minutes. The sections below were re-run with "
                  "more generate repeats (`--skip-train`).")
        md.append("")
    md.append("| model | L | threads | stock | patched | speed-up | runs (stock / patched) |")
    md.append("|---|---|---|---|---|---|---|")
    for c in results["train"]:
        s, p = med(c["stock"]), med(c["patched"])
        ratio = f"{s / p:.1f}x" if c["stock"] else "—"
        md.append(f"| {c['model']} | {c['n_t']} | {c['threads']} | {fmt_s(s) if c['stock'] else c.get('note', '—')} | "
                  f"{fmt_s(p)} | {ratio} | {len(c['stock'])} / {len(c['patched'])} |")
    md.append("")
    md.append("## generate (greedy, with the cache)")
    md.append("")
    g = results["generate_spec"]
    md.append(f"Prompt {g['n_prompt']} tokens, {g['n_new']} new tokens; tokens/s = new tokens / wall time of "
              "`model.generate` (prefill included), median of alternating runs.")
    md.append("")
    md.append("| model | threads | stock tokens/s | patched tokens/s | ratio | same tokens |")
    md.append("|---|---|---|---|---|---|")
    for c in results["generate"]:
        s, p = g["n_new"] / med(c["stock"]), g["n_new"] / med(c["patched"])
        md.append(f"| {c['model']} | {c['threads']} | {s:.1f} | {p:.1f} | {p / s:.2f}x | "
                  f"{'yes' if c['same'] else 'NO'} |")
    md.append("")
    md.append("## Where the time goes")
    md.append("")
    k = results["kernel_share"]
    md.append(f"Patched Mamba-2 training step, L = {k['n_t']}, {k['threads']} threads: time inside ssmgrad's C "
              f"kernels = **{100 * k['share']:.1f}%** of the step (median of {len(k['shares'])} steps: "
              + ", ".join(f"{100 * x:.1f}%" for x in k["shares"]) + "); per kernel: "
              + ", ".join(f"{n} {100 * v:.1f}%" for n, v in k["kernels"].items()) + ".")
    md.append("")
    md.append("torch.profiler, one patched step, top operators by self CPU time (share of the profiled total):")
    md.append("")
    md.append("| operator | share |")
    md.append("|---|---|")
    for name, share in k["top"]:
        md.append(f"| `{name}` | {100 * share:.1f}% |")
    md.append("")
    for name, gs in results["generate_share"].items():
        st_, pa = gs["stock"], gs["patched"]
        md.append(f"- generate, {name}, {gs['threads']} threads: the four replaced functions take "
                  f"{100 * st_['replaced']:.1f}% of the stock run (" + ", ".join(f"{n} {100 * v:.1f}%" for n, v in
                                                                       st_["per_function"].items())
                  + f") and {100 * pa['replaced']:.1f}% of the patched run ({100 * pa['kernels']:.1f}% inside "
                  f"ssmgrad's kernels): even free replacements could make generate at most "
                  f"{1 / (1 - st_['replaced']):.2f}x faster; the rest is the projections, norms, LM head and "
                  "transformers' generate loop, the same on both sides"
                  + (f" (the matrix products alone, `aten::mm`/`addmm` in torch.profiler, {100 * st_['matmul']:.1f}% of "
                     "the stock run: one token reads every projection weight from memory)" if "matmul" in st_ else "")
                  + ".")
    md.append("")
    md += new_sections_md(results)
    md.append("## Targets")
    md.append("")
    for line in results["targets"]:
        md.append(f"- {line}")
    md.append("")
    with open(os.path.join(out_dir, "results_hf.md"), "w") as f:
        f.write("\n".join(md))
    with open(os.path.join(out_dir, "results_hf.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    plot(results, os.path.join(out_dir, "results_hf.png"))


def targets(results):
    def cell(model, n_t, threads):
        for c in results["train"]:
            if c["model"] == model and c["n_t"] == n_t and c["threads"] == threads and c["stock"]:
                return med(c["stock"]) / med(c["patched"])
        return float("nan")

    def verdict(ratios, goal):
        return ", ".join(f"{r:.2f}x ({t} thread{'s' if t > 1 else ''}: {'met' if r >= goal else 'MISSED'})"
                         for t, r in ratios)

    out = []
    for model, goal in (("Mamba-1", 100.0), ("Mamba-2", 1.8)):
        out.append(f"{model} training step >= {goal:g}x stock at L = 512: "
                   + verdict([(t, cell(model, 512, t)) for t in (1, 2)], goal))
    for model in MODELS:
        ratios = [(c["threads"], med(c["stock"]) / med(c["patched"])) for c in results["generate"]
                  if c["model"] == model]
        line = f"{model} generate tokens/s >= 1.5x stock: " + verdict(ratios, 1.5)
        gs = results.get("generate_share", {}).get(model)
        if gs:
            bound = 1 / (1 - gs["stock"]["replaced"])
            line += (f"; limit: the replaced functions take {100 * gs['stock']['replaced']:.1f}% of the stock run "
                     f"(2 threads), so even free replacements give at most {bound:.2f}x")
        out.append(line)
    k = results["kernel_share"]
    out.append(f"ssmgrad ops' share of the patched Mamba-2 training step <= 20%: {100 * k['share']:.1f}%: "
               f"{'met' if k['share'] <= 0.20 else 'MISSED'}")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small models and lengths, output to a temp dir")
    ap.add_argument("--out", default=None, help="output directory (default: benchmarks/, or a temp dir with --quick)")
    ap.add_argument("--skip-train", metavar="RESULTS_JSON", default=None,
                    help="validate, then take the training-step table from an earlier run's results_hf.json (its "
                         "times are stated as that run's in the report) and run only generate and the profiles")
    ap.add_argument("--gen-reps", type=int, default=None, help="alternating generate runs per cell (default 3)")
    ap.add_argument("--new-only", action="store_true",
                    help="only sections 5 and 6 (conv families, torch.compile), written to results_hf_new.md")
    args = ap.parse_args()
    global MODELS
    if args.quick:
        MODELS = QUICK_MODELS
    conv_specs = conv_models(args.quick)
    out_dir = args.out or (tempfile.mkdtemp(prefix="hf_bench_") if args.quick else HERE)
    os.makedirs(out_dir, exist_ok=True)
    lengths = (32, 64) if args.quick else (256, 512, 1024)
    n_prompt, n_new = (8, 8) if args.quick else (16, 64)
    results = dict(started=datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M"), load=[os.getloadavg()[0]],
                   generate_spec=dict(n_prompt=n_prompt, n_new=n_new))

    def log(msg):
        print(f"[{datetime.datetime.utcnow():%H:%M:%S}] {msg}", flush=True)

    if args.new_only:
        run_new_sections(results, conv_specs, args.quick, n_prompt, n_new, log)
        results["load"].append(os.getloadavg()[0])
        results["finished"] = datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M")
        md = [f"# transformers on CPU: conv families and torch.compile (`python benchmarks/hf_train.py "
              f"{' '.join(sys.argv[1:])}`)", "", f"{results['started']} to {results['finished']} (UTC); load average "
              f"(1 min) {results['load'][0]:.1f} at start, {results['load'][1]:.1f} at end.", ""]
        md += machine_lines() + [""] + new_sections_md(results)
        with open(os.path.join(out_dir, "results_hf_new.md"), "w") as f:
            f.write("\n".join(md))
        print("\n".join(md))
        return 0 if all(c["validate"]["ok"] for c in results["conv"]) else 1

    set_threads(2)
    results["validate"] = {}
    for name, spec in MODELS.items():
        v = validate(spec, 16 if args.quick else 128)
        results["validate"][name] = v
        log(f"validate {name}: {v}")
    valid = {name for name, v in results["validate"].items() if v["ok"]}

    results["train"] = []
    if args.skip_train:
        with open(args.skip_train) as f:
            earlier = json.load(f)
        results["train"] = earlier["train"]
        results["train_from"] = f"{earlier['started']} to {earlier['finished']}"
    for name in (n for n in MODELS if n in valid and not args.skip_train):
        for n_t in lengths:
            for threads in (1, 2):
                slow = name == "Mamba-1"
                if args.quick:
                    rs, rp = 2, 3
                elif slow:
                    rs = {256: 2, 512: 2, 1024: 1}[n_t] if threads == 2 else {256: 1, 512: 1, 1024: 0}[n_t]
                    rp = 5
                else:
                    rs, rp = 5, 5
                times = time_train_cell(MODELS[name], n_t, threads, rs, rp, warm_stock=not slow or args.quick)
                c = dict(model=name, n_t=n_t, threads=threads, stock=times[False], patched=times[True])
                if not rs:
                    c["note"] = "not timed (one run takes minutes; see 2 threads)"
                results["train"].append(c)
                log(f"train {name} L={n_t} threads={threads}: stock {[round(t, 3) for t in times[False]]} "
                    f"patched {[round(t, 3) for t in times[True]]}")

    results["generate"] = []
    for name in (n for n in MODELS if n in valid):
        for threads in (1, 2):
            reps = args.gen_reps or (2 if args.quick else 3)
            times, same = time_generate(MODELS[name], threads, reps, n_prompt, n_new)
            results["generate"].append(dict(model=name, threads=threads, stock=times[False], patched=times[True],
                                            same=same))
            log(f"generate {name} threads={threads}: stock {times[False]} patched {times[True]} same={same}")

    n_t = 64 if args.quick else 512
    results["kernel_share"] = dict(kernel_share(MODELS["Mamba-2"], n_t, 2, 3 if args.quick else 5), n_t=n_t,
                                   threads=2)
    log(f"kernel share: {results['kernel_share']['share']:.3f}")
    results["generate_share"] = {}
    for name in MODELS:
        gs = generate_share(MODELS[name], 2, n_prompt, n_new)
        results["generate_share"][name] = dict(gs, threads=2)
        log(f"generate share {name}: {gs}")
    run_new_sections(results, conv_specs, args.quick, n_prompt, n_new, log)

    results["load"].append(os.getloadavg()[0])
    results["finished"] = datetime.datetime.utcnow().strftime("%Y-%m-%d %H:%M")
    results["targets"] = targets(results)
    write_report(results, out_dir, sys.argv[1:], args.quick)
    for line in results["targets"]:
        print(line)
    print(f"wrote {os.path.join(out_dir, 'results_hf.md')}")
    return 0 if all(v["ok"] for v in results["validate"].values()) and all(
        c["validate"]["ok"] for c in results["conv"]) else 1


if __name__ == "__main__":
    sys.exit(main())
