#!/usr/bin/env python
"""ssmgrad against the fastest PyTorch CPU formulations of SSM_SCAN and SSM_CONV, side by side.

    python benchmarks/bench.py                    # full run (minutes): writes benchmarks/results.md and results.png
    python benchmarks/bench.py --quick            # smoke test (< 1 min), tiny shapes, writes to a temp dir
    python benchmarks/bench.py --only mamba2,ssd --threads 1 --out /tmp/b
    python benchmarks/bench.py --busy             # only the busy-machine measurement (~2 min)

1. Validate: every implementation that will be timed runs at a small shape (two sequences, an
   extra state row, n_group 2, a dt above the softplus threshold) in float64 and float32; its forward
   output and every gradient are compared with the float64 torch reference (tests/reference.py, the test suite's oracle).
   An implementation that fails is reported and not timed.
2. Time (float32, one sequence, the real layer shapes): forward, backward and forward+backward,
   medians over repeats. Repeats adapt to the run time (--budget seconds per cell), so a slow peer
   gets fewer; the `reps` column says how many, `1*` meaning the warm-up run was the one sample.
   Each timed torch result is also compared with ssmgrad's at the timed shape (`agree` note).
3. ssmgrad only: n_t = 8192 added to the table, the 1 -> 2 thread bitwise comparison of the
   outputs, and the backward's peak memory beyond its inputs and output (VmHWM of a fresh
   subprocess, peak reset through /proc/self/clear_refs).
4. Interleaved sweep, ssmgrad only: 7 rounds, each running fwd+bwd once at every (n_t, threads)
   in turn; the time-per-token spread and the thread speedups in the targets section come from
   these rounds, so that load that comes and goes on a shared machine falls on every size alike.
5. Busy machine (`--busy` runs only this; `--no-busy` skips it): small and medium scan calls
   timed next to one busy process (a Python loop spinning on one core) and without it, in
   alternating phases of one child process; ratio of medians, for ssmgrad's defaults and for the
   former defaults (spinning OpenMP threads, threads from 2^16 multiply-adds).
6. The compiled peer (`--no-compiled` skips it, `--only ssd_compiled` keeps only it beside
   ssmgrad): torch.compile of the SSD form (inductor, CPU, COMPILE_MODE / COMPILE_CHUNK, validated in
   step 1 like every peer) beside eager SSD and ssmgrad at the Mamba-2-130m and 2.7B layers, n_t 512
   and 2048, each thread count; compiled afresh per cell in an empty inductor cache, the compile
   (the first call) timed apart and reported, never a sample.
7. Decode (`--no-decode` skips it): one-token ssm_scan_update and ssm_scan(n_t = 1) of the
   Mamba-2-130m and Mamba-130m layers against np.copyto of the same state bytes, in the same rounds.
8. "Scan targets": one row per target docs/performance.md states, computed from the run's own data.

Conventions: torch "fwd" is the training forward (autograd recording on); "bwd" is
torch.autograd.grad for s, x, dt, B, C (scan) or sx, c (conv), A frozen, like ssmgrad's
ssm_scan_back without d_A and ssm_conv_back + ssm_conv_back_weight. FLOP per state update
(n_t*n_head*head_dim*d_state of them): forward 5, backward 14 (Mamba-2) or 19 (Mamba-1). Conv
throughput is in GB/s of the bytes the op must move (inputs read once, outputs written once).
"""

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(1, ROOT)                                # the in-place build of ssmgrad

FLOP_FWD = 5
FLOP_BWD = {True: 19, False: 14}                        # keyed by "A is per state" (Mamba-1)
CQ = 64                                                 # tokens per chunk of the chunked forms


