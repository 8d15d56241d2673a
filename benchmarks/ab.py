#!/usr/bin/env python
"""A/B timing, interleaved: two (or more) builds of ssmgrad, or two forms of one scan kernel.

    # builds: each DIR is a source tree built in place (python setup.py build_ext --inplace),
    # e.g. a `git worktree` of the parent commit, or a copy built with CC=clang
    python benchmarks/ab.py builds DIR_A DIR_B [DIR_C ...] [--rounds 8] [--n-t 512] [--ops scan_mamba2,conv]

    # forms: the Mamba-2 scan forward's or backward's recurrence vs chunked form, in this build
    python benchmarks/ab.py forms fwd  [--nt 16,64,512,2048,8192] [--threads 1,2] [--reps 7]
    python benchmarks/ab.py forms back [--nt 512,2048,8192] [--shapes 130m,2.7b,grouped] [--dtype float64]

Validate, then time (llm.c's loop): nothing is timed before its results are checked.

builds: each round starts one fresh process per build (in alternating order) that imports ssmgrad
from that DIR only (checked). In the first round each build's outputs and gradients at the timed
shapes are checked against the float64 torch reference (tests/reference.py, the test suite's
oracle: max error relative to the largest value < 1e-3), and the builds' output hashes are
compared (printed: bitwise identical or not). Each op is timed on one thread: the median of
repeated calls for about 0.6 s, each call in CPU time of the calling thread (time.thread_time), so
that time spent descheduled on a busy machine is not counted (cache and core sharing still are).
Printed per op: the median over rounds of each build's time and of its ratio to the first build's
time in the same round, so that load that changes between rounds cancels out.
Ops: scan and scan_back at Mamba-1 (1536 heads x 1 x d_state 16) and Mamba-2 (24 heads x 64 x 128)
shapes (scan_back_kept_mamba2: with the forward's chunk states, as training runs it), conv, conv_back, conv_back_weight at d_inner 1536, d_conv 4, and where the build has it the
Gated DeltaNet forward and backward (gdn, gdn_back; gdn_keep and gdn_back_kept: the forward keeping its
chunks and the backward reading them, as training runs it; gdn_kda*: the per-channel gate) at Qwen3-Next's
layer (H_v 32, H_k 16, S 128); float32. The SIMD pass is the environment's (SSMGRAD_SIMD=x86-64-v3:
the AVX2 kernels).

forms: one process; for each shape and n_t the two forms' results are first checked against each
other (float32 rounding: relative 1e-4; float64: 1e-12; each form is checked against the torch
reference by tests/kernels/test_scan_back_chunked.py and tests/kernels/test_scan_fwd_chunked.py), then timed in
alternating calls; the ratio of the medians is the figure to read on a shared machine. The
forward also prints GFLOP/s: the recurrence's count, 5 FLOP per state element and token (2 mul +
1 add for the update, 2 for y); the chunked form's, per token and head, 4 N P (C.S0 and
B^T.(decay Xs)) + P (Q + 1) (the lower-triangular (L o CB).Xs) plus, per token and block of up to
8 heads of a group, N (Q + 1) (C.B^T, lower triangle), N = d_state, P = head_dim, Q = 64 tokens
per chunk. Compare with one core's FMA peak (benchmarks/probes/peak.c).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))   # the forms mode's ssmgrad: this tree
SHAPES = {  # Mamba-2 shapes of the forms mode: name: (n_head, head_dim, d_state, n_group)
    "130m": (24, 64, 128, 1),
    "2.7b": (80, 64, 128, 1),
    "grouped": (128, 64, 128, 8),
}
Q, FBH = 64, 8          # tokens per chunk, heads per block of the chunked forward

# ----------------------------------------------------------------------------------------------
# builds

WORKER = r'''
import hashlib, json, os, sys, time
d = os.path.realpath(sys.argv[1])
n_t = int(sys.argv[2])
validate = sys.argv[3] == "1"
sys.path.insert(0, d)
import numpy as np
import ssmgrad
import _ssmgrad
assert os.path.realpath(_ssmgrad.__file__).startswith(d + os.sep), _ssmgrad.__file__
ssmgrad.set_num_threads(1)
rng = np.random.default_rng(0)
f32 = np.float32
times, errs, hashes = {}, {}, {}


def timeit(name, fn, secs=0.6):
    res = fn()
    hashes[name] = hashlib.sha256(np.ascontiguousarray(res).tobytes()).hexdigest()[:16]
    ts = []
    t_end = time.perf_counter() + secs
    while time.perf_counter() < t_end or len(ts) < 5:
        t0 = time.thread_time()
        fn()
        ts.append(time.thread_time() - t0)
    ts.sort()
    times[name] = ts[len(ts) // 2]


def rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


if validate:
    import torch
    sys.path.insert(1, sys.argv[4])                     # this tree's tests/: the reference
    from reference import ref_ssm_conv, ref_ssm_scan

    def ref_grads(f, args, grad):
        t = [torch.tensor(np.asarray(a, np.float64), requires_grad=True) for a in args]
        out = f(*t)
        g = torch.autograd.grad(out, t, torch.tensor(np.asarray(grad, np.float64)).reshape(out.shape))
        return out.detach().numpy(), [v.numpy() for v in g]

for shape, (h, hd, n, m1) in {"mamba1": (1536, 1, 16, True), "mamba2": (24, 64, 128, False)}.items():
    s = rng.standard_normal((1, h, hd, n)).astype(f32)
    x = rng.standard_normal((1, n_t, h, hd)).astype(f32)
    dt = rng.standard_normal((1, n_t, h)).astype(f32)
    A = -np.abs(rng.standard_normal((h, n) if m1 else (h, 1))).astype(f32)
    B = rng.standard_normal((1, n_t, 1, n)).astype(f32)
    C = rng.standard_normal((1, n_t, 1, n)).astype(f32)
    ids = np.zeros(1, np.int64)
    out = ssmgrad.ssm_scan(s, x, dt, A, B, C, ids)
    grad = rng.standard_normal(out.shape).astype(f32)
    if validate:
        want, g = ref_grads(lambda s, x, dt, A, B, C: ref_ssm_scan(s, x, dt, A, B, C, ids), (s, x, dt, A, B, C), grad)
        errs[f"scan_{shape}"] = rel_err(out, want)
        gin = ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, grad)
        errs[f"scan_back_{shape}"] = rel_err(gin, np.concatenate([g[i].ravel() for i in (0, 1, 2, 4, 5)]))
    timeit(f"scan_{shape}", lambda: ssmgrad.ssm_scan(s, x, dt, A, B, C, ids))
    timeit(f"scan_back_{shape}", lambda: ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, grad))
    if not m1:   # the backward as training runs it: with the forward's chunk states
        kept = ssmgrad.ssm_scan(s, x, dt, A, B, C, ids, keep_states=True)[1]
        if validate:
            gk = ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, grad, chunk_states=kept)
            errs[f"scan_back_kept_{shape}"] = rel_err(gk, np.concatenate([g[i].ravel() for i in (0, 1, 2, 4, 5)]))
        timeit(f"scan_back_kept_{shape}", lambda: ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, grad,
                                                                        chunk_states=kept))
d_inner, d_conv = 1536, 4
sx = rng.standard_normal((1, d_inner, d_conv - 1 + n_t)).astype(f32)
c = rng.standard_normal((d_inner, d_conv)).astype(f32)
gy = rng.standard_normal((1, n_t, d_inner)).astype(f32)
if validate:
    want, g = ref_grads(ref_ssm_conv, (sx, c), gy)
    errs["conv"] = rel_err(ssmgrad.ssm_conv(sx, c), want)
    errs["conv_back"] = rel_err(ssmgrad.ssm_conv_back(sx, c, gy), g[0])
    errs["conv_back_weight"] = rel_err(ssmgrad.ssm_conv_back_weight(sx, c, gy), g[1])
timeit("conv", lambda: ssmgrad.ssm_conv(sx, c))
timeit("conv_back", lambda: ssmgrad.ssm_conv_back(sx, c, gy))
timeit("conv_back_weight", lambda: ssmgrad.ssm_conv_back_weight(sx, c, gy))
if hasattr(ssmgrad, "gated_delta_net"):   # Qwen3-Next's layer: H_v 32, H_k 16, S 128, both gates
    sys.path.insert(1, sys.argv[4])
    from reference import make_gdn_inputs, gdn_args
    for gate, kda in (("gdn", False), ("gdn_kda", True)):
        if validate:   # at 130 tokens (3 chunks): the torch reference keeps every state for autograd
            from reference import ref_gated_delta_net
            va = gdn_args(make_gdn_inputs(rng, n_seqs=1, n_t=130, H_v=32, H_k=16, S=128, kda=kda, dtype=f32))
            vo = ssmgrad.gated_delta_net(*va)
            vg = rng.standard_normal(vo.shape).astype(f32)
            want, g = ref_grads(ref_gated_delta_net, va, vg)
            errs[gate] = rel_err(vo, want)
            errs[gate + "_back"] = rel_err(ssmgrad.gated_delta_net_back(*va, vg), np.concatenate([v.ravel() for v in g]))
            vk = ssmgrad.gated_delta_net(*va, keep_states=True)[1]
            errs[gate + "_back_kept"] = rel_err(ssmgrad.gated_delta_net_back(*va, vg, chunk_states=vk),
                                                np.concatenate([v.ravel() for v in g]))
        ga = gdn_args(make_gdn_inputs(rng, n_seqs=1, n_t=n_t, H_v=32, H_k=16, S=128, kda=kda, dtype=f32))
        gg = rng.standard_normal(ssmgrad.gated_delta_net(*ga).shape).astype(f32)
        timeit(gate, lambda: ssmgrad.gated_delta_net(*ga))
        timeit(gate + "_back", lambda: ssmgrad.gated_delta_net_back(*ga, gg))
        gk = ssmgrad.gated_delta_net(*ga, keep_states=True)[1]   # as training runs it (an empty array where
        timeit(gate + "_keep", lambda: ssmgrad.gated_delta_net(*ga, keep_states=True)[0])   # the form keeps none)
        timeit(gate + "_back_kept", lambda: ssmgrad.gated_delta_net_back(*ga, gg, chunk_states=gk))
print(json.dumps({"times": times, "errs": errs, "hashes": hashes, "simd": ssmgrad._ext.build_info()["simd_compiled"]}))
'''


def ab_builds(a):
    dirs = [os.path.realpath(d) for d in a.dirs]
    data = {d: {} for d in dirs}
    first = {}
    for r in range(a.rounds):
        for d in (dirs if r % 2 == 0 else dirs[::-1]):
            out = subprocess.run([sys.executable, "-c", WORKER, d, str(a.n_t), "1" if r == 0 else "0",
                                  os.path.join(ROOT, "tests")],
                                 capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{d}: {out.stderr}")
            res = json.loads(out.stdout.strip().splitlines()[-1])
            bad = {k: e for k, e in res["errs"].items() if not e < 1e-3}
            if bad:
                sys.exit(f"{d}: outputs differ from the float64 reference: {bad}")
            if r == 0:
                first[d] = res
                print(f"{d}: {res['simd']}; max rel. err vs reference {max(res['errs'].values()):.1e}")
            for k, v in res["times"].items():
                data[d].setdefault(k, []).append(v)
    ref = dirs[0]
    for d in dirs[1:]:
        diff = [k for k in first[ref]["hashes"] if first[ref]["hashes"][k] != first[d]["hashes"].get(k)]
        print(f"{os.path.basename(d)} vs {os.path.basename(ref)}: outputs "
              + ("bitwise identical" if not diff else "DIFFER in " + ", ".join(diff)))
    names = [os.path.basename(d) for d in dirs]
    print(f"\n{'op (us, x vs ' + names[0] + ')':28s} " + " ".join(f"{n:>16s}" for n in names))
    for op in data[ref]:
        if a.ops and op not in a.ops.split(","):
            continue
        cells = []
        for d in dirs:
            ratio = statistics.median(b / x for x, b in zip(data[ref][op], data[d][op]))
            cells.append(f"{statistics.median(data[d][op]) * 1e6:9.0f} x{ratio:4.2f}")
        print(f"{op:28s} " + " ".join(f"{c:>16s}" for c in cells))


# ----------------------------------------------------------------------------------------------
# forms

def scan_inputs(rng, n_head, head_dim, d_state, n_group, n_t, dtype=np.float32):
    s = rng.standard_normal((1, n_head, head_dim, d_state)).astype(dtype) * 0.1
    x = rng.standard_normal((1, n_t, n_head, head_dim)).astype(dtype)
    dt = (rng.standard_normal((1, n_t, n_head)) * 0.5 - 2.0).astype(dtype)
    A = -np.exp(rng.standard_normal((n_head, 1))).astype(dtype)
    B = rng.standard_normal((1, n_t, n_group, d_state)).astype(dtype) * 0.3
    C = rng.standard_normal((1, n_t, n_group, d_state)).astype(dtype) * 0.3
    ids = np.zeros(1, dtype=np.int32)
    return s, x, dt, A, B, C, ids


def set_form(kernel, form):
    """Force the form of the scan forward ('fwd') or backward ('back'); 'auto' restores the choice."""
    import ssmgrad
    return getattr(ssmgrad._ext, "_set_scan_" + kernel)(form)


def fwd_flops(n_head, head_dim, d_state, n_group, n_t):
    N, P = d_state, head_dim
    blocks = n_group * -(-(n_head // n_group) // FBH)
    rec = 5.0 * N * P * n_head * n_t
    chk = n_t * (n_head * (4.0 * N * P + P * (Q + 1)) + blocks * N * (Q + 1))
    return {"recurrence": rec, "chunked": chk}


def ab_forms(a):
    sys.path.insert(0, ROOT)
    import ssmgrad

    rng = np.random.default_rng(0)
    dtype = np.dtype(a.dtype)
    forms = ("recurrence", "chunked")
    fwd = a.kernel == "fwd"
    print(f"| shape | n_t | threads | {' | '.join(f + ' ms' for f in forms)} | chunked/recurrence | auto picks |"
          + (" recurrence GFLOP/s | chunked GFLOP/s |" if fwd else ""))
    print("|---" * (6 + 2 * fwd) + "|")
    for name in a.shapes.split(","):
        nh, hd, ds, ng = SHAPES[name]
        for n_t in map(int, a.nt.split(",")):
            args = scan_inputs(rng, nh, hd, ds, ng, n_t, dtype)
            grad = rng.standard_normal(ssmgrad.ssm_scan(*args).shape).astype(dtype)

            def call():
                return ssmgrad.ssm_scan(*args) if fwd else ssmgrad.ssm_scan_back(*args, grad)

            res = {}
            for f in forms + ("auto",):
                set_form(a.kernel, f)
                res[f] = call()
            picks = "/".join(f for f in forms if res[f].tobytes() == res["auto"].tobytes())
            r0, r1 = res["recurrence"], res["chunked"]
            err = float(np.max(np.abs(r0 - r1)) / max(1.0, float(np.max(np.abs(r0)))))
            assert err < (1e-4 if dtype == np.float32 else 1e-12), (name, n_t, err)
            for nth in map(int, a.threads.split(",")):
                ssmgrad.set_num_threads(nth)
                t = {f: [] for f in forms}
                for _ in range(a.reps):
                    for f in forms:
                        set_form(a.kernel, f)
                        t0 = time.perf_counter()
                        call()
                        t[f].append(time.perf_counter() - t0)
                m = {k: statistics.median(v) for k, v in t.items()}
                line = (f"| {name} | {n_t} | {nth} | {m['recurrence'] * 1e3:.3g} | {m['chunked'] * 1e3:.3g} | "
                        f"{m['chunked'] / m['recurrence']:.2f} | {picks} |")
                if fwd:
                    fl = fwd_flops(nh, hd, ds, ng, n_t)
                    line += " ".join(f" {fl[f] / m[f] / 1e9:.3g} |" for f in forms)
                print(line, flush=True)
            set_form(a.kernel, "auto")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    b = sub.add_parser("builds", help="several in-place builds, fresh processes, interleaved rounds")
    b.add_argument("dirs", nargs="+", help="source trees with an in-place build")
    b.add_argument("--rounds", type=int, default=8)
    b.add_argument("--n-t", type=int, default=512)
    b.add_argument("--ops", default="", help="comma-separated subset of the ops to print")
    f = sub.add_parser("forms", help="the Mamba-2 scan's recurrence vs chunked form, in this build")
    f.add_argument("kernel", choices=["fwd", "back"])
    f.add_argument("--nt", default="512,2048,8192")
    f.add_argument("--threads", default="1,2")
    f.add_argument("--reps", type=int, default=7)
    f.add_argument("--shapes", default="130m,2.7b,grouped")
    f.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    a = ap.parse_args(argv)
    (ab_builds if a.mode == "builds" else ab_forms)(a)


if __name__ == "__main__":
    main()
