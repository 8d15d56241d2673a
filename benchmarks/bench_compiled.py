#!/usr/bin/env python
"""ssmgrad against torch.compile of the chunked SSD form (the strongest PyTorch formulation of the
Mamba-2 scan on CPU), with eager SSD beside them.

    python benchmarks/bench_compiled.py                # 130m and 2.7B layers, n_t 512 and 2048, 1 thread
    python benchmarks/bench_compiled.py --quick        # one tiny case: a smoke test (one compile)

Inductor on CPU, `dynamic=False`, `fullgraph=True`, mode and chunk from --compile-mode,
--compile-chunk; compiled afresh for each shape and thread count (inductor fixes the thread count
in its C++ kernels) in an empty inductor cache; the first call compiles and is timed apart, never a
sample. The compiled peer is validated against the float64 reference like every peer. Writes
compiled.md (--out, default a temp dir); bench.py puts the same section in results.md.
"""

import os
import shutil
import sys
import tempfile
import time

from common import (COMPILE_CHUNK, COMPILE_MODE, load_ssmgrad, log, parser, settings,
                    validate_first, write_section)
from bench_train_shapes import train_section

# (shape of TRAIN_SHAPES, n_seqs, n_t, peers): the side-by-side cases of the compiled peer; n_t is
# replaced by the run's --nt values of at least 512 (default 512 and 2048)
COMPILED_CASES = [("m2_130m", 1, None, ["ssd", "ssd_compiled"]), ("m2_2.7b", 1, None, ["ssd", "ssd_compiled"])]
QUICK_COMPILED_CASES = [("m2_130m", 1, 64, ["ssd", "ssd_compiled"])]


def compiled_cases(quick, nts, only_impls):
    """The (shape, n_seqs, n_t, peers) cells: n_t the --nt values of at least 512; ``only_impls``
    without "ssd" keeps the compiled peer alone beside ssmgrad."""
    if quick:
        cases = QUICK_COMPILED_CASES
    else:
        comp_nts = [n for n in nts if n >= 512] or nts
        cases = [(sh, nq, n_t, peers) for sh, nq, _, peers in COMPILED_CASES for n_t in comp_nts]
    if only_impls and "ssd" not in only_impls:
        cases = [(sh, nq, n_t, ["ssd_compiled"]) for sh, nq, n_t, _ in cases]
    return cases


def fresh_inductor_cache():
    """A fresh inductor cache (its directory, or None when TORCHINDUCTOR_CACHE_DIR is set): every
    compile of this run is then a cold one, so the compile times are honest."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:
        return None
    d = tempfile.mkdtemp(prefix="ssmgrad-bench-inductor-")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = d
    return d


def compiled_section(sg, cases, threads, s, failures, inductor_dir):
    """(rows, section lines) of the compiled peer beside eager SSD and ssmgrad."""
    cfg = s["cfg"]
    log(f"compiled peer (torch.compile, mode {cfg['compile_mode']}, chunk {cfg['compile_chunk']}) ...")
    t0 = time.time()
    rows, md = train_section(sg, cases, threads, s["budget"], s["max_reps"], failures, cfg, True, log)
    took = time.time() - t0
    compiles = [r["compile_s"] for r in rows if "compile_s" in r]
    cache = ("in an empty inductor cache (cold compiles)" if inductor_dir else
             f"with the inductor cache at {os.environ.get('TORCHINDUCTOR_CACHE_DIR')} (compiles may be cache hits)")
    span = (f": {min(compiles):.0f}" + (f"–{max(compiles):.0f}" if len(compiles) > 1 else "") + " s here"
            if compiles else "")
    return rows, ["", "## Against the compiled peer", "",
                  f"`torch.compile` of the chunked SSD form (ssmgrad/_bench_peers.py scan_ssd, chunk {cfg['compile_chunk']}), "
                  f"inductor on CPU, mode `{cfg['compile_mode']}`, `dynamic=False`, `fullgraph=True`, compiled afresh for "
                  "each shape and thread count (inductor fixes the thread count in its C++ kernels) " + cache
                  + "; the first call compiles and is not a timed sample (`compile` note" + span
                  + f"). Eager SSD and ssmgrad are timed beside it in the same cells; float32, one sequence. The "
                  f"section took {took:.0f} s, compiles included (`--no-compiled` skips it).", ""] + md


def add_compile_flags(ap):
    ap.add_argument("--compile-mode", default=COMPILE_MODE,
                    help=f"torch.compile mode of the compiled peer: default, max-autotune-no-cudagraphs, ... "
                         f"(default {COMPILE_MODE})")
    ap.add_argument("--compile-chunk", type=int, default=COMPILE_CHUNK,
                    help=f"SSD chunk size of the compiled peer (default {COMPILE_CHUNK})")
    ap.add_argument("--compiled-threads", default="1",
                    help="comma-separated thread counts of the compiled peer's cells (default 1: at 2 threads "
                         "inductor's compiled SSD backward corrupts the heap, without ssmgrad loaded: "
                         "benchmarks/probes/inductor_threads.py; each count compiles every case again)")


def main(argv=None):
    ap = parser(__doc__)
    add_compile_flags(ap)
    ap.add_argument("--nt", help="comma-separated n_t (default 512,2048)")
    args = ap.parse_args(argv)
    s = settings(args)
    sg = load_ssmgrad()
    cases = compiled_cases(args.quick, [int(v) for v in (args.nt or "512,2048").split(",")], [])
    inductor_dir = fresh_inductor_cache()
    want = {"mamba2": ["ssmgrad", "ssd", "ssd_compiled"]}
    failures, val_lines = validate_first(sg, want, s["cfg"])
    threads = [int(v) for v in args.compiled_threads.split(",")]
    section = compiled_section(sg, cases, threads, s, failures, inductor_dir)[1]
    if inductor_dir:
        shutil.rmtree(inductor_dir, ignore_errors=True)
    return write_section(sg, args, "compiled", section, val_lines, failures)


if __name__ == "__main__":
    sys.exit(main())
