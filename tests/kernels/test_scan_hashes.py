"""The current build reproduces benchmarks/scan_hashes.txt bitwise: the scan's forward, backward,
d_A and in-place update over 248 cases (both dtypes, both branches, n_t 1-130, K 1 and 3, 1-3
threads, each forced form, dense and strided inputs; benchmarks/scan_hashes.py), at every SIMD pass
this CPU can run. The oracle tests say the results are right; this one says a change (such as a
restructuring of the kernels) left every bit where it was.

The golden file was recorded (`python benchmarks/scan_hashes.py --all`) with the default build's
compiler, which its first line names: other compilers round differently (contraction into FMA,
vectorisation), so .ci/compilers.sh deselects this file, and a build by another compiler fails here
(record the golden again with CI's default compiler when that changes). The sections are the SIMD
passes of an AVX-512 machine (plain, no_avx512, x86-64-v3, x86-64); a CPU without AVX-512 checks the
passes it has. A pass the file has no section for fails.
"""

import hash_golden
import scan_hashes

test_build_reproduces_the_golden_hashes = hash_golden.golden_test(scan_hashes, 248)
