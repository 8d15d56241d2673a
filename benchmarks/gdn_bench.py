#!/usr/bin/env python
"""ssmgrad's GATED_DELTA_NET against transformers' torch_chunk_gated_delta_rule (eager and torch.compile'd),
side by side in one run: every figure of the op's performance targets, written to a markdown file.

    python benchmarks/gdn_bench.py                              # the full run (a few minutes, 1 thread)
    python benchmarks/gdn_bench.py --quick                      # small shapes, a smoke test
    python benchmarks/gdn_bench.py --shapes 16,8 --n-t 512 --reps 5 --out benchmarks/results_gdn.md
    python benchmarks/gdn_bench.py --decode-only --out benchmarks/results_gdn.md   # section 5 alone
    python benchmarks/gdn_bench.py --with-avx2 --out benchmarks/results_gdn.md     # AVX-512 host: then capped to AVX2

1. Validate before timing: ssmgrad, transformers' chunked rule eager and compiled (stock, unpatched),
   float32, at a small shape with the benchmark's head layout, each against the float64 reference
   recurrence (tests/reference.py): o, the final state and every gradient. A peer that fails is not
   timed (the report says so).
2. Time (float32, one sequence, one thread for everybody: torch.set_num_threads(1),
   ssmgrad.set_num_threads(1)), at H_v, H_k = 32, 16 (Qwen3-Next's layer) and 16, 8, S = 128,
   n_t = 512 and 2048: forward; forward + backward (transformers: autograd of o and the final state;
   ssmgrad: gated_delta_net then gated_delta_net_back); ssmgrad's backward alone. The calls of a cell
   alternate between the implementations, and each cell reports medians of --reps runs after one
   warm-up, of the wall time and of this thread's CPU time (time.thread_time: on the shared machine
   the time other processes hold the core is not counted; ratios use CPU time, wall times are shown).
3. FMA peak: one core's FMA rate (512-bit; 256-bit under --isa avx2 or on an AVX2-only host)
   measured by benchmarks/probes/peak.c in CPU time (its clock loop and FMA loop, timed with
   CLOCK_THREAD_CPUTIME_ID instead of the wall clock). The forward's
   FLOP count is 7 per state element and token (decay 1, S^T k 2, rank-1 update 2, S^T q 2); its
   instruction floor is 4 vector operations per 16 elements (1 multiply, 3 FMAs), so the count
   can reach at most 7/8 of the FMA peak. The share is taken from the forward writing into an output
   array kept across calls (``out=``, the kernel's own time; a new array of up to 35 MB each call adds
   the kernel's page faults, which on this VM once took the n_t 2048 forward from ~55 to 126 ms);
   the forward with a new output each call is reported beside it.
4. Backward memory: the kernel's work size (gdn_back_work_size, the scratch the glue allocates) and
   the peak RSS of one ssmgrad backward beyond its inputs and output in a fresh process (VmHWM after
   /proc/self/clear_refs), at n_t = 2048.
5. Decode: one token (n_t = 1) of ssmgrad's forward against np.copyto of the state array, and the
   same with ``out=`` (the packed output buffer reused across calls) when the op takes it. The
   calls alternate in one loop; medians of 201 wall times. ``--decode-only`` runs this section
   alone and puts it in place of the decode section of the --out file.
6. Training step of a Qwen3-Next-shaped layer (transformers' Qwen3NextGatedDeltaNet, hidden 2048,
   H_v 32, H_k 16, S 128, float32, n_t 512, batch 1): forward, a loss, backward through every
   parameter, stock against ssmgrad.transformers.patch() (validated: loss and gradient norms agree).

ssmgrad takes transformers' interleaved head broadcast (head_bcast="interleaved"). --form passes
form= to ssmgrad's op where it takes that keyword (otherwise the option is refused).
"""
import argparse
import inspect
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
sys.path.insert(1, os.path.join(ROOT, "tests"))         # tests/reference.py, the float64 oracle
sys.path.insert(1, os.path.join(ROOT, "tests", "kernels"))   # tests/kernels/gdn_checks.py, the C API's signatures
import common  # noqa: E402  (the --isa cap, shared with the scan's benchmarks)

