"""What every benchmark script shares: the shapes, inputs, the validation of every implementation
against the float64 reference (benchmarks/peers.py: tests/reference.py), the timing loop with
medians, the backward's peak memory, the machine's description, one core's FMA peak, the copy
bandwidth, the command-line flags and the writing of a markdown section. Not a script itself
(`python benchmarks/common.py --mem-child SPEC` is the memory measurement's child process).

Conventions: torch "fwd" is the training forward (autograd recording on); "bwd" is
torch.autograd.grad for s, x, dt, B, C (scan) or sx, c (conv), A frozen, like ssmgrad's
ssm_scan_back without d_A and ssm_conv_back + ssm_conv_back_weight. FLOP per state update
(n_t*n_head*head_dim*d_state of them): forward 5, backward 14 (Mamba-2) or 19 (Mamba-1). Conv
throughput is in GB/s of the bytes the op must move (inputs read once, outputs written once).
"""

import argparse
import contextlib
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
if ROOT not in sys.path:
    sys.path.insert(1, ROOT)                            # the in-place build of ssmgrad

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
    products of d_B and d_C with D summed over the unit's heads), Q = 64, P = head_dim, N = d_state;
    8 P N instead of 10 where both forms are chunked, as sg_scan_runner runs them: the backward then
    reads the forward's chunk states (keep_states) instead of recomputing them."""
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
        pn = 8 if forms["fwd"] == "chunked" and K == 1 else 10
        flop_b = n_t * (nq * h * (pn * P * N + 2 * CQ * P) + forms["back_units"] * 3 * CQ * N)
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
IMPL_LABEL = {"ssmgrad": "ssmgrad", "loop": "torch unbind loop", "ssd": "torch SSD chunked",
              "pscan": "mambapy pscan", "conv1d": "torch F.conv1d",
              "ssd_compiled": "torch.compile SSD (inductor)"}


# The compiled peer: scan_ssd through torch.compile (inductor, CPU), shape-specialized
# (dynamic=False), one compile per shape and thread count (inductor bakes the thread count into its
# C++ kernels), timed after the compile. Settings picked by measurement (benchmarks/README.md,
# "The compiled peer"): the default mode, chunk 128.
COMPILE_MODE = "default"
COMPILE_CHUNK = 128
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


class _Validation:
    """The validation table being filled: report lines and {impl_key: failure text}."""

    def __init__(self, log):
        self.log, self.failures, self.lines = log, {}, []

    def record(self, key, dtype, errs):
        worst = max(errs.values())
        ok = worst <= TOL[dtype]
        detail = ", ".join(f"{k} {v:.1e}" for k, v in errs.items())
        self.lines.append(f"| {key} | {dtype} | {worst:.2e} | {'ok' if ok else 'FAIL'} | {detail} |")
        if not ok:
            self.failures.setdefault(key, f"{dtype}: worst {worst:.2e} > {TOL[dtype]:g} ({detail})")
        self.log(f"  validate {key:16s} {dtype:8s} worst rel err {worst:.2e} {'ok' if ok else 'FAIL'}")

    def crashed(self, key, dtype, exc):                  # a crash is a failure, not an abort
        self.failures.setdefault(key, f"{dtype}: {type(exc).__name__}: {exc}")
        self.lines.append(f"| {key} | {dtype} | - | FAIL | {type(exc).__name__}: {exc} |")
        self.log(f"  validate {key:16s} {dtype:8s} FAIL {type(exc).__name__}: {exc}")


VALIDATE_SCAN = {                                        # small shapes, n_group 2
    "mamba1": dict(n_head=6, head_dim=2, d_state=8, n_group=2, m1=True),
    "mamba2": dict(n_head=4, head_dim=8, d_state=16, n_group=2, m1=False),
}
VALIDATE_NT = 150                                        # not a power of 2, > 2 SSD chunks of 64


