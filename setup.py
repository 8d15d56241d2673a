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
  SSMGRAD_OPT=-O2      the optimisation flag (default -O3); .ci/sanitize.sh and the mutant build
                       of tests/kernels/test_mutants.py build at -O2 (about half the compile time)
  SSMGRAD_BUILD_JOBS=N how many sources compile at once (default: `build_ext -j N`, else the CPU
                       count); setuptools alone compiles one extension's sources one at a time
"""
import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

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


def build_jobs(parallel):
    """Sources compiled at once: SSMGRAD_BUILD_JOBS, else build_ext's -j, else the CPU count."""
    env = os.environ.get("SSMGRAD_BUILD_JOBS")
    if env:
        return max(1, int(env))
    if parallel:
        return max(1, int(parallel))
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)


def source_weight(src):
    """Bytes of a source and of the local headers it includes, one level deep: an instantiation
    file in csrc/inst/ is a few lines that include a kernel body, and compiles as long as the body."""
    with open(src, errors="replace") as f:
        text = f.read()
    here = os.path.dirname(src)
    return len(text) + sum(os.path.getsize(os.path.join(here, h)) for h in re.findall(r'#include "([^"]+)"', text)
                           if os.path.isfile(os.path.join(here, h)))


class ParallelBuildExt(build_ext):
    """build_ext that compiles the extension's sources in parallel, with the OpenMP flag on the glue only.

    setuptools' -j runs extensions in parallel, not the sources of one, so this one extension of
    about 60 files compiled serially. The compile step is CCompiler.compile's own (_setup_compile,
    _get_cc_args, _compile: the same commands, objects and link order), spread over a thread pool,
    largest sources first. The glue (csrc/glue/) is the one part with OpenMP in it, so only its
    sources get the OpenMP flag: a kernel's compile command is the same with and without OpenMP (so
    ccache serves both builds from one compile, .ci/compilers.sh). If the compiler class lacks those
    methods, the serial compile runs, with the flag on every source."""

    def build_extension(self, ext):
        cc = self.compiler
        if all(hasattr(cc, a) for a in ("_setup_compile", "_get_cc_args", "_compile")):
            cc.compile = self._parallel_compile(cc, build_jobs(self.parallel))
        else:
            ext.extra_compile_args = ext.extra_compile_args + OMP
        super().build_extension(ext)

    @staticmethod
    def _parallel_compile(cc, jobs):
        def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=False,
                    extra_preargs=None, extra_postargs=None, depends=None):
            macros, objects, extra_postargs, pp_opts, build = cc._setup_compile(
                output_dir, macros, include_dirs, sources, depends, extra_postargs)
            cc_args = cc._get_cc_args(pp_opts, debug, extra_preargs)
            todo = sorted((o for o in objects if o in build), key=lambda o: -source_weight(build[o][0]))

            def postargs(src):
                return extra_postargs + OMP if is_glue(src) else extra_postargs
            with ThreadPoolExecutor(jobs) as pool:
                for f in [pool.submit(cc._compile, o, *build[o], cc_args, postargs(build[o][0]), pp_opts)
                          for o in todo]:
                    f.result()   # the first failure raises CompileError, as the serial compile does
            return objects
        return compile


def is_glue(src):
    return os.path.normpath(src).split(os.sep)[:2] == ["csrc", "glue"]


def opt_flag():
    opt = os.environ.get("SSMGRAD_OPT", "-O3")
    if opt not in ("-O0", "-O1", "-O2", "-O3", "-Os", "-Og"):
        raise SystemExit(f"SSMGRAD_OPT: expected one of -O0 -O1 -O2 -O3 -Os -Og, got {opt!r}")
    return opt


OMP = openmp_flags()
cflags = [opt_flag(), "-std=gnu11", "-fno-strict-aliasing", "-fno-trapping-math", "-Wall", "-Wno-unknown-pragmas", "-Wno-psabi"]
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
    extra_compile_args=cflags,      # and OMP on the glue's sources (ParallelBuildExt)
    extra_link_args=OMP,
)

setup(ext_modules=[ext], cmdclass={"build_ext": ParallelBuildExt})
