"""Hashes of the three conv functions' outputs over many shapes, to show a kernel change leaves
them bitwise unchanged: run before and after (and under each SSMGRAD_SIMD level, and with
SSMGRAD_NO_AVX512=1), then compare the files.

    python benchmarks/conv_hashes.py /tmp/after.txt && diff /tmp/before.txt /tmp/after.txt

Cases: float32 and float64, n_s 1 and 3, d_inner 1 to 1792 (not all multiples of the vector
width), n_t 1 to 1000 (windows of 256 crossed or not), d_conv 1-5 and 9, 1 and 2 threads,
fresh outputs and out= buffers (filled with NaN first), strided sx and grad; then float32 cases
large enough for the streamed y (>= 4 MiB) and several groups of channels.
"""
import hashlib
import itertools
import sys

import numpy as np

import ssmgrad as sg


def main(path):
    h_all = hashlib.sha256()
    lines = []
    for dt, n_s, d_inner, n_t, K, thr in itertools.product(
            (np.float32, np.float64), (1, 3), (1, 7, 23, 48, 100, 1792), (1, 5, 37, 300, 1000), (1, 2, 3, 4, 5, 9), (1, 2)):
        if d_inner == 1792 and (n_t > 300 or n_s > 1 or K not in (3, 4)):
            continue
        rng = np.random.default_rng(n_s * 1000003 + d_inner * 1009 + n_t * 7 + K)
        sx = rng.standard_normal((n_s, d_inner, K - 1 + n_t)).astype(dt)
        c = rng.standard_normal((d_inner, K)).astype(dt)
        g = rng.standard_normal((n_s, n_t, d_inner)).astype(dt)
        sg.set_num_threads(thr)
        h = hashlib.sha256()
        for use_out in (0, 1):
            if use_out:
                y = np.full((n_s, n_t, d_inner), np.nan, dt)
                dsx, dc = np.full_like(sx, np.nan), np.full_like(c, np.nan)
                r = (sg.ssm_conv(sx, c, out=y), sg.ssm_conv_back(sx, c, g, out=dsx), sg.ssm_conv_back_weight(sx, c, g, out=dc))
            else:
                r = (sg.ssm_conv(sx, c), sg.ssm_conv_back(sx, c, g), sg.ssm_conv_back_weight(sx, c, g))
            for a in r:
                h.update(np.ascontiguousarray(a).tobytes())
        if n_t > 1:     # strided views: sx with a token step, grad a transposed view
            sxw = rng.standard_normal((n_s, d_inner, 2 * (K - 1 + n_t))).astype(dt)[:, :, ::2]
            gw = np.ascontiguousarray(rng.standard_normal((n_s, d_inner, n_t)).astype(dt)).transpose(0, 2, 1)
            for a in (sg.ssm_conv(sxw, c), sg.ssm_conv_back(sxw, c, gw), sg.ssm_conv_back_weight(sxw, c, gw)):
                h.update(np.ascontiguousarray(a).tobytes())
        h_all.update(h.digest())
        lines.append(f"{np.dtype(dt).name} n_s{n_s} d{d_inner} t{n_t} K{K} thr{thr} {h.hexdigest()[:16]}")
    for n_s, d, n_t, K, thr in ((1, 1792, 1000, 4, 1), (1, 1792, 1000, 4, 2), (3, 1792, 600, 4, 2), (2, 1536, 2051, 4, 1),
                                (1, 1800, 2500, 4, 2), (1, 1792, 3000, 3, 1), (1, 4096, 700, 4, 2)):
        rng = np.random.default_rng(n_t + d)
        sx = rng.standard_normal((n_s, d, K - 1 + n_t), dtype=np.float32)
        c = rng.standard_normal((d, K), dtype=np.float32)
        g = rng.standard_normal((n_s, n_t, d), dtype=np.float32)
        sg.set_num_threads(thr)
        h = hashlib.sha256()
        for a in (sg.ssm_conv(sx, c), sg.ssm_conv(sx, c, out=np.empty((n_s, n_t, d), np.float32)),
                  sg.ssm_conv_back(sx, c, g), sg.ssm_conv_back_weight(sx, c, g)):
            h.update(a.tobytes())
        h_all.update(h.digest())
        lines.append(f"float32 n_s{n_s} d{d} t{n_t} K{K} thr{thr} {h.hexdigest()[:16]}")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"{len(lines)} cases, all: {h_all.hexdigest()[:16]}")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):
        sys.exit("usage: python benchmarks/conv_hashes.py OUT.txt   (see the module docstring)")
    main(sys.argv[1])
