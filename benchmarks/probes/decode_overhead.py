#!/usr/bin/env python
"""Where one decode token's time goes: ssmgrad's generate path against a copy of its state.

    python benchmarks/probes/decode_overhead.py [--rounds 40] [--threads 1,2] [--kernel] [--torch]
    python benchmarks/probes/decode_overhead.py --root DIR ...   # another build: DIR holds ssmgrad/ and _ssmgrad*.so

Layers (one sequence, one token, float32):
    mamba2  the Mamba-2-130m layer: s (1, 24, 64, 128) = 786 KB, A (24, 1)
    mamba1  the Mamba-1-130m layer: s (1, 1536, 1, 16) = 98 KB, A (1536, 16) (24576 exps per token)

Rows, each in the calling thread's CPU time (time.thread_time) per call, the median and the fastest
of --rounds batches; all rows of a layer are timed in alternating batches in one loop, so they see
the same cache state (the state lives in L2 either way), and are validated first (the update's y
and states against ssm_scan's, bitwise, and against a float64 NumPy evaluation of the recurrence):
    copy          np.copyto(dst, s): one read and one write of the state's bytes (the target)
    update        ssmgrad.ssm_scan_update(s, x, dt, A, B, C), in place (the generate path)
    ext_update    _ssmgrad._ssm_scan_update straight (no Python wrapper)
    scan1         ssmgrad.ssm_scan(s, x, dt, A, B, C, ids) with n_t = 1 (fresh packed output)
    parse         _ssmgrad._scan_work_bytes: the glue's argument parsing and checks alone, no kernel
    empty_y       np.empty of y's shape (the output allocation)
    noop          _ssmgrad._serial_after_fork(): a bare C call
--threads 2 passes 2 threads; the glue gives such a small call one thread (its work is below
MIN_WORK_PER_THREAD), so an extra row "update_forced2" lowers that limit to 0 and shows what an
OpenMP region would cost: its CPU time in the calling thread and, separately, its wall time.
--kernel builds benchmarks/probes/decode_kernel.c against this checkout's extension module and prints
the kernel-only times (no Python). --torch adds ssmgrad.torch's eager rows (ssm_scan_update_ under
no_grad, ssm_scan with n_t = 1, and the custom op called directly).

The machine is shared (2 cores, several agents): read the ratios within a run, not the absolute
figures; an idle run is still needed for results.md.

Measured 2026-12-01 (2-core Zen 4, NOT idle: 5 other agents' builds and tests, load 11-12; two
alternating before/after process pairs, 30 rounds each; us per call, thread CPU time, median / fastest;
"before" = 187d2e6, "after" = branch decode; x copy = the update's median over np.copyto's in that run):

  Mamba-2-130m (786 KB state)        before                       after
    np.copyto of the state           24.7/21.6, 22.9/18.3         23.7/18.3, 29.8/22.5
    ssm_scan_update                  36.4/27.5 (x1.48),           29.3/23.1 (x1.24),
                                     38.2/34.6 (x1.67)            33.2/30.8 (x1.11)
    glue parse + checks (parse)      1.45/1.22, 0.96/0.88         0.65/0.43, 0.84/0.57
    y allocation (empty_y)           0.5-0.9 either way
    Python wrapper (update - ext)    1.5-5 (isinstance, flags, np.shape, np.arange)   none measurable
    kernel only (decode_kernel.c)    in place 21.3-25.7 fastest vs memcpy 16.1-18.0: 1.2-1.25x the copy
  Mamba-1-130m (98 KB state, 24576 exps per token)
    np.copyto                        2.3-3.2
    ssm_scan_update                  23.9/17.4 (x7.5),            18.8/14.3 (x5.9),
                                     19.6/16.4 (x7.3)             20.3/16.2 (x6.5)
    parse                            1.41/0.72, 1.23/0.84         0.59/0.34, 0.58/0.37
    kernel only                      13.3-14.6 fastest vs memcpy 1.7-1.8: 7-8x the copy, all in the
                                     kernel: exp-bound, not overhead (perf: the decode kernel 78% and
                                     ssm_softplus_n 6% of samples over both layers, the rest the copy)
  2 threads: the glue gives both layers one thread (work below MIN_WORK_PER_THREAD): the same figures.
  Forced onto 2 threads (update_forced2) the calling thread's CPU is no lower and the wall time is
  36-78 us fastest, 76-164 us median (waking the passive OpenMP thread on a busy machine): the
  one-thread rule stays. So the remaining gap to the copy is the kernel: Mamba-2's 1.2x (y's dot
  products and the 16-byte misalignment of NumPy's default arrays: AVX-512 rows straddle cache lines;
  a 64-byte-aligned s measured 20.6 vs 25.0 us fastest), Mamba-1's exps.
  torch eager, no_grad (ssmgrad.torch; before: the custom op in eager mode):
    ssm_scan_update_  Mamba-2        174.9/111.4, 101.0/75.7      59.0/38.9, 71.1/43.9
                      Mamba-1        133.1/76.1, 95.9/70.2        43.5/28.3, 43.2/29.5
    ssm_scan n_t=1    Mamba-2        133.5/84.0, 84.2/62.9        71.0/45.3, 84.9/67.2
                      Mamba-1        96.5/57.3, 68.6/51.1         49.1/30.7, 47.1/34.2
  What torch still adds over the NumPy call (~15 us): the argument checks (~3), _eager (~2), six
  tensor.numpy() (~6), torch.from_numpy (~1.5), the no_grad context (~1).
An idle run is still needed for benchmarks/results.md.
"""
import argparse
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# --root DIR: import ssmgrad (and its _ssmgrad*.so) from DIR instead, e.g. a copy of another build,
# for an A/B run in alternating processes; else this checkout's in-place build
if "--root" in sys.argv:
    ROOT = os.path.abspath(sys.argv[sys.argv.index("--root") + 1])