NAMES = ("q", "k", "v", "g", "beta", "state")
FLOP_FWD = 7


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def inputs(rng, n_t, H_v, H_k, S):
    from reference import make_gdn_inputs
    return make_gdn_inputs(rng, n_seqs=1, n_t=n_t, H_v=H_v, H_k=H_k, S=S, dtype=np.float32)


def form_kwargs(sg, form):
    if form is None:
        return {}
    if "form" not in inspect.signature(sg.gated_delta_net).parameters:
        sys.exit(f"--form {form}: this ssmgrad's gated_delta_net takes no form= keyword")
    return {"form": form}


class Ssm:
    """ssmgrad's calls. Its training step (fwd_bwd) keeps the chunked forward's chunks and the backward reads
    them, where this ssmgrad has keep_states (nothing is kept where the call takes the recurrence)."""
    def __init__(self, sg, fkw):
        self.sg, self.fkw = sg, fkw
        self.keep = "keep_states" in inspect.signature(sg.gated_delta_net).parameters

    def fwd(self, a, out=None):
        kw = dict(self.fkw)
        if out is not None:
            kw["out"] = out
        return self.sg.gated_delta_net(*(a[n] for n in NAMES), head_bcast="interleaved", **kw)

    def fwd_keep(self, a):
        """(out, chunk_states), chunk_states None where this ssmgrad cannot keep them"""
        if not self.keep:
            return self.fwd(a), None
        return self.sg.gated_delta_net(*(a[n] for n in NAMES), head_bcast="interleaved", keep_states=True,
                                       **self.fkw)

    def back(self, a, grad, kept=None):
        kw = dict(self.fkw)
        if kept is not None:
            kw["chunk_states"] = kept
        return self.sg.gated_delta_net_back(*(a[n] for n in NAMES), grad, head_bcast="interleaved", **kw)

    def fwd_bwd(self, a, grad):
        _, kept = self.fwd_keep(a)
        return self.back(a, grad, kept)


def hf_call(fn, a, grad=None):
    import torch
    t = {n: torch.from_numpy(a[n]).requires_grad_(grad is not None) for n in NAMES}
    o, final = fn(t["q"], t["k"], t["v"], t["g"][..., 0], t["beta"][..., 0],
                  initial_state=t["state"].transpose(-1, -2), output_final_state=True)
    if grad is None:
        return o, final, None
    do, dstate = grad                                   # dstate in transformers' (.., S_k, S_v) layout
    grads = torch.autograd.grad((o * do).sum() + (final * dstate).sum(), [t[n] for n in NAMES])
    return o, final, grads


def peers(quick):
    import torch
    import transformers.models.qwen3_next.modeling_qwen3_next as tq
    out = {"eager": tq.torch_chunk_gated_delta_rule}
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    out["compiled"] = torch.compile(tq.torch_chunk_gated_delta_rule, dynamic=False)
    return out


