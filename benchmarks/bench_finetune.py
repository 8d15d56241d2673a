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

--lora: LoRA fine-tuning at real size instead (LORA_MODELS: random models of Falcon-H1-1.5B's and Mamba-2-2.7B's
shapes). The checkpoint's weights are rounded to F16 values; ggml/convert.py writes the F16 (and F32) GGUF,
llama-quantize the Q8_0 / Q4_0 ones (--base); PEFT makes a rank-16 adapter (A Kaiming-uniform, B zero) on the
targets PEFT allows, ggml/lora_peft.py to-gguf writes it, and every peer trains that adapter one AdamW step per
window of each --ctx: `llama-finetune --lora-init` on each base (and each --llama build), PEFT on transformers
stock and + ssmgrad (--torch-peers), plus `llama-finetune --lora-rank 16` on its default targets
(--default-targets BASE). Peak RSS, step times and the first losses against stock's (LORA_VALIDATE_TOL) as above;
a memory guard kills a child past --mem-limit GiB of RSS (or when the machine runs low), and the table says
where it was killed. Models, GGUFs and texts stay in --workdir for the next run.

    python benchmarks/bench_finetune.py --lora --workdir /tmp/lbench --threads 2 --steps 3 \\
        --llama native=build/ggml-native-llamafile --out benchmarks/results_finetune_lora.md
    python benchmarks/bench_finetune.py --lora --quick    # a tiny Mamba-2, 1 thread, 2 steps

--isa avx2 caps the torch peers (and ssmgrad's kernels in them) to AVX2 (benchmarks/common.py, apply_isa), so
that on an AVX-512 host the default llama build (GGML_NATIVE=OFF: AVX2 + FMA + F16C) meets torch at its own
width; a build with GGML_NATIVE=ON is refused under the cap. The native build meets torch uncapped.
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
from common import ISA_CAPS, add_isa_flag, apply_isa, check_isa  # noqa: E402  (benchmarks/common.py: numpy only, torch not yet)

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

def _native_build(build_dir):
    """Whether the llama build in BUILD_DIR was configured with GGML_NATIVE=ON (its CMakeCache says)."""
    try:
        return re.search(r"^GGML_NATIVE:BOOL=(ON|TRUE|1)$", (build_dir / "CMakeCache.txt").read_text(), re.M) is not None
    except OSError:
        return False


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
    return finish_report(md, problems, args.out)


# ------------------------------------------------------------------------------------------ LoRA at real size

# --lora: LoRA fine-tuning of random models of published checkpoints' shapes, on a frozen F16 / Q8_0 (/ Q4_0)
# base. name -> (config class, model class, config kwargs, PEFT targets, what the shape is and which target)
LORA_RANK = 16
LORA_ALPHA = 16.0          # llama-finetune's default alpha is the rank: a scale of 1
LORA_MODELS = {
    # Falcon-H1-1.5B (transformers' FalconH1Config docs table: 24 layers, d_model 2048, 8 attention heads of 128,
    # 2 KV heads, 48 Mamba heads of 64, d_state 256; intermediate 4608 and mamba_d_ssm 3072 as in the published
    # config.json), untied; the vocab cut to 50432 (the published one has 65537): a random checkpoint gets the
    # bundled GPT-NeoX vocab, and llama.cpp refuses an embedding with more rows than the converted vocab
    "falcon_h1_1.5b": ("FalconH1Config", "FalconH1ForCausalLM", dict(
        vocab_size=50432, hidden_size=2048, intermediate_size=4608, num_hidden_layers=24, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, mamba_d_ssm=3072, mamba_n_heads=48, mamba_d_head=64, mamba_n_groups=1,
        mamba_d_state=256, mamba_d_conv=4, mamba_chunk_size=256, tie_word_embeddings=False),
        ["in_proj", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        "Falcon-H1-1.5B's shape: the ~1.5B model of the 8 GB target"),
    # Mamba-2-2.7B (state-spaces/mamba2-2.7b: d_model 2560, 64 layers, d_state 128, headdim 64, expand 2 -> 80
    # heads, 1 group, vocab 50288 (50277 padded to 16), tied embeddings)
    "mamba2_2.7b": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=50288, hidden_size=2560, num_hidden_layers=64, num_heads=80, head_dim=64, state_size=128,
        n_groups=1, expand=2, conv_kernel=4, chunk_size=256, tie_word_embeddings=True),
        ["in_proj"], "Mamba-2-2.7B's shape: the ~3B model of the 16 GB target"),
    # --quick: a tiny Mamba-2 (the code path, in seconds)
    "quick": ("Mamba2Config", "Mamba2ForCausalLM", dict(
        vocab_size=50288, hidden_size=256, num_hidden_layers=2, num_heads=8, head_dim=64, state_size=32,
        n_groups=1, expand=2, conv_kernel=4, chunk_size=256, tie_word_embeddings=True),
        ["in_proj"], "a tiny Mamba-2 (--quick)"),
}
# the first VALIDATE losses of each llama base against PEFT on stock transformers (relative). The torch peers
# run the checkpoint, whose weights are rounded to F16 values, so that the F16 GGUF holds them exactly (ggml's F16
# product rounds only its input to F16, through 64 layers for Mamba-2-2.7B's shape): measured 1.4e-5 (Falcon-H1-1.5B's
# shape, 256 tokens), 1.5e-4 (Mamba-2-2.7B's: 23.08116 against 23.08469), 4.6e-6 (--quick); held at about 3x.
# A Q8_0 / Q4_0 base holds other weights, and its product rounds the input to 8 bits, so its losses are another
# model's: measured 9.7e-4 (Falcon-H1) and 7.8e-3 (Mamba-2-2.7B's shape, first loss 22.90169 against F16's
# 23.08116), 2.4e-4 (--quick); its bound catches a broken run, not a rounding (the quantized path is checked
# against the dequantized weights by tests/ggml/test_llama_finetune_lora_quant.py)
LORA_VALIDATE_TOL = {"f32": 1e-4, "f16": 5e-4, "q8_0": 2e-2, "q4_0": 5e-2}


