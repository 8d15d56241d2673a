"""Data-parallel training with ssmgrad: torch.distributed (gloo, 2 processes on 127.0.0.1), each rank
a separate process running ssmgrad's kernels on its half of the batch, DistributedDataParallel
averaging the gradients. Oracle: the same models trained in this process on the combined batch; every
gradient of every step must agree in float64 to 1e-12. Two models: a small LM of Mamba-1/Mamba-2
blocks on ssmgrad.torch, and transformers' Mamba-2 with ssmgrad.transformers.patch() (which must have
run the scan and the conv on ssmgrad, with no fallback). The ranks run with OMP_NUM_THREADS=1, as
torchrun sets it, and ssmgrad's default follows it.
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

import ssmgrad.transformers as sht
from ddp_worker import MODELS, build, train
from reference import assert_close
import pytest

pytestmark = pytest.mark.integration   # .ci's sanitizer and compiler passes skip it

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
TIMEOUT = 300   # seconds for both ranks, imports included (about 20 s on an idle 2-core machine)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _run_ranks(out_dir):
    env = {k: v for k, v in os.environ.items() if not k.startswith("OMP_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]))
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / "ddp_worker.py"), str(r), str(WORLD), str(port),
                               str(out_dir)], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True)
             for r in range(WORLD)]
    try:
        outs = [p.communicate(timeout=TIMEOUT)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, f"rank {r} failed:\n{out[-4000:]}"
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(WORLD)]


def test_ddp_gradients_equal_single_process(tmp_path):
    ranks = _run_ranks(tmp_path)
    with sht.patched():
        want = {name: train(name, build(name)) for name in MODELS}
    for r, res in enumerate(ranks):
        assert res["threads"] == (1, 1), f"rank {r}: (ssmgrad, torch) threads {res['threads']}"
        calls = res["call_counts"]
        assert calls.get("mamba2_chunk_scan", 0) > 0 and calls.get("causal_conv1d_fn", 0) > 0, calls
        assert not res["fallback_counts"], res["fallback_counts"]
        for name in MODELS:
            assert len(res[name]) == len(want[name])
            for step, (got, w) in enumerate(zip(res[name], want[name])):
                assert got.keys() == w.keys()
                for p in w:
                    assert_close(got[p].numpy(), w[p].numpy(), 1e-12, 1e-12, f"rank {r} {name} step {step} d_{p}")