def validate(ssm, fns, rng, H_v, H_k):
    """Max relative error (max |x - ref| / max(1, max |ref|)) of every output and gradient of each
    implementation against the float64 reference; a dict name -> (worst, ok)."""
    import torch
    from reference import ref_gated_delta_net
    S, n_t = 32, 100
    a = inputs(rng, n_t, H_v, H_k, S)
    do = rng.standard_normal(a["v"].shape).astype(np.float32)
    dstate = rng.standard_normal(a["state"].shape).astype(np.float32)      # ssmgrad's transposed layout
    t64 = {n: torch.from_numpy(a[n].astype(np.float64)).requires_grad_(True) for n in NAMES}
    ref = ref_gated_delta_net(*(t64[n] for n in NAMES), head_bcast="interleaved")
    grad = np.concatenate([do.reshape(-1), dstate.reshape(-1)])
    r_grads = torch.autograd.grad((ref * torch.from_numpy(grad.astype(np.float64))).sum(), [t64[n] for n in NAMES])
    ref = ref.detach().numpy()
    r_o, r_s = ref[:do.size].reshape(do.shape), ref[do.size:].reshape(dstate.shape)
    r_grads = [g.numpy() for g in r_grads]
    rel = lambda x, y: float(np.abs(np.asarray(x, np.float64) - y).max() / max(1.0, np.abs(y).max()))
    res = {}
    out = ssm.fwd(a)
    gin = ssm.sg.split(ssm.back(a, grad), *(a[n].shape for n in NAMES))
    errs = [rel(out[:do.size].reshape(do.shape), r_o), rel(out[do.size:].reshape(dstate.shape), r_s)]
    errs += [rel(x, y) for x, y in zip(gin, r_grads)]
    res["ssmgrad"] = max(errs)
    for name, fn in fns.items():
        try:
            o, final, grads = hf_call(fn, a, (torch.from_numpy(do), torch.from_numpy(dstate).transpose(-1, -2)))
            errs = [rel(o.detach().numpy(), r_o), rel(final.detach().numpy().transpose(0, 1, 3, 2), r_s)]
            errs += [rel(x.numpy(), y) for x, y in zip(grads, r_grads)]
            res[name] = max(errs)
        except Exception as exc:                     # a peer that cannot run is reported, not timed
            res[name] = float("nan")
            log(f"{name} failed to run: {exc}")
    return {k: (v, v < 1e-4) for k, v in res.items()}


def timed(fn):
    w, c = time.perf_counter(), time.thread_time()
    fn()
    return time.perf_counter() - w, time.thread_time() - c


def cell(fns, reps):
    """{name: (median wall s, median cpu s)}: one warm-up each, then reps rounds alternating."""
    for fn in fns.values():
        fn()
    ts = {k: [] for k in fns}
    for _ in range(reps):
        for k, fn in fns.items():
            ts[k].append(timed(fn))
    return {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in ts.items()}


def fma_peak_cpu():
    """(clock GHz, GFLOP/s) of benchmarks/probes/peak.c at the run's ISA in this thread's CPU time, or None."""
    return common.peak_probe(cpu_time=True)


def mem_child(spec):
    """In a fresh process: bytes of one backward beyond its inputs and output (VmHWM)."""
    import ssmgrad as sg
    sg.set_num_threads(1)
    ssm = Ssm(sg, spec["fkw"])
    rng = np.random.default_rng(3)
    small = inputs(rng, 4, spec["H_v"], spec["H_k"], 128)
    ssm.back(small, np.zeros(ssm.fwd(small).size, np.float32))      # warm up
    a = inputs(rng, spec["n_t"], spec["H_v"], spec["H_k"], 128)
    grad = rng.standard_normal(ssm.fwd(a).size).astype(np.float32)

    def vm(field):
        with open("/proc/self/status") as f:
            return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith(field + ":"))
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = vm("VmRSS")
    gin = ssm.back(a, grad)
    print(json.dumps(dict(extra=vm("VmHWM") - base - gin.nbytes)))


def measure_memory(fkw, H_v, H_k, n_t):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="131072")
    spec = json.dumps(dict(fkw=fkw, H_v=H_v, H_k=H_k, n_t=n_t))
    try:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--mem-child", spec], capture_output=True,
                           text=True, timeout=600, env=env)
        return json.loads(r.stdout.strip().splitlines()[-1])["extra"] / 1e6
    except Exception as exc:
        log(f"memory: not measured ({exc})")
        return float("nan")


def work_size_mb(H_v, H_k, n_t):
    """The backward's scratch as the glue allocates it: the C API's gdn_back_work_size (float32, one thread,
    the automatic form), asked of the build that runs, not computed again here."""
    import ctypes
    from gdn_checks import GdnParams, gdn_clib
    p = GdnParams(n_seqs=1, n_seqs_k=1, n_t=n_t, H_v=H_v, H_k=H_k, S=128, K=1)
    return gdn_clib().gdn_back_work_size(ctypes.byref(p), 4, 1) / 1e6