def make_lora_model(name, seed=0):
    import torch
    import transformers
    cfg_name, model_name, kw, _, _ = LORA_MODELS[name]
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**kw)).float()
    with torch.no_grad():
        for w in model.parameters():        # F16 values: the F16 GGUF is the checkpoint exactly
            w.copy_(w.half().float())
    return model


def lora_windows_text(p, n_ctx, steps, bin_dir):
    """A text of exactly `steps` windows of n_ctx (stride n_ctx / 2) for p's model, and its tokens."""
    import finetune_check as fc
    workdir = p["workdir"]
    text, tokens_file = workdir / f"text-{n_ctx}-{steps}.txt", workdir / f"tokens-{n_ctx}-{steps}.json"
    if not tokens_file.is_file():
        target = n_ctx + 1 + (n_ctx // 2) * steps + n_ctx // 4
        n_words = target // 3
        for _ in range(20):
            text.write_bytes(fc.make_text(n_words).encode())
            tokens = fc.tokenize(p["gguf"]["f16"], text, bin_dir)
            nd = (len(tokens) - n_ctx - 1) // (n_ctx // 2)
            if nd == steps:
                break
            scaled = round(n_words * target / len(tokens))
            n_words = max(n_words + 1, scaled) if nd < steps else min(n_words - 1, scaled)
        else:
            raise RuntimeError(f"no text of {steps} windows of {n_ctx} found")
        tokens_file.write_text(json.dumps(tokens))
    return text, tokens_file


def prepare_lora(name, workdir, bases, bin_dir):
    """The checkpoint (F16 values in float32), its F16 GGUF (ggml/convert.py), the other bases from it
    (llama-quantize), the PEFT adapter (rank LORA_RANK, PEFT's init: A Kaiming-uniform, B zero) and that
    adapter as a GGUF for llama-finetune --lora-init (ggml/lora_peft.py to-gguf). Everything is reused."""
    import convert
    import lora_peft
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    hf_dir, peft_dir, init = workdir / "hf", workdir / "peft", workdir / "init.gguf"
    if not (hf_dir / "n_params.txt").is_file() or not (peft_dir / "adapter_config.json").is_file():
        import torch
        import peft
        log(f"{name}: making the random checkpoint")
        model = make_lora_model(name)
        n_params = sum(w.numel() for w in model.parameters())
        model.save_pretrained(hf_dir)
        (hf_dir / "n_params.txt").write_text(str(n_params))
        torch.manual_seed(1)
        cfg = peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules=LORA_MODELS[name][3],
                              lora_dropout=0.0)
        peft.get_peft_model(model, cfg).save_pretrained(peft_dir)
        del model
    gguf = {"f16": workdir / "model-f16.gguf"}
    if not gguf["f16"].is_file():
        log(f"{name}: converting to {gguf['f16']}")
        convert.convert(hf_dir, gguf["f16"], "f16")
    for q in bases:
        if q == "f16":
            continue
        gguf[q] = workdir / f"model-{q}.gguf"
        if q == "f32" and not gguf[q].is_file():
            log(f"{name}: converting to {gguf[q]}")
            convert.convert(hf_dir, gguf[q], "f32")
        elif not gguf[q].is_file():
            log(f"{name}: llama-quantize {q}")
            proc = subprocess.run([str(Path(bin_dir) / "llama-quantize"), str(gguf["f16"]), str(gguf[q]), q.upper(),
                                   "2"], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"llama-quantize {q} failed:\n{proc.stderr[-3000:]}")
    if not init.is_file():
        lora_peft.to_gguf(peft_dir, hf_dir, init)
    return dict(name=name, hf_dir=hf_dir, peft_dir=peft_dir, init=init, gguf=gguf, workdir=workdir,
                n_params=int((hf_dir / "n_params.txt").read_text()))


