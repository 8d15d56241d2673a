"""Hashes of the Gated DeltaNet forward's and backward's outputs over a set of shapes, to show a
kernel change leaves them bitwise unchanged: run before and after (and under each SSMGRAD_SIMD
level, and with SSMGRAD_NO_AVX512=1), then compare the files.

    python benchmarks/gdn_hashes.py /tmp/after.txt && diff /tmp/before.txt /tmp/after.txt

Cases: float32 and float64, scalar gate and per-channel gate (KDA), both head broadcasts, n_t 1
to 130, head sizes 3 to 128, K 1 and 3, key heads and key sequences shared, 1 and 2 threads.
"""
import hashlib
import itertools
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
import ssmgrad as sg  # noqa: E402
from reference import gdn_args, make_gdn_inputs  # noqa: E402

# (n_seqs, n_seqs_k, n_t, H_v, H_k, S)
SHAPES = ((1, 1, 1, 2, 1, 4), (3, 3, 1, 4, 2, 5), (2, 2, 5, 2, 2, 3), (2, 1, 64, 2, 2, 16), (4, 2, 130, 4, 1, 3),
          (1, 1, 9, 2, 1, 17), (1, 1, 33, 2, 2, 64), (1, 1, 7, 1, 1, 128))


def main(path):
    h_all = hashlib.sha256()
    lines = []
    for shape, dt, kda, bc, K, thr in itertools.product(SHAPES, (np.float32, np.float64), (False, True),
                                                        ("tiled", "interleaved"), (1, 3), (1, 2)):
        n_seqs, n_seqs_k, n_t, H_v, H_k, S = shape
        rng = np.random.default_rng(n_seqs * 1009 + n_t * 101 + S * 7 + H_v + kda)
        inp = make_gdn_inputs(rng, n_seqs=n_seqs, n_seqs_k=n_seqs_k, n_t=n_t, H_v=H_v, H_k=H_k, S=S, kda=kda,
                              dtype=dt)
        sg.set_num_threads(thr)
        out = sg.gated_delta_net(*gdn_args(inp), K=K, head_bcast=bc)
        grad = rng.standard_normal(out.shape).astype(dt)
        gin = sg.gated_delta_net_back(*gdn_args(inp), grad, K=K, head_bcast=bc)
        h = hashlib.sha256(out.tobytes() + gin.tobytes())
        h_all.update(h.digest())
        lines.append(f"{np.dtype(dt).name} {shape} kda{int(kda)} {bc} K{K} thr{thr} {h.hexdigest()[:16]}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{len(lines)} cases, all: {h_all.hexdigest()[:16]}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python benchmarks/gdn_hashes.py OUT.txt   (see the module docstring)")
    main(sys.argv[1])