def layer_step(n_t, reps, quick):
    """Qwen3-Next-shaped Qwen3NextGatedDeltaNet: one training step (forward, loss, backward) stock vs
    patched. Returns (rows, validation line)."""
    import torch
    import ssmgrad.transformers as st
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextGatedDeltaNet
    hidden = 256 if quick else 2048
    cfg = Qwen3NextConfig(hidden_size=hidden, linear_num_value_heads=32, linear_num_key_heads=16,
                          linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                          num_hidden_layers=1, vocab_size=16, num_attention_heads=16, num_key_value_heads=2,
                          head_dim=128)
    torch.manual_seed(0)
    layer = Qwen3NextGatedDeltaNet(cfg, 0).float()
    x = torch.randn(1, n_t, hidden) * 0.5
    w = torch.randn(1, n_t, hidden)

    def step():
        layer.zero_grad(set_to_none=True)
        loss = (layer(x) * w).sum() / n_t
        loss.backward()
        return loss.item(), [p.grad.norm().item() for p in layer.parameters()]

    st.unpatch(["qwen3_next"])
    ref = step()
    st.patch(["qwen3_next"])
    got = step()
    st.unpatch(["qwen3_next"])
    gerr = max(abs(a - b) / max(1e-12, abs(a)) for a, b in zip(ref[1], got[1]))
    val = (f"layer step validation: loss stock {ref[0]:.7g}, patched {got[0]:.7g}; worst relative difference "
           f"of a parameter's gradient norm {gerr:.1e}")
    ok = abs(ref[0] - got[0]) <= 1e-4 * max(1.0, abs(ref[0])) and gerr < 1e-3

    def stock():
        st.unpatch(["qwen3_next"])
        step()

    def patched():
        st.patch(["qwen3_next"])
        step()
    res = cell({"stock": stock, "patched": patched}, reps) if ok else None
    st.unpatch(["qwen3_next"])
    return res, val, ok, hidden


def ms(t):
    return f"{t * 1e3:.1f}" if t < 10 else f"{t * 1e3:,.0f}"


DECODE_HEAD = "## Decode (n_t = 1)"


def decode_lines(sg, ssm, shapes, rng, quick):
    """Section 5: per head layout, one token of ssmgrad's forward (fresh output, and out=) against
    np.copyto of the state, the calls alternating in one loop; medians of the wall time."""
    lines = []
    for H_v, H_k in shapes:
        a = inputs(rng, 1, H_v, H_k, 128)
        dst = np.empty_like(a["state"])
        dec = {"ssmgrad": lambda: ssm.fwd(a), "copy": lambda: np.copyto(dst, a["state"])}
        if "out" in inspect.signature(sg.gated_delta_net).parameters:
            buf = np.empty_like(ssm.fwd(a))
            dec["ssmgrad out="] = lambda: ssm.fwd(a, out=buf)
        c = cell(dec, 7 if quick else 201)
        line = (f"- H_v {H_v}, H_k {H_k}: np.copyto of the state ({a['state'].nbytes / 1e6:.1f} MB) "
                f"{c['copy'][0] * 1e6:.0f} us wall; ssmgrad {c['ssmgrad'][0] * 1e6:.0f} us "
                f"({c['ssmgrad'][0] / c['copy'][0]:.2f}x the copy)")
        if "ssmgrad out=" in c:
            line += f"; with out= {c['ssmgrad out='][0] * 1e6:.0f} us ({c['ssmgrad out='][0] / c['copy'][0]:.2f}x; target <= 1.5x)"
        lines.append(line)
    return lines