def scan_flops(sg, a, p, K=1):
    """FLOP of ssm_scan and ssm_scan_back for inputs a, on the count of the form each takes here
    (ssmgrad._ext._scan_forms): the recurrence 5 per state update forward and 14 (Mamba-2) or 19
    (Mamba-1) backward; the chunked forward, per token, 4 N P + P (Q + 1) per head (C S0, the state
    update, the triangular Q x Q x P product) plus N (Q + 1) per block of up to 8 heads (C_t . B_tau);
    the chunked backward, per token, 10 P N + 2 Q P per head (five P x N products,
    two triangular Q x Q x P ones) plus 3 Q N per unit of heads (C_t . B_tau and the two triangular
    products of d_B and d_C with D summed over the unit's heads), Q = 64, P = head_dim, N = d_state."""
    nq, n_t = a["x"].shape[0], a["x"].shape[1]
    h, P, N = p["n_head"], p["head_dim"], p["d_state"]
    upd = nq * n_t * h * P * N
    forms = sg._ext._scan_forms(a["s"], a["x"], a["dt"], a["A"], a["B"], a["C"], a["ids"], K)
    if forms["fwd"] == "chunked":
        blocks = nq * p["n_group"] * -(-(h // p["n_group"]) // 8)    # at least: threads may cut a group's blocks
        flop_f = n_t * (nq * h * (4 * N * P + P * (CQ + 1)) + blocks * N * (CQ + 1))
    else:
        flop_f = FLOP_FWD * upd
    if forms["back"] == "chunked":
        flop_b = n_t * (nq * h * (10 * P * N + 2 * CQ * P) + forms["back_units"] * 3 * CQ * N)
    else:
        flop_b = FLOP_BWD[p["m1"]] * upd
    return flop_f, flop_b, forms

# name -> (kind, params); scan params: n_head, head_dim, d_state, n_group, a_per_state
FULL_SHAPES = {
    "mamba1": ("scan", dict(n_head=1536, head_dim=1, d_state=16, n_group=1, m1=True)),
    "mamba2": ("scan", dict(n_head=24, head_dim=64, d_state=128, n_group=1, m1=False)),
    "conv1536": ("conv", dict(d_inner=1536, d_conv=4)),
    "conv1792": ("conv", dict(d_inner=1792, d_conv=4)),
}
QUICK_SHAPES = {
    "mamba1": ("scan", dict(n_head=128, head_dim=1, d_state=16, n_group=1, m1=True)),
    "mamba2": ("scan", dict(n_head=2, head_dim=64, d_state=128, n_group=1, m1=False)),
    "conv1536": ("conv", dict(d_inner=256, d_conv=4)),
    "conv1792": ("conv", dict(d_inner=320, d_conv=4)),
}
SHAPE_LABEL = {
    "mamba1": "Mamba-130m scan (1536 heads x 1, d_state 16, A per state)",
    "mamba2": "Mamba-2-130m scan (24 heads x 64, d_state 128, scalar A)",
    "conv1536": "conv, 1536 channels, d_conv 4",
    "conv1792": "conv, 1792 channels, d_conv 4",
}
# Training-scale cases: (label, shape params, n_seqs, n_t, torch peers timed beside).
# The peers are the fastest formulation of each kind at the 130m shapes (results above); the
# others are left out for memory: the token loop's autograd graph keeps ~5 tensors of
# (n_seqs, d_inner, d_state) per token (Falcon-Mamba, 4 x 1024: ~11 GB) and mambapy's pscan
# several of (n_seqs, n_t, d_inner, d_state) (2 GB each there).
TRAIN_SHAPES = {
    "m2_130m": dict(n_head=24, head_dim=64, d_state=128, n_group=1, m1=False),
    "m2_2.7b": dict(n_head=80, head_dim=64, d_state=128, n_group=1, m1=False),
    "m2_grouped": dict(n_head=128, head_dim=64, d_state=128, n_group=8, m1=False),
    "m1_130m": dict(n_head=1536, head_dim=1, d_state=16, n_group=1, m1=True),
    "falcon7b": dict(n_head=8192, head_dim=1, d_state=16, n_group=1, m1=True),
}
TRAIN_LABEL = {
    "m2_130m": "Mamba-2-130m layer (24 heads x 64, d_state 128, 1 group)",
    "m2_2.7b": "Mamba-2-2.7B layer (80 heads x 64, d_state 128, 1 group)",
    "m2_grouped": "grouped Mamba-2 layer (128 heads x 64, d_state 128, 8 groups)",
    "m1_130m": "Mamba-130m layer (d_inner 1536, d_state 16)",
    "falcon7b": "Falcon-Mamba-7B layer (Mamba-1, d_inner 8192, d_state 16)",
}
TRAIN_CASES = [
    ("m2_130m", 4, 1024, ["ssd"]),
    ("m2_2.7b", 1, 2048, ["ssd"]),
    ("m2_2.7b", 4, 1024, ["ssd"]),
    ("m2_grouped", 4, 1024, ["ssd"]),
    ("m1_130m", 4, 1024, ["loop"]),
    ("falcon7b", 1, 512, ["loop"]),
    ("falcon7b", 4, 1024, []),
]
QUICK_TRAIN_CASES = [("m2_130m", 2, 128, ["ssd"]), ("m1_130m", 2, 128, ["loop"])]
TORCH_IMPLS = {"scan_m1": ["loop", "pscan"], "scan_m2": ["loop", "ssd"], "conv": ["conv1d"]}
IMPL_LABEL = {"ssmgrad": "ssmgrad", "loop": "torch unbind loop", "ssd": "torch SSD chunked",
              "pscan": "mambapy pscan", "conv1d": "torch F.conv1d",
              "ssd_compiled": "torch.compile SSD (inductor)"}
# The compiled peer: scan_ssd through torch.compile (inductor, CPU), shape-specialized
# (dynamic=False), one compile per shape and thread count (inductor bakes the thread count into its
# C++ kernels), timed after the compile. Settings picked by measurement (benchmarks/README.md,
# "The compiled peer"): the default mode, chunk 128.
COMPILE_MODE = "default"
COMPILE_CHUNK = 128
# (shape of TRAIN_SHAPES, n_seqs, n_t, peers): the side-by-side cases of the compiled peer; n_t is
# replaced by the run's --nt values of at least 512 (default 512 and 2048)
COMPILED_CASES = [("m2_130m", 1, None, ["ssd", "ssd_compiled"]), ("m2_2.7b", 1, None, ["ssd", "ssd_compiled"])]
QUICK_COMPILED_CASES = [("m2_130m", 1, 64, ["ssd", "ssd_compiled"])]
SG_MIN_REPS = 7                            # timed repeats of an ssmgrad cell, at least
TOL = {"float64": 1e-9, "float32": 1e-4}   # max |impl - ref| / max |ref|, per tensor
AGREE_TOL = 1e-3                           # same measure, torch float32 vs ssmgrad float32 at the timed shape


# ------------------------------------------------------------------------------------ inputs

def scan_inputs(p, n_t, dtype, rng, n_seqs=1, n_rs=1, ids=(0,)):
    """Realistic values: A < 0, softplus(dt) in [0.001, 0.1], x, B, C, s ~ N(0, 1)."""
    h, hd, n, g = p["n_head"], p["head_dim"], p["d_state"], p["n_group"]
    a = dict(
        s=rng.standard_normal((n_rs, h, hd, n)),
        x=rng.standard_normal((n_seqs, n_t, h, hd)),
        dt=np.log(np.expm1(rng.uniform(0.001, 0.1, (n_seqs, n_t, h)))),
        A=-np.exp(rng.uniform(0.0, 1.0, (h, n if p["m1"] else 1))),
        B=rng.standard_normal((n_seqs, n_t, g, n)),
        C=rng.standard_normal((n_seqs, n_t, g, n)),
    )
    a = {k: v.astype(dtype) for k, v in a.items()}
    a["ids"] = np.asarray(ids, dtype=np.int32)
    return a


def scan_sizes(p, n_t, n_seqs=1):
    n_y = n_seqs * n_t * p["n_head"] * p["head_dim"]
    n_s = n_seqs * p["n_head"] * p["head_dim"] * p["d_state"]
    return n_y, n_s


def conv_inputs(p, n_t, dtype, rng, n_s=1):
    return dict(sx=rng.standard_normal((n_s, p["d_inner"], p["d_conv"] - 1 + n_t)).astype(dtype),
                c=rng.standard_normal((p["d_inner"], p["d_conv"])).astype(dtype))


SCAN_ARGS = ("s", "x", "dt", "A", "B", "C")


def sg_scan_grads(sg, a, grad, return_dA):
    """{name: gradient} from ssmgrad.ssm_scan_back."""
    res = sg.ssm_scan_back(*(a[k] for k in SCAN_ARGS), a["ids"], grad, return_dA=return_dA)
    gin, d_A = res if return_dA else (res, None)
    parts = sg.split(gin, a["s"].shape, a["x"].shape, a["dt"].shape, a["B"].shape, a["C"].shape)
    g = dict(zip(("s", "x", "dt", "B", "C"), parts))
    if d_A is not None:
        g["A"] = d_A
    return g


def rel_err(got, ref):
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if got.shape != ref.shape:
        return float("inf")
    if ref.size == 0:
        return 0.0
    if not np.all(np.isfinite(got)):
        return float("inf")
    return float(np.max(np.abs(got - ref)) / max(float(np.max(np.abs(ref))), 1e-300))


# ------------------------------------------------------------------------------------ validation

def torch_scan_outputs(fn, a, torch_dtype, grad_of, gpacked, n_y):
    """Run a torch scan formulation; return (packed out, {name: grad}) as float64 numpy."""
    import torch
    t = {k: torch.tensor(a[k], dtype=torch_dtype, requires_grad=k in grad_of) for k in SCAN_ARGS}
    ids = torch.as_tensor(a["ids"].astype(np.int64))
    y, fin = fn(*(t[k] for k in SCAN_ARGS), ids)
    out = torch.cat([y.reshape(-1), fin.reshape(-1)])
    g = torch.tensor(gpacked, dtype=torch_dtype)
    grads = torch.autograd.grad(out, [t[k] for k in grad_of], g)
    return (out.detach().double().numpy(),
            {k: v.double().numpy() for k, v in zip(grad_of, grads)})


def validate(sg, impls_wanted, log, cfg):
    """Check every implementation at small shapes in float64 and float32. Returns
    ({impl_key: failure text} for failures, list of report lines)."""
    import torch
    import peers as ti
    ref_name = ti.REFERENCE
    rng = np.random.default_rng(1234)
    failures, lines = {}, []

    def record(key, dtype, errs):
        worst = max(errs.values())
        ok = worst <= TOL[dtype]
        detail = ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
        lines.append(f"| {key} | {dtype} | {worst:.2e} | {'ok' if ok else 'FAIL'} | {detail} |")
        if not ok:
            failures.setdefault(key, f"{dtype}: worst {worst:.2e} > {TOL[dtype]:g} ({detail})")
        log(f"  validate {key:16s} {dtype:8s} worst rel err {worst:.2e} {'ok' if ok else 'FAIL'}")

    small = {
        "mamba1": dict(n_head=6, head_dim=2, d_state=8, n_group=2, m1=True),
        "mamba2": dict(n_head=4, head_dim=8, d_state=16, n_group=2, m1=False),
    }
    n_t = 150                                          # not a power of 2, > 2 SSD chunks of 64
    for shape, p in small.items():
        want = [i for i in impls_wanted.get(shape, [])]
        if not want:
            continue
        a = scan_inputs(p, n_t, np.float64, rng, n_seqs=2, n_rs=3, ids=(2, 0))
        a["dt"][0, 3, 0] = 25.0                        # the softplus threshold branch
        n_y, n_s = scan_sizes(p, n_t, 2)
        gpacked = rng.standard_normal(n_y + n_s)
        rt = {k: torch.tensor(a[k], requires_grad=True) for k in SCAN_ARGS}
        rout = ti.ref_ssm_scan(*(rt[k] for k in SCAN_ARGS), a["ids"])
        rgrads = torch.autograd.grad(rout, [rt[k] for k in SCAN_ARGS], torch.tensor(gpacked))
        rout = rout.detach().numpy()
        rgrads = {k: v.numpy() for k, v in zip(SCAN_ARGS, rgrads)}
        for dtype in ("float64", "float32"):
            ad = {k: (v.astype(dtype) if k != "ids" else v) for k, v in a.items()}
            for impl in want:
                key = f"{shape}/{impl}"
                try:
                    if impl == "ssmgrad":
                        out = sg.ssm_scan(*(ad[k] for k in SCAN_ARGS), ad["ids"])
                        grads = sg_scan_grads(sg, ad, gpacked.astype(dtype), return_dA=True)
                    else:
                        fn = scan_peer(impl, cfg)
                        tdt = torch.float64 if dtype == "float64" else torch.float32
                        out, grads = torch_scan_outputs(fn, ad, tdt, SCAN_ARGS, gpacked, n_y)
                    errs = {"y": rel_err(out[:n_y], rout[:n_y]), "state": rel_err(out[n_y:], rout[n_y:])}
                    errs.update({f"d_{k}": rel_err(grads[k], rgrads[k]) for k in SCAN_ARGS})
                    record(key, dtype, errs)
                except Exception as exc:                   # a crash is a failure, not an abort
                    failures.setdefault(key, f"{dtype}: {type(exc).__name__}: {exc}")
                    lines.append(f"| {key} | {dtype} | - | FAIL | {type(exc).__name__}: {exc} |")
                    log(f"  validate {key:16s} {dtype:8s} FAIL {type(exc).__name__}: {exc}")

    want = impls_wanted.get("conv", [])
    if want:
        p = dict(d_inner=16, d_conv=4)
        a = conv_inputs(p, 37, np.float64, rng, n_s=2)
        g = rng.standard_normal((2, 37, 16))
        rt = {k: torch.tensor(a[k], requires_grad=True) for k in ("sx", "c")}
        ry = ti.ref_ssm_conv(rt["sx"], rt["c"])
        rd = torch.autograd.grad(ry, [rt["sx"], rt["c"]], torch.tensor(g))
        ry, rd = ry.detach().numpy(), [v.numpy() for v in rd]
        for dtype in ("float64", "float32"):
            sx, c, gd = a["sx"].astype(dtype), a["c"].astype(dtype), g.astype(dtype)
            for impl in want:
                key = f"conv/{impl}"
                try:
                    if impl == "ssmgrad":
                        y, dsx, dc = sg.ssm_conv(sx, c), sg.ssm_conv_back(sx, c, gd), sg.ssm_conv_back_weight(sx, c, gd)
                    else:
                        tdt = torch.float64 if dtype == "float64" else torch.float32
                        tsx = torch.tensor(sx, dtype=tdt, requires_grad=True)
                        tc = torch.tensor(c, dtype=tdt, requires_grad=True)
                        ty = ti.CONV_IMPLS[impl](tsx, tc)
                        dsx, dc = (v.numpy() for v in torch.autograd.grad(ty, [tsx, tc], torch.tensor(gd)))
                        y = ty.detach().numpy()
                    record(key, dtype, {"y": rel_err(y, ry), "d_sx": rel_err(dsx, rd[0]), "d_c": rel_err(dc, rd[1])})
                except Exception as exc:
                    failures.setdefault(key, f"{dtype}: {type(exc).__name__}: {exc}")
                    lines.append(f"| {key} | {dtype} | - | FAIL | {type(exc).__name__}: {exc} |")
                    log(f"  validate {key:16s} {dtype:8s} FAIL {type(exc).__name__}: {exc}")
    head = [f"Reference: {ref_name} (float64, torch autograd). Error = max|impl - ref| / max|ref| per tensor; "
            f"tolerance {TOL['float64']:g} (float64), {TOL['float32']:g} (float32). Scan: n_seqs 2, n_rs 3, "
            f"ids (2, 0), n_t {n_t}, n_group 2, one dt = 25; conv: n_s 2, 16 channels, n_t 37.",
            "", "| implementation | dtype | worst | result | per tensor |", "|---|---|---|---|---|"]
    return failures, head + lines


# ------------------------------------------------------------------------------------ timing

def measure(run_once, budget, max_reps, min_reps=1):
    """run_once() -> (t_fwd, t_bwd, result). One warm-up run, then repeats to fill ``budget``
    seconds (at least min_reps, at most max_reps; the count is set from the first timed run,
    which has no first-touch page faults). A warm-up longer than 2*budget is its own single
    sample."""
    t_f, t_b, res = run_once()
    if t_f + t_b > 2 * budget:
        return dict(fwd=t_f, bwd=t_b, fb=t_f + t_b, fb_min=t_f + t_b, fwd_min=t_f, bwd_min=t_b, reps="1*"), res
    fs, bs = [], []
    n = 1
    while len(fs) < n:
        del res
        t_f, t_b, res = run_once()
        fs.append(t_f)
        bs.append(t_b)
        if len(fs) == 1:
            n = max(1, min_reps, min(max_reps, int(budget / max(t_f + t_b, 1e-9))))
    fbs = [f + b for f, b in zip(fs, bs)]
    return dict(fwd=statistics.median(fs), bwd=statistics.median(bs), fb=statistics.median(fbs),
                fb_min=min(fbs), fwd_min=min(fs), bwd_min=min(bs), reps=str(n)), res


def sg_scan_runner(sg, a, grad):
    args = [a[k] for k in SCAN_ARGS] + [a["ids"]]

    def run():
        t0 = time.perf_counter()
        out = sg.ssm_scan(*args)
        t1 = time.perf_counter()
        gin = sg.ssm_scan_back(*args, grad)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, (out, gin)
    return run


def sg_conv_runner(sg, a, grad, split_times):
    sx, c = a["sx"], a["c"]

    def run():
        t0 = time.perf_counter()
        y = sg.ssm_conv(sx, c)
        t1 = time.perf_counter()
        d_sx = sg.ssm_conv_back(sx, c, grad)
        t2 = time.perf_counter()
        d_c = sg.ssm_conv_back_weight(sx, c, grad)
        t3 = time.perf_counter()
        split_times.append((t2 - t1, t3 - t2))
        return t1 - t0, t3 - t1, (y, d_sx, d_c)
    return run


def torch_scan_runner(fn, a, grad, n_y):
    import torch
    t = {k: torch.from_numpy(a[k]) for k in SCAN_ARGS}
    leaves = [t[k].requires_grad_() for k in ("s", "x", "dt", "B", "C")]
    ids = torch.as_tensor(a["ids"].astype(np.int64))
    gy = torch.from_numpy(grad[:n_y]).view(a["x"].shape)
    gS = torch.from_numpy(grad[n_y:]).view((len(a["ids"]),) + a["s"].shape[1:])

    def run():
        t0 = time.perf_counter()
        y, fin = fn(*(t[k] for k in SCAN_ARGS), ids)
        t1 = time.perf_counter()
        grads = torch.autograd.grad((y, fin), leaves, (gy, gS))
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, (y.detach(), fin.detach(), grads)
    return run


def scan_peer(impl, cfg):
    """The torch scan function of a peer: eager from SCAN_IMPLS, or for ``*_compiled`` a fresh
    torch.compile of it (dynamo's caches reset first, so the first call compiles for the current
    shapes, dtype and thread count). cfg: chunk (eager SSD), compile_chunk, compile_mode."""
    import peers as ti
    compiled = impl.endswith("_compiled")
    base = impl[:-len("_compiled")] if compiled else impl
    fn = ti.SCAN_IMPLS[base]
    if base == "ssd":
        fn = lambda *xs, _f=fn, _c=cfg["compile_chunk" if compiled else "chunk"]: _f(*xs, chunk=_c)   # noqa: E731
    if not compiled:
        return fn
    import torch
    torch._dynamo.reset()
    mode = cfg["compile_mode"]
    return torch.compile(fn, dynamic=False, fullgraph=True, mode=None if mode == "default" else mode)


def torch_conv_runner(fn, a, grad):
    import torch
    sx = torch.from_numpy(a["sx"]).requires_grad_()
    c = torch.from_numpy(a["c"]).requires_grad_()
    g = torch.from_numpy(grad)

    def run():
        t0 = time.perf_counter()
        y = fn(sx, c)
        t1 = time.perf_counter()
        grads = torch.autograd.grad(y, [sx, c], g)
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, (y.detach(), grads)
    return run


# ------------------------------------------------------------------------------------ memory

def _vm(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return -1


def mem_child(spec):
    """Runs in a fresh process: peak bytes of one ssmgrad backward beyond its inputs and output."""
    import ssmgrad as sg
    sg.set_num_threads(spec["threads"])
    rng = np.random.default_rng(7)
    p = spec["params"]
    if spec["kind"] == "scan":
        nq = spec.get("n_seqs", 1)

        def make(n_t):
            a = scan_inputs(p, n_t, np.float32, rng, n_seqs=nq, ids=tuple(range(nq)), n_rs=nq)
            n_y, n_s = scan_sizes(p, n_t, nq)
            return a, rng.standard_normal(n_y + n_s).astype(np.float32)
        a, g = make(4)
        sg.ssm_scan_back(*(a[k] for k in SCAN_ARGS), a["ids"], g)          # warm up: thread pool, stacks
        a, g = make(spec["n_t"])
        call = lambda: sg.ssm_scan_back(*(a[k] for k in SCAN_ARGS), a["ids"], g)  # noqa: E731
    else:
        def make(n_t):
            a = conv_inputs(p, n_t, np.float32, rng)
            return a, rng.standard_normal((1, n_t, p["d_inner"])).astype(np.float32)
        a, g = make(4)
        sg.ssm_conv_back(a["sx"], a["c"], g)
        sg.ssm_conv_back_weight(a["sx"], a["c"], g)
        a, g = make(spec["n_t"])
        call = lambda: (sg.ssm_conv_back(a["sx"], a["c"], g), sg.ssm_conv_back_weight(a["sx"], a["c"], g))  # noqa: E731
    try:
        with open("/proc/self/clear_refs", "w") as f:   # reset VmHWM to the current RSS
            f.write("5")
        reset = True
    except OSError:
        reset = False
    base = _vm("VmRSS")
    res = call()
    hwm = _vm("VmHWM")
    out_bytes = sum(r.nbytes for r in res) if isinstance(res, tuple) else res.nbytes
    print(json.dumps(dict(extra=hwm - base - out_bytes, hwm=hwm, base=base, out=out_bytes, reset=reset)))


def measure_memory(kind, params, n_t, threads, n_seqs=1):
    spec = dict(kind=kind, params=params, n_t=n_t, threads=threads, n_seqs=n_seqs)
    try:
        # A fixed mmap threshold: every large block is a fresh mapping, released on free, so a
        # buffer cannot hide in heap pages that an earlier free left resident (glibc tunables).
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="131072")
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--mem-child", json.dumps(spec)],
                           capture_output=True, text=True, timeout=600, env=env)
        d = json.loads(r.stdout.strip().splitlines()[-1])
        return d["extra"] / 1e6, d["reset"]
    except Exception:                                       # memory is a report column, never fatal
        return float("nan"), False


# ------------------------------------------------------------------------------------ machine

def machine_description(sg):
    lines = []
    info = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            if ":" in line:
                k, v = line.split(":", 1)
                info[k.strip()] = v.strip()
    except OSError:
        pass
    flags = info.get("Flags", "").split()
    simd = [f for f in ("avx2", "fma", "avx512f", "avx512bw", "avx512vl") if f in flags]
    lines.append(f"- CPU: {info.get('Model name', platform.processor() or '?')}, {info.get('CPU(s)', os.cpu_count())} CPUs "
                 f"({info.get('Core(s) per socket', '?')} cores/socket x {info.get('Socket(s)', '?')} sockets, "
                 f"{info.get('Thread(s) per core', '?')} thread/core), SIMD: {' '.join(simd) or '?'}, "
                 f"L2 {info.get('L2 cache', '?')}, L3 {info.get('L3 cache', '?')}"
                 + (f", hypervisor {info['Hypervisor vendor']}" if "Hypervisor vendor" in info else ""))
    import torch
    try:
        from importlib.metadata import version
        mambapy_v = version("mambapy")
    except Exception:
        mambapy_v = "not installed"
    lines.append(f"- Python {platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}, "
                 f"mambapy {mambapy_v}, ssmgrad {getattr(sg, '__version__', '?')}")
    cfg = io.StringIO()
    try:
        with contextlib.redirect_stdout(cfg):
            r = sg.show_config()
        text = cfg.getvalue().strip() or (str(r) if r is not None else "")
    except Exception as exc:
        text = f"show_config() failed: {exc}"
    if text:
        lines.append("- ssmgrad.show_config(): " + "; ".join(" ".join(line.split()) for line in text.splitlines() if line.strip()))
    try:
        with open("/proc/meminfo") as f:
            mem_kb = int(f.readline().split()[1])
        lines.append(f"- Memory: {mem_kb / 2**20:.1f} GiB")
    except (OSError, ValueError, IndexError):
        pass
    return lines


def cpu_snapshot():
    """(CPU seconds busy on the whole machine, of them stolen by the hypervisor, used by this
    process and its children, wall time), from /proc/stat and getrusage; None off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    idle = v[3] + (v[4] if len(v) > 4 else 0)
    steal = v[7] if len(v) > 7 else 0
    import resource
    own = sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
              for f in ("ru_utime", "ru_stime"))
    return (sum(v[:8]) - idle) / hz, steal / hz, own, time.time()


def other_load(a, b):
    """Cores' worth of CPU used by other processes (and stolen by the hypervisor) between two
    cpu_snapshot()s, or None."""
    if a is None or b is None or b[3] <= a[3]:
        return None
    wall = b[3] - a[3]
    return max(0.0, (b[0] - a[0]) - (b[2] - a[2])) / wall, (b[1] - a[1]) / wall


def fma_peak(log):
    """One core's float32 FMA peak in GFLOP/s, measured by benchmarks/probes/peak.c (AVX-512 CPUs with a C
    compiler only; None elsewhere, and the report says so)."""
    with open("/proc/cpuinfo") as f:
        if "avx512f" not in f.read().split():
            log("FMA peak: not measured (peak.c needs AVX-512)")
            return None
    with tempfile.TemporaryDirectory() as d:
        exe = os.path.join(d, "peak")
        cc = os.environ.get("CC", "cc")
        r = subprocess.run([cc, "-O2", "-mavx512f", os.path.join(HERE, "probes", "peak.c"), "-o", exe], capture_output=True, text=True)
        if r.returncode != 0:
            log(f"FMA peak: not measured ({cc} failed: {r.stderr.strip()[:200]})")
            return None
        out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    m = re.search(r"= ([0-9.]+) GFLOP/s", out)
    log(f"FMA peak: {out.strip()}")
    return float(m.group(1)) if m else None


def copy_bandwidth(n_bytes):
    """Single-thread numpy copy (read + write) GB/s: a rough memory-bandwidth yardstick for the conv."""
    src = np.ones(n_bytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best / 1e9


# ------------------------------------------------------------------------------------ training shapes

def train_section(sg, cases, threads, budget, max_reps, failures, cfg, no_mem, log):
    """Time ssmgrad and the torch peers at training-scale shapes (batches of sequences), float32.
    Returns (rows, report lines)."""
    import torch
    import peers as ti
    rows = []
    for shape, nq, n_t, peers in cases:
        p = TRAIN_SHAPES[shape]
        vkey = "mamba1" if p["m1"] else "mamba2"
        rng = np.random.default_rng(n_t + nq)
        a = scan_inputs(p, n_t, np.float32, rng, n_seqs=nq, n_rs=nq, ids=tuple(range(nq)))
        n_y, n_s = scan_sizes(p, n_t, nq)
        grad = rng.standard_normal(n_y + n_s).astype(np.float32)
        for thr in threads:
            sg.set_num_threads(thr)
            torch.set_num_threads(thr)
            base = dict(shape=shape, n_seqs=nq, n_t=n_t, threads=thr, notes=[])
            if f"{vkey}/ssmgrad" in failures:
                rows.append(dict(base, impl="ssmgrad", failed=failures[f"{vkey}/ssmgrad"]))
                continue
            m, res = measure(sg_scan_runner(sg, a, grad), budget, max_reps, min_reps=3)
            row = dict(base, impl="ssmgrad", **m)
            flop_f, flop_b, forms = scan_flops(sg, a, p)
            row.update(thr_f=flop_f / m["fwd"] / 1e9, thr_b=flop_b / m["bwd"] / 1e9, forms=forms)
            if not no_mem:
                row["mem"], _ = measure_memory("scan", p, n_t, thr, n_seqs=nq)
            rows.append(row)
            log(f"  train {shape:10s} {nq}x{n_t} {thr}T ssmgrad fwd {fmt_ms(m['fwd'])} ms, bwd {fmt_ms(m['bwd'])} ms "
                f"({m['reps']} reps)")
            sg_out, sg_m = res, m
            del res
            for impl in peers:
                if f"{vkey}/{impl}" in failures:
                    rows.append(dict(base, impl=impl, failed=failures[f"{vkey}/{impl}"], notes=[]))
                    continue
                fn = scan_peer(impl, cfg)
                run = torch_scan_runner(fn, a, grad, n_y)
                compile_s = None
                if impl.endswith("_compiled"):        # the first call compiles: timed apart, not a sample
                    t0 = time.perf_counter()
                    run()
                    compile_s = time.perf_counter() - t0
                # at least 3 repeats, like ssmgrad's: one run of a peer varied by up to 1.6x between runs
                m, res = measure(run, budget, max_reps, min_reps=3)
                y, fin, grads = res
                out = np.concatenate([y.numpy().ravel(), fin.numpy().ravel()])
                parts = sg.split(sg_out[1], a["s"].shape, a["x"].shape, a["dt"].shape, a["B"].shape, a["C"].shape)
                worst = max([rel_err(out, sg_out[0])] + [rel_err(g.numpy(), q) for g, q in zip(grads, parts)])
                del res, y, fin, grads
                trow = dict(base, impl=impl, notes=[f"agree {worst:.0e}" + ("" if worst <= AGREE_TOL else " MISMATCH")], **m)
                if compile_s is not None:
                    trow["compile_s"] = compile_s
                    trow["notes"].append(f"compile {compile_s:.1f} s (first call, not timed)")
                trow.update(ratio_f=m["fwd"] / sg_m["fwd"], ratio_b=m["bwd"] / sg_m["bwd"], ratio_fb=m["fb"] / sg_m["fb"])
                rows.append(trow)
                log(f"  train {shape:10s} {nq}x{n_t} {thr}T {impl:7s} fwd {fmt_ms(m['fwd'])} ms, bwd {fmt_ms(m['bwd'])} ms"
                    f" ({m['reps']} reps), fwd+bwd {trow['ratio_fb']:.3g}x ssmgrad")
            del sg_out
    md = ["| shape | n_seqs x n_t | thr | implementation | reps | fwd ms | bwd ms | fwd+bwd ms | us/token | "
          "x ssmgrad fwd | x bwd | x fwd+bwd | bwd/fwd | ssmgrad fwd | ssmgrad bwd | bwd extra MB | notes |",
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "failed" in r:
            md.append(f"| {r['shape']} | {r['n_seqs']} x {r['n_t']} | {r['threads']} | {IMPL_LABEL[r['impl']]} | - | - | - | - | - "
                      f"| - | - | - | - | - | - | - | {r['failed']} |")
            continue
        sgr = r["impl"] == "ssmgrad"
        gf = f"{r['thr_f']:.3g} GFLOP/s" if sgr else "-"
        gb = f"{r['thr_b']:.3g} GFLOP/s" if sgr else "-"
        mem = f"{r['mem']:.1f}" if sgr and "mem" in r else "-"
        rf, rb, rfb = ("-", "-", "-") if sgr else (fmt_ratio(r["ratio_f"]), fmt_ratio(r["ratio_b"]), fmt_ratio(r["ratio_fb"]))
        per_tok = r["fb"] * 1e6 / (r["n_seqs"] * r["n_t"])
        md.append(f"| {r['shape']} | {r['n_seqs']} x {r['n_t']} | {r['threads']} | {IMPL_LABEL[r['impl']]} | {r['reps']} "
                  f"| {fmt_ms(r['fwd'])} | {fmt_ms(r['bwd'])} | {fmt_ms(r['fb'])} | {per_tok:.3g} | {rf} | {rb} | {rfb} "
                  f"| {r['bwd'] / r['fwd']:.2f} | {gf} | {gb} | {mem} | {'; '.join(r['notes'])} |")
    return rows, md


def train_targets(rows, peak):
    """Lines for the training-scale targets (docs/performance.md) measured by train_section; peak: one
    core's FMA GFLOP/s or None."""
    out = []
    by = {}
    for r in rows:
        if "failed" not in r:
            by.setdefault((r["shape"], r["n_seqs"], r["n_t"], r["threads"]), {})[r["impl"]] = r
    for (shape, nq, n_t, thr), d in by.items():
        sgr = d.get("ssmgrad")
        if not sgr:
            continue
        peers = [(k, r["fb"] / sgr["fb"]) for k, r in d.items() if k != "ssmgrad"]
        best = min(peers, key=lambda kv: d[kv[0]]["fb"]) if peers else None
        m2 = not TRAIN_SHAPES[shape]["m1"]
        target = (">= 2.5x" if m2 else ">= 10x on 1 thread")
        txt = f"- {shape} {nq}x{n_t} {thr}T: bwd/fwd {sgr['bwd'] / sgr['fwd']:.2f} (target <= 2.5)"
        if best:
            txt += f"; fwd+bwd, fastest torch ({IMPL_LABEL[best[0]]}) / ssmgrad {best[1]:.2f}x (target {target})"
        if "mem" in sgr:
            txt += f"; backward extra memory {sgr['mem']:.1f} MB"
        if m2 and peak:
            f_pt, b_pt = sgr["thr_f"] / thr, sgr["thr_b"] / thr
            txt += (f"; per thread fwd {f_pt:.3g} GFLOP/s = {100 * f_pt / peak:.0f}% of the FMA peak "
                    f"({sgr['forms']['fwd']} count), bwd {b_pt:.3g} = {100 * b_pt / peak:.0f}% "
                    f"({sgr['forms']['back']} count) (targets >= 70%, >= 50%)")
        out.append(txt + ".")
    return out


