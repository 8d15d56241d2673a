"""Concurrency: thread safety, GIL release, and thread-count determinism.

* 8 Python threads call every forward and backward at once (started together by a barrier,
  several rounds each) on the same shared input arrays: every result is bitwise identical to the
  serial result, and the shared inputs are unchanged.
* The GIL is released during compute, counted rather than timed: with preemptive GIL switching off
  (a switch interval of 1000 s), another Python thread, woken as the scan (forward, backward), conv
  or delta-rule backward C function is entered, runs all its 1000 bytecode steps before that
  function returns (1 compute thread). A positive control (builtin sum over a range, which holds the
  GIL) lets it make none.
* set_num_threads(1), (2), (3): all outputs bitwise identical (each reduction owned by one
  thread, fixed order); the previous thread count is restored afterwards.
* The scan scratch cache (csrc/glue/scratch.c, work_alloc/work_release) is correct without the GIL:
  POSIX threads inside the extension (no GIL, as under free-threaded Python) take and return it
  hundreds of thousands of times and never hold one buffer twice; and Python threads running
  backward calls of different shapes (so the cached buffer is reused, replaced and contended)
  all match the float64 torch reference.
* fork: after a call on 2 threads, a multiprocessing child forked from the process returns the
  same bits (libgomp's pool does not survive fork; the child runs serially) instead of hanging.
"""

import os
import signal
import subprocess
import sys
import textwrap
import threading

import numpy as np

import ssmgrad
from reference import (
    assert_close, gdn_args, gdn_out_size, make_gdn_inputs, make_scan_inputs, ref_scan_grads, ref_scan_np, scan_args,
)


def scan_inputs(rng, dtype, mamba2, n_seqs=3, n_t=40, n_head=6, head_dim=8, d_state=16, n_group=2, n_rs=5):
    s = rng.standard_normal((n_rs, n_head, head_dim, d_state)).astype(dtype)
    x = rng.standard_normal((n_seqs, n_t, n_head, head_dim)).astype(dtype)
    dt = rng.uniform(-3, 2, (n_seqs, n_t, n_head)).astype(dtype)
    A = -rng.uniform(0.1, 2, (n_head, 1) if mamba2 else (n_head, d_state)).astype(dtype)
    B = rng.standard_normal((n_seqs, n_t, n_group, d_state)).astype(dtype)
    C = rng.standard_normal((n_seqs, n_t, n_group, d_state)).astype(dtype)
    ids = np.array([4, 0, 4][:n_seqs] + list(range(max(0, n_seqs - 3))), dtype=np.int64)
    return s, x, dt, A, B, C, ids


def all_calls(dtype, seed=0):
    """name -> zero-argument callable computing one public function on fixed shared inputs."""
    rng = np.random.default_rng(seed)
    calls = {}
    for mamba2 in (False, True):
        K = 3 if mamba2 else 1
        args = scan_inputs(rng, dtype, mamba2)
        n_out = ssmgrad.ssm_scan(*args, K=K).size
        grad = rng.standard_normal(n_out).astype(dtype)
        tag = "m2" if mamba2 else "m1"
        calls[f"scan_{tag}"] = lambda a=args, K=K: ssmgrad.ssm_scan(*a, K=K)
        calls[f"scan_back_{tag}"] = lambda a=args, g=grad, K=K: ssmgrad.ssm_scan_back(*a, g, K=K, return_dA=True)
    sx = rng.standard_normal((3, 48, 3 + 64)).astype(dtype)
    c = rng.standard_normal((48, 4)).astype(dtype)
    gy = rng.standard_normal((3, 64, 48)).astype(dtype)
    calls["conv"] = lambda: ssmgrad.ssm_conv(sx, c)
    calls["conv_back"] = lambda: ssmgrad.ssm_conv_back(sx, c, gy)
    calls["conv_back_weight"] = lambda: ssmgrad.ssm_conv_back_weight(sx, c, gy)
    return calls


def flat(res):
    return res if isinstance(res, tuple) else (res,)


def assert_bitwise(a, b, what):
    for r1, r2 in zip(flat(a), flat(b)):
        assert r1.dtype == r2.dtype and r1.shape == r2.shape, what
        # compare bytes, so -0.0 vs 0.0 and NaN payloads count as differences
        assert r1.tobytes() == r2.tobytes(), f"{what}: max diff {np.max(np.abs(r1 - r2))}"


