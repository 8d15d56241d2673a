"""ggml-opt with graphs rebuilt for every step, as llama_opt_epoch uses it.

ggml/opt_rebuilt_graphs.c trains a tiny linear model, out = W x + b, with ggml-opt's mean-squared-error
loss, building a new forward graph in a new context before every ggml_opt_alloc (no static graphs),
as llama_context::opt_epoch_iter does. The oracle is the same steps in float64 NumPy: the gradient of
the loss by hand, SGD or AdamW as ggml's opt_step kernels define them (AdamW: decoupled weight decay,
both moments bias-corrected, eps added after the square root), and gradient accumulation over
opt_period evals (each eval's loss scaled by 1/opt_period, one optimizer step per period).

Unfixed, ggml-opt zeroes the gradient accumulators only when they are allocated, so every step
applies the sum of all earlier gradients: the unpatched build (`bash ggml/build.sh --unpatched`)
must match the NumPy steps WITHOUT the zeroing, and not the correct ones.
"""

import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ggml_build import build_ggml  # noqa: E402

pytestmark = pytest.mark.integration   # .ci's sanitizer and compiler passes skip it

BUILDS = {
    "patched": os.environ.get("SSMGRAD_GGML_BUILD", os.path.join(ROOT, "build", "ggml")),
    "unpatched": os.environ.get("SSMGRAD_GGML_BUILD_UNPATCHED", os.path.join(ROOT, "build", "ggml-unpatched")),
}
N_IN, N_OUT, N_BATCH = 5, 3, 4
BETA1, BETA2, EPS = 0.9, 0.999, 1e-8


def _build(which):
    build_ggml(*(["--unpatched"] if which == "unpatched" else []))
    exe = os.path.join(BUILDS[which], "bin", "opt-rebuilt-graphs")
    assert os.access(exe, os.X_OK), exe
    return exe


@pytest.fixture(scope="module")
def exes():
    return {}


def _exe(exes, which):
    if which not in exes:
        exes[which] = _build(which)
    return exes[which]


def _case(n_evals, seed):
    rng = np.random.default_rng(seed)
    W0 = rng.standard_normal((N_OUT, N_IN)).astype(np.float32)
    b0 = rng.standard_normal(N_OUT).astype(np.float32)
    xs = rng.standard_normal((n_evals, N_BATCH, N_IN)).astype(np.float32)
    ys = rng.standard_normal((n_evals, N_BATCH, N_OUT)).astype(np.float32)
    return W0, b0, xs, ys


