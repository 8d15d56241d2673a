"""Build of the _ssmgrad extension module (the C kernels, imported by the ssmgrad package): sources,
flags and an OpenMP probe.

Compilers: GCC 9+ and clang 7+ (checked in CI: gcc-11, gcc-12, clang 14 with and without
OpenMP, see .ci/compilers.sh); CC in the environment picks one. On x86-64 the kernels are
compiled for three SIMD levels and pick one at run time (csrc/ssm_common.h, docs/simd.md); elsewhere for the
build's own target.

Environment switches:
  CC=...               the C compiler (also used by the OpenMP probe)
  SSMGRAD_NATIVE=1     tune for this CPU (-march=native) instead of runtime SIMD dispatch
                       (defines SSM_NO_DISPATCH)
  SSMGRAD_OPENMP=0     build without OpenMP (the kernels then run their thread slices serially);
                       with clang, OpenMP needs libomp (Debian: libomp-dev), else the probe
                       fails and the build is serial
"""
import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

import numpy as np
from setuptools import Extension, setup

# the kernels' dispatchers (csrc/), one instantiation file per (op, element type, SIMD level) (csrc/inst/),
# and the CPython glue (csrc/glue/, the only files with Python.h; docs/architecture.md); sorted, so
# that the link order does not depend on the file system
SOURCES = sorted(glob.glob("csrc/*.c")) + sorted(glob.glob("csrc/inst/*.c")) + sorted(glob.glob("csrc/glue/*.c"))
DEPENDS = sorted(glob.glob("csrc/*.h")) + sorted(glob.glob("csrc/glue/*.h"))


def openmp_flags():
    """Compile, link and run a tiny OpenMP program; return its flags, or [] to build serial."""
    if os.environ.get("SSMGRAD_OPENMP", "1") == "0":
        return []
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    cc = cc.split()
    prog = "#include <omp.h>\nint main(void){int n=0;\n#pragma omp parallel reduction(+:n)\nn+=1;\nreturn n<1;}\n"
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "probe.c")
        exe = os.path.join(tmp, "probe")
        with open(src, "w") as f:
            f.write(prog)
        try:
            subprocess.run(cc + ["-fopenmp", src, "-o", exe], check=True, capture_output=True, timeout=120)
            subprocess.run([exe], check=True, capture_output=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            print("ssmgrad: OpenMP not available, building single-threaded kernels", file=sys.stderr)
            return []
    return ["-fopenmp"]


omp = openmp_flags()
cflags = ["-O3", "-std=gnu11", "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas", "-Wno-psabi"]
macros = [("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION")]
if os.environ.get("SSMGRAD_NATIVE") == "1":
    cflags.append("-march=native")
    macros.append(("SSM_NO_DISPATCH", "1"))

ext = Extension(
    "_ssmgrad",
    sources=SOURCES,
    depends=DEPENDS,
    include_dirs=["csrc", np.get_include()],
    define_macros=macros,
    extra_compile_args=cflags + omp,
    extra_link_args=omp,
)

setup(ext_modules=[ext])