class MemoryGuard:
    """Kills a child whose RSS passes `limit` bytes, or when the machine's MemAvailable falls under `floor`
    (polled every 0.2 s from /proc): a child must never push the shared machine into the OOM killer."""

    def __init__(self, pid, limit, floor=1 << 30):
        import threading
        self.pid, self.limit, self.floor = pid, limit, floor
        self.killed, self.rss_seen = None, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.wait(0.2):
            try:
                status = Path(f"/proc/{self.pid}/status").read_text()
                rss = int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) * 1024
                avail = int(re.search(r"MemAvailable:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) * 1024
            except (OSError, AttributeError):
                return
            self.rss_seen = max(self.rss_seen, rss)
            if rss > self.limit or avail < self.floor:
                self.killed = (f"killed at RSS {rss / 2**30:.2f} GiB ("
                               + (f"over the limit {self.limit / 2**30:.1f} GiB" if rss > self.limit else
                                  f"MemAvailable {avail / 2**30:.2f} GiB") + ")")
                try:
                    os.kill(self.pid, 9)
                except OSError:
                    pass
                return

    def stop(self):
        self._stop.set()
        self._thread.join()


def _limit_as(nbytes):
    """preexec_fn: the child's address space limited to nbytes (an allocation past it fails in the child)."""
    import resource

    def f():
        resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))
    return f


