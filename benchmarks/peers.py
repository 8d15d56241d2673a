"""The PyTorch CPU peers the benchmarks time beside ssmgrad (ssmgrad/_bench_peers.py, which
`python -m ssmgrad bench` times too: a token loop, the chunked SSD form, mambapy's parallel scan,
depthwise F.conv1d; shapes and semantics there) and the float64 reference every peer is validated
against before it is timed (tests/reference.py, the test suite's oracle, loaded by path).
"""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for _p in (ROOT, os.path.join(ROOT, "tests")):     # the in-place build of ssmgrad; tests/reference.py
    if _p not in sys.path:
        sys.path.insert(1, _p)

from reference import ref_ssm_conv, ref_ssm_scan  # noqa: E402
from ssmgrad._bench_peers import CONV_IMPLS, SCAN_IMPLS, conv_conv1d, scan_loop, scan_pscan, scan_ssd  # noqa: E402

REFERENCE = "tests/reference.py ref_ssm_scan / ref_ssm_conv, the test suite's oracle"
__all__ = ["ref_ssm_conv", "ref_ssm_scan", "scan_loop", "scan_ssd", "scan_pscan", "conv_conv1d",
           "SCAN_IMPLS", "CONV_IMPLS", "REFERENCE"]