def _scan_impl_outputs(sg, impl, ad, gpacked, dtype, n_y, cfg):
    """(packed output, {input: gradient}) of one implementation at the validation inputs ``ad``."""
    import torch
    if impl == "ssmgrad":
        out = sg.ssm_scan(*(ad[k] for k in SCAN_ARGS), ad["ids"])
        return out, sg_scan_grads(sg, ad, gpacked.astype(dtype), return_dA=True)
    tdt = torch.float64 if dtype == "float64" else torch.float32
    return torch_scan_outputs(scan_peer(impl, cfg), ad, tdt, SCAN_ARGS, gpacked, n_y)


def _validate_scan(sg, shape, want, rng, cfg, v):
    import torch
    import peers as ti
    p = VALIDATE_SCAN[shape]
    a = scan_inputs(p, VALIDATE_NT, np.float64, rng, n_seqs=2, n_rs=3, ids=(2, 0))
    a["dt"][0, 3, 0] = 25.0                            # the softplus threshold branch
    n_y, n_s = scan_sizes(p, VALIDATE_NT, 2)
    gpacked = rng.standard_normal(n_y + n_s)
    rt = {k: torch.tensor(a[k], requires_grad=True) for k in SCAN_ARGS}
    rout = ti.ref_ssm_scan(*(rt[k] for k in SCAN_ARGS), a["ids"])
    rgrads = torch.autograd.grad(rout, [rt[k] for k in SCAN_ARGS], torch.tensor(gpacked))
    rout = rout.detach().numpy()
    rgrads = {k: g.numpy() for k, g in zip(SCAN_ARGS, rgrads)}
    for dtype in ("float64", "float32"):
        ad = {k: (x.astype(dtype) if k != "ids" else x) for k, x in a.items()}
        for impl in want:
            try:
                out, grads = _scan_impl_outputs(sg, impl, ad, gpacked, dtype, n_y, cfg)
                errs = {"y": rel_err(out[:n_y], rout[:n_y]), "state": rel_err(out[n_y:], rout[n_y:])}
                errs.update({f"d_{k}": rel_err(grads[k], rgrads[k]) for k in SCAN_ARGS})
                v.record(f"{shape}/{impl}", dtype, errs)
            except Exception as exc:
                v.crashed(f"{shape}/{impl}", dtype, exc)


def _conv_impl_outputs(sg, impl, sx, c, gd, dtype):
    """(y, d_sx, d_c) of one conv implementation."""
    import torch
    import peers as ti
    if impl == "ssmgrad":
        return sg.ssm_conv(sx, c), sg.ssm_conv_back(sx, c, gd), sg.ssm_conv_back_weight(sx, c, gd)
    tdt = torch.float64 if dtype == "float64" else torch.float32
    tsx = torch.tensor(sx, dtype=tdt, requires_grad=True)
    tc = torch.tensor(c, dtype=tdt, requires_grad=True)
    ty = ti.CONV_IMPLS[impl](tsx, tc)
    dsx, dc = (g.numpy() for g in torch.autograd.grad(ty, [tsx, tc], torch.tensor(gd)))
    return ty.detach().numpy(), dsx, dc


def _validate_conv(sg, want, rng, v):
    import torch
    import peers as ti
    a = conv_inputs(dict(d_inner=16, d_conv=4), 37, np.float64, rng, n_s=2)
    g = rng.standard_normal((2, 37, 16))
    rt = {k: torch.tensor(a[k], requires_grad=True) for k in ("sx", "c")}
    ry = ti.ref_ssm_conv(rt["sx"], rt["c"])
    rd = torch.autograd.grad(ry, [rt["sx"], rt["c"]], torch.tensor(g))
    ry, rd = ry.detach().numpy(), [x.numpy() for x in rd]
    for dtype in ("float64", "float32"):
        sx, c, gd = a["sx"].astype(dtype), a["c"].astype(dtype), g.astype(dtype)
        for impl in want:
            try:
                y, dsx, dc = _conv_impl_outputs(sg, impl, sx, c, gd, dtype)
                v.record(f"conv/{impl}", dtype, {"y": rel_err(y, ry), "d_sx": rel_err(dsx, rd[0]), "d_c": rel_err(dc, rd[1])})
            except Exception as exc:
                v.crashed(f"conv/{impl}", dtype, exc)