def run_llama_lora(p, bin_dir, threads, n_ctx, base, text, mem_limit, lora_args):
    """llama-finetune training a LoRA adapter for 1 epoch over the text's windows on p's BASE GGUF."""
    import finetune_check as fc
    out = p["workdir"] / f"trained-{base}-{n_ctx}.gguf"
    cmd = [str(Path(bin_dir) / "llama-finetune"), "-m", str(p["gguf"][base]), "-f", str(text),
           "-c", str(n_ctx), "-b", str(n_ctx), "-ub", str(n_ctx), "-epochs", "1", "-opt", "adamw",
           "-lr", repr(LR), "-wd", repr(WD), "-val-split", "0", "-t", str(threads), "-v", *lora_args,
           "--lora-out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, bufsize=0,
                            preexec_fn=_limit_as(mem_limit + (4 << 30)))
    guard = MemoryGuard(proc.pid, mem_limit)
    buf, stamps, cpus, seen = b"", [], [], set()
    t0 = time.perf_counter()
    while True:
        chunk = os.read(proc.stderr.fileno(), 65536)
        now = time.perf_counter()
        if not chunk:
            break
        buf += chunk
        text_so_far = buf.decode("utf-8", "replace")
        for m in PROGRESS.finditer(text_so_far):
            k = int(m.group(1))
            if k not in seen and m.end() < len(text_so_far):
                seen.add(k)
                stamps.append(now)
                cpus.append(_cpu_seconds(proc.pid))
    rc, rss = wait_rss(proc)
    guard.stop()
    stderr = buf.decode("utf-8", "replace")
    res = dict(cmd=cmd, rss=rss, wall=time.perf_counter() - t0, rc=rc, buffers=_llama_buffers(stderr))
    if rc != 0 or guard.killed:
        alloc = re.findall(r"failed to allocate .*? of size (\d+)", stderr)
        res["failed"] = guard.killed or (f"exit {rc}" + (f", failed to allocate {int(alloc[-1]) / 2**30:.2f} GiB"
                                                          if alloc else "") + ": " + stderr[-300:].strip())
        return res
    losses = fc.parse_progress(stderr)[0]
    if len(stamps) != len(losses):
        raise RuntimeError(f"llama-finetune: {len(stamps)} progress lines timed, {len(losses)} losses parsed")
    m = re.search(r"ggml-opt holds gradients for (\d+) tensors, (\d+) parameters", stderr)
    res.update(losses=losses, times=[stamps[0] - t0] + [float(x) for x in np.diff(stamps)],
               cpu=[cpus[0]] + [float(x) for x in np.diff(cpus)],
               opt_params=(int(m.group(1)), int(m.group(2))) if m else None)
    return res


def _llama_buffers(stderr):
    """The buffer sizes libllama logs (MiB): the model's, the compute graph's (the last reserve), the LoRA's."""
    out = {}
    for key, rx in (("model", r"CPU model buffer size =\s+([0-9.]+) MiB"),
                    ("compute", r"CPU compute buffer size =\s+([0-9.]+) MiB"),
                    ("lora", r"CPU LoRA buffer size =\s+([0-9.]+) MiB"),
                    ("opt", r"ggml-opt .*?buffer.*?([0-9.]+) MiB")):
        found = re.findall(rx, stderr)
        if found:
            out[key] = float(found[-1])
    return out


def run_torch_lora_child(p, threads, patch, n_ctx, steps, mem_limit):
    """This script as a child (--child torch-lora): PEFT on transformers, under the memory guard; its stderr
    (a line per step) passes through."""
    import threading
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "torch-lora", "--child-model", p["name"],
           "--child-workdir", str(p["workdir"]), "--child-steps", str(steps), "--child-threads", str(threads),
           "--child-patch", str(int(patch)), "--child-ctx", str(n_ctx)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    t0 = time.perf_counter()
    # no address-space limit here: loading the checkpoint maps its safetensors file (the model's size again)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, env=env)
    guard = MemoryGuard(proc.pid, mem_limit)
    out = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.read()), daemon=True)
    reader.start()
    rc, rss = wait_rss(proc)
    reader.join()
    guard.stop()
    lines = (out[0] if out else b"").decode().strip().splitlines()
    d = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    d.update(rss=rss, cmd=cmd, wall=time.perf_counter() - t0)
    if rc != 0 or guard.killed or "error" in d:
        d["failed"] = guard.killed or d.get("error") or f"exit {rc}"
    return d


