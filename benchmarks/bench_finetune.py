"""Fine-tuning at real size: llama.cpp's llama-finetune beside transformers (stock, and with
ssmgrad.transformers.patch()) on random 130m-shaped models, f32, one window of 256 tokens per step.

Models (random weights, transformers' init, saved with save_pretrained and converted by ggml/convert.py):
  - mamba2:     Mamba-2-130m's shape (d_model 768, 24 layers, 24 heads x 64, d_state 128, 1 group,
                vocab 50288, tied embeddings);
  - mamba1:     Mamba-130m's shape (d_model 768, 24 layers, d_inner 1536, d_state 16, dt_rank 48,
                vocab 50280, tied embeddings);
  - nemotron_h: a Nemotron-H hybrid of about that size (d_model 768, 24 layers: 10 Mamba-2 mixers as
                mamba2's, 2 attention layers (12 query heads, 4 KV heads of 64), 12 relu^2 MLPs of 1536,
                vocab 50288, untied).

Each step is one AdamW step on one window of 256 tokens (forward, cross-entropy, backward, optimizer),
what llama-finetune does with -c = -b = -ub 256 (ggml/finetune_check.py's docstring has the details; the
text, its windows and the torch run's form of the parameters are those of ggml/finetune_check.py and
ggml/finetune_hybrid.py: A is trained as the GGUF stores it, A = -exp(A_log)).

What is measured, per model and thread count, every peer in a child process of its own:
  - the step time: the median of the steps after the first (warm-up). llama-finetune's steps are timed
    by the arrival of its progress lines on stderr (one per step, written unbuffered when the step ends);
    torch's by perf_counter around each step;
  - the peak memory: the child's RSS high-water mark (ru_maxrss from wait4), start-up included;
  - validation before timing counts: the first VALIDATE steps' losses of every peer against stock
    transformers' (llama-finetune prints 5 decimals; the first loss is the forward of the same weights,
    the second follows one AdamW step).
llama-finetune runs from one or more builds (--llama NAME=BUILD_DIR, e.g. the build options of
ggml/build.sh: SSMGRAD_GGML_NATIVE=1, SSMGRAD_GGML_LLAMAFILE=1), so that they are compared in one run.

--profile NAME: `perf record` (cpu-clock samples, start-up skipped) of that build's llama-finetune at
each thread count, the samples grouped by the op their function computes: the matrix products of the
forward (MUL_MAT: every weight's product, and attention's), those of the backward (ggml builds both
gradients of a MUL_MAT as OUT_PROD), the SSM ops forward and backward (SSM_CONV, SSM_SCAN, ssmgrad's
kernels), the optimizer (OPT_STEP_ADAMW), the thread pool's waiting (ggml_barrier and its spin), and the
rest (element-wise ops, norms, the loss, copies, the kernel).

    python benchmarks/bench_finetune.py --llama default=build/ggml --llama native=build/ggml-native \\
        --profile default --out benchmarks/results_finetune.md
    python benchmarks/bench_finetune.py --quick       # 3 steps, mamba2 only, 2 threads
"""

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
for p in (str(ROOT), str(ROOT / "ggml")):
    if p not in sys.path:
        sys.path.insert(0, p)

N_CTX = 256
LR, WD = 1e-3, 0.01
BETAS, EPS = (0.9, 0.999), 1e-8
VALIDATE = 2
# the first two losses of each peer against stock transformers, relative. The printed llama loss has
# 5 decimals (5e-6 absolute, 5e-7 relative at losses near 10.8).
VALIDATE_TOL = 1e-4