def test_threads_share_inputs_same_results(restore_threads, force_threads):
    for dtype in (np.float32, np.float64):
        calls = all_calls(dtype)
        serial = {k: f() for k, f in calls.items()}
        n_threads, rounds = 8, 4
        barrier = threading.Barrier(n_threads)
        errors, results = [], {}

        def worker(tid):
            try:
                barrier.wait()
                names = list(calls)
                out = []
                for r in range(rounds):
                    for k in names[tid % len(names):] + names[:tid % len(names)]:   # different orders
                        out.append((k, calls[k]()))
                results[tid] = out
            except BaseException as e:  # noqa: BLE001
                errors.append(repr(e))

        for nt in (1, 2):                                 # serial kernels and parallel kernels inside
            ssmgrad.set_num_threads(nt)
            threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not any(t.is_alive() for t in threads), "a worker thread hung"
            assert not errors, errors
            assert len(results) == n_threads
            for tid, out in results.items():
                assert len(out) == rounds * len(calls)
                for k, res in out:
                    assert_bitwise(res, serial[k], f"{np.dtype(dtype)} thread {tid} {k} (num_threads={nt})")
            results.clear()
        # the shared inputs were not modified
        again = {k: f() for k, f in all_calls(dtype).items()}
        for k in serial:
            assert_bitwise(again[k], serial[k], f"rerun {k}")


def _steps_inside(fn, target, steps=1000):
    """How far another Python thread gets while fn() is inside its call of the C function TARGET.

    The switch interval is set to 1000 s for the call, so that the GIL changes hands only where a
    thread gives it up (a blocking wait, or C code releasing it), never by preemption. A profile
    hook on this thread sees TARGET's 'c_call' and 'c_return' (on either side of the C code, with no
    Python bytecode between): at the call it wakes a second thread, which then runs STEPS steps of
    Python bytecode and ends; at the return it reads how many steps were made. STEPS means that the
    second thread ran inside the call, so the C function released the GIL; 0 that it did not (or
    that the woken thread was not scheduled before the call ended: the caller retries longer).
    Returns (steps made inside the call, whether TARGET was called)."""
    entered = threading.Event()
    count, seen = [0], []

    def worker():
        if entered.wait(120):
            for _ in range(steps):
                count[0] += 1

    def hook(frame, event, arg):
        if arg is target:
            if event == "c_call":
                entered.set()
            elif event in ("c_return", "c_exception"):
                seen.append(count[0])

    th = threading.Thread(target=worker)
    th.start()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        sys.setprofile(hook)
        try:
            fn()
        finally:
            sys.setprofile(None)
    finally:
        sys.setswitchinterval(old)
        entered.set()
        th.join()
    return (seen[0] if seen else 0), bool(seen)


def _released(make_call, target, attempts=6):
    """Steps another thread made inside the call (see _steps_inside), for calls of growing size
    make_call(i): a longer call leaves more time for the woken thread to be scheduled on a loaded
    machine. Where the C function holds the GIL every attempt gives 0."""
    for i in range(attempts):
        made, called = _steps_inside(make_call(i), target)
        assert called, f"{target.__name__} was never called"
        if made:
            return made
    return 0


def test_gil_released_during_compute(restore_threads):
    import _ssmgrad
    ssmgrad.set_num_threads(1)
    rng = np.random.default_rng(3)

    def scan_call(i, back):
        args = scan_inputs(rng, np.float32, True, n_seqs=2, n_t=4096 << i, n_head=8, head_dim=32, d_state=32,
                           n_group=1)
        if not back:
            return lambda: ssmgrad.ssm_scan(*args)
        grad = np.ones(ssmgrad.ssm_scan(*args).size, np.float32)
        return lambda: ssmgrad.ssm_scan_back(*args, grad)

    def conv_call(i):
        sx = rng.standard_normal((4, 1024, 3 + (1024 << i))).astype(np.float32)
        c = rng.standard_normal((1024, 4)).astype(np.float32)
        return lambda: ssmgrad.ssm_conv(sx, c)

    def gdn_call(i):
        inp = make_gdn_inputs(rng, n_seqs=1, n_t=512 << i, H_v=4, H_k=2, S=64, dtype=np.float32)
        grad = np.ones(gdn_out_size(inp), np.float32)
        return lambda: ssmgrad.gated_delta_net_back(*gdn_args(inp), grad)

    calls = {"ssm_scan_back": (lambda i: scan_call(i, True), _ssmgrad.ssm_scan_back),
             "ssm_scan": (lambda i: scan_call(i, False), _ssmgrad.ssm_scan),
             "ssm_conv": (conv_call, _ssmgrad.ssm_conv),
             "gated_delta_net_back": (gdn_call, _ssmgrad.gated_delta_net_back)}
    for name, (make_call, target) in calls.items():
        made = _released(make_call, target)
        assert made == 1000, f"{name}: another Python thread made {made} of 1000 steps inside the call: GIL held?"

    # positive control: a builtin that holds the GIL for its whole call lets the other thread make no step
    made, called = _steps_inside(lambda: sum(range(3_000_000)), sum)
    assert called and made == 0, f"the other thread made {made} steps inside sum(), which holds the GIL"


