"""Hashes of the scan's outputs and gradients over many shapes, to show a change leaves them
bitwise unchanged (the scan's twin of conv_hashes.py): run before and after, then compare.

    python benchmarks/scan_hashes.py /tmp/after.txt && diff /tmp/before.txt /tmp/after.txt

One run covers the SIMD pass the environment selects; --all runs itself once per pass this
machine has (plain, SSMGRAD_NO_AVX512=1, SSMGRAD_SIMD=x86-64-v3, SSMGRAD_SIMD=x86-64) and
writes one file with a section per pass, headed by the compiler of the build (the command line,
the passes and the file's format are hash_golden.py's, shared with gdn_hashes.py).

benchmarks/scan_hashes.txt is the golden file of the default build (`python setup.py build_ext`
with the compiler CI's main pass uses) on an AVX-512 machine: tests/kernels/test_scan_hashes.py checks
that the current build reproduces it, at each pass the CPU can run. Re-record it (`--all`) only
for a change meant to change results, and say so in the commit.

Cases: float32 and float64; Mamba-1 (A per state) and Mamba-2 (one decay per head); n_t 1-4
(the decode path), 5, 37 and 130 (the recurrence, and for Mamba-2 with K = 1 the chunked forms:
one chunk, a partial one, three); K 1 and 3 (Mamba-2: ggml's snapshots); ids with a duplicate and a row no id names;
1, 2 and 3 threads (with no minimum work per thread, so that small shapes do split); each forced
form of the forward and the backward (auto, recurrence, chunked; the same for both); dense and
strided inputs; then a larger Mamba-2 shape where auto takes the chunked forms. Per case: the packed forward output, the in-place update's y and states
(_ssm_scan_update, where it applies), the backward's gin and d_A.

A's decays are -exact_exp(.) (tests/reference.py), not -np.exp(.): numpy's exp takes AVX-512 or AVX2
code by the CPU, with other last bits, and an AVX2-only host drew other inputs (55 cases differed).
"""
import hashlib
import itertools

import numpy as np

import hash_golden

if __name__ == "__main__":
    hash_golden.run_from_this_tree()
from reference import exact_exp  # noqa: E402


def make(rng, dtype, mamba2, n_t, strided, big=False):
    n_rs, n_seqs, n_head = 4, 3, 4
    if big:     # where auto takes the chunked forms (head_dim >= 32, d_state >= 128, n_t >= 64)
        head_dim, d_state, n_group = 64, 128, 1
    elif mamba2:
        head_dim, d_state, n_group = 16, 24, 2
    else:
        head_dim, d_state, n_group = 5, 16, 1
    s = rng.standard_normal((n_rs, n_head, head_dim, d_state)).astype(dtype)
    x = rng.standard_normal((n_seqs, n_t, n_head, head_dim)).astype(dtype)
    dt = (rng.standard_normal((n_seqs, n_t, n_head)) - 1.0).astype(dtype)
    A = -exact_exp(rng.standard_normal((n_head, d_state if not mamba2 else 1))).astype(dtype)   # not np.exp: its bits depend on the CPU
    B = rng.standard_normal((n_seqs, n_t, n_group, d_state)).astype(dtype)
    C = rng.standard_normal((n_seqs, n_t, n_group, d_state)).astype(dtype)
    if strided:   # x and B as views with a step, C a transposed copy's view
        x = np.repeat(x, 2, axis=3)[..., ::2]
        B = np.repeat(B, 2, axis=3)[..., ::2]
        C = np.ascontiguousarray(C.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    ids = np.array([2, 0, 2], np.int64)
    return s, x, dt, A, B, C, ids


def input_digest():
    """A hash of every input make() gives the cases (tests/kernels/test_hash_inputs.py: the same on
    every host); the cases' seeds, as _case_hashes draws them"""
    h = hashlib.sha256()
    for dtype, mamba2, n_t, K, strided in itertools.product((np.float32, np.float64), (0, 1), (1, 2, 4, 5, 37, 130),
                                                            (1, 3), (0, 1)):
        for a in make(np.random.default_rng(1000 * n_t + 10 * K + mamba2), dtype, mamba2, n_t, strided):
            h.update(a.tobytes())
    for dtype in (np.float32, np.float64):
        for a in make(np.random.default_rng(7), dtype, 1, 200, 0, big=True):
            h.update(a.tobytes())
    return h.hexdigest()[:16]


def case_hashes():
    """(one line per case, the hash of all cases) at the SIMD pass selected now; leaves the forms
    at auto, the minimum work per thread and the thread count as they were."""
    import ssmgrad as sg
    ext = sg._ext
    old_min, old_threads = ext._set_min_work_per_thread(0), sg.get_num_threads()
    try:
        return _case_hashes(sg, ext)
    finally:
        ext._set_min_work_per_thread(old_min)
        sg.set_num_threads(old_threads)
        ext._set_scan_fwd("auto")
        ext._set_scan_back("auto")


def _case_hashes(sg, ext):
    h_all = hashlib.sha256()
    lines = []
    for dtype, mamba2, n_t, K, strided, thr, form in itertools.product(
            (np.float32, np.float64), (0, 1), (1, 2, 4, 5, 37, 130), (1, 3), (0, 1), (1, 2, 3),
            ("auto", "recurrence", "chunked")):
        if K > 1 and not mamba2:
            continue    # snapshots are Mamba-2 only (ggml)
        if form != "auto" and not (mamba2 and K == 1 and n_t > 4):
            continue    # the forms differ only where the chunked form applies
        if strided and thr == 3:
            continue
        rng = np.random.default_rng(1000 * n_t + 10 * K + mamba2)
        args = make(rng, dtype, mamba2, n_t, strided)
        sg.set_num_threads(thr)
        ext._set_scan_fwd(form)
        ext._set_scan_back(form)
        h = hashlib.sha256()
        out = sg.ssm_scan(*args, K=K)
        h.update(out.tobytes())
        grad = rng.standard_normal(out.shape).astype(dtype)
        gin, dA = sg.ssm_scan_back(*args, grad, K=K, return_dA=True)
        h.update(gin.tobytes())
        h.update(dA.tobytes())
        if K == 1:
            s2 = args[0][:3].copy()
            y = ext._ssm_scan_update(s2, *args[1:6], np.arange(3, dtype=np.int64), thr)
            if y is not None:
                h.update(y.tobytes())
                h.update(s2.tobytes())
        h_all.update(h.digest())
        lines.append(f"{np.dtype(dtype).name} m{2 if mamba2 else 1} t{n_t} K{K} strided{strided} thr{thr} "
                     f"{form} {h.hexdigest()[:16]}")
    for dtype, thr, form in itertools.product((np.float32, np.float64), (1, 2), ("auto", "recurrence")):
        rng = np.random.default_rng(7)
        args = make(rng, dtype, 1, 200, 0, big=True)
        sg.set_num_threads(thr)
        ext._set_scan_fwd(form)
        ext._set_scan_back(form)
        h = hashlib.sha256()
        out = sg.ssm_scan(*args)
        grad = rng.standard_normal(out.shape).astype(dtype)
        gin, dA = sg.ssm_scan_back(*args, grad, return_dA=True)
        for a in (out, gin, dA):
            h.update(a.tobytes())
        h_all.update(h.digest())
        lines.append(f"{np.dtype(dtype).name} m2 big t200 thr{thr} {form} {h.hexdigest()[:16]}")
    return lines, h_all.hexdigest()[:16]


if __name__ == "__main__":
    hash_golden.main(__file__, case_hashes)
