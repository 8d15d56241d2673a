"""torch.compile'd SSD (inductor, CPU) aborts the process at 2 threads, without ssmgrad's kernels.

Why bench.py times its compiled peer at one thread only: with torch 2.13.0+cpu on this machine
(2-core AMD EPYC, Python 3.11, GCC 12), the backward of the compiled chunked-SSD scan corrupts the
heap when torch runs 2 threads ("malloc(): unaligned tcache chunk detected", "free(): invalid size",
or a segmentation fault), with chunk 64 or 128, compiled after a 1-thread compile or alone, in a
fresh inductor cache. ssmgrad's extension is never loaded here: the peer is read from its file.

    python benchmarks/probes/inductor_threads.py 1    # exits 0
    python benchmarks/probes/inductor_threads.py 2    # aborted by glibc on 2026-12-01 (exit 134)
"""
import importlib.util
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="inductor-threads-"))
import numpy as np  # noqa: E402
import torch  # noqa: E402

# the pure-torch peer, loaded as a module of its own so that `import ssmgrad` (and its kernels) never runs
_src = Path(__file__).resolve().parents[2] / "ssmgrad" / "_bench_peers.py"
_tmp = Path(tempfile.mkdtemp(prefix="inductor-threads-src-"))
(_tmp / "ssd_peer.py").write_text(_src.read_text())
sys.path.insert(0, str(_tmp))
from ssd_peer import scan_ssd  # noqa: E402

threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
torch.set_num_threads(threads)
rng = np.random.default_rng(0)
n_head, head_dim, d_state, n_t = 24, 64, 128, 512        # the Mamba-2-130m layer


def t(*shape):
    return torch.from_numpy(rng.standard_normal(shape).astype(np.float32))


s, x, dt = t(1, n_head, head_dim, d_state), t(1, n_t, n_head, head_dim), t(1, n_t, n_head)
B, C = t(1, n_t, 1, d_state), t(1, n_t, 1, d_state)
A = -torch.rand(n_head, 1)
ids = torch.zeros(1, dtype=torch.int64)
inputs = [v.requires_grad_() for v in (s, x, dt, B, C)]
f = torch.compile(lambda *a: scan_ssd(*a, chunk=128), dynamic=False, fullgraph=True)
for _ in range(5):
    out = torch.cat([o.reshape(-1) for o in f(s, x, dt, A, B, C, ids)])
    torch.autograd.grad(out, inputs, torch.ones_like(out))
print(f"{threads} thread(s): compiled SSD forward and backward ran", "ssmgrad loaded:", "_ssmgrad" in sys.modules)
