"""Instructions the Mamba-2 scan's kernels execute, counted by valgrind's callgrind: the forward, the forward
keeping its chunk states (keep_states), the backward that recomputes them, and the backward that reads them
(chunk_states). Counts, not seconds: the same for the same binary and inputs whatever else the machine does,
so they compare the kernels' work on a busy machine. callgrind does not run AVX-512: the dispatch picks the
x86-64-v3 (AVX2 + FMA) pass under it, which is what an AVX2 host runs.

    python benchmarks/probes/scan_work.py [--shapes 512x24,2048x24,512x80]   (n_t x n_head; head_dim 64,
                                                                             d_state 128, one group)

Prints a markdown table: instructions per call and the ratios backward / forward. One thread. About a
minute per call at 512 x 24 on a Zen 5.
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
CALLS = ("fwd", "keep", "back", "kept")
KERNELS = ("ssm_scan_f32", "ssm_scan_keep_f32", "ssm_scan_back_f32", "ssm_scan_back_kept_f32",
           "ssm_scan_back_reduce_f32")


def child(what, n_t, n_head):
    """One call of `what` on random inputs (the others only set up), one thread."""
    sys.path.insert(0, ROOT)
    import numpy as np
    import ssmgrad as sg
    rng = np.random.default_rng(0)
    f32 = np.float32
    P, N = 64, 128
    s = np.zeros((1, n_head, P, N), f32)
    x = rng.standard_normal((1, n_t, n_head, P)).astype(f32)
    dt = (rng.standard_normal((1, n_t, n_head)) - 2).astype(f32)
    A = -np.exp(rng.standard_normal((n_head, 1))).astype(f32)
    B = rng.standard_normal((1, n_t, 1, N)).astype(f32)
    C = rng.standard_normal((1, n_t, 1, N)).astype(f32)
    args = (s, x, dt, A, B, C, [0])
    sg.set_num_threads(1)
    out, kept = sg.ssm_scan(*args, keep_states=True)
    grad = rng.standard_normal(out.shape).astype(f32)
    if what == "fwd":
        sg.ssm_scan(*args)
    elif what == "keep":
        sg.ssm_scan(*args, keep_states=True)
    elif what == "back":
        sg.ssm_scan_back(*args, grad)
    elif what == "kept":
        sg.ssm_scan_back(*args, grad, chunk_states=kept)


def count(what, n_t, n_head):
    """Instructions inside the kernels' public entry points (callgrind's toggle-collect) in one child: its
    setup's forward (keeping the states) and then the call `what` ("none": no call; main subtracts it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
               *(f"--toggle-collect={k}" for k in KERNELS),
               sys.executable, os.path.abspath(__file__), "--child", what, str(n_t), str(n_head)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        m = re.search(r"Collected : (\d+)", proc.stderr)
        return int(m.group(1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="512x24,2048x24,512x80")
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        child(a.child[0], int(a.child[1]), int(a.child[2]))
        return 0
    if not shutil.which("valgrind"):
        print("scan_work.py: needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 1
    print("| n_t x n_head | fwd | fwd keeping states | back (recomputes) | back (reads states) | "
          "back / fwd, recomputing | back / fwd, with the states | fwd + back |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in a.shapes.split(","):
        n_t, n_head = map(int, shape.split("x"))
        base = count("none", n_t, n_head)          # the setup: one keeping forward
        c = {w: count(w, n_t, n_head) - base for w in CALLS}
        m = {w: f"{c[w] / 1e6:.1f} M" for w in CALLS}
        print(f"| {n_t} x {n_head} | {m['fwd']} | {m['keep']} | {m['back']} | {m['kept']} | "
              f"{c['back'] / c['fwd']:.2f} | {c['kept'] / c['keep']:.2f} | "
              f"{(c['fwd'] + c['back']) / 1e6:.0f} M -> {(c['keep'] + c['kept']) / 1e6:.0f} M "
              f"({(c['keep'] + c['kept']) / (c['fwd'] + c['back']) - 1:+.1%}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
