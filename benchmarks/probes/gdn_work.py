"""Instructions the Gated DeltaNet's chunked kernels execute, counted by valgrind's callgrind: the forward, the
forward keeping its chunks (keep_states), the backward that recomputes them by its own pass over the chunks,
and the backward that reads them (chunk_states). Counts, not seconds: the same for the same binary and inputs
whatever else the machine does, so they compare the kernels' work on a busy machine. callgrind does not run
AVX-512: the dispatch picks the x86-64-v3 (AVX2 + FMA) pass under it, which is what an AVX2 host runs.

    python benchmarks/probes/gdn_work.py [--shapes 16x16,32x16] [--n-t 512] [--gate scalar|kda]
                                          (H_v x H_k; S 128, one sequence, the interleaved broadcast)

Prints a markdown table: instructions per call and the ratios backward / forward. One thread, float32,
form="chunked". About a minute per shape and gate on a Zen 5.
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
KERNELS = ("gdn_fwd_f32", "gdn_fwd_keep_f32", "gdn_back_f32", "gdn_back_kept_f32")
NAMES = ("q", "k", "v", "g", "beta", "state")


def child(what, n_t, H_v, H_k, gate):
    """One call of `what` on random inputs (the others only set up), one thread."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import numpy as np
    import ssmgrad as sg
    from reference import make_gdn_inputs
    rng = np.random.default_rng(0)
    a = make_gdn_inputs(rng, n_seqs=1, n_t=n_t, H_v=H_v, H_k=H_k, S=128, kda=gate == "kda", dtype=np.float32)
    args = [a[n] for n in NAMES]
    kw = dict(head_bcast="interleaved", form="chunked")
    sg.set_num_threads(1)
    out, kept = sg.gated_delta_net(*args, keep_states=True, **kw)
    grad = rng.standard_normal(out.shape).astype(np.float32)
    if what == "fwd":
        sg.gated_delta_net(*args, **kw)
    elif what == "keep":
        sg.gated_delta_net(*args, keep_states=True, **kw)
    elif what == "back":
        sg.gated_delta_net_back(*args, grad, **kw)
    elif what == "kept":
        sg.gated_delta_net_back(*args, grad, chunk_states=kept, **kw)


def count(what, n_t, H_v, H_k, gate):
    """Instructions inside the kernels' public entry points (callgrind's toggle-collect) in one child: its
    setup's forward (keeping the chunks) and then the call `what` ("none": no call; main subtracts it)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "cg.out")
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
               *(f"--toggle-collect={k}" for k in KERNELS),
               sys.executable, os.path.abspath(__file__), "--child", what, str(n_t), str(H_v), str(H_k), gate]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-2000:])
        m = re.search(r"Collected : (\d+)", proc.stderr)
        return int(m.group(1))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default="16x16,32x16")
    ap.add_argument("--n-t", type=int, default=512)
    ap.add_argument("--gate", choices=("scalar", "kda", "both"), default="both")
    ap.add_argument("--child", nargs=5, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        w, n_t, H_v, H_k, gate = a.child
        child(w, int(n_t), int(H_v), int(H_k), gate)
        return 0
    if not shutil.which("valgrind"):
        print("gdn_work.py: needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 1
    print(f"n_t {a.n_t}, S 128, float32, one thread, x86-64-v3 (callgrind)\n")
    print("| gate | H_v x H_k | fwd | fwd keeping | back (recomputes) | back (reads them) | "
          "back / fwd, recomputing | back / fwd, with the chunks | fwd + back |")
    print("|---|---|---|---|---|---|---|---|---|")
    for gate in (("scalar", "kda") if a.gate == "both" else (a.gate,)):
        for shape in a.shapes.split(","):
            H_v, H_k = map(int, shape.split("x"))
            base = count("none", a.n_t, H_v, H_k, gate)          # the setup: one keeping forward
            c = {w: count(w, a.n_t, H_v, H_k, gate) - base for w in CALLS}
            m = {w: f"{c[w] / 1e6:.1f} M" for w in CALLS}
            print(f"| {gate} | {H_v} x {H_k} | {m['fwd']} | {m['keep']} | {m['back']} | {m['kept']} | "
                  f"{c['back'] / c['fwd']:.2f} | {c['kept'] / c['keep']:.2f} | "
                  f"{(c['fwd'] + c['back']) / 1e6:.0f} M -> {(c['keep'] + c['kept']) / 1e6:.0f} M "
                  f"({(c['keep'] + c['kept']) / (c['fwd'] + c['back']) - 1:+.1%}) |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