def validate(sg, impls_wanted, log, cfg):
    """Check every implementation of ``impls_wanted`` ({"mamba1" | "mamba2" | "conv": [impl, ...]})
    at small shapes in float64 and float32 against the float64 reference. Returns
    ({impl_key: failure text} for failures, list of report lines)."""
    import peers as ti
    rng = np.random.default_rng(1234)
    v = _Validation(log)
    for shape in VALIDATE_SCAN:
        if impls_wanted.get(shape):
            _validate_scan(sg, shape, impls_wanted[shape], rng, cfg, v)
    if impls_wanted.get("conv"):
        _validate_conv(sg, impls_wanted["conv"], rng, v)
    head = [f"Reference: {ti.REFERENCE} (float64, torch autograd). Error = max|impl - ref| / max|ref| per tensor; "
            f"tolerance {TOL['float64']:g} (float64), {TOL['float32']:g} (float32). Scan: n_seqs 2, n_rs 3, "
            f"ids (2, 0), n_t {VALIDATE_NT}, n_group 2, one dt = 25; conv: n_s 2, 16 channels, n_t 37.",
            "", "| implementation | dtype | worst | result | per tensor |", "|---|---|---|---|---|"]
    return v.failures, head + v.lines


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
    """ssmgrad's training step: the forward keeps its chunk states, the backward reads them (where the
    kernels take the chunked forms; elsewhere nothing is kept)."""
    args = [a[k] for k in SCAN_ARGS] + [a["ids"]]

    def run():
        t0 = time.perf_counter()
        out, kept = sg.ssm_scan(*args, keep_states=True)
        t1 = time.perf_counter()
        gin = sg.ssm_scan_back(*args, grad, chunk_states=kept)
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

def lscpu():
    """lscpu's fields ("Model name", "CPU(s)", "Flags", "L2 cache", ...) as a dict; empty without lscpu."""
    info = {}
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return info
    for line in out.splitlines():
        if ":" in line:
            k, v = line.split(":", 1)
            info[k.strip()] = v.strip()
    return info


def machine_description(sg):
    check_isa(_ISA["isa"], sg)
    lines = []
    info = lscpu()
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
    lines.append(isa_line(_ISA["isa"]) + f"; torch's CPU capability {torch.backends.cpu.get_cpu_capability()}")
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


def peak_bits():
    """The vector width of this run's FMA peak: 256 under --isa avx2 (or SSMGRAD_SIMD=x86-64-v3) or on
    an AVX2-only host, else 512"""
    capped = _ISA["isa"] == "avx2" or os.environ.get("SSMGRAD_SIMD") == "x86-64-v3"
    return 256 if capped or host_isa() != "AVX-512" else 512


def peak_line(out):
    """The line of peak.c's output for this run's ISA (peak_bits)"""
    lines = [ln for ln in out.splitlines() if "GFLOP/s" in ln]
    pick = [ln for ln in lines if f"{peak_bits()}-bit" in ln]
    return (pick or lines or [""])[0]


