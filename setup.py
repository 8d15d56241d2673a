"""Build of the _ssmgrad extension module (the C kernels, imported by the ssmgrad package): sources,
flags and an OpenMP probe.

Compilers: GCC 9+ and clang 7+ (checked in CI: gcc-11, gcc-12, clang 14 with and without
OpenMP, see .ci/compilers.sh); CC in the environment picks one. On x86-64 the kernels are
compiled for three SIMD levels and pick one at run time (csrc/ssm_common.h); elsewhere for the
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

SOURCES = ["csrc/ssm_conv.c", "csrc/ssm_conv_blk.c", "csrc/ssm_dispatch.c", "csrc/ssm_scan_recurrence.c",
           "csrc/ssm_scan_decode.c", "csrc/ssm_scan_chunked.c", "csrc/ssm_scan_back_recurrence.c",
           "csrc/ssm_scan_back_chunked.c", "csrc/gdn_dispatch.c", "csrc/ssmgrad_module.c", "csrc/gdn_module.c"]
# one file per (op, element type, SIMD level): each includes its op's body (csrc/<op>_<form>_body.h)
SOURCES += sorted(glob.glob("csrc/inst/*.c"))
DEPENDS = ["csrc/ssmgrad.h", "csrc/ssm_common.h", "csrc/ssm_arena.h", "csrc/ssm_scan_layout.h", "csrc/ssm_scan_step.h",
           "csrc/ssm_scan_forms.h", "csrc/ssm_scan_back.h", "csrc/ssm_chunk.h", "csrc/ssm_mm.h", "csrc/ssm_instantiate.h",
           "csrc/ssm_instantiate_pass.h", "csrc/ssm_instantiate_types.h", "csrc/ssm_instantiate_end.h",
           "csrc/ssm_target_begin.h", "csrc/ssm_target_end.h", "csrc/ssm_real_f32.h", "csrc/ssm_real_f64.h",
           "csrc/ssm_glue.h", "csrc/gdn_common.h", "csrc/gdn_inst.h", "csrc/gdn_recurrence_body.h"]


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
