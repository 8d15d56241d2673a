"""python -m ssmgrad [check|bench|info] [options]; `python -m ssmgrad COMMAND --help` for each.

check (the default): runs the scan and the conv on Mamba-1 and Mamba-2 shapes and the Gated
    DeltaNet (both gates, both forms) forward and backward, compares every gradient with central
    finite differences in float64 (no torch needed) and float32 with float64, times each call at
    real layer shapes, prints a table, and exits 1 if any check fails.
bench: times forward and backward at the real layer shapes for one n_t (medians), and, where
    torch is installed, the PyTorch CPU formulations beside them (token loop, chunked SSD,
    mambapy's pscan when installed, F.conv1d; transformers' torch_chunk_gated_delta_rule for the
    Gated DeltaNet when transformers is installed), each checked against ssmgrad's output first.
    Exits 1 if a peer disagrees.
info: version, threads, SIMD level and OpenMP found at build time.

Bad option values exit 2 with a one-line message.
"""
import argparse
import sys
import time

import numpy as np

import ssmgrad

FD_EPS = 1e-6
FD_TOL = 1e-6          # max |analytic - finite difference| relative to the gradient's scale
F32_TOL = 2e-5         # max |float32 - float64| relative to the result's scale
PEER_TOL = 1e-3        # bench: max |peer - ssmgrad| relative to the output's scale, float32


def _scan_inputs(rng, n_rs, n_head, head_dim, d_state, n_group, n_t, n_seqs, mamba1, dtype=np.float64):
    s = rng.standard_normal((n_rs, n_head, head_dim, d_state))
    x = rng.standard_normal((n_seqs, n_t, n_head, head_dim))
    dt = rng.standard_normal((n_seqs, n_t, n_head)) - 1.0
    A = -np.exp(0.5 * rng.standard_normal((n_head, d_state if mamba1 else 1)))
    B = rng.standard_normal((n_seqs, n_t, n_group, d_state))
    C = rng.standard_normal((n_seqs, n_t, n_group, d_state))
    return [a.astype(dtype) for a in (s, x, dt, A, B, C)]


def _fd_grad(f, args, i, g, eps=FD_EPS):
    """d/d args[i] of sum(f(*args) * g), central differences, float64."""
    base = args[i]
    res = np.zeros(base.shape)
    flat = res.reshape(-1)
    for j in range(base.size):
        pert = base.copy().reshape(-1)
        pert[j] += eps
        hi = f(*args[:i], pert.reshape(base.shape), *args[i + 1:])
        pert[j] -= 2 * eps
        lo = f(*args[:i], pert.reshape(base.shape), *args[i + 1:])
        flat[j] = np.dot(hi - lo, g) / (2 * eps)
    return res


def _rel(a, b):
    scale = max(np.abs(b).max(initial=0.0), 1e-12)
    return float(np.abs(a - b).max(initial=0.0) / scale)


def _scan_check_dims(mamba1):
    return dict(n_rs=3, n_head=4, head_dim=1 if mamba1 else 3, d_state=5, n_group=2, n_t=6, n_seqs=2)


CHECK_IDS = [2, 2]                                                # duplicated; rows 0 and 1 unreferenced
CONV_CHECK = dict(n_s=2, d_inner=3, d_conv=4, n_t=7)
# two value sequences reading one key sequence and two value heads one key head (their gradients
# add up); 66 tokens: past one 64-token chunk of the chunked form and one checkpoint segment of the
# recurrence's backward
GDN_CHECK = dict(n_seqs=2, n_seqs_k=1, H_v=2, H_k=1, S=4, n_t=66)
GDN_FORMS = (("rec", "recurrence"), ("chunked", "chunked"))
GDN_NAMES = ("q", "k", "v", "g", "beta", "state")