def peak_probe(cpu_time=False, log=None):
    """(clock GHz, GFLOP/s) of benchmarks/probes/peak.c at the run's ISA (peak_line), timed in wall
    time or, with cpu_time, in this thread's CPU time (CLOCK_THREAD_CPUTIME_ID); None on a CPU without
    AVX2 or where the compiler fails (said through log)."""
    log = log or (lambda msg: None)
    if host_isa() == "baseline":
        log("FMA peak: not measured (peak.c needs AVX2 or AVX-512)")
        return None
    with tempfile.TemporaryDirectory() as d:
        src, exe = os.path.join(d, "peak.c"), os.path.join(d, "peak")
        text = open(os.path.join(HERE, "probes", "peak.c")).read()
        with open(src, "w") as f:
            f.write(text.replace("CLOCK_MONOTONIC", "CLOCK_THREAD_CPUTIME_ID") if cpu_time else text)
        cc = os.environ.get("CC", "cc")
        r = subprocess.run([cc, "-O2", src, "-o", exe], capture_output=True, text=True)
        if r.returncode != 0:
            log(f"FMA peak: not measured ({cc} failed: {r.stderr.strip()[:200]})")
            return None
        out = subprocess.run([exe], capture_output=True, text=True, check=True).stdout
    line = peak_line(out)
    log(f"FMA peak: {line.strip()}")
    m = re.search(r"clock ([0-9.]+) GHz.*= ([0-9.]+) GFLOP/s", line)
    return (float(m.group(1)), float(m.group(2))) if m else None


def fma_peak(log):
    """One core's float32 FMA peak in GFLOP/s at the run's ISA, in wall time (peak_probe), or None."""
    r = peak_probe(log=log)
    return r[1] if r else None


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


# ------------------------------------------------------------------------------------ scripts

def log(msg):
    print(msg, file=sys.stderr, flush=True)


def load_ssmgrad():
    import ssmgrad as sg
    if not hasattr(sg, "ssm_scan"):
        sys.exit(f"ssmgrad at {getattr(sg, '__path__', '?')} has no ssm_scan: build it first "
                 f"(python setup.py build_ext --inplace)")
    return sg


# --isa avx2: both sides capped to what an AVX2-only core runs, set before torch and ssmgrad load
# (ssmgrad reads SSMGRAD_SIMD at import, torch its capability and oneDNN's and MKL's ISA at load)
ISA_CAPS = {"avx2": {"SSMGRAD_SIMD": "x86-64-v3", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                     "MKL_ENABLE_INSTRUCTIONS": "AVX2"}}


def numpy_avx512_groups():
    """numpy's dispatch groups of AVX-512 code that this CPU runs ("X86_V4 AVX512_ICL ..."; numpy refuses to
    disable one the CPU lacks): NPY_DISABLE_CPU_FEATURES with them caps numpy to its AVX2 code too, so
    that a yardstick such as its exp is capped with the rest (numpy 2.x names)."""
    try:
        from numpy._core._multiarray_umath import __cpu_dispatch__, __cpu_features__
    except ImportError:
        return ""
    return " ".join(f for f in __cpu_dispatch__ if __cpu_features__.get(f) and (f == "X86_V4" or f.startswith("AVX512")))


def isa_env(isa):
    """The environment of a cap: ISA_CAPS's, and numpy's AVX-512 groups off where it has some."""
    env = dict(ISA_CAPS[isa])
    groups = os.environ.get("NPY_DISABLE_CPU_FEATURES") or numpy_avx512_groups()
    if groups:
        env["NPY_DISABLE_CPU_FEATURES"] = groups
    return env


def numpy_exp_ns(n=24576, reps=2000, rounds=7):
    """numpy's float32 exp, ns per element (n elements in cache, in place into a second array; the median
    of `rounds`): the yardstick of Mamba-1's cost per state update, whose step is one exp and two FMAs."""
    x = -np.random.default_rng(0).uniform(0.05, 8.0, n).astype(np.float32)
    o = np.empty_like(x)
    for _ in range(50):
        np.exp(x, out=o)
    ts = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(reps):
            np.exp(x, out=o)
        ts.append((time.perf_counter() - t) / reps / n * 1e9)
    return statistics.median(ts)


def host_isa():
    """The widest x86 vector ISA this CPU has: "AVX-512", "AVX2" or "baseline" (another machine)."""
    try:
        flags = open("/proc/cpuinfo").read().split()
    except OSError:
        flags = []
    return "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags and "fma" in flags else "baseline"


_ISA = {"isa": "native"}   # the run's --isa, set by apply_isa (settings() calls it), read by machine_description