_M2 = dict(num_heads=24, head_dim=64, state_size=128, n_groups=1, expand=2, conv_kernel=4, chunk_size=256)
MODELS = {
    "mamba2": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=50288, hidden_size=768, num_hidden_layers=24, tie_word_embeddings=True, **_M2)),
    "mamba1": ("MambaConfig", "MambaForCausalLM", dict(
        vocab_size=50280, hidden_size=768, num_hidden_layers=24, state_size=16, expand=2, conv_kernel=4,
        time_step_rank=48, tie_word_embeddings=True)),
    "nemotron_h": ("NemotronHConfig", "NemotronHForCausalLM", dict(
        vocab_size=50288, hidden_size=768, num_hidden_layers=24,
        layers_block_type=(["mamba", "mlp"] * 5 + ["attention", "mlp"]) * 2,
        num_attention_heads=12, num_key_value_heads=4, head_dim=64, intermediate_size=1536,
        ssm_state_size=128, mamba_num_heads=24, mamba_head_dim=64, n_groups=1, chunk_size=256, expand=2,
        conv_kernel=4, tie_word_embeddings=False)),
}


def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------ preparation

def make_model(name, seed=0):
    import torch
    import transformers
    cfg_name, model_name, kw = MODELS[name]
    torch.manual_seed(seed)
    return getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kw)).float()


def prepare(name, workdir, steps, bin_dir):
    """The checkpoint, its f32 GGUF, a text making exactly `steps` windows of N_CTX and its tokens."""
    import convert                  # ggml/convert.py
    import finetune_check as fc     # ggml/finetune_check.py
    workdir = Path(workdir)
    hf_dir, gguf = workdir / name, workdir / f"{name}.gguf"
    if not (hf_dir / "config.json").is_file():
        model = make_model(name)
        n_params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(hf_dir)
        del model
        (hf_dir / "n_params.txt").write_text(str(n_params))
    if not gguf.is_file():
        log(f"{name}: converting to {gguf}")
        convert.convert(hf_dir, gguf)
    n_params = int((hf_dir / "n_params.txt").read_text())
    text = workdir / f"text-{steps}.txt"
    tokens_file = workdir / f"tokens-{steps}.json"
    if not tokens_file.is_file():
        # windows = (n_tokens - N_CTX - 1) // (N_CTX // 2): grow the text until there are exactly `steps`
        target = N_CTX + 1 + (N_CTX // 2) * steps + N_CTX // 4       # mid-range for `steps` windows
        n_words = target // 3
        for _ in range(20):
            text.write_bytes(fc.make_text(n_words).encode())
            tokens = fc.tokenize(gguf, text, bin_dir)
            nd = (len(tokens) - N_CTX - 1) // (N_CTX // 2)
            if nd == steps:
                break
            scaled = round(n_words * target / len(tokens))
            n_words = max(n_words + 1, scaled) if nd < steps else min(n_words - 1, scaled)
        else:
            raise RuntimeError(f"no text of {steps} windows found (last: {len(tokens)} tokens, {nd} windows)")
        tokens_file.write_text(json.dumps(tokens))
    return dict(name=name, hf_dir=hf_dir, gguf=gguf, text=text, tokens=json.loads(tokens_file.read_text()),
                n_params=n_params, workdir=workdir)


# ------------------------------------------------------------------------------------------ children

def wait_rss(proc):
    """Waits for proc; returns (returncode, peak RSS in bytes) from wait4's rusage (ru_maxrss, KiB)."""
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, ru.ru_maxrss * 1024


PROGRESS = re.compile(r"\] data=(\d+)/(\d+) loss=([-+0-9.naif]+)")


def run_llama(p, bin_dir, threads, perf_data=None, perf_delay_ms=0):
    """llama-finetune, 1 epoch over p's windows: per-step losses and times, peak RSS, the command."""
    import finetune_check as fc
    for _ in range(90):             # a build named on the command line may still be being made
        if (Path(bin_dir) / "llama-finetune").is_file():
            break
        time.sleep(10)
    out = p["workdir"] / f"{p['name']}-tuned.gguf"
    cmd = [str(Path(bin_dir) / "llama-finetune"), "-m", str(p["gguf"]), "-f", str(p["text"]), "-o", str(out),
           "-c", str(N_CTX), "-b", str(N_CTX), "-ub", str(N_CTX), "-epochs", "1", "-opt", "adamw",
           "-lr", repr(LR), "-wd", repr(WD), "-val-split", "0", "-t", str(threads)]
    run = cmd
    if perf_data:
        run = ["perf", "record", "-q", "-F", "499", "-D", str(perf_delay_ms), "-o", str(perf_data), "--"] + cmd
    proc = subprocess.Popen(run, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, bufsize=0)
    buf, stamps, cpus, seen = b"", [], [], set()
    t0 = time.perf_counter()
    while True:
        chunk = os.read(proc.stderr.fileno(), 65536)
        now = time.perf_counter()
        if not chunk:
            break
        buf += chunk
        # a progress line is complete when its "loss=" value is followed by more text
        for m in PROGRESS.finditer(buf.decode("utf-8", "replace")):
            k = int(m.group(1))
            if k not in seen and m.end() < len(buf.decode("utf-8", "replace")):
                seen.add(k)
                stamps.append(now)
                cpus.append(_cpu_seconds(proc.pid))
    rc, rss = wait_rss(proc)
    stderr = buf.decode("utf-8", "replace")
    if rc != 0:
        raise RuntimeError(f"llama-finetune failed ({rc}): {' '.join(cmd)}\n{stderr[-3000:]}")
    losses = fc.parse_progress(stderr)[0]
    if len(stamps) != len(losses):
        raise RuntimeError(f"llama-finetune: {len(stamps)} progress lines timed, {len(losses)} losses parsed")
    # the first "step" includes start-up (loading, building the graphs): warm-up, not in the median
    times = [stamps[0] - t0] + [float(x) for x in np.diff(stamps)]
    cpu = [cpus[0]] + [float(x) for x in np.diff(cpus)]
    return dict(losses=losses, times=times, cpu=cpu, first_step_total=stamps[0] - t0, rss=rss, cmd=cmd,
                wall=time.perf_counter() - t0)


def _cpu_seconds(pid):
    """User + system CPU seconds of a running process, all its threads (/proc/PID/stat), or nan."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def run_torch_child(p, threads, patch, steps):
    """This script as a child (--child torch): the torch peer's losses, step times and peak RSS."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "torch", "--child-model", p["name"],
           "--child-workdir", str(p["workdir"]), "--child-steps", str(steps), "--child-threads", str(threads),
           "--child-patch", str(int(patch))]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    out, err = proc.stdout.read(), proc.stderr.read()
    rc, rss = wait_rss(proc)
    if rc != 0:
        raise RuntimeError(f"torch child failed ({rc}): {' '.join(cmd)}\n{err.decode()[-3000:]}")
    d = json.loads(out.decode().strip().splitlines()[-1])
    d["rss"] = rss
    return d