def _gdn_inputs(rng, n_seqs, n_seqs_k, H_v, H_k, S, n_t, kda, dtype=np.float64):
    """q, k, v, g, beta, state as models feed them: q and k L2-normalized per head, the log decay
    g = -softplus(.) < 0 (one per head, or one per key channel with kda), beta = sigmoid(.)."""
    q, k = (rng.standard_normal((n_seqs_k, n_t, H_k, S)) for _ in range(2))
    q /= np.linalg.norm(q, axis=-1, keepdims=True)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.standard_normal((n_seqs, n_t, H_v, S))
    g = -np.logaddexp(0.0, rng.standard_normal((n_seqs, n_t, H_v, S if kda else 1)) - 1.0)
    beta = 1.0 / (1.0 + np.exp(-rng.standard_normal((n_seqs, n_t, H_v, 1))))
    state = 0.5 * rng.standard_normal((n_seqs, H_v, S, S))
    return [a.astype(dtype) for a in (q, k, v, g, beta, state)]


def _check_scan(rng, label, mamba1, rows):
    dims = _scan_check_dims(mamba1)
    s, x, dt, A, B, C = _scan_inputs(rng, **dims, mamba1=mamba1)
    ids = np.array(CHECK_IDS)
    out = ssmgrad.ssm_scan(s, x, dt, A, B, C, ids)
    g = rng.standard_normal(out.size)                            # y region AND final-state region
    gin, dA = ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, g, return_dA=True)
    grads = ssmgrad.split(gin, s.shape, x.shape, dt.shape, B.shape, C.shape)
    args = [s, x, dt, A, B, C]
    names = ["s", "x", "dt", "A", "B", "C"]
    got = dict(zip(["s", "x", "dt", "B", "C"], grads), A=dA)

    def f(*a):
        return ssmgrad.ssm_scan(*a, ids)

    for i, name in enumerate(names):
        fd = _fd_grad(f, args, i, g)
        rows.append((label, "d_" + name, _rel(got[name], fd), FD_TOL))
    f32 = [a.astype(np.float32) for a in args]
    out32 = ssmgrad.ssm_scan(*f32, ids)
    rows.append((label, "fwd f32 vs f64", _rel(out32, out), F32_TOL))
    gin32 = ssmgrad.ssm_scan_back(*f32, ids, g.astype(np.float32))
    rows.append((label, "bwd f32 vs f64", _rel(gin32, gin), F32_TOL * 10))


def _check_conv(rng, rows):
    cc = CONV_CHECK
    sx = rng.standard_normal((cc["n_s"], cc["d_inner"], cc["d_conv"] - 1 + cc["n_t"]))
    c = rng.standard_normal((cc["d_inner"], cc["d_conv"]))
    y = ssmgrad.ssm_conv(sx, c)
    g = rng.standard_normal(y.size)
    got_sx = ssmgrad.ssm_conv_back(sx, c, g.reshape(y.shape))
    got_c = ssmgrad.ssm_conv_back_weight(sx, c, g.reshape(y.shape))

    def f(sx_, c_):
        return ssmgrad.ssm_conv(sx_, c_).reshape(-1)

    rows.append(("conv", "d_sx", _rel(got_sx, _fd_grad(f, [sx, c], 0, g)), FD_TOL))
    rows.append(("conv", "d_c", _rel(got_c, _fd_grad(f, [sx, c], 1, g)), FD_TOL))
    y32 = ssmgrad.ssm_conv(sx.astype(np.float32), c.astype(np.float32))
    rows.append(("conv", "fwd f32 vs f64", _rel(y32, y), F32_TOL))