def test_bitwise_identical_for_1_2_3_threads(restore_threads, force_threads):
    for dtype in (np.float32, np.float64):
        calls = all_calls(dtype, seed=1)
        # bigger scan so that every thread gets work: 5 sequences, 12 heads, 3 groups
        rng = np.random.default_rng(9)
        for mamba2 in (False, True):
            K = 4 if mamba2 else 1
            a = scan_inputs(rng, dtype, mamba2, n_seqs=5, n_t=37, n_head=12, head_dim=5, d_state=7, n_group=3,
                            n_rs=7)
            g = rng.standard_normal(ssmgrad.ssm_scan(*a, K=K).size).astype(dtype)
            calls[f"big_scan_{mamba2}"] = lambda a=a, K=K: ssmgrad.ssm_scan(*a, K=K)
            calls[f"big_back_{mamba2}"] = lambda a=a, g=g, K=K: ssmgrad.ssm_scan_back(*a, g, K=K, return_dA=True)
        results = {}
        for nt in (1, 2, 3):
            ssmgrad.set_num_threads(nt)
            assert ssmgrad.get_num_threads() == nt
            results[nt] = {k: f() for k, f in calls.items()}
        for nt in (2, 3):
            for k in calls:
                assert_bitwise(results[nt][k], results[1][k], f"{np.dtype(dtype)} {k}: {nt} threads vs 1")


def test_reused_scratch_changes_nothing():
    """The scan kernels' scratch buffer is kept from one call to the next (csrc/glue/scratch.c,
    work_alloc). Whatever an earlier call left in it must not matter: each call gives the same
    bits right after calls of other shapes and dtypes as it gave in the first place, with the
    same thread count. Poisoning comes from the earlier calls: their checkpoints, partial sums
    and states fill the scratch with finite values of other shapes."""
    ref = {dt: {k: f() for k, f in all_calls(dt).items()} for dt in (np.float64, np.float32)}
    rng = np.random.default_rng(7)
    for dt in (np.float32, np.float64):      # big calls of other shapes fill the scratch
        big = scan_inputs(rng, dt, True, n_seqs=2, n_t=300, n_head=8, head_dim=16, d_state=32)
        ssmgrad.ssm_scan_back(*big, rng.standard_normal(ssmgrad.ssm_scan(*big).size).astype(dt))
        big1 = scan_inputs(rng, dt, False, n_seqs=2, n_t=300, n_head=64, head_dim=1, d_state=16)
        ssmgrad.ssm_scan_back(*big1, rng.standard_normal(ssmgrad.ssm_scan(*big1).size).astype(dt))
        for dt2 in (np.float64, np.float32):
            for name, f in all_calls(dt2).items():
                assert_bitwise(f(), ref[dt2][name], f"{name} {dt2.__name__} after a {dt.__name__} call")


def test_scratch_cache_guarded_without_gil():
    # in a child process: the unguarded cache this replaces (a plain load and store) double-frees
    # and aborts here, which must fail this test and not take pytest with it
    code = "import _ssmgrad; print(_ssmgrad._scratch_stress(8, 200000))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"scratch stress crashed (exit {r.returncode}): {r.stderr[-2000:]}"
    assert r.stdout.strip() == "0", f"a scratch buffer was held by two threads at once {r.stdout.strip()} times"