def torch_child(name, workdir, steps, threads, patch):
    """The torch peer: the saved checkpoint, trained in the GGUF's form with torch.optim.AdamW, one step
    per window; prints {losses, times, calls} as JSON."""
    import torch
    import torch.nn.functional as F
    import transformers
    import finetune_check as fc
    import finetune_hybrid as fh
    torch.set_num_threads(threads)
    p = dict(name=name, workdir=Path(workdir))
    tokens = json.loads((p["workdir"] / f"tokens-{steps}.json").read_text())
    inputs, labels = fc.windows(tokens, N_CTX)
    model = transformers.AutoModelForCausalLM.from_pretrained(p["workdir"] / name, dtype=torch.float32)
    fh.train_gguf_form(model)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    calls = {}
    if patch:
        import ssmgrad.transformers as st
        st.patch([model.config.model_type])
    losses, times, cpu = [], [], []
    for x, y in zip(inputs, labels):
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=x[None], use_cache=False).logits[0]
        loss = F.cross_entropy(logits.float(), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        losses.append(loss.item())
    if patch:
        calls = dict(st.call_counts)
        if st.fallback_counts:
            raise RuntimeError(f"ssmgrad.transformers fell back to stock: {dict(st.fallback_counts)}")
    print(json.dumps(dict(losses=losses, times=times, cpu=cpu, calls=calls, threads=torch.get_num_threads())))


# ------------------------------------------------------------------------------------------ profile

# function name (perf's symbol) -> group; first match wins
GROUPS = [
    ("matmul backward (OUT_PROD)", re.compile(r"out_prod|vec_mad")),
    ("matmul forward (MUL_MAT)", re.compile(r"mul_mat|vec_dot_f32|sgemm|tinyBLAS|gemm|gemv|vec_dot")),
    ("SSM ops fwd+bwd (SSM_CONV, SSM_SCAN, ssmgrad)", re.compile(r"ssm|scan|conv_back|ssmgrad|chunk")),
    ("optimizer (OPT_STEP_ADAMW)", re.compile(r"adamw|opt_step")),
    ("thread pool wait (ggml_barrier)", re.compile(r"barrier|sched_yield|graph_compute_thread|thread_sync")),
]


def perf_groups(perf_data):
    """perf report's per-symbol self time, summed per GROUPS (the rest: 'other'); also the top symbols."""
    rep = subprocess.run(["perf", "report", "-i", str(perf_data), "--stdio", "--no-children", "--sort", "symbol",
                          "--percent-limit", "0"], capture_output=True, text=True)
    if rep.returncode != 0:
        raise RuntimeError(f"perf report failed: {rep.stderr[-2000:]}")
    shares, top = {}, []
    for line in rep.stdout.splitlines():
        m = re.match(r"\s*([0-9.]+)%\s+\[[.k]\]\s+(.+?)\s*$", line)
        if not m:
            continue
        pct, sym = float(m.group(1)), re.sub(r"(\s+-)+$", "", m.group(2))
        group = next((g for g, rx in GROUPS if rx.search(sym)), "other (element-wise, norms, loss, copies, kernel)")
        shares[group] = shares.get(group, 0.0) + pct
        top.append((pct, sym, group))
    top.sort(reverse=True)
    return shares, top[:15]


# ------------------------------------------------------------------------------------------ report

def machine():
    from common import lscpu
    info = lscpu()
    flags = info.get("Flags", "").split()
    simd = " ".join(f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_bf16") if f in flags)
    mem = ""
    try:
        kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, AttributeError):
        pass
    import torch
    import transformers
    return (f"{info.get('Model name', platform.processor())}, {info.get('CPU(s)', os.cpu_count())} CPUs, "
            f"SIMD {simd}, L2 {info.get('L2 cache', '?')}, L3 {info.get('L3 cache', '?')}{mem}; "
            f"Python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}")


def fmt_s(x):
    return f"{x:.2f} s" if x == x else "n/a"


def write_report(args, argv, started, load0, steps, builds, rows, profiles, problems):
    """The markdown of everything measured so far; written to --out (after every model, so that a run cut
short keeps what it measured)."""
    load1 = os.getloadavg()

    md = [f"# Fine-tuning at real size: llama-finetune beside transformers", "",
          f"Written by `python benchmarks/bench_finetune.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
          f"({started}).", "",
          f"- machine: {machine()}",
          f"- load average (1, 5, 15 min) at the start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, at the end "
          f"{load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} (the machine is shared; the column `load` is the 1-min "
          f"average when each peer finished)",
          f"- each step: one AdamW step on one window of {N_CTX} tokens, f32; the time is the median of steps "
          f"2..{steps} ({steps - 1} steps, the first is warm-up), wall-clock and CPU time (user + system, every "
          f"thread of the peer's process: on a loaded machine the wall time of a step includes the time other "
          f"processes had the cores, its CPU time does not, but a waiting thread that spins counts); peak RSS of "
          f"the peer's process (start-up included)",
          f"- llama builds: " + ", ".join(f"`{n}` = {b.parent}" for n, b in builds), ""]
    md += ["| model | params | threads | peer | wall s/step (median) | wall steps (s) | wall / torch + ssmgrad "
           "| CPU s/step (median) | CPU / torch + ssmgrad | peak RSS | "
           f"first {VALIDATE} losses | rel. vs stock | load |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        base = row["res"].get("torch + ssmgrad", {})
        for peer, r in row["res"].items():
            md.append(f"| {row['model']} | {row['n_params'] / 1e6:.1f}M | {row['threads']} | {peer} | "
                      f"{fmt_s(r['median'])} | {' '.join(f'{x:.2f}' for x in r['times'])} | "
                      f"{r['median'] / base.get('median', float('nan')):.2f}x | {fmt_s(r['cpu_median'])} | "
                      f"{r['cpu_median'] / base.get('cpu_median', float('nan')):.2f}x | {r['rss'] / 2**30:.2f} GiB | "
                      f"{' '.join(f'{x:.5f}' for x in r['losses'][:VALIDATE])} | {r.get('val_rel', float('nan')):.1e} | "
                      f"{r['load']:.1f} |")
    md += ["", "llama-finetune's command (per build and thread count): `" + " ".join(
        Path(c).name if i == 0 else c for i, c in enumerate(rows[-1]["res"][f"llama ({builds[0][0]})"]["cmd"]))
        + "` (paths shortened)", ""]
    for pr in profiles:
        md += [f"## Where llama-finetune's step goes: {pr['model']}, {pr['threads']} thread(s), build `{pr['build']}`", "",
               f"`perf record -F 499` (cpu-clock), the first {pr['skipped']:.1f} s (start-up and the first step) "
               f"skipped; step median in that run {pr['median']:.2f} s. Self time per function, grouped:", "",
               "| group | share of samples |", "|---|---|"]
        for g, s in sorted(pr["shares"].items(), key=lambda kv: -kv[1]):
            md.append(f"| {g} | {s:.1f}% |")
        md += ["", "Top functions:", "", "| share | function | group |", "|---|---|---|"]
        for pct, sym, g in pr["top"]:
            md.append(f"| {pct:.1f}% | `{sym[:90]}` | {g} |")
        md.append("")
    if problems:
        md += ["## Validation failures", ""] + [f"- {x}" for x in problems] + [""]
    text = "\n".join(md)
    if args.out:
        args.out.write_text(text)
        log(f"wrote {args.out}")
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", choices=sorted(MODELS), help="default: mamba2, mamba1, nemotron_h")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--steps", type=int, default=5, help="windows = steps per peer, the first is warm-up (default 5)")
    ap.add_argument("--llama", action="append", metavar="NAME=BUILD_DIR",
                    help="a ggml/build.sh build directory to run llama-finetune from (repeatable; default "
                         "default=build/ggml)")
    ap.add_argument("--profile", metavar="NAME", action="append",
                    help="perf-record that --llama build's step (a separate run; repeatable)")
    ap.add_argument("--profile-model", action="append", help="models to profile (default: every one)")
    ap.add_argument("--profile-threads", default="1", help="thread counts to profile at (default 1)")
    ap.add_argument("--no-torch", action="store_true", help="llama builds only")
    ap.add_argument("--workdir", type=Path, help="keep checkpoints, GGUFs and texts here (reused when present)")
    ap.add_argument("--out", type=Path, help="write the markdown results here")
    ap.add_argument("--quick", action="store_true", help="mamba2, 2 threads, 3 steps")
    ap.add_argument("--child", choices=["torch"], help=argparse.SUPPRESS)
    ap.add_argument("--child-model", help=argparse.SUPPRESS)
    ap.add_argument("--child-workdir", help=argparse.SUPPRESS)
    ap.add_argument("--child-steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-patch", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        torch_child(args.child_model, args.child_workdir, args.child_steps, args.child_threads, bool(args.child_patch))
        return 0

    models = args.model or ["mamba2", "mamba1", "nemotron_h"]
    threads = [int(t) for t in args.threads.split(",")]
    steps = args.steps
    if args.quick:
        models, threads, steps = (args.model or ["mamba2"]), [2], 3
    builds = []
    for spec in args.llama or [f"default={ROOT / 'build' / 'ggml'}"]:
        name, _, d = spec.partition("=")
        bin_dir = (Path(d) if Path(d).is_absolute() else ROOT / d) / "bin"
        if not (bin_dir / "llama-finetune").is_file():
            log(f"--llama {spec}: {bin_dir / 'llama-finetune'} not found yet (bash ggml/build.sh)")
        builds.append((name, bin_dir))
    for name in args.profile or []:
        if name not in dict(builds):
            ap.error(f"--profile {name}: not one of the --llama names {[b[0] for b in builds]}")
    if steps < 2:
        ap.error("--steps: at least 2 (the first is warm-up)")

    tmp = tempfile.TemporaryDirectory()
    workdir = args.workdir or Path(tmp.name)
    workdir.mkdir(parents=True, exist_ok=True)
    load0 = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    rows, profiles, problems = [], [], []
    for name in models:
        p = prepare(name, workdir / name, steps, builds[0][1])
        log(f"{name}: {p['n_params'] / 1e6:.1f}M parameters, {len(p['tokens'])} tokens, {steps} windows")
        for t in threads:
            res = {}
            if not args.no_torch:
                for peer, patch in (("torch stock", False), ("torch + ssmgrad", True)):
                    log(f"{name} {t}t: {peer}")
                    res[peer] = run_torch_child(p, t, patch, steps)
                    res[peer]["load"] = os.getloadavg()[0]
            for bname, bin_dir in builds:
                log(f"{name} {t}t: llama-finetune ({bname})")
                res[f"llama ({bname})"] = run_llama(p, bin_dir, t)
                res[f"llama ({bname})"]["load"] = os.getloadavg()[0]
            ref = res.get("torch stock")
            for peer, r in res.items():
                r["median"] = statistics.median(r["times"][1:])
                r["cpu_median"] = statistics.median(r["cpu"][1:])
                if ref is not None:
                    a = np.asarray(r["losses"][:VALIDATE], dtype=np.float64)
                    b = np.asarray(ref["losses"][:VALIDATE], dtype=np.float64)
                    r["val_rel"] = float(np.max(np.abs(a - b) / np.abs(b)))
                    if not r["val_rel"] <= VALIDATE_TOL:
                        problems.append(f"{name} {t}t {peer}: first {VALIDATE} losses {a.tolist()} vs stock "
                                        f"{b.tolist()} (rel. {r['val_rel']:.1e} > {VALIDATE_TOL:.0e})")
            rows.append(dict(model=name, threads=t, res=res, n_params=p["n_params"]))
            for peer, r in res.items():
                log(f"  {peer}: median {r['median']:.3f} s/step (CPU {r['cpu_median']:.3f} s), "
                    f"times {[round(x, 2) for x in r['times']]}, "
                    f"peak RSS {r['rss'] / 2**30:.2f} GiB, losses {[round(x, 5) for x in r['losses'][:3]]}")
            for prof in args.profile or []:
                if str(t) not in args.profile_threads.split(",") or (args.profile_model and name not in args.profile_model):
                    continue
                perf_data = workdir / f"perf-{name}-{t}-{prof}.data"
                bin_dir = dict(builds)[prof]
                # skip start-up (loading, graph building) and the first step: its end, measured above
                first = res[f"llama ({prof})"]["first_step_total"]
                log(f"{name} {t}t: perf record of llama-finetune ({prof}), the first {first:.1f} s skipped")
                pr = run_llama(p, bin_dir, t, perf_data=perf_data, perf_delay_ms=int(first * 1000))
                shares, top = perf_groups(perf_data)
                profiles.append(dict(model=name, threads=t, build=prof, shares=shares, top=top,
                                     median=statistics.median(pr["times"][1:]), skipped=first))
            write_report(args, argv, started, load0, steps, builds, rows, profiles, problems)
    text = write_report(args, argv, started, load0, steps, builds, rows, profiles, problems)
    print(text)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