def isa_line(isa):
    """The report's line for --isa: the host's ISA and the cap"""
    if isa in (None, "native"):
        return f"- ISA: the host's ({host_isa()}), uncapped"
    return (f"- ISA: capped to {isa.upper()} on {'an' if host_isa()[0] in 'AE' else 'a'} {host_isa()} host ("
            + ", ".join(f"{k}={v}" for k, v in isa_env(isa).items())
            + "): the wider core's caches, clock and issue width stay, so this is not the same as an AVX2 core")


def apply_isa(isa):
    """For --isa: run this script again with the cap's environment unless it is set already (it
    must be in place before torch and ssmgrad are imported). Returns the line the report states."""
    _ISA["isa"] = isa or "native"
    if isa in (None, "native"):
        return isa_line(isa)
    env = isa_env(isa)
    if any(os.environ.get(k) != v for k, v in env.items()):
        sys.stdout.flush()
        sys.stderr.flush()
        # inductor's kernels compiled under the cap in a cache of their own: an uncapped run that
        # loaded them from the shared default cache aborted in the compiled peer ("free(): invalid
        # pointer", torch 2.13)
        extra = {} if "TORCHINDUCTOR_CACHE_DIR" in os.environ else {
            "TORCHINDUCTOR_CACHE_DIR": os.path.join(tempfile.gettempdir(), f"torchinductor-{isa}")}
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, **env, **extra))
    return isa_line(isa)


def check_isa(isa, sg):
    """That the cap took on both sides: ssmgrad's selected pass and torch's CPU capability."""
    if isa in (None, "native"):
        return
    import torch
    sel = sg._ext.build_info()["simd_selected"].split(" ")[0]
    cap = torch.backends.cpu.get_cpu_capability()
    if sel != "x86-64-v3" or cap.upper() != "AVX2":
        sys.exit(f"--isa {isa}: ssmgrad runs {sel}, torch {cap}: the cap did not take")
    if numpy_avx512_groups():
        sys.exit(f"--isa {isa}: numpy still runs its {numpy_avx512_groups()} code: the cap did not take")


def add_isa_flag(ap):
    ap.add_argument("--isa", choices=["native", *ISA_CAPS], default="native",
                    help="native (default) or avx2: both ssmgrad and torch (ATen, oneDNN, MKL) capped to AVX2")


def add_with_avx2_flag(ap):
    ap.add_argument("--with-avx2", action="store_true",
                    help="on an AVX-512 host: after this uncapped run, the same run again capped to AVX2 (--isa "
                         "avx2), its report appended as a section of the same file (both ISAs' rows)")


def check_with_avx2(ap, args):
    """--with-avx2 is for an uncapped run on an AVX-512 host (elsewhere the run is AVX2 or less already)."""
    if getattr(args, "with_avx2", False):
        if args.isa not in (None, "native"):
            ap.error("--with-avx2 runs the capped pass itself: leave --isa out")
        if host_isa() != "AVX-512":
            ap.error(f"--with-avx2: this host's widest ISA is {host_isa()}, so the run is not capped by anything")