def test_threads_with_varying_shapes_match_reference(restore_threads, force_threads):
    """12 Python threads, each running backward calls whose scratch sizes differ (Mamba-1 and
    Mamba-2, short and long), against the float64 torch reference computed beforehand."""
    rng = np.random.default_rng(11)
    cases = []
    for i, (hd, ds, n_t, ng) in enumerate([(1, 16, 40, 1), (8, 16, 9, 2), (4, 32, 70, 1), (16, 8, 3, 2)]):
        inp = make_scan_inputs(rng, n_head=4, head_dim=hd, d_state=ds, n_group=ng, n_seqs=2, n_t=n_t, n_rs=3)
        args = scan_args(inp)
        out_ref = ref_scan_np(*args)
        g = rng.standard_normal(out_ref.size)
        ref = ref_scan_grads(*args, g)
        cases.append((args, g, out_ref, ref))
    for nt in (1, 2):
        ssmgrad.set_num_threads(nt)
        n_threads, rounds = 12, 6
        barrier = threading.Barrier(n_threads)
        errors = []

        def worker(tid):
            try:
                barrier.wait()
                for r in range(rounds):
                    args, g, out_ref, ref = cases[(tid + r) % len(cases)]
                    assert_close(ssmgrad.ssm_scan(*args), out_ref, 1e-12, 1e-10, f"thread {tid} out")
                    gin, d_A = ssmgrad.ssm_scan_back(*args, g, return_dA=True)
                    s, x, dt, A, B, C, _ = args
                    got = dict(zip("s x dt B C".split(), ssmgrad.split(gin, s.shape, x.shape, dt.shape, B.shape,
                                                                      C.shape)), A=d_A)
                    for k, v in got.items():
                        assert_close(v, ref[k], 1e-11, 1e-9, f"thread {tid} round {r} d_{k} ({nt} threads)")
            except BaseException as e:  # noqa: BLE001
                errors.append(repr(e))

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(n_threads)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not any(t.is_alive() for t in threads), "a worker thread hung"
        assert not errors, errors[:3]


FORK_SCRIPT = textwrap.dedent("""
    import multiprocessing as mp, sys
    import numpy as np
    import _ssmgrad, ssmgrad

    def inputs():
        rng = np.random.default_rng(0)
        n_head, head_dim, d_state, n_t = 24, 64, 128, 32        # Mamba-2-130m heads
        f = lambda *shape: rng.standard_normal(shape, dtype=np.float32)
        return (f(1, n_head, head_dim, d_state), f(1, n_t, n_head, head_dim), f(1, n_t, n_head) - 2,
                -np.ones((n_head, 1), np.float32), f(1, n_t, 1, d_state), f(1, n_t, 1, d_state),
                np.zeros(1, np.int64))

    def child(q):
        a = inputs()
        out = ssmgrad.ssm_scan(*a)
        gin = ssmgrad.ssm_scan_back(*a, np.ones_like(out))
        q.put((out.tobytes(), gin.tobytes(), _ssmgrad._serial_after_fork()))

    if __name__ == "__main__":
        ssmgrad.set_num_threads(2)
        a = inputs()
        out = ssmgrad.ssm_scan(*a)                               # a team of 2 OpenMP threads
        gin = ssmgrad.ssm_scan_back(*a, np.ones_like(out))
        assert not _ssmgrad._serial_after_fork()
        ctx = mp.get_context("fork")
        q = ctx.Queue()
        p = ctx.Process(target=child, args=(q,), daemon=True)
        p.start()
        c_out, c_gin, serial = q.get(timeout=60)
        p.join(60)
        assert p.exitcode == 0, p.exitcode
        assert c_out == out.tobytes(), "forward differs in the forked child"
        assert c_gin == gin.tobytes(), "backward differs in the forked child"
        omp = _ssmgrad.build_info()["openmp"]
        assert serial == omp, (serial, omp)                      # with OpenMP the child ran serially
        print("fork ok")
    """)


def test_forked_child_after_threaded_call(tmp_path):
    script = tmp_path / "fork_child.py"
    script.write_text(FORK_SCRIPT)
    # its own session, so that on a hang the parent AND the forked child are killed (a plain
    # timeout would leave the child spinning forever)
    p = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        p.communicate()
        raise AssertionError("the forked child hung in its first threaded ssmgrad call") from None
    assert p.returncode == 0 and "fork ok" in out, out + err[-3000:]