def _check_gdn(rng, kda, rows):
    args = _gdn_inputs(rng, **GDN_CHECK, kda=kda)
    f32 = [a.astype(np.float32) for a in args]
    for short, form in GDN_FORMS:
        label = f"gdn {'KDA' if kda else 'g'} {short}"
        out = ssmgrad.gated_delta_net(*args, form=form)
        g = rng.standard_normal(out.size)                        # o region AND final-state region
        gin = ssmgrad.gated_delta_net_back(*args, g, form=form)
        got = ssmgrad.split(gin, *(a.shape for a in args))

        def f(*a, form=form):
            return ssmgrad.gated_delta_net(*a, form=form)

        for i, name in enumerate(GDN_NAMES):
            rows.append((label, "d_" + name, _rel(got[i], _fd_grad(f, args, i, g)), FD_TOL))
        rows.append((label, "fwd f32 vs f64", _rel(ssmgrad.gated_delta_net(*f32, form=form), out), F32_TOL))
        gin32 = ssmgrad.gated_delta_net_back(*f32, g.astype(np.float32), form=form)
        rows.append((label, "bwd f32 vs f64", _rel(gin32, gin), F32_TOL * 10))


def _median_time(fn, repeat):
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


# (label, n_head, head_dim, d_state, mamba1, flop per update of the backward)
LAYERS = [
    ("Mamba-130m scan", 1536, 1, 16, True, 19),
    ("Mamba-2-130m scan", 24, 64, 128, False, 14),
]


# (label, H_v, H_k, per-channel gate, form): Qwen3-Next / Qwen3.5-like layers (S 128), the scalar
# gate in both forms; the per-channel gate (Kimi-Linear's KDA) at H_v == H_k, as transformers has it
GDN_S = 128
GDN_LAYERS = [(f"{'KDA' if kda else 'GDN'} {H_v}/{H_k} {short}", H_v, H_k, kda, form)
              for H_v, H_k, kda in ((16, 16, False), (32, 16, False), (16, 16, True)) for short, form in GDN_FORMS]
GDN_FLOP_FWD = 7      # per state element and token: decay 1, S^T k 2, rank-one update 2, S^T q 2


def _time_gdn(rng, n_t, repeat, progress, rows):
    """GDN rows: the forward's GFLOP/s counts GDN_FLOP_FWD whichever form runs; the backward has
    no count of its own (its GFLOP/s is left out)."""
    for label, H_v, H_k, kda, form in GDN_LAYERS:
        if progress:
            progress(label)
        a = _gdn_inputs(rng, 1, 1, H_v, H_k, GDN_S, n_t, kda, np.float32)
        g = rng.standard_normal(ssmgrad.gated_delta_net(*a).size).astype(np.float32)
        tf = _median_time(lambda: ssmgrad.gated_delta_net(*a, form=form), repeat)
        tb = _median_time(lambda: ssmgrad.gated_delta_net_back(*a, g, form=form), repeat)
        rows.append((label, tf, tb, GDN_FLOP_FWD * n_t * H_v * GDN_S * GDN_S / tf / 1e9, None))


def _time_layers(n_t, repeat, progress=None):
    rng = np.random.default_rng(1)
    rows = []
    for label, n_head, head_dim, d_state, mamba1, bflop in LAYERS:
        if progress:
            progress(label)
        s, x, dt, A, B, C = _scan_inputs(rng, 1, n_head, head_dim, d_state, 1, n_t, 1, mamba1, np.float32)
        dt -= 3.0
        ids = np.zeros(1, np.int32)
        out = ssmgrad.ssm_scan(s, x, dt, A, B, C, ids)
        g = rng.standard_normal(out.size).astype(np.float32)
        tf = _median_time(lambda: ssmgrad.ssm_scan(s, x, dt, A, B, C, ids), repeat)
        tb = _median_time(lambda: ssmgrad.ssm_scan_back(s, x, dt, A, B, C, ids, g), repeat)
        upd = n_t * n_head * head_dim * d_state
        rows.append((label, tf, tb, 5 * upd / tf / 1e9, bflop * upd / tb / 1e9))
    for d_inner in (1536, 1792):
        label = f"conv {d_inner} ch"
        if progress:
            progress(label)
        sx = rng.standard_normal((1, d_inner, 3 + n_t)).astype(np.float32)
        c = rng.standard_normal((d_inner, 4)).astype(np.float32)
        g = rng.standard_normal((1, n_t, d_inner)).astype(np.float32)
        tf = _median_time(lambda: ssmgrad.ssm_conv(sx, c), repeat)
        tb = _median_time(lambda: (ssmgrad.ssm_conv_back(sx, c, g), ssmgrad.ssm_conv_back_weight(sx, c, g)), repeat)
        rows.append((label, tf, tb, 2 * 4 * n_t * d_inner / tf / 1e9, 4 * 4 * n_t * d_inner / tb / 1e9))
    _time_gdn(rng, n_t, repeat, progress, rows)
    return rows