sys.path.insert(0 if "--root" in sys.argv else 1, ROOT)

import ssmgrad  # noqa: E402
from ssmgrad import _ext  # noqa: E402

LAYERS = {"mamba2": (24, 64, 128, True), "mamba1": (1536, 1, 16, False)}


def inputs(layer, dtype=np.float32):
    n_head, hd, ds, mamba2 = LAYERS[layer]
    rng = np.random.default_rng(0)
    f = lambda *shape: rng.standard_normal(shape).astype(dtype)
    return dict(s=f(1, n_head, hd, ds), x=f(1, 1, n_head, hd),
                dt=rng.uniform(-3.0, 1.0, (1, 1, n_head)).astype(dtype),
                A=(-np.exp(rng.uniform(-1.5, 0.5, (n_head, 1 if mamba2 else ds)))).astype(dtype),
                B=f(1, 1, 1, ds), C=f(1, 1, 1, ds))


def reference(inp):
    """One token of the recurrence in float64: (y, new state)."""
    s, x, dt, A, B, C = (inp[k].astype(np.float64) for k in ("s", "x", "dt", "A", "B", "C"))
    sp = np.logaddexp(0.0, dt[0, 0])                         # (n_head,)
    dA = np.exp(sp[:, None] * A)                             # (n_head, d_state | 1)
    h = dA[:, None, :] * s[0] + B[0, 0, 0][None, None, :] * (x[0, 0] * sp[:, None])[:, :, None]
    return (h * C[0, 0, 0]).sum(-1)[None, None], h[None]


def validate(layer):
    inp = inputs(layer)
    names = ("x", "dt", "A", "B", "C")
    out = ssmgrad.ssm_scan(inp["s"], *(inp[k] for k in names), np.arange(1))
    y_scan, st_scan = ssmgrad.split(out, inp["x"].shape, inp["s"].shape)
    s = inp["s"].copy()
    y = ssmgrad.ssm_scan_update(s, *(inp[k] for k in names))
    assert np.array_equal(y, y_scan) and np.array_equal(s, st_scan), "update != ssm_scan, bitwise"
    y_ref, st_ref = reference(inp)
    for got, ref in ((y, y_ref), (s, st_ref)):
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err < 1e-5, f"{layer}: relative error {err:.2e} against float64"


def rows(layer, nth, with_torch):
    """name -> a function of no arguments doing one call, on this layer's inputs."""
    inp = inputs(layer)
    s, x, dt, A, B, C = (inp[k] for k in ("s", "x", "dt", "A", "B", "C"))
    dst = np.empty_like(s)
    ids = np.arange(1, dtype=np.int64)
    y_shape = x.shape
    r = {
        "copy": lambda: np.copyto(dst, s),
        "update": lambda: ssmgrad.ssm_scan_update(s, x, dt, A, B, C),
        "ext_update": lambda: _ext._ssm_scan_update(s, x, dt, A, B, C, ids, nth),
        "scan1": lambda: ssmgrad.ssm_scan(s, x, dt, A, B, C, ids),
        "parse": lambda: _ext._scan_work_bytes(s, x, dt, A, B, C, ids, 1, nth),
        "empty_y": lambda: np.empty(y_shape, np.float32),
        "noop": _ext._serial_after_fork,
    }
    if with_torch:
        import torch
        import ssmgrad.torch as st
        ts, tx, tdt, tA, tB, tC = (torch.from_numpy(a) for a in (s, x, dt, A, B, C))
        tids = torch.from_numpy(ids)
        op = torch.ops.ssmgrad

        def no_grad(fn):
            def call():
                with torch.no_grad():
                    return fn()
            return call
        r["torch_update_"] = no_grad(lambda: st.ssm_scan_update_(ts, tx, tdt, tA, tB, tC))
        r["torch_update_op"] = no_grad(lambda: op.ssm_scan_update_(ts, tx, tdt, tA, tB, tC))
        r["torch_scan1"] = no_grad(lambda: st.ssm_scan(ts, tx, tdt, tA, tB, tC, tids))
        r["torch_scan1_op"] = no_grad(lambda: op.ssm_scan(ts, tx, tdt, tA, tB, tC, tids, 1))
    return r