def _run(exe, tmp_path, case, period, sgd, lr, wd):
    W0, b0, xs, ys = case
    n_evals = len(xs)
    inp, out = tmp_path / "in.bin", tmp_path / "out.bin"
    with open(inp, "wb") as f:
        f.write(np.array([N_IN, N_OUT, N_BATCH, n_evals, period, int(sgd)], dtype="<i4").tobytes())
        f.write(np.array([lr, BETA1, BETA2, EPS, wd], dtype="<f4").tobytes())
        f.write(W0.astype("<f4").tobytes() + b0.astype("<f4").tobytes())
        for x, y in zip(xs, ys):
            f.write(x.astype("<f4").tobytes() + y.astype("<f4").tobytes())
    p = subprocess.run([exe, str(inp), str(out)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)
    assert p.returncode == 0, p.stdout.decode(errors="replace")[-3000:]
    r = np.fromfile(out, dtype="<f4")
    assert r.size == n_evals + N_OUT * N_IN + N_OUT
    return r[:n_evals], r[n_evals:n_evals + N_OUT * N_IN].reshape(N_OUT, N_IN), r[n_evals + N_OUT * N_IN:]


def _numpy(case, period, sgd, lr, wd, zero_grad=True):
    """The same evals in float64: per eval the loss mean((W x + b - y)^2) / period and its gradient
    added into the accumulators; every period-th eval one optimizer step, then (zero_grad) the
    accumulators start again from zero."""
    W0, b0, xs, ys = case
    W, b = W0.astype(np.float64), b0.astype(np.float64)
    gW, gb = np.zeros_like(W), np.zeros_like(b)
    mW, mb, vW, vb = np.zeros_like(W), np.zeros_like(b), np.zeros_like(W), np.zeros_like(b)
    losses, it = [], 0
    for e, (x, y) in enumerate(zip(xs.astype(np.float64), ys.astype(np.float64))):
        r = x @ W.T + b - y                                     # (n_batch, n_out)
        scale = 1.0 / (period * r.size)
        losses.append(scale * np.sum(r * r))
        gW += 2 * scale * r.T @ x
        gb += 2 * scale * r.sum(axis=0)
        if (e + 1) % period:
            continue
        it += 1
        if sgd:
            W, b = W * (1 - lr * wd) - lr * gW, b * (1 - lr * wd) - lr * gb
        else:
            mW, mb = BETA1 * mW + (1 - BETA1) * gW, BETA1 * mb + (1 - BETA1) * gb
            vW, vb = BETA2 * vW + (1 - BETA2) * gW ** 2, BETA2 * vb + (1 - BETA2) * gb ** 2
            c1, c2 = 1 / (1 - BETA1 ** it), 1 / (1 - BETA2 ** it)
            W = W * (1 - lr * wd) - lr * (mW * c1) / (np.sqrt(vW * c2) + EPS)
            b = b * (1 - lr * wd) - lr * (mb * c1) / (np.sqrt(vb * c2) + EPS)
        if zero_grad:
            gW, gb = np.zeros_like(W), np.zeros_like(b)
    return np.array(losses), W, b


CONFIGS = [
    # (optimizer, opt_period, lr, weight decay)
    ("sgd", 1, 0.1, 0.0),
    ("adamw", 1, 0.05, 0.0),
    ("adamw", 1, 0.05, 0.1),
    ("sgd", 2, 0.1, 0.0),       # gradient accumulation over 2 evals, as llama's n_batch / n_ubatch
]


def _close(got, want):
    losses, W, b = got
    l_ref, W_ref, b_ref = want
    return (np.allclose(losses, l_ref, rtol=2e-5, atol=1e-6) and np.allclose(W, W_ref, rtol=2e-5, atol=2e-6)
            and np.allclose(b, b_ref, rtol=2e-5, atol=2e-6))


@pytest.mark.parametrize("opt,period,lr,wd", CONFIGS)
def test_rebuilt_graphs_take_the_numpy_steps(exes, tmp_path, opt, period, lr, wd):
    case = _case(n_evals=6, seed=period * 10 + len(opt))
    got = _run(_exe(exes, "patched"), tmp_path, case, period, opt == "sgd", lr, wd)
    want = _numpy(case, period, opt == "sgd", lr, wd)
    losses, W, b = got
    np.testing.assert_allclose(losses, want[0], rtol=2e-5, atol=1e-6, err_msg="losses")
    np.testing.assert_allclose(W, want[1], rtol=2e-5, atol=2e-6, err_msg="W")
    np.testing.assert_allclose(b, want[2], rtol=2e-5, atol=2e-6, err_msg="b")
    # the check can tell: the trajectory without zeroing is far from this one
    assert not _close(got, _numpy(case, period, opt == "sgd", lr, wd, zero_grad=False))


@pytest.mark.parametrize("opt,period,lr,wd", CONFIGS[:2])
def test_unpatched_ggml_opt_never_zeroes_the_gradients(exes, tmp_path, opt, period, lr, wd):
    """The bug the patch fixes, shown on the stock ggml-opt: its steps are those of a loop without
    zero_grad."""
    case = _case(n_evals=6, seed=period * 10 + len(opt))
    got = _run(_exe(exes, "unpatched"), tmp_path, case, period, opt == "sgd", lr, wd)
    assert _close(got, _numpy(case, period, opt == "sgd", lr, wd, zero_grad=False))
    assert not _close(got, _numpy(case, period, opt == "sgd", lr, wd))