def _without_flags(argv, with_value, alone):
    """ARGV less the flags WITH_VALUE (with their value, as --f v or --f=v) and the flags ALONE."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a.split("=", 1)[0] in with_value:
            skip = "=" not in a
        elif a not in alone:
            out.append(a)
    return out


def avx2_report(script, argv, out_name=None, extra=()):
    """For --with-avx2: SCRIPT (a file of benchmarks/) run again with the same ARGV capped to AVX2 (--isa avx2,
    EXTRA added), its report written into a temp dir (--out DIR, the report DIR/OUT_NAME; or --out FILE when
    OUT_NAME is None), returned as markdown lines under a heading of their own, its headings one level down."""
    args = _without_flags(argv, {"--out", "--isa"}, {"--with-avx2"}) + list(extra)
    with tempfile.TemporaryDirectory(prefix="ssmgrad-avx2-") as d:
        out = os.path.join(d, out_name or "report.md")
        cmd = [sys.executable, os.path.join(HERE, script), *args, "--isa", "avx2", "--out", d if out_name else out]
        log(f"--with-avx2: {' '.join(cmd[1:])}")
        # an inductor cache of its own: the parent's (bench.py's fresh one, inherited) holds kernels compiled
        # uncapped, which the capped run would load and crash in ("SystemError ... returned a result with an
        # exception set" from the compiled peer's kernel)
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(d, "inductor"))
        rc = subprocess.run(cmd, env=env).returncode
        if rc or not os.path.exists(out):
            sys.exit(f"--with-avx2: the capped run failed (exit {rc})")
        lines = open(out).read().splitlines()
    body = lines[1:] if lines and lines[0].startswith("# ") else lines
    return (["", f"## The same run capped to AVX2 (`{script} --isa avx2`, right after, on this host)", ""]
            + ["#" + ln if ln.startswith("#") else ln for ln in body])


def parser(doc, out_help="directory for the markdown written (default: a temp dir)"):
    """The flags every script takes; each script adds its own."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    add_isa_flag(ap)
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 1-2 repeats: a smoke test")
    ap.add_argument("--out", help=out_help)
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (default 1,2)")
    ap.add_argument("--budget", type=float, help="seconds of repeats per cell (default 3, quick 0.2)")
    ap.add_argument("--chunk", type=int, default=64, help="SSD chunk size of the eager SSD peer (default 64)")
    return ap


def settings(args):
    """The run's settings from the common flags: quick, threads, budget, max_reps, cfg (the peers'
    chunk sizes and compile mode, as scan_peer takes them). With --isa avx2 the script first runs
    itself again under the cap (apply_isa)."""
    apply_isa(getattr(args, "isa", "native"))
    quick = args.quick
    return dict(quick=quick, threads=[int(v) for v in args.threads.split(",")],
                budget=args.budget if args.budget is not None else (0.2 if quick else 3.0),
                max_reps=2 if quick else 31,
                cfg=dict(chunk=args.chunk, compile_chunk=getattr(args, "compile_chunk", COMPILE_CHUNK),
                         compile_mode=getattr(args, "compile_mode", COMPILE_MODE)))


def validate_first(sg, want, cfg):
    """Validation before any timing, one thread: (failures, report lines)."""
    import torch
    log("validating against the float64 reference ...")
    torch.set_num_threads(1)
    sg.set_num_threads(1)
    failures, lines = validate(sg, want, log, cfg)
    if any(k.endswith("/ssmgrad") for k in failures):
        log("ssmgrad itself failed validation: ratios against it would be meaningless")
    return failures, lines


def validation_lines(val_lines, failures):
    md = ["", "## Validation (before timing)", ""] + val_lines
    if failures:
        md += ["", "Not timed (failed validation): " + "; ".join(f"{k}: {v}" for k, v in failures.items())]
    return md


def write_section(sg, args, name, section, val_lines, failures):
    """A script's own report: ``name``.md in --out (default a temp dir) with the machine, its section
    and the validation table; printed too. Returns the exit status (1 if anything failed validation)."""
    cmd = f"python benchmarks/{os.path.basename(sys.argv[0])} {' '.join(sys.argv[1:])}".strip()
    md = [f"# ssmgrad benchmark: {name}{' (QUICK smoke test)' if args.quick else ''}", "", f"`{cmd}`", ""]
    md += machine_description(sg) + [f"- load average {os.getloadavg()[0]:.2f} at the end", ""]
    md += section + validation_lines(val_lines, failures) + [""]
    out = args.out or tempfile.gettempdir()
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write("\n".join(md))
    print("\n".join(md))
    log(f"wrote {os.path.join(out, name + '.md')}")
    return 1 if failures else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--mem-child"]:
        mem_child(json.loads(sys.argv[2]))
    else:
        sys.exit(__doc__)
