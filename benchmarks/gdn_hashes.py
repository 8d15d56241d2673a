"""Hashes of the Gated DeltaNet forward's and backward's outputs over a set of shapes, to show a
kernel change leaves them bitwise unchanged: run before and after, then compare the files.

    python benchmarks/gdn_hashes.py /tmp/after.txt && diff /tmp/before.txt /tmp/after.txt
    python benchmarks/gdn_hashes.py --all benchmarks/gdn_hashes.txt    # every SIMD pass (hash_golden.py)

benchmarks/gdn_hashes.txt is the golden file of the default build (`python setup.py build_ext` with
the compiler CI's main pass uses) on an AVX-512 machine: tests/kernels/test_gdn_hashes.py checks that
the current build reproduces it at each pass the CPU can run. Re-record it (`--all`) only for a change
meant to change results, and say so in the commit.

Cases: float32 and float64; the scalar gate and the per-channel gate (KDA); both head broadcasts (tiled,
interleaved; the tiled one alone where H_k is 1 or H_v, as the two agree there); n_t 1 (the decode
path), 3, 5, 33 (where auto takes the scalar gate's chunked form), 64, 65 and 130 (one chunk, a chunk
and a token, three chunks); S from 3 to 128 (the vector rows where S is a power-of-two multiple of the
vector width, the scalar ones elsewhere); key heads and key sequences shared; K 1 and 3 (ggml's
snapshots); with K = 1 each form forced (recurrence, chunked: the scalar gate's or KDA's) and auto, with
K = 3 auto (only the recurrence takes snapshots); 1 and 2 threads (with no minimum work per thread, so
that small shapes do split); dense inputs, and at one thread views (q with a step, k and v transposed
copies' views, the state a transposed view, so its rows are not dense). Per case: the packed forward
output and the packed backward output.

The inputs are make_gdn_inputs(exact=True): their softplus, sigmoid and norms from exactly rounded
operations only, so that they have the same bits on every host (numpy's np.exp and np.log take
AVX-512 or AVX2 code by the CPU: with them, an AVX2-only host drew other inputs and 192 cases
differed; tests/reference.py, exact_exp).
"""
import hashlib
import itertools

import numpy as np

import hash_golden

if __name__ == "__main__":
    hash_golden.run_from_this_tree()
from reference import gdn_args, make_gdn_inputs  # noqa: E402

# (n_seqs, n_seqs_k, n_t, H_v, H_k, S): each with two key groups or more (the backward's thread split)
SHAPES = ((3, 3, 1, 4, 2, 32), (2, 1, 1, 2, 2, 5), (4, 2, 1, 2, 2, 16), (2, 2, 3, 4, 2, 16), (2, 1, 5, 4, 2, 3),
          (1, 1, 33, 4, 2, 128), (2, 2, 64, 2, 1, 64), (2, 1, 65, 2, 2, 16), (2, 1, 130, 4, 2, 32))
FORMS = ("auto", "recurrence", "chunked")


def views(args):
    """The same values as args (q, k, v, g, beta, state), q, k, v and state as strided views."""
    q, k, v, g, beta, state = args
    q = np.repeat(q, 2, axis=3)[..., ::2]
    k, v = (np.ascontiguousarray(a.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2) for a in (k, v))
    state = np.ascontiguousarray(state.transpose(0, 1, 3, 2)).transpose(0, 1, 3, 2)
    return q, k, v, g, beta, state


def case_inputs(i, dt, kda):
    """The inputs (q, k, v, g, beta, state) of SHAPES[i]'s cases in dtype dt, with or without the
    per-channel gate: the same bits on every host (make_gdn_inputs' exact=True)"""
    n_seqs, n_seqs_k, n_t, H_v, H_k, S = SHAPES[i]
    return gdn_args(make_gdn_inputs(np.random.default_rng(10 * i + kda), n_seqs=n_seqs, n_seqs_k=n_seqs_k, n_t=n_t,
                                    H_v=H_v, H_k=H_k, S=S, kda=kda, dtype=dt, exact=True))


def input_digest():
    """A hash of every input the cases draw (tests/kernels/test_hash_inputs.py: the same on every host)"""
    h = hashlib.sha256()
    for i, dt, kda in itertools.product(range(len(SHAPES)), (np.float32, np.float64), (False, True)):
        for a in case_inputs(i, dt, kda):
            h.update(a.tobytes())
    return h.hexdigest()[:16]


def case_hashes():
    """(one line per case, the hash of all cases) at the SIMD pass selected now; leaves the minimum
    work per thread and the thread count as they were."""
    import ssmgrad as sg
    ext = sg._ext
    old_min, old_threads = ext._set_min_work_per_thread(0), sg.get_num_threads()
    try:
        return _case_hashes(sg)
    finally:
        ext._set_min_work_per_thread(old_min)
        sg.set_num_threads(old_threads)


def _case_hashes(sg):
    h_all = hashlib.sha256()
    lines = []
    for i, shape in enumerate(SHAPES):
        n_seqs, n_seqs_k, n_t, H_v, H_k, S = shape
        for dt, kda in itertools.product((np.float32, np.float64), (False, True)):
            args = case_inputs(i, dt, kda)
            for bc, K, form, (thr, strided) in itertools.product(("tiled", "interleaved"), (1, 3), FORMS,
                                                                 ((1, 0), (2, 0), (1, 1))):
                if bc == "interleaved" and H_k in (1, H_v) or K > 1 and form != "auto":
                    continue    # the broadcasts agree where H_k is 1 or H_v; only the recurrence takes K > 1
                sg.set_num_threads(thr)
                a = views(args) if strided else args
                out = sg.gated_delta_net(*a, K=K, head_bcast=bc, form=form)
                grad = np.random.default_rng(10 * i + K).standard_normal(out.shape).astype(dt)
                gin = sg.gated_delta_net_back(*a, grad, K=K, head_bcast=bc, form=form)
                h = hashlib.sha256(out.tobytes() + gin.tobytes())
                h_all.update(h.digest())
                lines.append(f"{np.dtype(dt).name} b{n_seqs}/{n_seqs_k} t{n_t} h{H_v}/{H_k} S{S} kda{int(kda)} {bc} "
                             f"K{K} thr{thr} strided{strided} {form} {h.hexdigest()[:16]}")
    return lines, h_all.hexdigest()[:16]


if __name__ == "__main__":
    hash_golden.main(__file__, case_hashes)