def _print_times(rows, n_t):
    print(f"\nTime per call, float32, one sequence, n_t = {n_t}, {ssmgrad.get_num_threads()} thread(s), medians"
          " (wall clock: they depend on what else the machine runs):")
    print(f"  {'layer':<20} {'forward ms':>11} {'backward ms':>12} {'fwd GFLOP/s':>12} {'bwd GFLOP/s':>12}")
    for label, tf, tb, gf, gb in rows:
        gb = "-" if gb is None else f"{gb:.1f}"
        print(f"  {label:<20} {tf * 1e3:11.3f} {tb * 1e3:12.3f} {gf:12.1f} {gb:>12}")
    print(f"  (GDN/KDA: S={GDN_S}, H_v/H_k, form; their forward GFLOP/s count {GDN_FLOP_FWD} FLOP per state element"
          " and token, their backward none)")


def cmd_check(args):
    rng = np.random.default_rng(0)
    rows = []
    _check_scan(rng, "scan Mamba-1", True, rows)
    _check_scan(rng, "scan Mamba-2", False, rows)
    _check_conv(rng, rows)
    _check_gdn(rng, False, rows)
    _check_gdn(rng, True, rows)
    print(f"ssmgrad {ssmgrad.__version__} self-check: gradients vs central finite differences (float64, eps={FD_EPS})")
    print("shapes checked:")
    for label, mamba1 in (("scan Mamba-1", True), ("scan Mamba-2", False)):
        d = _scan_check_dims(mamba1)
        A = f"({d['n_head']}, {d['d_state'] if mamba1 else 1})"
        print(f"  {label:<14} " + " ".join(f"{k}={v}" for k, v in d.items()) + f", A {A}, ids={CHECK_IDS}")
    print(f"  {'conv':<14} " + " ".join(f"{k}={v}" for k, v in CONV_CHECK.items()))
    for gate, last in (("g", "1"), ("KDA", "S")):
        print(f"  {'gdn ' + gate:<14} " + " ".join(f"{k}={v}" for k, v in GDN_CHECK.items())
              + f", g (n_seqs, n_t, H_v, {last}), K=1, forms " + ", ".join(f for _, f in GDN_FORMS))
    print(f"  {'op':<16} {'quantity':<16} {'max rel err':>12} {'tolerance':>10}  result")
    failed = 0
    for op, what, err, tol in rows:
        ok = err <= tol
        failed += not ok
        print(f"  {op:<16} {what:<16} {err:12.2e} {tol:10.0e}  {'ok' if ok else 'FAIL'}")
    _print_times(_time_layers(args.n_t, 5), args.n_t)
    if failed:
        print(f"\n{failed} check(s) FAILED")
        return 1
    print("\nall checks passed")
    return 0