def torch_lora_child(name, workdir, steps, threads, patch, n_ctx):
    """PEFT's adapter (prepare_lora) on the checkpoint in float32, torch.optim.AdamW on the adapter only, one step
    per window; prints {losses, times, cpu, rss_self} as JSON, or {error} when an allocation failed."""
    import resource
    import torch
    import torch.nn.functional as F
    import transformers
    import peft
    import finetune_check as fc
    torch.set_num_threads(threads)
    import ssmgrad
    # the cap this child runs under (apply_isa set its environment): that it took on both sides
    check_isa(next((k for k, env in ISA_CAPS.items() if all(os.environ.get(e) == v for e, v in env.items())), None),
              ssmgrad)
    workdir = Path(workdir)
    tokens = json.loads((workdir / f"tokens-{n_ctx}-{steps}.json").read_text())
    inputs, labels = fc.windows(tokens, n_ctx)
    losses, times, cpu = [], [], []

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(workdir / "hf", dtype=torch.float32)
        pm = peft.PeftModel.from_pretrained(model, workdir / "peft", is_trainable=True)
        params = [w for w in pm.parameters() if w.requires_grad]
        opt = torch.optim.AdamW(params, lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        if patch:
            import ssmgrad.transformers as st
            st.patch([model.config.model_type])
        pm.train()
        loaded = peak()
        for x, y in zip(inputs, labels):
            t0, c0 = time.perf_counter(), time.process_time()
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(pm(input_ids=x[None], use_cache=False).logits[0].float(), y)
            loss.backward()
            opt.step()
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
            losses.append(loss.item())
            log(f"  torch step {len(losses)}: loss {losses[-1]:.5f}, {times[-1]:.1f} s, "
                f"peak RSS {peak() / 2**30:.2f} GiB")
    except (RuntimeError, MemoryError) as e:
        print(json.dumps(dict(error=f"{type(e).__name__}: {str(e)[:300]}", losses=losses, times=times, cpu=cpu,
                              rss_self=peak())))
        return
    calls = {}
    if patch:
        calls = dict(st.call_counts)
        if st.fallback_counts:
            raise RuntimeError(f"ssmgrad.transformers fell back to stock: {dict(st.fallback_counts)}")
    print(json.dumps(dict(losses=losses, times=times, cpu=cpu, calls=calls, rss_self=peak(), rss_loaded=loaded,
                          n_trainable=sum(w.numel() for w in params), threads=torch.get_num_threads())))


def _file_gib(path):
    return Path(path).stat().st_size / 2**30


def lora_main(args, argv, builds, threads, steps):
    """--lora: every model, context, thread count: the torch peers, then llama-finetune on each base."""
    models = args.model or (["quick"] if args.quick else ["falcon_h1_1.5b", "mamba2_2.7b"])
    args.builds_desc = ", ".join(f"`{n}` = {b.parent}" for n, b in builds)
    ctxs = [int(c) for c in args.ctx.split(",")]
    bases = args.base.split(",")
    mem_limit = int(args.mem_limit * 2**30)
    bin_dir = builds[0][1]
    tmp = tempfile.TemporaryDirectory()
    workdir = args.workdir or Path(tmp.name)
    load0 = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    rows, problems, failed_at = [], [], {}
    for name in models:
        p = prepare_lora(name, workdir / name, bases, bin_dir)
        log(f"{name}: {p['n_params'] / 1e6:.1f}M parameters, bases "
            + ", ".join(f"{q} {_file_gib(g):.2f} GiB" for q, g in p["gguf"].items()))
        for n_ctx in ctxs:
            text, _ = lora_windows_text(p, n_ctx, steps, bin_dir)
            for t in threads:
                res = {}
                peers = [] if args.no_torch else [
                    (f"PEFT, torch {'+ ssmgrad' if k == 'ssmgrad' else k}", k == "ssmgrad")
                    for k in args.torch_peers.split(",")]
                for peer, patch in peers:
                    if (name, peer) in failed_at:
                        res[peer] = dict(failed=f"not run: failed at {failed_at[name, peer]} tokens", rss=0)
                        continue
                    log(f"{name} {n_ctx} tokens {t}t: {peer}")
                    res[peer] = run_torch_lora_child(p, t, patch, n_ctx, steps, mem_limit)
                    res[peer]["base"] = "f32 (F16 values)"
                    res[peer]["load"] = os.getloadavg()[0]
                llama_runs = []
                for bname, bdir in builds:
                    # the first build's peers are "llama-finetune BASE", the others' "llama-finetune BASE (NAME)"
                    tag = "" if bname == builds[0][0] else f" ({bname})"
                    llama_runs += [(f"llama-finetune {q}{tag}", q, ["--lora-init", str(p["init"])], bdir)
                                   for q in bases]
                    if n_ctx == ctxs[0] and args.default_targets:
                        q = args.default_targets
                        llama_runs.append((f"llama-finetune {q}, default targets{tag}", q,
                                           ["--lora-rank", str(LORA_RANK)], bdir))
                for peer, q, lora_args, bdir in llama_runs:
                    if (name, peer) in failed_at:
                        res[peer] = dict(failed=f"not run: failed at {failed_at[name, peer]} tokens", rss=0)
                        continue
                    log(f"{name} {n_ctx} tokens {t}t: {peer}")
                    res[peer] = run_llama_lora(p, bdir, t, n_ctx, q, text, mem_limit, lora_args)
                    res[peer]["base"] = q
                    res[peer]["load"] = os.getloadavg()[0]
                ref_name = next((k for k in ("PEFT, torch stock", "PEFT, torch + ssmgrad")
                                 if k in res and "failed" not in res[k]), None)
                for peer, r in res.items():
                    if "failed" in r:
                        failed_at.setdefault((name, peer), n_ctx)
                        log(f"  {peer}: FAILED ({r['failed'][:200]}), peak RSS {r['rss'] / 2**30:.2f} GiB")
                        continue
                    r["median"] = statistics.median(r["times"][1:])
                    r["cpu_median"] = statistics.median(r["cpu"][1:])
                    if ref_name is not None and peer != ref_name:
                        # the default targets' adapter has another A: only its first loss (B = 0: the base's) compares
                        k = 1 if "default targets" in peer else VALIDATE
                        a = np.asarray(r["losses"][:k], dtype=np.float64)
                        b = np.asarray(res[ref_name]["losses"][:k], dtype=np.float64)
                        r["val_rel"] = float(np.max(np.abs(a - b) / np.abs(b)))
                        r["val_ref"] = ref_name
                        tol = LORA_VALIDATE_TOL.get(r["base"], VALIDATE_TOL)
                        if not r["val_rel"] <= tol:
                            problems.append(f"{name} {n_ctx} tokens {t}t {peer}: first {k} losses {a.tolist()} vs "
                                            f"{ref_name} {b.tolist()} (rel. {r['val_rel']:.1e} > {tol:.0e})")
                    log(f"  {peer}: median {r['median']:.2f} s/step (CPU {r['cpu_median']:.2f} s), times "
                        f"{[round(x, 2) for x in r['times']]}, peak RSS {r['rss'] / 2**30:.2f} GiB, losses "
                        f"{[round(x, 5) for x in r['losses'][:3]]}")
                rows.append(dict(model=name, n_ctx=n_ctx, threads=t, res=res, n_params=p["n_params"],
                                 base_gib={q: _file_gib(g) for q, g in p["gguf"].items()}))
                write_lora_report(args, argv, started, load0, steps, rows, problems)
    text = write_lora_report(args, argv, started, load0, steps, rows, problems)
    print(text)
    return 1 if problems else 0


def _trained(r):
    """The adapter's parameter count a peer trained: ggml-opt's log, or PEFT's trainable parameters."""
    n = r["opt_params"][1] if r.get("opt_params") else r.get("n_trainable")
    return f"{n:,}" if n else "?"


def write_lora_report(args, argv, started, load0, steps, rows, problems):
    load1 = os.getloadavg()
    md = ["# LoRA fine-tuning at real size: llama-finetune on a frozen F16 / Q8_0 base beside PEFT + transformers", "",
          f"Written by `python benchmarks/bench_finetune.py {' '.join(argv if argv is not None else sys.argv[1:])}` "
          f"({started}).", "",
          f"- machine: {machine()}",
          f"{args.isa_line} (torch's peers; the llama builds keep theirs, below)",
          f"- load average (1, 5, 15 min) at the start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, at the end "
          f"{load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f} (`load`: the 1-min average when each peer finished)",
          f"- each step: one AdamW step (lr {LR}, wd {WD}) of a rank-{LORA_RANK} LoRA adapter (alpha {LORA_ALPHA:g}) "
          f"on one window; the time is the median of steps 2..{steps} (the first is warm-up), wall-clock and CPU "
          f"(user + system of every thread of the process); peak RSS is the process's ru_maxrss (start-up, model "
          f"loading included); every peer in a child process of its own, limited to {args.mem_limit:g} GiB of RSS "
          f"(killed past it; llama-finetune also to {args.mem_limit + 4:g} GiB of address space)",
          f"- llama builds: {getattr(args, 'builds_desc', '?')} (the first build's peers are `llama-finetune BASE`, "
          "another's `llama-finetune BASE (NAME)`)",
          "- the adapter: PEFT's (A Kaiming-uniform, B zero) on the PEFT targets below, written to GGUF by "
          "`ggml/lora_peft.py to-gguf` and trained by `llama-finetune --lora-init`, so that every peer trains the "
          "same adapter; `default targets` is `llama-finetune --lora-rank 16` (its own draw of A) on every weight "
          "llama-finetune adapts by default (PEFT's targets plus the mixers' `ssm_out`, which PEFT refuses on "
          "Mamba-type models)",
          "- the torch peers run the checkpoint in float32 (its weights rounded to F16 values, so the F16 GGUF "
          "holds the same weights); `rel. vs` compares the first "
          f"{VALIDATE} losses (default targets: the first, B = 0) with the stock run's "
          "(or + ssmgrad's where stock did not fit)", ""]
    for name in dict.fromkeys(r["model"] for r in rows):
        _, _, kw, targets, what = LORA_MODELS[name]
        r0 = next(r for r in rows if r["model"] == name)
        md += [f"## {name}: {what}", "",
               f"{r0['n_params'] / 1e9:.3f}B parameters; config {json.dumps(kw)}; PEFT targets {targets}; base files "
               + ", ".join(f"{q} {g:.2f} GiB" for q, g in r0["base_gib"].items()), "",
               "| tokens | threads | peer | base | wall s/step (median) | wall steps (s) | wall / torch + ssmgrad | "
               "CPU s/step | peak RSS | trained params | first losses | rel. vs ref | load |",
               "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in (r for r in rows if r["model"] == name):
            ref = row["res"].get("PEFT, torch + ssmgrad", {})
            for peer, r in row["res"].items():
                if "failed" in r:
                    md.append(f"| {row['n_ctx']} | {row['threads']} | {peer} | {r.get('base', '')} | failed: "
                              f"{r['failed'][:160].replace('|', '/')} | | | | "
                              f"{r['rss'] / 2**30:.2f} GiB | | | | {r.get('load', float('nan')):.1f} |")
                    continue
                ratio = r["median"] / ref["median"] if "median" in ref else float("nan")
                md.append(f"| {row['n_ctx']} | {row['threads']} | {peer} | {r['base']} | {fmt_s(r['median'])} | "
                          f"{' '.join(f'{x:.1f}' for x in r['times'])} | {ratio:.2f}x | {fmt_s(r['cpu_median'])} | "
                          f"{r['rss'] / 2**30:.2f} GiB | {_trained(r)} | "
                          f"{' '.join(f'{x:.5f}' for x in r['losses'][:VALIDATE])} | "
                          + (f"{r['val_rel']:.1e}" if "val_rel" in r else "ref" if peer.startswith("PEFT") else "n/a")
                          + f" | {r['load']:.1f} |")
        md.append("")
        # full fine-tuning beside it: 16 bytes a parameter (f32 weight, gradient, two AdamW moments) plus what the
        # F16 LoRA run held above its base file (the activations and the program), computed
        md += ["Full fine-tuning (f32 AdamW) at this size, **computed**: 16 bytes × parameters (weight, gradient, two "
               "moments) + the activations, taken as the F16 LoRA run's peak RSS minus its base file:", "",
               "| tokens | 16 B × params | activations (LoRA F16 peak − F16 file) | full fine-tuning |",
               "|---|---|---|---|"]
        for row in (r for r in rows if r["model"] == name):
            r = row["res"].get("llama-finetune f16", {})
            if "rss" in r and "failed" not in r:
                act = r["rss"] / 2**30 - row["base_gib"]["f16"]
                st = 16 * row["n_params"] / 2**30
                md.append(f"| {row['n_ctx']} | {st:.1f} GiB | {act:.2f} GiB | {st + act:.1f} GiB |")
        md.append("")
    return finish_report(md, problems, args.out)


def finish_report(md, problems, out):
    """The markdown lines MD with the validation failures appended, written to OUT if given; returns the text."""
    if problems:
        md = md + ["## Validation failures", ""] + [f"- {x}" for x in problems] + [""]
    text = "\n".join(md)
    if out:
        out.write_text(text)
        log(f"wrote {out}")
    return text


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", action="append", choices=sorted(MODELS) + sorted(LORA_MODELS),
                    help="default: mamba2, mamba1, nemotron_h (--lora: falcon_h1_1.5b, mamba2_2.7b)")
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
    ap.add_argument("--lora", action="store_true", help="LoRA fine-tuning of published checkpoints' shapes on a "
                    "frozen F16 / Q8_0 base (models: " + ", ".join(LORA_MODELS) + ")")
    ap.add_argument("--ctx", default="256,512", help="--lora: comma-separated window lengths (default 256,512)")
    ap.add_argument("--base", default="f16,q8_0", help="--lora: comma-separated base types (f32, f16, q8_0, q4_0)")
    ap.add_argument("--default-targets", default="q8_0", metavar="BASE",
                    help="--lora: also train a new adapter on llama-finetune's default targets on this base, at the "
                         "first --ctx ('' for none; default q8_0)")
    ap.add_argument("--torch-peers", default="stock,ssmgrad", help="--lora: which torch peers (stock, ssmgrad)")
    ap.add_argument("--mem-limit", type=float, default=17.0, help="--lora: GiB of RSS a child may use (default 17)")
    ap.add_argument("--child", choices=["torch", "torch-lora"], help=argparse.SUPPRESS)
    ap.add_argument("--child-ctx", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-model", help=argparse.SUPPRESS)
    ap.add_argument("--child-workdir", help=argparse.SUPPRESS)
    ap.add_argument("--child-steps", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-threads", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--child-patch", type=int, help=argparse.SUPPRESS)
    add_isa_flag(ap)
    args = ap.parse_args(argv)
    # --isa avx2 caps the torch peers (ATen, oneDNN, MKL) and ssmgrad's kernels: the script runs itself again
    # under the cap, which its children inherit; a llama build keeps the ISA it was compiled for
    if args.isa != "native" and argv is not None:
        ap.error("--isa: from the command line only (the script runs itself again under the cap)")
    args.isa_line = apply_isa(args.isa)
    if args.child == "torch-lora":
        torch_lora_child(args.child_model, args.child_workdir, args.child_steps, args.child_threads,
                         bool(args.child_patch), args.child_ctx)
        return 0
    if args.child:
        torch_child(args.child_model, args.child_workdir, args.child_steps, args.child_threads, bool(args.child_patch))
        return 0

    models = args.model or ["mamba2", "mamba1", "nemotron_h"]
    threads = [int(t) for t in args.threads.split(",")]
    steps = args.steps
    if args.quick:
        models, threads, steps = (args.model or ["mamba2"]), [2], 3
    if args.lora:
        bad = [m for m in args.model or [] if m not in LORA_MODELS]
        if bad:
            ap.error(f"--lora: models {bad} are not among {sorted(LORA_MODELS)}")
        if args.quick:
            threads, steps, args.ctx = [1], 2, "256"
        if not set(args.torch_peers.split(",")) <= {"stock", "ssmgrad"}:
            ap.error(f"--torch-peers: stock and/or ssmgrad, not {args.torch_peers!r}")
    elif [m for m in args.model or [] if m not in MODELS]:
        ap.error(f"models {[m for m in args.model if m not in MODELS]} need --lora")
    builds = []
    for spec in args.llama or [f"default={ROOT / 'build' / 'ggml'}"]:
        name, _, d = spec.partition("=")
        bin_dir = (Path(d) if Path(d).is_absolute() else ROOT / d) / "bin"
        if args.isa != "native" and _native_build(bin_dir.parent):
            ap.error(f"--isa {args.isa} --llama {spec}: that build has GGML_NATIVE=ON (this host's widest ISA); "
                     "compare a build made without it (bash ggml/build.sh)")
        if not (bin_dir / "llama-finetune").is_file():
            log(f"--llama {spec}: {bin_dir / 'llama-finetune'} not found yet (bash ggml/build.sh)")
        builds.append((name, bin_dir))
    for name in args.profile or []:
        if name not in dict(builds):
            ap.error(f"--profile {name}: not one of the --llama names {[b[0] for b in builds]}")
    if steps < 2:
        ap.error("--steps: at least 2 (the first is warm-up)")
    if args.lora:
        return lora_main(args, argv, builds, threads, steps)

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
