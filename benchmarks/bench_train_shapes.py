#!/usr/bin/env python
"""ssmgrad beside the fastest torch peer of each kind at training-scale shapes, float32.

    python benchmarks/bench_train_shapes.py            # the cases of TRAIN_CASES, 1 and 2 threads
    python benchmarks/bench_train_shapes.py --quick    # two tiny cases: a smoke test

Mamba-2-130m, Mamba-2-2.7B, a grouped layer, Mamba-130m and Falcon-Mamba-7B, mostly as batches of
4 sequences x n_t 1024: ssmgrad beside the peer (SSD chunked for Mamba-2, the token loop for
Mamba-1), each validated against the float64 reference first and compared with ssmgrad at the
timed shape (`agree`); bwd/fwd, GFLOP/s and the backward's extra memory per case. Writes
train_shapes.md (--out, default a temp dir); bench.py puts the same section in results.md.
"""

import sys
import time

import numpy as np

from common import (AGREE_TOL, IMPL_LABEL, TRAIN_LABEL, TRAIN_SHAPES, fma_peak, fmt_ms, fmt_ratio,
                    load_ssmgrad, log, measure, measure_memory, parser, rel_err, scan_flops, scan_inputs,
                    scan_peer, scan_sizes, settings, sg_scan_runner, torch_scan_runner, validate_first,
                    write_section)

# Training-scale cases: (label, shape params, n_seqs, n_t, torch peers timed beside).
# The peers are the fastest formulation of each kind at the 130m shapes (results above); the
# others are left out for memory: the token loop's autograd graph keeps ~5 tensors of
# (n_seqs, d_inner, d_state) per token (Falcon-Mamba, 4 x 1024: ~11 GB) and mambapy's pscan
# several of (n_seqs, n_t, d_inner, d_state) (2 GB each there).
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


def train_want(cases):
    """{validation key: implementations} for the cases."""
    want = {}
    for shape, _, _, peers in cases:
        key = "mamba1" if TRAIN_SHAPES[shape]["m1"] else "mamba2"
        want.setdefault(key, ["ssmgrad"])
        want[key] += [i for i in peers if i not in want[key]]
    return want


def train_header():
    return ["", "## Training-scale shapes", "",
            "float32; batches of `n_seqs` sequences, each with its own state row. "
            + "; ".join(f"`{k}` = {v}" for k, v in TRAIN_LABEL.items()) + ". Torch peers: the fastest "
            "formulation of each kind at the 130m shapes; see TRAIN_CASES in bench_train_shapes.py for the "
            "ones left out for memory.", ""]


def main(argv=None):
    ap = parser(__doc__)
    ap.add_argument("--no-mem", action="store_true", help="skip the peak-memory subprocesses")
    args = ap.parse_args(argv)
    s = settings(args)
    sg = load_ssmgrad()
    cases = QUICK_TRAIN_CASES if args.quick else TRAIN_CASES
    failures, val_lines = validate_first(sg, train_want(cases), s["cfg"])
    rows, md = train_section(sg, cases, s["threads"], s["budget"], s["max_reps"], failures, s["cfg"],
                             args.no_mem, log)
    section = train_header() + md + [""] + train_targets(rows, fma_peak(log))
    return write_section(sg, args, "train_shapes", section, val_lines, failures)


if __name__ == "__main__":
    sys.exit(main())