# ------------------------------------------------------------------------------------ report

def fmt_ms(t):
    if t is None:
        return "-"
    ms = t * 1e3
    return f"{ms:.3g}" if ms < 1000 else f"{ms:,.0f}"


def fmt_ratio(r):
    if r is None:
        return "-"
    return f"{r:.3g}x"


def write_plot(rows, path, shapes):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [s for s in shapes if any(r["shape"] == s for r in rows)]
    ncol = min(2, len(names))
    nrow = (len(names) + ncol - 1) // ncol
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.2 * ncol, 4.4 * nrow), squeeze=False)
    for ax in axes.flat[len(names):]:
        ax.set_visible(False)
    colors = {"ssmgrad": "C0", "loop": "C1", "ssd": "C2", "pscan": "C3", "conv1d": "C4"}
    for ax, shape in zip(axes.flat, names):
        series = {}
        for r in rows:
            if r["shape"] == shape and r.get("fb"):
                series.setdefault((r["impl"], r["threads"]), []).append((r["n_t"], r["fb"] / r["n_t"] * 1e6))
        for (impl, thr), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors.get(impl, "k"),
                    linestyle="-" if thr == min(k[1] for k in series) else "--",
                    label=f"{IMPL_LABEL.get(impl, impl)}, {thr}T")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("n_t (tokens)")
        ax.set_ylabel("fwd+bwd time per token (us)")
        ax.set_title(SHAPE_LABEL.get(shape, shape), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("ssmgrad vs PyTorch CPU, float32, one sequence: fwd+bwd time per token "
                 "(solid: fewest threads, dashed: more)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(rows):
    head = ("| shape | n_t | thr | implementation | reps | fwd ms | bwd ms | fwd+bwd ms | us/token | "
            "x ssmgrad fwd | x bwd | x fwd+bwd | ssmgrad fwd | ssmgrad bwd | bwd extra MB | notes |")
    out = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in rows:
        if r.get("failed"):
            out.append(f"| {r['shape']} | {r['n_t']} | {r['threads']} | {IMPL_LABEL.get(r['impl'], r['impl'])} | - | - | - | - | - "
                       f"| - | - | - | - | - | - | not timed: {r['failed']} |")
            continue
        us_tok = r["fb"] / r["n_t"] * 1e6
        thr_unit = "GB/s" if r["kind"] == "conv" else "GFLOP/s"
        tf = f"{r['thr_f']:.3g} {thr_unit}" if r.get("thr_f") else "-"
        tb = f"{r['thr_b']:.3g} {thr_unit}" if r.get("thr_b") else "-"
        mem = f"{max(r['mem'], 0.0):.1f}" if r.get("mem") is not None and r["mem"] == r["mem"] else "-"
        out.append(f"| {r['shape']} | {r['n_t']} | {r['threads']} | {IMPL_LABEL.get(r['impl'], r['impl'])} | {r['reps']} "
                   f"| {fmt_ms(r['fwd'])} | {fmt_ms(r['bwd'])} | {fmt_ms(r['fb'])} | {us_tok:.3g} "
                   f"| {fmt_ratio(r.get('ratio_f'))} | {fmt_ratio(r.get('ratio_b'))} | {fmt_ratio(r.get('ratio_fb'))} "
                   f"| {tf} | {tb} | {mem} | {'; '.join(r.get('notes', []))} |")
    return out


# ------------------------------------------------------------------------------------ busy machine
# Calls timed next to one busy process (a Python loop spinning on one core), against the same
# calls on the machine as it otherwise is, in alternating phases of one child process: the
# spinner is stopped (SIGSTOP) for the quiet phases and continued for the busy ones, so load
# from elsewhere falls on both alike. Each variant runs in fresh processes because the OpenMP
# runtime reads its wait policy once, when it is loaded.
BUSY_CALLS = [   # label, shape, n_t, forward only?
    ("small: Mamba-2 forward, n_t=1 (decode step)", "mamba2", 1, True),
    ("small: Mamba-2 fwd+bwd, n_t=8", "mamba2", 8, False),
    ("medium: Mamba-2 fwd+bwd, n_t=64", "mamba2", 64, False),
    ("medium: Mamba-1 fwd+bwd, n_t=256", "mamba1", 256, False),
]
BUSY_VARIANTS = [   # label, environment, min work per thread (None: the build's default)
    ("ssmgrad's defaults", {}, None),
    # the OpenMP runtimes' own defaults (libgomp spins 300000 times, libomp 200 ms) and the old
    # work threshold: ssmgrad's former defaults
    ("the former defaults (spinning OpenMP threads, threads from 2^16 multiply-adds)",
     {"GOMP_SPINCOUNT": "300000", "KMP_BLOCKTIME": "200"}, 1 << 16),
]


def busy_child(spec):
    import signal
    import ssmgrad as sg
    import _ssmgrad
    if spec["min_work"] is not None:
        _ssmgrad._set_min_work_per_thread(spec["min_work"])
    sg.set_num_threads(spec["threads"])
    calls = []
    for label, shape, n_t, fwd_only in BUSY_CALLS:
        p = FULL_SHAPES[shape][1]
        a = scan_inputs(p, n_t, np.float32, np.random.default_rng(n_t))
        args = [a[k] for k in ("s", "x", "dt", "A", "B", "C", "ids")]
        g = np.ones(sum(scan_sizes(p, n_t)), np.float32)
        calls.append((label, (lambda a=args: sg.ssm_scan(*a)) if fwd_only else
                      (lambda a=args, g=g: (sg.ssm_scan(*a), sg.ssm_scan_back(*a, g)))))
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    os.kill(spinner.pid, signal.SIGSTOP)
    res = {label: {"quiet": [], "busy": []} for label, _ in calls}
    try:
        for _, fn in calls:
            fn()
        for r in range(spec["rounds"]):
            for phase in ("quiet", "busy") if r % 2 == 0 else ("busy", "quiet"):
                if phase == "busy":
                    os.kill(spinner.pid, signal.SIGCONT)
                    time.sleep(0.05)
                for label, fn in calls:
                    for _ in range(spec["reps"]):
                        t0 = time.perf_counter()
                        fn()
                        res[label][phase].append(time.perf_counter() - t0)
                if phase == "busy":
                    os.kill(spinner.pid, signal.SIGSTOP)
    finally:
        spinner.kill()
        spinner.wait()
    print(json.dumps(res))


def busy_machine(threads, rounds, reps, log, repeats=2):
    """{variant: {call: {"quiet": [...], "busy": [...]}}}: children of each variant alternate."""
    out = {label: {c[0]: {"quiet": [], "busy": []} for c in BUSY_CALLS} for label, _, _ in BUSY_VARIANTS}
    base_env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")}
    for rep in range(repeats):
        for label, env, min_work in BUSY_VARIANTS:
            log(f"  busy machine: {label} ({rep + 1}/{repeats})")
            spec = dict(threads=threads, rounds=rounds, reps=reps, min_work=min_work)
            r = subprocess.run([sys.executable, os.path.abspath(__file__), "--busy-child", json.dumps(spec)],
                               env=dict(base_env, **env), capture_output=True, text=True, timeout=3600)
            if r.returncode != 0:
                raise RuntimeError(f"busy-machine child failed: {r.stderr[-2000:]}")
            for call, v in json.loads(r.stdout.strip().splitlines()[-1]).items():
                for phase in ("quiet", "busy"):
                    out[label][call][phase] += v[phase]
    return out


def busy_table(res, threads):
    md = [f"ssmgrad on {threads} threads, float32, one sequence; medians over the samples of each phase, "
          "ratio = busy median / quiet median, and the busy phase's 90th percentile over the quiet median:", "",
          "| call | " + " | ".join(f"{v} quiet ms | busy ms | ratio | p90 ratio" for v in res) + " |",
          "|---|" + "---:|---:|---:|---:|" * len(res)]
    for call in next(iter(res.values())):
        cells = []
        for v in res.values():
            q, b = statistics.median(v[call]["quiet"]), statistics.median(v[call]["busy"])
            p90 = float(np.percentile(v[call]["busy"], 90))
            cells.append(f"{fmt_ms(q)} | {fmt_ms(b)} | {b / q:.2f}x | {p90 / q:.1f}x")
        md.append(f"| {call} | " + " | ".join(cells) + " |")
    first = next(iter(res))
    worst = max(statistics.median(v["busy"]) / statistics.median(v["quiet"]) for v in res[first].values())
    md += ["", f"Target, next to one busy process no call above 2.5x its quiet time: worst ratio of "
           f"medians, {first}: {worst:.2f}x ({'met' if worst <= 2.5 else 'MISSED'})."]
    return md



def interleaved_sweep(sg, shapes, sizes, threads, rounds, log):
    """ssmgrad fwd+bwd of every (n_t, threads) of a shape, taken in turn, ``rounds`` times after
    one untimed round: on this shared VM, load that comes and goes during one table cell moved
    that cell's median by up to 50%, while a round-robin spreads it over every size and thread
    count alike. Returns {(shape, n_t, threads): [seconds per fwd+bwd, one per round]}."""
    times = {}
    for shape, (kind, p) in shapes.items():
        runs = {}
        for n_t in sizes:
            rng = np.random.default_rng(n_t)
            if kind == "scan":
                a = scan_inputs(p, n_t, np.float32, rng)
                n_y, n_s = scan_sizes(p, n_t)
                runs[n_t] = sg_scan_runner(sg, a, rng.standard_normal(n_y + n_s).astype(np.float32))
            else:
                a = conv_inputs(p, n_t, np.float32, rng)
                grad = rng.standard_normal((1, n_t, p["d_inner"])).astype(np.float32)
                runs[n_t] = sg_conv_runner(sg, a, grad, [])
        for r in range(rounds + 1):
            for n_t in sizes:
                for thr in threads:
                    sg.set_num_threads(thr)
                    t_f, t_b, res = runs[n_t]()
                    del res
                    if r:
                        times.setdefault((shape, n_t, thr), []).append(t_f + t_b)
        del runs
        log(f"  {shape:9s} interleaved sweep: {rounds} rounds of n_t {sizes} x threads {threads}")
    sg.set_num_threads(max(threads))
    return times


def conv_variants(sg, shapes, sizes, threads, rounds, log):
    """Conv forward + both backwards per token, in four variants taken in turn (round-robin):
    outputs fresh (the default call) or written into reused buffers (``out=``), and inputs warm
    (the same arrays again: at n_t 512 they stay in the 32 MB L3 between calls) or cold (64 MB
    read in between, so every n_t streams its inputs from memory). Returns
    {(shape, n_t, threads, variant): [seconds per fwd+bwd]} and the results agree bitwise."""
    times = {}
    evict = np.ones((96 << 20) // 4, dtype=np.float32)
    for shape, (kind, p) in shapes.items():
        if kind != "conv":
            continue
        for n_t in sizes:
            rng = np.random.default_rng(n_t)
            a = conv_inputs(p, n_t, np.float32, rng)
            sx, c = a["sx"], a["c"]
            g = rng.standard_normal((1, n_t, p["d_inner"])).astype(np.float32)
            outs = (np.empty((1, n_t, p["d_inner"]), np.float32), np.empty_like(sx), np.empty_like(c))
            want = (sg.ssm_conv(sx, c), sg.ssm_conv_back(sx, c, g), sg.ssm_conv_back_weight(sx, c, g))

            def call(reuse):
                if reuse:
                    return (sg.ssm_conv(sx, c, out=outs[0]), sg.ssm_conv_back(sx, c, g, out=outs[1]),
                            sg.ssm_conv_back_weight(sx, c, g, out=outs[2]))
                return sg.ssm_conv(sx, c), sg.ssm_conv_back(sx, c, g), sg.ssm_conv_back_weight(sx, c, g)
            for r in range(rounds + 1):
                for thr in threads:
                    sg.set_num_threads(thr)
                    for variant in ("fresh warm", "out= warm", "fresh cold", "out= cold"):
                        if "cold" in variant:
                            float(evict.sum())
                        t0 = time.perf_counter()
                        res = call(variant.startswith("out="))
                        dt = time.perf_counter() - t0
                        if not r:
                            assert all(np.array_equal(u, v) for u, v in zip(res, want)), (shape, n_t, variant)
                        else:
                            times.setdefault((shape, n_t, thr, variant), []).append(dt)
                        del res
            del outs, want
        log(f"  {shape:9s} conv variants: {rounds} rounds of n_t {sizes} x threads {threads}")
    sg.set_num_threads(max(threads))
    return times


def conv_variant_lines(cv, shapes, threads, bw):
    """The conv targets (docs/performance.md) per variant of conv_variants: spread of time per token over n_t 512 to
    8192, and GB/s of the bytes fwd + bwd must move at the largest n_t on one thread."""
    lines = []
    for shape, (kind, p) in shapes.items():
        if kind != "conv":
            continue
        for variant in ("fresh warm", "out= warm", "fresh cold", "out= cold"):
            for thr in threads:
                pts = sorted((n_t, statistics.median(v) / n_t) for (sh, n_t, th, va), v in cv.items()
                             if sh == shape and th == thr and va == variant and 512 <= n_t <= 8192)
                if len(pts) < 2:
                    continue
                v = [q[1] for q in pts]
                n_big = pts[-1][0]
                moved = 4 * (2 * ((p["d_conv"] - 1 + n_big) * p["d_inner"]) + 3 * n_big * p["d_inner"])
                gbs = moved / (v[-1] * n_big) / 1e9
                bw_txt = f"; at n_t {n_big} {gbs:.3g} GB/s = {100 * gbs / bw:.0f}% of the copy" if bw and thr == 1 else ""
                lines.append(f"- conv {shape} {thr}T, {variant}: fwd+bwd us/token over n_t "
                             f"{[q[0] for q in pts]}: " + ", ".join(f"{x * 1e6:.3g}" for x in v)
                             + f", spread {100 * (max(v) / min(v) - 1):.0f}% (target 25%){bw_txt}.")
    if lines:
        lines.append("- (conv variants: medians of rounds taken in turn; `out=` reuses one output buffer per "
                     "result, `cold` reads 64 MB before each call so the inputs come from memory; bytes moved: "
                     "sx and grad read twice, y, d_sx written, c and d_c ignored; the copy is numpy's "
                     "single-thread copyto into a buffer written before.)")
    return lines


def summary(rows, shapes, nts, sweep, threads, bw, inter):
    """The scan-speed, conv-bandwidth and time-per-token targets (docs/performance.md), each with the
    measured value, computed from the rows (and, for the
    time-per-token spread and the thread speedups, from the interleaved sweep ``inter``)."""
    lines = []
    sgr = [r for r in rows if r["impl"] == "ssmgrad" and not r.get("failed")]
    big = max(nts)

    def get(shape, n_t, thr, impl="ssmgrad"):
        for r in rows:
            if (r["shape"], r["n_t"], r["threads"], r["impl"]) == (shape, n_t, thr, impl) and not r.get("failed"):
                return r
        return None

    t1 = min(threads)
    if "mamba2" in shapes:
        vals = [(thr, get("mamba2", big, thr)) for thr in threads]
        txt = ", ".join(f"{thr}T {r['thr_f'] / thr:.3g}" for thr, r in vals if r)
        lines.append(f"- Mamba-2 scan forward, n_t={big}: GFLOP/s per thread {txt} (target >= 50% of one core's FMA peak).")
    if "mamba1" in shapes:
        r = get("mamba1", big, t1)
        if r:
            p = shapes["mamba1"][1]
            upd = big * p["n_head"] * p["head_dim"] * p["d_state"]
            lines.append(f"- Mamba-1 scan forward, n_t={big}, {t1}T: {r['fwd'] / upd * 1e9 * t1:.3g} ns per state update "
                         f"per thread (ggml about 5 ns; target <= 0.5 ns).")
    ratios = [(r["bwd"] / r["fwd"], r) for r in sgr if r["kind"] == "scan" and r["n_t"] in nts]
    if ratios:
        worst, r = max(ratios, key=lambda x: x[0])
        lines.append(f"- Backward / forward time (scan, ssmgrad): worst {worst:.2f} at {r['shape']} n_t={r['n_t']} "
                     f"{r['threads']}T (target <= 3).")
    best_torch = []
    for r in sgr:
        if r["kind"] != "scan":
            continue
        peers = [q for q in rows if (q["shape"], q["n_t"], q["threads"]) == (r["shape"], r["n_t"], r["threads"])
                 and q["impl"] != "ssmgrad" and not q.get("failed")]
        if peers:
            q = min(peers, key=lambda q: q["fb"])
            best_torch.append((q["fb"] / r["fb"], r, q))
    if best_torch:
        worst = min(best_torch, key=lambda x: x[0])
        lines.append("- fwd+bwd, fastest PyTorch / ssmgrad (scan): " + ", ".join(
            f"{r['shape']} n_t={r['n_t']} {r['threads']}T {v:.3g}x ({IMPL_LABEL[q['impl']]})" for v, r, q in best_torch)
            + f". Smallest {worst[0]:.3g}x (target >= 30x).")
    if "mamba2" in shapes:
        mems = [f"{r['threads']}T {r['mem']:.1f} MB" for r in sgr
                if r["shape"] == "mamba2" and r["n_t"] == big and r.get("mem") is not None]
        if mems:
            lines.append(f"- Backward peak memory beyond inputs and output, Mamba-2 n_t={big}: {', '.join(mems)} "
                         f"(target < 32 MB; storing every state would be "
                         f"{big * 24 * 64 * 128 * 4 / 1e9:.2g} GB).")
    for shape in shapes:
        for thr in threads:
            pts = sorted((n_t, statistics.median(v) / n_t, min(v) / n_t)
                         for (sh, n_t, th), v in inter.items() if sh == shape and th == thr)
            if len(pts) >= 2:
                v, w = [p[1] for p in pts], [p[2] for p in pts]
                lines.append(f"- Time per token, {shape} {thr}T, fwd+bwd over n_t {[p[0] for p in pts]} "
                             f"(interleaved rounds): medians " + ", ".join(f"{x * 1e6:.3g}" for x in v)
                             + f" us, spread {100 * (max(v) / min(v) - 1):.0f}% (fastest runs: "
                             + ", ".join(f"{x * 1e6:.3g}" for x in w)
                             + f" us, {100 * (max(w) / min(w) - 1):.0f}%) (target within 15%).")
    if len(threads) >= 2:
        ta, tb = min(threads), max(threads)
        for shape in shapes:
            sp, sp_min, bits = [], [], []
            for n_t in sorted(set(nts) | set(sweep)):
                r2 = get(shape, n_t, tb)
                v1, v2 = inter.get((shape, n_t, ta)), inter.get((shape, n_t, tb))
                if v1 and v2:
                    sp.append(f"{n_t}: {statistics.median(v1) / statistics.median(v2):.2f}x")
                    sp_min.append(f"{min(v1) / min(v2):.2f}x")
                    bits.append(r2.get("bitwise") if r2 else None)
            if sp:
                same = "all bitwise identical" if all(bits) else "NOT bitwise identical: see notes"
                lines.append(f"- {ta} -> {tb} threads, {shape} fwd+bwd (interleaved rounds): {', '.join(sp)} "
                             f"(fastest runs: {', '.join(sp_min)}); {same} (target >= 1.7x, identical).")
    convs = [r for r in sgr if r["kind"] == "conv" and r["n_t"] == big]
    if convs and bw:
        lines.append(f"- Conv at n_t={big}: " + ", ".join(
            f"{r['shape']} {r['threads']}T fwd {r['thr_f']:.3g} / bwd {r['thr_b']:.3g} GB/s" for r in convs)
            + f"; numpy single-thread copy moves {bw:.3g} GB/s on this machine (target: within 2x of the bandwidth limit).")
    # conv time per token over n_t, conv bandwidth, the backward's extra memory
    for shape in shapes:
        if shapes[shape][0] != "conv":
            continue
        for thr in threads:
            pts = sorted((n_t, statistics.median(v) / n_t, min(v) / n_t)
                         for (sh, n_t, th), v in inter.items() if sh == shape and th == thr and 512 <= n_t <= 8192)
            if len(pts) >= 2:
                v, w = [p[1] for p in pts], [p[2] for p in pts]
                lines.append(f"- conv time per token, {shape} {thr}T over n_t {[p[0] for p in pts]}: medians "
                             + ", ".join(f"{x * 1e6:.3g}" for x in v) + f" us, spread {100 * (max(v) / min(v) - 1):.0f}% "
                             f"(fastest runs {100 * (max(w) / min(w) - 1):.0f}%) (target within 25%).")
    for r in sgr:
        if r["kind"] == "conv" and r["n_t"] == 8192 and r["threads"] == 1 and bw:
            lines.append(f"- conv {r['shape']} n_t=8192 1T: fwd {r['thr_f']:.3g} GB/s ({100 * r['thr_f'] / bw:.0f}% of "
                         f"the copy), bwd {r['thr_b']:.3g} GB/s ({100 * r['thr_b'] / bw:.0f}%) (target >= 60%).")
    if "mamba2" in shapes:
        mems = [f"n_t={r['n_t']} {r['threads']}T {r['mem']:.1f} MB" for r in sgr
                if r["shape"] == "mamba2" and r["n_t"] in (2048, 8192) and r.get("mem") is not None]
        if mems:
            lines.append(f"- backward extra memory, Mamba-2-130m: {', '.join(mems)} (targets <= 32 MB at 2048, "
                         f"<= 48 MB at 8192).")
    return lines


# ------------------------------------------------------------------------------------ decode

DECODE_SHAPES = ["m2_130m", "m1_130m"]      # keys of TRAIN_SHAPES: one layer's state, one sequence


def decode_vs_copy(sg, threads, rounds, log):
    """One-token decode of one layer against one copy of its state, in the same rounds: each round
    times, in turn, ``ssm_scan_update`` (the in-place generate path), ``ssm_scan`` with n_t = 1 (the
    packed output) and ``np.copyto`` of the state's bytes into a second buffer (the state read once
    and written once, as the update must), so the three see the same cache state and the same load.
    Returns {(shape, threads): {call: [seconds]}} and {shape: state bytes}; checks first that the
    update's y and state equal ssm_scan's to float32 rounding."""
    out, nbytes = {}, {}
    for shape in DECODE_SHAPES:
        p = TRAIN_SHAPES[shape]
        a = scan_inputs(p, 1, np.float32, np.random.default_rng(11))
        args = [a[k] for k in ("x", "dt", "A", "B", "C")]
        s = a["s"].copy()                                         # the cache row, advanced in place
        y = sg.ssm_scan_update(s, *args)
        ref = sg.split(sg.ssm_scan(*(a[k] for k in SCAN_ARGS), a["ids"]), a["x"].shape, a["s"].shape)
        err = max(rel_err(y, ref[0]), rel_err(s, ref[1]))
        if err > TOL["float32"]:
            raise RuntimeError(f"decode {shape}: ssm_scan_update differs from ssm_scan by {err:.1e}")
        dst = np.empty_like(s)
        nbytes[shape] = s.nbytes
        full = [a[k] for k in SCAN_ARGS] + [a["ids"]]
        calls = [("update", lambda: sg.ssm_scan_update(s, *args)), ("scan n_t=1", lambda: sg.ssm_scan(*full)),
                 ("copy", lambda: np.copyto(dst, s))]
        for thr in threads:
            sg.set_num_threads(thr)
            res = {name: [] for name, _ in calls}
            for r in range(rounds + 10):                          # 10 untimed rounds: pool, caches
                for i in range(len(calls)):
                    name, fn = calls[(i + r) % len(calls)]         # rotate the order: none always first
                    t0 = time.perf_counter()
                    fn()
                    dt = time.perf_counter() - t0
                    if r >= 10:
                        res[name].append(dt)
            out[(shape, thr)] = res
        log(f"  decode {shape}: {rounds} rounds x threads {threads}, state {s.nbytes / 1e3:.0f} kB")
    sg.set_num_threads(max(threads))
    return out, nbytes


def decode_lines(dec, nbytes):
    md = ["One-token decode of one layer (one sequence, float32) against `np.copyto` of its state into a second "
          "buffer (the bytes the update must read and write), timed in the same rounds in rotating order; "
          "`ratio` = decode / copy, of the medians and of the fastest runs. `update` is "
          "`ssmgrad.ssm_scan_update` (the in-place generate path), `scan n_t=1` is `ssmgrad.ssm_scan` (packed "
          "output, a fresh array). The copy is single-threaded at every thread count.", "",
          "| layer | state kB | thr | update us | scan n_t=1 us | copy us | update / copy | fastest | "
          "scan n_t=1 / copy | fastest | rounds |",
          "|---|---|---|---|---|---|---|---|---|---|---|"]
    for (shape, thr), v in dec.items():
        med = {k: statistics.median(x) for k, x in v.items()}
        lo = {k: min(x) for k, x in v.items()}
        md.append(f"| {shape} | {nbytes[shape] / 1e3:.0f} | {thr} | {med['update'] * 1e6:.3g} | {med['scan n_t=1'] * 1e6:.3g} "
                  f"| {med['copy'] * 1e6:.3g} | {med['update'] / med['copy']:.2f}x | {lo['update'] / lo['copy']:.2f}x "
                  f"| {med['scan n_t=1'] / med['copy']:.2f}x | {lo['scan n_t=1'] / lo['copy']:.2f}x | {len(v['copy'])} |")
    return md


# ------------------------------------------------------------------------------------ scan targets

# Mamba-1's documented floor, ns per state update (forward, backward): docs/performance.md counts the
# multiplies and FMAs per 16 updates of the AVX-512 loops (15.5 forward, 39.5 backward) at one 512-bit
# FMA per cycle and this machine's 3.65 GHz (benchmarks/probes/peak.c).
M1_FLOOR_NS = {"fwd": 0.27, "bwd": 0.68}


def scan_targets(rows, comp_rows, train_rows, dec, inter, shapes, threads, peak, bw):
    """The scan targets of docs/performance.md, each row computed from this run's data: (measure, medians,
    fastest runs, target, met/missed)."""
    out = ["| measure | measured (medians) | fastest runs | target | result |", "|---|---|---|---|---|"]

    def rng_txt(v, fmt="{:.3g}", unit=""):
        v = sorted(v)
        return (fmt.format(v[0]) + unit) if len(v) == 1 or fmt.format(v[0]) == fmt.format(v[-1]) \
            else f"{fmt.format(v[0])}–{fmt.format(v[-1])}{unit}"

    def add(measure, med, fast, target, ok):
        out.append(f"| {measure} | {med} | {fast} | {target} | {'-' if ok is None else ('met' if ok else 'MISSED')} |")

    t1 = min(threads)
    ok_rows = [r for r in comp_rows if "failed" not in r]
    # 1. Mamba-2 fwd+bwd vs the compiled SSD, 1 thread
    pairs = []
    for r in ok_rows:
        if r["impl"] == "ssd_compiled" and r["threads"] == 1:
            sgr = next((q for q in ok_rows if q["impl"] == "ssmgrad" and
                        (q["shape"], q["n_seqs"], q["n_t"], q["threads"]) == (r["shape"], r["n_seqs"], r["n_t"], 1)), None)
            if sgr:
                pairs.append((r["fb"] / sgr["fb"], r["fb_min"] / sgr["fb_min"], f"{r['shape']} {r['n_t']}"))
    if pairs:
        cases = ", ".join(f"{c} {m:.2f}x" for m, _, c in pairs)
        add(f"Mamba-2 fwd+bwd, compiled SSD / ssmgrad, 1 thread ({cases})", rng_txt([p[0] for p in pairs], unit="x"),
            rng_txt([p[1] for p in pairs], unit="x"), ">= 3x", min(p[0] for p in pairs) >= 3)
    else:
        add("Mamba-2 fwd+bwd, compiled SSD / ssmgrad, 1 thread", "not measured", "-", ">= 3x", None)
    # 2, 3. Mamba-2 % of the FMA peak per thread, backward / forward: the compiled-peer cases'
    # ssmgrad rows (130m and 2.7B, n_t >= 512) and the main table's Mamba-2 rows at n_t >= 512
    m2 = [r for r in ok_rows if r["impl"] == "ssmgrad"]
    m2 += [r for r in rows if r["impl"] == "ssmgrad" and r["shape"] == "mamba2" and not r.get("failed")
           and r["n_t"] >= 512 and "thr_f" in r]
    if m2 and peak:
        f_med = [100 * r["thr_f"] / r["threads"] / peak for r in m2]
        f_min = [100 * r["thr_f"] * r["fwd"] / r["fwd_min"] / r["threads"] / peak for r in m2]
        b_med = [100 * r["thr_b"] / r["threads"] / peak for r in m2]
        b_min = [100 * r["thr_b"] * r["bwd"] / r["bwd_min"] / r["threads"] / peak for r in m2]
        add(f"Mamba-2 forward, % of one core's FMA peak ({peak:.1f} GFLOP/s) per thread, {len(m2)} cells",
            rng_txt(f_med, "{:.0f}", "%"), rng_txt(f_min, "{:.0f}", "%"), ">= 80%", min(f_med) >= 80)
        add("Mamba-2 backward, % of the FMA peak per thread, same cells", rng_txt(b_med, "{:.0f}", "%"),
            rng_txt(b_min, "{:.0f}", "%"), ">= 70%", min(b_med) >= 70)
    else:
        add("Mamba-2 forward / backward, % of the FMA peak", "not measured" + ("" if peak else " (no peak)"), "-",
            ">= 80% / >= 70%", None)
    if m2:
        ratio = [r["bwd"] / r["fwd"] for r in m2]
        add("Mamba-2 backward / forward, same cells", rng_txt(ratio, "{:.2f}"),
            rng_txt([r["bwd_min"] / r["fwd_min"] for r in m2], "{:.2f}"), "<= 2.3", max(ratio) <= 2.3)
    # 4. Mamba-1 ns per state update (per thread), main table n_t >= 512
    if "mamba1" in shapes:
        p = shapes["mamba1"][1]
        m1 = [r for r in rows if r["impl"] == "ssmgrad" and r["shape"] == "mamba1" and not r.get("failed")
              and r["n_t"] >= 512]
        for d in ("fwd", "bwd"):
            ns = [r[d] * r["threads"] / (r["n_t"] * p["n_head"] * p["head_dim"] * p["d_state"]) * 1e9 for r in m1]
            ns_min = [r[d + "_min"] * r["threads"] / (r["n_t"] * p["n_head"] * p["head_dim"] * p["d_state"]) * 1e9
                      for r in m1]
            floor = M1_FLOOR_NS[d]
            target = f"<= {1.5 * floor:.3g} (1.5x the floor {floor:g})" if floor else \
                "within 1.5x of the floor: see docs/performance.md"
            add(f"Mamba-1 ns per state update per thread, {'forward' if d == 'fwd' else 'backward'} "
                f"(n_t {sorted({r['n_t'] for r in m1})}, threads {sorted({r['threads'] for r in m1})})",
                rng_txt(ns) if ns else "not measured", rng_txt(ns_min) if ns else "-", target,
                (max(ns) <= 1.5 * floor) if (floor and ns) else None)
    # 5. Mamba-1 vs the torch loop at Falcon-Mamba-7B's width, 1 thread
    fal = {r["impl"]: r for r in train_rows if r["shape"] == "falcon7b" and r["threads"] == t1 and "failed" not in r
           and r["n_seqs"] == 1}
    if "ssmgrad" in fal and "loop" in fal:
        s_, l_ = fal["ssmgrad"], fal["loop"]
        add(f"Mamba-1 fwd+bwd, torch loop / ssmgrad, Falcon-Mamba-7B width, 1x{s_['n_t']}, {t1} thread",
            f"{l_['fb'] / s_['fb']:.2f}x", f"{l_['fb_min'] / s_['fb_min']:.2f}x", ">= 6x", l_["fb"] / s_["fb"] >= 6)
    else:
        add("Mamba-1 fwd+bwd vs torch loop, Falcon-Mamba-7B width", "not measured (no falcon7b 1-sequence case with "
            "the loop in this run's training shapes)", "-", ">= 6x", None)
    # 6. decode / a copy of the state
    for shape in DECODE_SHAPES:
        v = [(thr, d) for (sh, thr), d in (dec or {}).items() if sh == shape]
        if not v:
            add(f"decode step / state copy, {shape}", "not measured", "-", "<= 1.5x", None)
            continue
        med = [statistics.median(d["update"]) / statistics.median(d["copy"]) for _, d in v]
        fast = [min(d["update"]) / min(d["copy"]) for _, d in v]
        add(f"decode step (ssm_scan_update) / state copy, {shape} layer, threads {[t for t, _ in v]}",
            ", ".join(f"{t}T {x:.2f}x" for (t, _), x in zip(v, med)),
            ", ".join(f"{t}T {x:.2f}x" for (t, _), x in zip(v, fast)), "<= 1.5x", max(med) <= 1.5)
    # 7. conv: growth of the time per token 512 -> 8192 (interleaved rounds), share of the copy's bandwidth at 8192
    for shape, (kind, p) in shapes.items():
        if kind != "conv":
            continue
        g_med, g_min = [], []
        for thr in threads:
            a, b = inter.get((shape, 512, thr)), inter.get((shape, 8192, thr))
            if a and b:
                g_med.append((thr, 100 * (statistics.median(b) / 8192 / (statistics.median(a) / 512) - 1)))
                g_min.append((thr, 100 * (min(b) / 8192 / (min(a) / 512) - 1)))
        if g_med:
            add(f"conv {shape}: growth of fwd+bwd time per token, n_t 512 -> 8192 (interleaved rounds)",
                ", ".join(f"{t}T {x:+.0f}%" for t, x in g_med), ", ".join(f"{t}T {x:+.0f}%" for t, x in g_min),
                "<= 25%", max(x for _, x in g_med) <= 25)
        else:
            add(f"conv {shape}: growth of time per token 512 -> 8192", "not measured (n_t 512 and 8192 needed)", "-",
                "<= 25%", None)
        r = next((q for q in rows if q["impl"] == "ssmgrad" and q["shape"] == shape and q["n_t"] == 8192
                  and q["threads"] == 1 and not q.get("failed")), None)
        if r and bw:
            f_, b_ = 100 * r["thr_f"] / bw, 100 * r["thr_b"] / bw
            add(f"conv {shape}: share of the copy's bandwidth ({bw:.3g} GB/s) at n_t 8192, 1 thread, fwd / bwd",
                f"{f_:.0f}% / {b_:.0f}%",
                f"{f_ * r['fwd'] / r['fwd_min']:.0f}% / {b_ * r['bwd'] / r['bwd_min']:.0f}%", ">= 60%",
                min(f_, b_) >= 60)
        else:
            add(f"conv {shape}: share of the copy's bandwidth at n_t 8192", "not measured", "-", ">= 60%", None)
    return out


# ------------------------------------------------------------------------------------ main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 1-2 repeats: a smoke test under a minute")
    ap.add_argument("--out", help="directory for results.md and results.png (default: benchmarks/, "
                                  "or a temp dir with --quick)")
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--only", default="", help="comma-separated shapes (mamba1, mamba2, conv1536, conv1792) "
                                               "and/or implementations (loop, ssd, pscan, conv1d, ssd_compiled: "
                                               "ssd also selects the compiled SSD); ssmgrad always runs")
    ap.add_argument("--nt", help="comma-separated n_t for the side-by-side table (default 128,512,2048)")
    ap.add_argument("--sweep", help="extra n_t timed for ssmgrad only (default 8192)")
    ap.add_argument("--budget", type=float, help="seconds of repeats per cell (default 3, quick 0.2)")
    ap.add_argument("--chunk", type=int, default=64, help="SSD chunk size (default 64)")
    ap.add_argument("--no-compiled", action="store_true",
                    help="skip the compiled peer (torch.compile of the SSD form: one compile per shape and thread count)")
    ap.add_argument("--compile-mode", default=COMPILE_MODE,
                    help=f"torch.compile mode of the compiled peer: default, max-autotune-no-cudagraphs, ... "
                         f"(default {COMPILE_MODE})")
    ap.add_argument("--compile-chunk", type=int, default=COMPILE_CHUNK,
                    help=f"SSD chunk size of the compiled peer (default {COMPILE_CHUNK})")
    ap.add_argument("--compiled-threads", default="1",
                    help="comma-separated thread counts of the compiled peer's cells (default 1: at 2 threads "
                         "inductor's compiled SSD backward corrupts the heap, without ssmgrad loaded: "
                         "benchmarks/probes/inductor_threads.py; each count compiles every case again)")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode-step vs state-copy measurement")
    ap.add_argument("--no-mem", action="store_true", help="skip the peak-memory subprocesses")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--busy", action="store_true", help="only the busy-machine measurement: calls next to one "
                                                            "busy process vs quiet, ssmgrad's defaults vs before")
    ap.add_argument("--no-busy", action="store_true", help="skip the busy-machine measurement")
    ap.add_argument("--no-train", action="store_true", help="skip the training-scale shapes (batches, 2.7B, grouped, Falcon-Mamba)")
    ap.add_argument("--train-only", action="store_true",
                    help="only validation and the training-scale shapes; writes train.md in --out (default a temp dir)")
    ap.add_argument("--mem-child", help=argparse.SUPPRESS)
    ap.add_argument("--busy-child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.mem_child:
        mem_child(json.loads(args.mem_child))
        return 0
    if args.busy_child:
        busy_child(json.loads(args.busy_child))
        return 0
    if args.busy:
        thr = max(int(v) for v in args.threads.split(","))
        rounds, reps = (2, 2) if args.quick else (8, 10)
        res = busy_machine(thr, rounds, reps, lambda m: print(m, file=sys.stderr, flush=True))
        print("\n".join(busy_table(res, thr)))
        return 0

    t_start = time.time()
    quick = args.quick
    shapes = dict(QUICK_SHAPES if quick else FULL_SHAPES)
    nts = [int(v) for v in args.nt.split(",")] if args.nt else ([64, 256] if quick else [128, 512, 2048])
    sweep = [int(v) for v in args.sweep.split(",") if v] if args.sweep is not None else ([1024] if quick else [8192])
    sweep = [v for v in sweep if v not in nts]
    threads = [int(v) for v in args.threads.split(",")]
    budget = args.budget if args.budget is not None else (0.2 if quick else 3.0)
    max_reps = 2 if quick else 31
    only = [w.strip() for w in args.only.split(",") if w.strip()]
    only_shapes = [w for w in only if w in shapes]
    only_impls = [w for w in only if w in IMPL_LABEL and w != "ssmgrad"]
    unknown = [w for w in only if w not in shapes and w not in IMPL_LABEL]
    if unknown:
        ap.error(f"--only: unknown name(s) {unknown}; shapes {list(shapes)}, implementations {list(IMPL_LABEL)}")
    if only_shapes:
        shapes = {k: v for k, v in shapes.items() if k in only_shapes}
    out_dir = args.out or (os.path.join(tempfile.gettempdir(), "ssmgrad-bench-quick") if quick else HERE)
    os.makedirs(out_dir, exist_ok=True)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    import ssmgrad as sg
    if not hasattr(sg, "ssm_scan"):
        sys.exit(f"ssmgrad at {getattr(sg, '__path__', '?')} has no ssm_scan: build it first "
                 f"(python setup.py build_ext --inplace)")
    import torch
    import peers as ti

    def torch_impls_for(shape):
        kind, p = shapes[shape]
        names = TORCH_IMPLS["conv" if kind == "conv" else ("scan_m1" if p["m1"] else "scan_m2")]
        if only_impls:
            names = [n for n in names if n in only_impls]
        return names

    train_cases = QUICK_TRAIN_CASES if quick else TRAIN_CASES
    if args.train_only:
        shapes = {}
    cfg = dict(chunk=args.chunk, compile_chunk=args.compile_chunk, compile_mode=args.compile_mode)
    # the compiled peer: with the Mamba-2 shape, unless the implementations named leave out SSD
    comp_cases = []
    if "mamba2" in shapes and not args.no_compiled and (not only_impls or {"ssd", "ssd_compiled"} & set(only_impls)):
        if quick:
            comp_cases = QUICK_COMPILED_CASES
        else:
            comp_nts = [n for n in nts if n >= 512] or nts
            comp_cases = [(sh, nq, n_t, peers) for sh, nq, _, peers in COMPILED_CASES for n_t in comp_nts]
        if only_impls and "ssd" not in only_impls:
            comp_cases = [(sh, nq, n_t, ["ssd_compiled"]) for sh, nq, n_t, _ in comp_cases]
    comp_threads = ([int(v) for v in args.compiled_threads.split(",")] if args.compiled_threads
                    else threads[:1] if quick else threads)       # quick: one compile fewer
    inductor_dir = None
    if comp_cases and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        # a fresh inductor cache: every compile of this run is a cold one, so the compile times are honest
        inductor_dir = tempfile.mkdtemp(prefix="ssmgrad-bench-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_dir
    # 1. validation
    want = {}
    if not args.no_train:
        for shape, nq, n_t, peers in train_cases:
            key = "mamba1" if TRAIN_SHAPES[shape]["m1"] else "mamba2"
            want.setdefault(key, ["ssmgrad"])
            want[key] += [i for i in peers if i not in want[key]]
    for shape, (kind, p) in shapes.items():
        key = "conv" if kind == "conv" else shape
        want.setdefault(key, ["ssmgrad"])
        want[key] += [i for i in torch_impls_for(shape) if i not in want[key]]
    for _, _, _, peers in comp_cases:
        want.setdefault("mamba2", ["ssmgrad"])
        want["mamba2"] += [i for i in peers if i not in want["mamba2"]]
    log("validating against the float64 reference ...")
    torch.set_num_threads(1)
    sg.set_num_threads(1)
    failures, val_lines = validate(sg, want, log, cfg)
    if any(k.endswith("/ssmgrad") for k in failures):
        log("ssmgrad itself failed validation: ratios against it would be meaningless")

    # 2. timing
    rows = []
    sg_results = {}                               # (shape, n_t) -> (threads, outputs) of the first thread count
    load_start = os.getloadavg()
    cpu_start = cpu_snapshot()
    for shape, (kind, p) in shapes.items():
        vkey = "conv" if kind == "conv" else shape
        for n_t in nts + sweep:
            rng = np.random.default_rng(n_t)
            if kind == "scan":
                a = scan_inputs(p, n_t, np.float32, rng)
                n_y, n_s = scan_sizes(p, n_t)
                grad = rng.standard_normal(n_y + n_s).astype(np.float32)
                flop_f, flop_b, forms = scan_flops(sg, a, p)
            else:
                a = conv_inputs(p, n_t, np.float32, rng)
                grad = rng.standard_normal((1, n_t, p["d_inner"])).astype(np.float32)
                n_sx, n_c, n_y = a["sx"].size, a["c"].size, grad.size
                bytes_f = 4 * (n_sx + n_c + n_y)
                bytes_b = 4 * ((n_y + n_c + n_sx) + (n_y + n_sx + n_c))   # d_sx, then d_c
            for thr in threads:
                sg.set_num_threads(thr)
                torch.set_num_threads(thr)
                base = dict(shape=shape, kind=kind, n_t=n_t, threads=thr)
                row = dict(base, impl="ssmgrad", notes=[])
                if f"{vkey}/ssmgrad" in failures:
                    rows.append(dict(row, failed="failed validation: " + failures[f"{vkey}/ssmgrad"]))
                    continue
                split_times = []
                run = sg_scan_runner(sg, a, grad) if kind == "scan" else sg_conv_runner(sg, a, grad, split_times)
                # ssmgrad gets at least SG_MIN_REPS samples: the n_t = 8192 sweep would get 3,
                # and a median of 3 on this shared VM moved the time-per-token spread by 10%
                m, res = measure(run, budget, max_reps, min_reps=1 if quick else SG_MIN_REPS)
                row.update(m)
                if kind == "scan":
                    row.update(thr_f=flop_f / m["fwd"] / 1e9, thr_b=flop_b / m["bwd"] / 1e9, forms=forms)
                else:
                    row.update(thr_f=bytes_f / m["fwd"] / 1e9, thr_b=bytes_b / m["bwd"] / 1e9)
                    timed = split_times[1:] or split_times          # without the warm-up run
                    ds = statistics.median(t[0] for t in timed)
                    dc = statistics.median(t[1] for t in timed)
                    row["notes"].append(f"bwd = d_sx {fmt_ms(ds)} + d_c {fmt_ms(dc)} ms")
                if (shape, n_t) in sg_results:
                    thr0, res0 = sg_results[(shape, n_t)]
                    same = all(np.array_equal(u, v) for u, v in zip(res0, res))
                    r0 = next(r for r in rows if (r["shape"], r["n_t"], r["threads"], r["impl"]) == (shape, n_t, thr0, "ssmgrad"))
                    row["bitwise"] = same
                    row["notes"].append(f"{r0['fb'] / m['fb']:.2f}x vs {thr0}T, "
                                        + ("bitwise identical" if same else "NOT bitwise identical"))
                else:
                    sg_results[(shape, n_t)] = (thr, res)
                if not args.no_mem:
                    mem, reset = measure_memory(kind, p, n_t, thr)
                    row["mem"] = mem
                    if not reset:
                        row["notes"].append("peak not reset: memory is an upper bound")
                rows.append(row)
                log(f"  {shape:9s} n_t={n_t:5d} {thr}T ssmgrad        fwd {fmt_ms(m['fwd'])} ms, bwd {fmt_ms(m['bwd'])} ms"
                    f" ({m['reps']} reps)")
                sg_fwd, sg_bwd, sg_fb = m["fwd"], m["bwd"], m["fb"]
                sg_out = res
                del res
                if n_t in sweep:
                    continue
                for impl in torch_impls_for(shape):
                    trow = dict(base, impl=impl, notes=[])
                    if f"{vkey}/{impl}" in failures:
                        rows.append(dict(trow, failed="failed validation: " + failures[f"{vkey}/{impl}"]))
                        continue
                    if kind == "scan":
                        run = torch_scan_runner(scan_peer(impl, cfg), a, grad, n_y)
                    else:
                        run = torch_conv_runner(ti.CONV_IMPLS[impl], a, grad)
                    m, res = measure(run, budget, max_reps)
                    trow.update(m, ratio_f=m["fwd"] / sg_fwd, ratio_b=m["bwd"] / sg_bwd, ratio_fb=m["fb"] / sg_fb)
                    # the same numbers as ssmgrad's, at the timed shape?
                    if kind == "scan":
                        y, fin, grads = res
                        out = np.concatenate([y.numpy().ravel(), fin.numpy().ravel()])
                        sgo = sg_out[0]
                        parts = sg.split(sg_out[1], a["s"].shape, a["x"].shape, a["dt"].shape, a["B"].shape, a["C"].shape)
                        errs = [rel_err(out, sgo)] + [rel_err(g.numpy(), q) for g, q in zip(grads, parts)]
                    else:
                        y, grads = res
                        errs = [rel_err(y.numpy(), sg_out[0]), rel_err(grads[0].numpy(), sg_out[1]),
                                rel_err(grads[1].numpy(), sg_out[2])]
                    del res
                    worst = max(errs)
                    trow["notes"].append(f"agree {worst:.0e}" + ("" if worst <= AGREE_TOL else " MISMATCH"))
                    if m["reps"] == "1*":
                        trow["notes"].append("single run")
                    rows.append(trow)
                    log(f"  {shape:9s} n_t={n_t:5d} {thr}T {impl:14s} fwd {fmt_ms(m['fwd'])} ms, bwd {fmt_ms(m['bwd'])} ms"
                        f" ({m['reps']} reps), fwd+bwd {m['fb'] / sg_fb:.3g}x ssmgrad")
            sg_results.pop((shape, n_t), None)            # compared with every thread count: free it
    train_rows, train_md = [], []
    peak = fma_peak(log)
    if not args.no_train:
        log("training-scale shapes ...")
        train_rows, train_md = train_section(sg, train_cases, threads, budget, max_reps, failures, cfg,
                                             args.no_mem, log)
        if args.train_only:
            md = [f"# ssmgrad training-scale shapes (`python benchmarks/bench.py {' '.join(sys.argv[1:])}`)", ""]
            md += machine_description(sg) + [f"- load average {load_start[0]:.2f} at start, {os.getloadavg()[0]:.2f} at end", ""]
            md += train_md + [""] + train_targets(train_rows, peak) + ["", "## Validation (before timing)", ""] + val_lines + [""]
            out = args.out or tempfile.gettempdir()
            with open(os.path.join(out, "train.md"), "w") as f:
                f.write("\n".join(md))
            print("\n".join(md))
            log(f"wrote {os.path.join(out, 'train.md')}")
            return 1 if failures else 0
    comp_rows, comp_md, comp_s = [], [], 0.0
    if comp_cases:
        log(f"compiled peer (torch.compile, mode {cfg['compile_mode']}, chunk {cfg['compile_chunk']}) ...")
        t0 = time.time()
        comp_rows, comp_md = train_section(sg, comp_cases, comp_threads, budget, max_reps, failures, cfg, True, log)
        comp_s = time.time() - t0
    dec, dec_bytes = (None, None) if args.no_decode else decode_vs_copy(sg, threads, 200 if quick else 2000, log)
    ok_shapes = {k: v for k, v in shapes.items()
                 if f"{'conv' if v[0] == 'conv' else k}/ssmgrad" not in failures}
    inter = interleaved_sweep(sg, ok_shapes, sorted(set(nts) | set(sweep)), threads, 2 if quick else 7, log)
    cv = conv_variants(sg, ok_shapes, sorted(n for n in set(nts) | set(sweep) if n >= (0 if quick else 512)),
                       threads, 2 if quick else 7, log)
    busy_res = None
    if not args.no_busy:
        busy_res = busy_machine(max(threads), 2 if quick else 8, 2 if quick else 10, log)
    sg.set_num_threads(max(threads))
    bw = copy_bandwidth(64 << 20 if quick else 512 << 20)
    load_end = os.getloadavg()
    others = other_load(cpu_start, cpu_snapshot())

    # 3. report
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python benchmarks/bench.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = [f"# ssmgrad benchmarks{' (QUICK smoke test: tiny shapes, not representative)' if quick else ''}", "",
          f"Generated {now} by `{cmd.strip()}` in {time.time() - t_start:.0f} s.", ""]
    md += machine_description(sg)
    busy = (f"; other processes used {others[0]:.2f} cores on average during the timing (hypervisor steal "
            f"{others[1]:.2f})" if others else "")
    md.append(f"- Threads timed: {', '.join(map(str, threads))} (ssmgrad.set_num_threads and torch.set_num_threads); "
              f"load average {load_start[0]:.2f} at start, {load_end[0]:.2f} at end (this run's own threads "
              f"included){busy}; numpy copy bandwidth {bw:.3g} GB/s.")
    md.append(f"- One core's float32 FMA peak (benchmarks/probes/peak.c): {peak:.1f} GFLOP/s." if peak else
              "- One core's FMA peak: not measured (benchmarks/probes/peak.c needs AVX-512 and a C compiler).")
    if (others[0] if others else load_start[0]) > 0.1 * (os.cpu_count() or 1):
        md.append("- **The machine was not idle** (above): times, thread speedups and the sweep are "
                  "noisy; rerun on an idle machine before quoting them.")
    md += ["", "## Results", "",
           "float32, one sequence. Times are medians over `reps` repeats after one warm-up (`1*`: a single run, "
           "the warm-up itself, because one run exceeded twice the per-cell budget of "
           f"{budget:g} s). `x ssmgrad` = torch time / ssmgrad time. "
           "Throughput columns: GFLOP/s for the scan on the count of the form each kernel takes (bench.py's "
           "scan_flops: the recurrence 5 FLOP per state update forward, 14 Mamba-2 / 19 Mamba-1 backward; the chunked "
           "Mamba-2 forward 4 N P + P (Q + 1) per token and head plus N (Q + 1) per token and block of 8 heads, the "
           "chunked backward 10 P N + 2 Q P per token and head plus 3 Q N per token and unit of heads, Q = 64), GB/s of bytes moved for the conv. `bwd extra MB`: peak RSS of one ssmgrad backward beyond "
           "its inputs and output (fresh subprocess). torch fwd records autograd; torch bwd is autograd.grad "
           "w.r.t. s, x, dt, B, C (A frozen) or sx, c. `agree`: worst max|torch - ssmgrad| / max|ssmgrad| over the "
           f"output and every gradient at the timed shape (flagged above {AGREE_TOL:g}). n_t = "
           f"{', '.join(map(str, sweep))}: ssmgrad only (linearity sweep).", ""]
    md += [f"Shapes: " + "; ".join(f"`{k}` = {SHAPE_LABEL[k]}" + (" (quick: scaled down " + json.dumps(v[1]) + ")" if quick else "")
                                   for k, v in shapes.items()), ""]
    tab = table(rows)
    md += tab
    md += ["", "## Against the targets: scan speed, conv bandwidth, time per token", ""]
    md += summary(rows, shapes, nts, sweep, threads, bw, inter)
    md += conv_variant_lines(cv, shapes, threads, bw)
    if busy_res is not None:
        md += ["", "## Next to a busy process", "",
               "One busy process (a Python loop on one core) beside ssmgrad's calls, in phases alternating with "
               "quiet ones (`python benchmarks/bench.py --busy` runs only this)."] + [""] + busy_table(busy_res, max(threads))
    if train_md:
        md += ["", "## Training-scale shapes", "",
               "float32; batches of `n_seqs` sequences, each with its own state row. "
               + "; ".join(f"`{k}` = {v}" for k, v in TRAIN_LABEL.items()) + ". Torch peers: the fastest "
               "formulation of each kind at the 130m shapes; see TRAIN_CASES in bench.py for the ones left out "
               "for memory.", ""] + train_md + [""] + train_targets(train_rows, peak)
    if comp_md:
        compiles = [r["compile_s"] for r in comp_rows if "compile_s" in r]
        md += ["", "## Against the compiled peer", "",
               f"`torch.compile` of the chunked SSD form (ssmgrad/_bench_peers.py scan_ssd, chunk {cfg['compile_chunk']}), "
               f"inductor on CPU, mode `{cfg['compile_mode']}`, `dynamic=False`, `fullgraph=True`, compiled afresh for "
               "each shape and thread count (inductor fixes the thread count in its C++ kernels) "
               + ("in an empty inductor cache (cold compiles)" if inductor_dir else
                  f"with the inductor cache at {os.environ.get('TORCHINDUCTOR_CACHE_DIR')} (compiles may be cache hits)")
               + "; the first call compiles and is not a timed sample (`compile` note"
               + (f": {min(compiles):.0f}" + (f"–{max(compiles):.0f}" if len(compiles) > 1 else "") + " s here"
                  if compiles else "")
               + f"). Eager SSD and ssmgrad are timed beside it in the same cells; float32, one sequence. The "
               f"section took {comp_s:.0f} s, compiles included (`--no-compiled` skips it).", ""] + comp_md
    if dec is not None:
        md += ["", "## Decode step against a copy of its state", ""] + decode_lines(dec, dec_bytes)
    md += ["", "## Scan targets: compiled peer, FMA peak, decode", "",
           "Computed from this run's tables above (medians, and the same ratios of the fastest runs); "
           "`-`: no verdict (not measured). What limits each missed one: docs/performance.md." + ("" if not quick else
           " QUICK run: tiny shapes, the verdicts mean nothing."), ""]
    md += scan_targets(rows, comp_rows, train_rows, dec, inter, shapes, threads, peak, bw)
    md += ["", "## Validation (before timing)", ""] + val_lines
    if failures:
        md += ["", "Not timed (failed validation): " + "; ".join(f"{k}: {v}" for k, v in failures.items())]
    md.append("")
    print("\n".join(tab))
    with open(os.path.join(out_dir, "results.md"), "w") as f:
        f.write("\n".join(md))
    log(f"wrote {os.path.join(out_dir, 'results.md')}")
    if inductor_dir:
        import shutil
        shutil.rmtree(inductor_dir, ignore_errors=True)
    if not args.no_plot:
        try:
            write_plot(rows, os.path.join(out_dir, "results.png"), list(shapes))
            log(f"wrote {os.path.join(out_dir, 'results.png')}")
        except ImportError:
            log("matplotlib is not installed: no plot (pip install matplotlib)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