def decode_only(args, sg, ssm, shapes):
    """--decode-only: section 5 alone. With --out naming a results file that has a decode section,
    that section is replaced (the rest of the file stays as its own run measured it) and says which
    command and load it was measured with; otherwise a file with that section alone is written."""
    load0 = os.getloadavg()
    lines = decode_lines(sg, ssm, shapes, np.random.default_rng(0), args.quick)
    load1 = os.getloadavg()
    cmd = f"`python benchmarks/gdn_bench.py {' '.join(sys.argv[1:])}`".replace(" `", "`")
    section = [DECODE_HEAD, "", f"Measured apart from the rest of this file: {cmd}, load average {load0[0]:.2f} "
               f"at the start, {load1[0]:.2f} at the end.", ""] + lines
    out = args.out or os.path.join(tempfile.gettempdir(), "results_gdn_decode.md")
    old = open(out).read() if os.path.exists(out) else ""
    m = re.search(rf"^{re.escape(DECODE_HEAD)}\n.*?(?=^## |\Z)", old, re.M | re.S)
    text = old[:m.start()] + "\n".join(section) + "\n\n" + old[m.end():] if m else "\n".join(section) + "\n"
    print("\n".join(section))
    with open(out, "w") as f:
        f.write(text)
    log(f"wrote {out}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="32,16;16,8", help="H_v,H_k pairs separated by ';' (S is 128)")
    ap.add_argument("--n-t", default="512,2048", help="comma-separated token counts")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="small shapes, 1 rep: a smoke test")
    ap.add_argument("--form", help="ssmgrad's form= keyword (when the op takes it)")
    ap.add_argument("--no-layer", action="store_true", help="skip the Qwen3-Next layer's training step")
    ap.add_argument("--out", default=None, help="markdown file to write (default: a temp file)")
    ap.add_argument("--decode-only", action="store_true",
                    help="time the decode (section 5) alone; replaces the decode section of --out if it has one")
    common.add_isa_flag(ap)
    common.add_with_avx2_flag(ap)
    args = ap.parse_args()
    common.check_with_avx2(ap, args)
    if args.with_avx2 and args.decode_only:
        ap.error("--with-avx2 takes the full run (not --decode-only)")
    isa_line = common.apply_isa(args.isa)      # --isa avx2: runs itself again under the cap first
    import torch
    import ssmgrad as sg
    common.check_isa(args.isa, sg)
    torch.set_num_threads(1)
    sg.set_num_threads(1)
    fkw = form_kwargs(sg, args.form)
    ssm = Ssm(sg, fkw)
    shapes = [tuple(map(int, s.split(","))) for s in args.shapes.split(";")]
    if args.decode_only:
        return decode_only(args, sg, ssm, [(4, 2)] if args.quick else shapes)
    n_ts = [int(v) for v in args.n_t.split(",")]
    reps = args.reps
    if args.quick:
        shapes, n_ts, reps = [(4, 2)], [128], 1
    load0 = os.getloadavg()
    t_start = time.time()
    rng = np.random.default_rng(0)
    md = ["# Gated DeltaNet benchmark" + (" (QUICK smoke test)" if args.quick else ""), "",
          f"`python benchmarks/gdn_bench.py {' '.join(sys.argv[1:])}`".replace(" `", "`"), ""]
    md += [f"- {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; torch {torch.__version__}, "
           f"numpy {np.__version__}, ssmgrad form {args.form or 'default'}; 1 thread everywhere",
           f"{isa_line}; ssmgrad runs {sg._ext.build_info()['simd_selected']}, torch's CPU capability "
           f"{torch.backends.cpu.get_cpu_capability()}"]

    # 1. validation
    fns = peers(args.quick)
    val = {}
    for H_v, H_k in shapes:
        for k, v in validate(ssm, fns, rng, H_v, H_k).items():
            val[k] = (max(val.get(k, (0.0, True))[0], v[0]), val.get(k, (0, True))[1] and v[1])
    timed_peers = {k: f for k, f in fns.items() if val[k][1]}
    if not val["ssmgrad"][1]:
        sys.exit(f"ssmgrad failed validation: {val}")

    # 3. the peak, before and after the timing (the better of the two)
    peaks = [fma_peak_cpu()]

    # 2. timing
    rows, summary = [], []
    for H_v, H_k in shapes:
        for n_t in n_ts:
            log(f"H_v {H_v}, H_k {H_k}, n_t {n_t} ...")
            a = inputs(rng, n_t, H_v, H_k, 128)
            do = torch.randn(a["v"].shape)
            dstate = torch.randn(a["state"].shape)
            grad = np.concatenate([do.numpy().reshape(-1), dstate.numpy().reshape(-1)])
            hgrad = (do, dstate.transpose(-1, -2))

            def nograd(fn):
                def run():
                    with torch.no_grad():
                        hf_call(fn, a)
                return run
            obuf = ssm.fwd(a)
            f_cells = cell({"ssmgrad": lambda: ssm.fwd(a), "ssmgrad out=": lambda: ssm.fwd(a, out=obuf),
                            **{k: nograd(f) for k, f in timed_peers.items()}}, reps)
            fb_cells = cell({"ssmgrad": lambda: ssm.fwd_bwd(a, grad),
                             **{k: (lambda f=f: hf_call(f, a, hgrad)) for k, f in timed_peers.items()}}, reps)
            kept = ssm.fwd_keep(a)[1]
            b_cells = {"ssmgrad": lambda: ssm.back(a, grad, kept)}
            if kept is not None:
                b_cells["ssmgrad recomputing"] = lambda: ssm.back(a, grad)
                b_cells["ssmgrad fwd keeping"] = lambda: ssm.fwd_keep(a)
            b_cell = cell(b_cells, reps)
            gflop = FLOP_FWD * n_t * H_v * 128 * 128 / 1e9
            rows.append(dict(H_v=H_v, H_k=H_k, n_t=n_t, f=f_cells, fb=fb_cells, b=b_cell["ssmgrad"], bc=b_cell,
                             gflop=gflop))
            del kept
    peaks.append(fma_peak_cpu())
    peak = max((p for p in peaks if p), key=lambda p: p[1], default=None)

    md += ["", "## Forward, backward, forward + backward (float32, S 128, one sequence)", "",
           "Medians of CPU time (time.thread_time), in ms; wall-time medians in parentheses. `x`: the peer's time "
           "over ssmgrad's (CPU time, both making a new output each call). `ssmgrad fwd out=`: the same forward "
           "writing into one output array kept across calls (the kernel alone, without the page faults of a new "
           "output of up to 35 MB); the FMA-peak share is taken from it.", ""]
    hdr = ["H_v, H_k", "n_t", "ssmgrad fwd", "ssmgrad fwd out=", "GFLOP/s fwd out="] + [f"{k} fwd" for k in timed_peers] + \
          ["ssmgrad bwd", "ssmgrad f+b"] + [f"{k} f+b" for k in timed_peers]
    md += ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    back_lines = []
    for r in rows:
        sf, so, sfb = r["f"]["ssmgrad"], r["f"]["ssmgrad out="], r["fb"]["ssmgrad"]
        cells = [f"{r['H_v']}, {r['H_k']}", str(r["n_t"]), f"{ms(sf[1])} ({ms(sf[0])})", f"{ms(so[1])} ({ms(so[0])})",
                 f"{r['gflop'] / so[1]:.1f}"]
        cells += [f"{ms(r['f'][k][1])} ({ms(r['f'][k][0])}), {r['f'][k][1] / sf[1]:.2f}x" for k in timed_peers]
        cells += [f"{ms(r['b'][1])} ({ms(r['b'][0])})", f"{ms(sfb[1])} ({ms(sfb[0])})"]
        cells += [f"{ms(r['fb'][k][1])} ({ms(r['fb'][k][0])}), {r['fb'][k][1] / sfb[1]:.2f}x" for k in timed_peers]
        md.append("| " + " | ".join(cells) + " |")
        if "ssmgrad recomputing" in r["bc"]:     # the training step's backward reads the forward's chunks
            bc = r["bc"]
            back_lines.append(f"- H_v {r['H_v']}, H_k {r['H_k']}, n_t {r['n_t']}: backward reading the chunks "
                              f"{ms(bc['ssmgrad'][1])} ms over the forward keeping them "
                              f"{ms(bc['ssmgrad fwd keeping'][1])} ms: {bc['ssmgrad'][1] / bc['ssmgrad fwd keeping'][1]:.2f}x; "
                              f"the recomputing backward {ms(bc['ssmgrad recomputing'][1])} ms over the plain forward "
                              f"{ms(sf[1])} ms: {bc['ssmgrad recomputing'][1] / sf[1]:.2f}x; forward + backward "
                              f"{ms(sf[1] + bc['ssmgrad recomputing'][1])} -> "
                              f"{ms(bc['ssmgrad fwd keeping'][1] + bc['ssmgrad'][1])} ms (CPU time)")
        fastest = min((r["fb"][k][1] for k in timed_peers), default=None)
        line = f"- H_v {r['H_v']}, H_k {r['H_k']}, n_t {r['n_t']}: "
        if fastest is not None:
            line += f"fwd+bwd, fastest peer / ssmgrad {fastest / sfb[1]:.2f}x (target >= 1.5x)"
        if "eager" in timed_peers:
            line += f", eager / ssmgrad {r['fb']['eager'][1] / sfb[1]:.2f}x (target >= 3x)"
        if peak:
            line += (f"; forward into out= {r['gflop'] / so[1]:.1f} GFLOP/s = {100 * r['gflop'] / so[1] / peak[1]:.0f}% of the "
                     f"FMA peak (target >= 60%; with a new output array each call {100 * r['gflop'] / sf[1] / peak[1]:.0f}%)")
        summary.append(line)
    if back_lines:
        md += ["", "ssmgrad's training step (`ssmgrad f+b`, `ssmgrad bwd`): the forward keeps its chunks "
               "(keep_states=True), the backward reads them (chunk_states=); against the backward that recomputes "
               "them by its own pass over the chunks, in the same cells:", ""] + back_lines
    md += ["", "One core's FMA peak (benchmarks/probes/peak.c in CPU time, the better of a run before and one "
           "after the timing): " + (f"{peak[1]:.1f} GFLOP/s float32 at {peak[0]:.2f} GHz, "
                                    f"{common.peak_bits()}-bit FMAs"
                                    if peak else "not measured"),
           f"(forward FLOP: {FLOP_FWD} per state element and token; at most 7/8 of the peak, see the script's doc)."]

    # 4. memory
    mem_lines = []
    for H_v, H_k in shapes:
        n_t = max(n_ts)
        mem_lines.append(f"- H_v {H_v}, H_k {H_k}, n_t {n_t}: work size {work_size_mb(H_v, H_k, n_t):.1f} MB; "
                         f"peak RSS beyond inputs and output {measure_memory(fkw, H_v, H_k, n_t):.1f} MB (target <= 64 MB)")
    md += ["", "## Backward extra memory (1 thread)", ""] + mem_lines

    # 5. decode
    md += ["", DECODE_HEAD, ""] + decode_lines(sg, ssm, shapes, rng, args.quick)

    # 6. layer training step
    if not args.no_layer:
        res, vline, ok, hidden = layer_step(128 if args.quick else 512, reps, args.quick)
        md += ["", f"## Training step of a Qwen3-Next-shaped layer (Qwen3NextGatedDeltaNet, hidden {hidden}, "
               f"H_v 32, H_k 16, S 128, n_t {128 if args.quick else 512}, float32, 1 thread)", "", "- " + vline]
        if res:
            md.append(f"- stock {ms(res['stock'][1])} ms CPU ({ms(res['stock'][0])} wall), patched "
                      f"{ms(res['patched'][1])} ms CPU ({ms(res['patched'][0])} wall): "
                      f"{res['stock'][1] / res['patched'][1]:.2f}x")
        else:
            md.append("- not timed: the patched layer failed validation")

    md += ["", "## Validation (before timing)", "",
           "Worst max |x - ref| / max(1, max |ref|) over o, the final state and every gradient, float32 against "
           "the float64 reference recurrence (S 32, n_t 100, each benchmark head layout); timed only below 1e-4:", ""]
    md += [f"- {k}: {v[0]:.1e}" + ("" if v[1] else " FAILED, not timed") for k, v in val.items()]
    md += ["", "## Targets", ""] + summary
    load1 = os.getloadavg()
    md += ["", f"Load average {load0[0]:.2f} at the start, {load1[0]:.2f} at the end (the machine is shared); "
           f"run time {time.time() - t_start:.0f} s.", ""]
    if args.with_avx2:
        md += common.avx2_report("gdn_bench.py", sys.argv[1:])
    text = "\n".join(md)
    print(text)
    out = args.out or os.path.join(tempfile.gettempdir(), "results_gdn.md")
    with open(out, "w") as f:
        f.write(text)
    log(f"wrote {out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--mem-child"]:
        mem_child(json.loads(sys.argv[2]))
    else:
        main()
