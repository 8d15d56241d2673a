"""benchmarks/train.py at a tiny size: ssmgrad.torch and the pure-torch ops train identically.

The benchmark's own torch reference ops are first checked against tests/reference.py, so that
"agrees with the reference" means agreement with the spec's oracle.
"""

import importlib.util
import re
from pathlib import Path

import torch

from reference import assert_close, ref_ssm_conv, ref_ssm_scan

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("ssmgrad_bench_train", ROOT / "benchmarks" / "train.py")
train = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train)

F64 = torch.float64


def _leaves(*shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*sh, generator=g, dtype=F64).requires_grad_() for sh in shapes]


def test_benchmark_reference_ops_match_tests_reference():
    sx, c = _leaves((2, 5, 3 + 6), (5, 4), seed=0)
    for mamba1 in (False, True):
        n_head, head_dim, d_state, n_group = (6, 1, 4, 1) if mamba1 else (4, 2, 3, 2)
        s, x, dt, A, B, C = _leaves((3, n_head, head_dim, d_state), (2, 5, n_head, head_dim), (2, 5, n_head),
                                    (n_head, d_state if mamba1 else 1), (2, 5, n_group, d_state),
                                    (2, 5, n_group, d_state), seed=1 + mamba1)
        ids = torch.tensor([2, 2])
        for f_bench, f_ref, args in ((train.ref_ssm_conv, ref_ssm_conv, (sx, c)),
                                     (train.ref_ssm_scan, ref_ssm_scan, (s, x, dt, A, B, C))):
            extra = () if len(args) == 2 else (ids,)
            got, want = f_bench(*args, *extra), f_ref(*args, *extra)
            assert_close(got.detach().numpy(), want.detach().numpy(), 1e-12, 1e-12, f_bench.__name__)
            w = torch.randn(got.shape, generator=torch.Generator().manual_seed(9), dtype=F64)
            g_got = torch.autograd.grad((got * w).sum(), args)
            g_want = torch.autograd.grad((want * w).sum(), args)
            for a, b in zip(g_got, g_want):
                assert_close(a.numpy(), b.numpy(), 1e-12, 1e-12, f"{f_bench.__name__} grad")


def test_training_cli_agrees_and_learns(tmp_path, capsys):
    png = tmp_path / "train.png"
    rc = train.main(["--quick", "--steps", "30", "--out", str(png)])
    out = capsys.readouterr().out
    assert rc == 0, out
    rows = re.findall(r"^(mamba[12])" + r"\s+(\S+)" * 8 + r"x$", out, re.M)
    assert [r[0] for r in rows] == ["mamba2", "mamba1"], out
    for kind, _lr, max_diff, _dw, start, end, t_ssm, _t_ref, ratio in rows:
        assert float(max_diff) < 1e-8, f"{kind}: losses differ by {max_diff}"
        assert float(end) < 0.9 * float(start), f"{kind}: loss {start} -> {end}"
        assert float(t_ssm) > 0 and float(ratio) > 0
    assert png.stat().st_size > 10_000


def test_full_finetuning_and_float32_agree():
    # --full: conv weight and A train too (ssm_conv_back_weight and d_A in use)
    for r in train.run(steps=8, quick=True, full=True):
        assert r["grads"] == {"A": True, "conv_weight": True}
        assert r["max_diff"] < 1e-8, (r["kind"], r["max_diff"])
    # LoRA path: frozen conv weight and A get no gradient at all
    for r in train.run(steps=3, quick=True):
        assert r["grads"] == {"A": False, "conv_weight": False}
    for r in train.run(steps=8, quick=True, dtype=torch.float32):
        assert r["max_diff"] < 1e-3, (r["kind"], r["max_diff"])