def _torch_peer_rows(n_t, repeat, progress):
    """fwd / bwd medians of the PyTorch formulations (ssmgrad._bench_peers) at the layer shapes,
    each checked against ssmgrad's output first; [] when torch is not installed."""
    try:
        import torch
    except ImportError:
        return None
    from . import _bench_peers as peers

    torch.set_num_threads(ssmgrad.get_num_threads())
    rng = np.random.default_rng(1)
    rows = []

    def timed(label, impl, fn, inputs, want):
        progress(f"{label}: {impl}")
        with torch.no_grad():                                    # validate first (and warm up)
            outs = fn(*(torch.from_numpy(a.copy()) for a in inputs))
        outs = outs if isinstance(outs, tuple) else (outs,)
        wants = want if isinstance(want, tuple) else (want,)     # compared output by output
        err = max(float(np.abs(o.numpy() - w).max() / max(np.abs(w).max(), 1e-30)) for o, w in zip(outs, wants))
        if not err <= PEER_TOL:                                  # a peer that disagrees is not timed
            rows.append((label, impl, None, None, err))
            return
        ts_f, ts_b = [], []
        for _ in range(repeat):
            leaves = [torch.from_numpy(a.copy()).requires_grad_(a.dtype.kind == "f") for a in inputs]
            t0 = time.perf_counter()
            outs = fn(*leaves)
            t1 = time.perf_counter()
            outs = outs if isinstance(outs, tuple) else (outs,)
            torch.autograd.grad(sum(o.sum() for o in outs), [v for v in leaves if v.requires_grad],
                                allow_unused=True)
            t2 = time.perf_counter()
            ts_f.append(t1 - t0)
            ts_b.append(t2 - t1)
        rows.append((label, impl, float(np.median(ts_f)), float(np.median(ts_b)), err))

    for label, n_head, head_dim, d_state, mamba1, _ in LAYERS:
        s, x, dt, A, B, C = _scan_inputs(rng, 1, n_head, head_dim, d_state, 1, n_t, 1, mamba1, np.float32)
        dt -= 3.0
        ids = np.zeros(1, np.int64)
        y = ssmgrad.split(ssmgrad.ssm_scan(s, x, dt, A, B, C, ids), x.shape, (1,) + s.shape[1:])[0]
        impls = ["loop"] + (["pscan"] if mamba1 else ["ssd"])
        for impl in impls:
            if impl == "pscan":
                try:
                    import mambapy  # noqa: F401
                except ImportError:
                    continue
            fn = peers.SCAN_IMPLS[impl]
            timed(label, "torch " + impl, lambda *a, fn=fn: fn(*a[:6], a[6]), [s, x, dt, A, B, C, ids], y)
    for d_inner in (1536, 1792):
        sx = rng.standard_normal((1, d_inner, 3 + n_t)).astype(np.float32)
        c = rng.standard_normal((d_inner, 4)).astype(np.float32)
        timed(f"conv {d_inner} ch", "torch F.conv1d", peers.conv_conv1d, [sx, c], ssmgrad.ssm_conv(sx, c))
    try:
        import transformers  # noqa: F401
    except ImportError:
        return rows
    for label, H_v, H_k, kda, form in GDN_LAYERS:
        if kda or form != "chunked":           # the peer: the scalar gate's chunked rule, beside ssmgrad's
            continue
        a = _gdn_inputs(rng, 1, 1, H_v, H_k, GDN_S, n_t, False, np.float32)
        out = ssmgrad.gated_delta_net(*a, head_bcast="interleaved", form=form)       # transformers' head layout
        o, final = ssmgrad.split(out, a[2].shape, a[5].shape)
        timed(label, "hf chunk rule", peers.gdn_chunk_transformers, a, (o, final))
    return rows