def time_rows(fns, rounds, inner):
    """name -> list of per-call thread CPU times (s), one per round; the rows alternate within each round."""
    times = {k: [] for k in fns}
    for fn in fns.values():      # warm up
        for _ in range(inner):
            fn()
    for r in range(rounds):
        order = list(fns.items())
        if r % 2:
            order.reverse()
        for name, fn in order:
            t0 = time.thread_time()
            for _ in range(inner):
                fn()
            times[name].append((time.thread_time() - t0) / inner)
    return times


def forced2(layer, rounds, inner):
    """update on 2 threads with the per-thread work limit at 0: (CPU of the calling thread, wall), per call."""
    inp = inputs(layer)
    args = tuple(inp[k] for k in ("s", "x", "dt", "A", "B", "C"))
    old = _ext._set_min_work_per_thread(0)
    old_n = ssmgrad.get_num_threads()
    ssmgrad.set_num_threads(2)
    try:
        cpu, wall = [], []
        for _ in range(rounds):
            t0, w0 = time.thread_time(), time.perf_counter()
            for _ in range(inner):
                ssmgrad.ssm_scan_update(*args)
            cpu.append((time.thread_time() - t0) / inner)
            wall.append((time.perf_counter() - w0) / inner)
        return cpu, wall
    finally:
        _ext._set_min_work_per_thread(old)
        ssmgrad.set_num_threads(old_n)


def fmt(ts):
    return f"{statistics.median(ts) * 1e6:8.2f} / {min(ts) * 1e6:8.2f}"


def kernel_times(rounds):
    import glob
    so = glob.glob(os.path.join(ROOT, "_ssmgrad*.so"))
    assert so, "no in-place build of the extension in this checkout"
    libdir = sysconfig.get_config_var("LIBDIR")
    pylib = "python" + sysconfig.get_config_var("LDVERSION")
    exe = os.path.join(tempfile.mkdtemp(), "decode_kernel")
    csrc = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")
    subprocess.run([os.environ.get("CC", "cc"), "-O2", "-std=gnu11", "-Wall", "-I", csrc,
                    os.path.join(os.path.dirname(os.path.abspath(__file__)), "decode_kernel.c"), so[0], f"-L{libdir}",
                    f"-l{pylib}", f"-Wl,-rpath,{libdir}", "-o", exe], check=True)
    return subprocess.run([exe, str(rounds * 5)], check=True, capture_output=True, text=True).stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--layers", default="mamba2,mamba1")
    ap.add_argument("--kernel", action="store_true")
    ap.add_argument("--torch", action="store_true")
    ap.add_argument("--root", help="import ssmgrad from this directory (see above)")
    args = ap.parse_args()
    assert os.path.dirname(os.path.abspath(ssmgrad.__file__)) == os.path.join(ROOT, "ssmgrad"), ssmgrad.__file__
    print(f"ssmgrad from {os.path.dirname(ssmgrad.__file__)}; machine load {os.getloadavg()[0]:.1f}; "
          "us per call, thread CPU time, median / fastest")
    for layer in args.layers.split(","):
        validate(layer)
        inner = 40 if layer == "mamba2" else 100
        for nth in map(int, args.threads.split(",")):
            ssmgrad.set_num_threads(nth)
            t = time_rows(rows(layer, nth, args.torch), args.rounds, inner)
            copy = statistics.median(t["copy"])
            for name, ts in t.items():
                print(f"{layer} threads={nth} {name:16s} {fmt(ts)}   x copy {statistics.median(ts) / copy:5.2f}")
            if nth > 1:
                cpu, wall = forced2(layer, args.rounds, inner)
                print(f"{layer} threads={nth} {'update_forced2':16s} {fmt(cpu)}   (wall {fmt(wall)})")
    if args.kernel:
        print("kernel only (benchmarks/probes/decode_kernel.c), ns per call, median / fastest:")
        print(kernel_times(args.rounds), end="")


if __name__ == "__main__":
    main()