def cmd_bench(args):
    tty = sys.stderr.isatty()        # a progress line only where someone watches it, not in logs

    def progress(label):
        if tty:
            print(f"\r  timing {label:<40}", end="", file=sys.stderr, flush=True)

    rows = _time_layers(args.n_t, args.repeat, progress)
    peer_rows = _torch_peer_rows(args.n_t, args.repeat, progress)
    if tty:
        print("\r" + " " * 60 + "\r", end="", file=sys.stderr)
    _print_times(rows, args.n_t)
    if peer_rows is None:
        print("\n(torch is not installed: no PyTorch comparison; pip install torch)")
        return 0
    ours = {label: tf + tb for label, tf, tb, _, _ in rows}
    print(f"\nPyTorch CPU formulations at the same shapes and threads (forward records autograd;"
          f" backward is autograd.grad), medians:")
    print(f"  {'layer':<20} {'implementation':<16} {'fwd ms':>9} {'bwd ms':>9} {'fwd+bwd / ssmgrad':>18}"
          f" {'agrees':>8}")
    bad = 0
    for label, impl, tf, tb, err in peer_rows:
        ok = err <= PEER_TOL
        bad += not ok
        if not ok:
            print(f"  {label:<20} {impl:<16} {'not timed: disagrees with ssmgrad':>38} {f'NO {err:.0e}':>8}")
            continue
        print(f"  {label:<20} {impl:<16} {tf * 1e3:9.3f} {tb * 1e3:9.3f} {(tf + tb) / ours[label]:17.2f}x"
              f" {'yes':>8}")
    if not any(label.startswith("GDN") for label, *_ in peer_rows):
        print("  (transformers is not installed: no peer for the Gated DeltaNet; pip install transformers)")
    else:
        print("  (hf chunk rule: transformers' torch_chunk_gated_delta_rule, interleaved heads, beside ssmgrad's"
              " chunked form)")
    return 1 if bad else 0


def cmd_info(args):
    ssmgrad.show_config()
    return 0


class _Parser(argparse.ArgumentParser):
    """Bad values end in one line on stderr and exit 2 (no usage block, no traceback)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _int_in(lo, hi=None):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo or (hi is not None and v > hi):
            raise argparse.ArgumentTypeError(f"must be {'in [' + str(lo) + ', ' + str(hi) + ']' if hi else '>= ' + str(lo)}, got {v}")
        return v
    return parse


def _parser():
    ap = _Parser(prog="python -m ssmgrad", description=__doc__.split("\n\n")[0],
                 epilog="With no command, runs `check`.")
    sub = ap.add_subparsers(dest="command", metavar="{check,bench,info}", parser_class=_Parser)

    def threads(p):
        p.add_argument("--threads", type=_int_in(1, ssmgrad.MAX_THREADS), default=None, metavar="N",
                       help=f"threads for the kernels (default: usable cores, {ssmgrad.get_num_threads()} here)")

    p = sub.add_parser("check", help="self-check against finite differences, then time the layer shapes",
                       description="Checks the ops forward and backward (every gradient against float64 finite "
                       "differences, float32 against float64) on small Mamba-1, Mamba-2, conv and Gated DeltaNet "
                       "shapes (both gates, both forms), printed first; then times each call at the real layer "
                       "shapes. Exits 1 if a check fails.")
    threads(p)
    p.add_argument("--n-t", type=_int_in(1), default=512, metavar="N", help="tokens for the timed layer shapes (512)")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("bench", help="time the real layer shapes beside the PyTorch CPU formulations",
                       description="Times forward and backward (medians) at the Mamba-130m / Mamba-2-130m layer "
                       "shapes and Qwen3-Next-like Gated DeltaNet layers for one n_t, beside the PyTorch CPU "
                       "formulations when torch is installed (transformers' chunked gated delta rule when "
                       "transformers is), each checked against ssmgrad first. Exits 1 if a peer disagrees.")
    threads(p)
    p.add_argument("--n-t", type=_int_in(1), default=512, metavar="N", help="tokens per sequence (512)")
    p.add_argument("--repeat", type=_int_in(1), default=7, metavar="N", help="timed repeats per call (7)")
    p.set_defaults(func=cmd_bench)

    p = sub.add_parser("info", help="version, threads, SIMD level and OpenMP of this build",
                       description="Prints the version, threads, SIMD level and OpenMP of this build.")
    p.set_defaults(func=cmd_info)
    return ap


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv.insert(0, "check")                       # `python -m ssmgrad [--n-t N ...]` is the self-check
    args = _parser().parse_args(argv)
    if getattr(args, "threads", None) is not None:
        ssmgrad.set_num_threads(args.threads)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
