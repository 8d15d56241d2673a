"""arm_loops.py -- what the kernels' inner loops are made of on aarch64, where no speed can be measured
here (no Arm machine; qemu-aarch64 checks results, not time).

    python benchmarks/probes/arm_loops.py [--cc aarch64-linux-gnu-gcc] [--opt -O3] [--top 6]

Cross-compiles every csrc/inst/*_v0.c (on aarch64 the build compiles only the _v0 files, at the
build's own target: SSM_LEVEL 0, 16-byte register tiles, i.e. one NEON register; docs/simd.md) with
setup.py's flags, disassembles each object (aarch64-linux-gnu-objdump), and reports per function its
instructions, its vector FMAs (fmla/fmls on .4s or .2d: 4 floats or 2 doubles each) and scalar FMAs
(fmadd/fmsub/fnmadd/fnmsub on s or d registers), then the innermost loops (a backward branch whose
range holds no other backward branch) that hold the most FMAs: their instruction count, vector and
scalar FMAs, vector loads/stores. A hot loop with vector FMAs and no scalar ones is vectorized; a loop
whose FMAs are scalar is not. The instruction counts are static (per iteration of the loop body), not
a profile.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLAGS = ["-std=gnu11", "-fno-strict-aliasing", "-fno-trapping-math", "-Wno-unknown-pragmas", "-Wno-psabi"]   # setup.py's cflags

INSN = re.compile(r"^\s*([0-9a-f]+):\s+[0-9a-f]{8}\s+(\S+)\s*(.*)$")
FUNC = re.compile(r"^[0-9a-f]+ <(.+)>:$")
VFMA = re.compile(r"^fml[as]$")
VREG = re.compile(r"\bv\d+\.(4s|2d)\b")
SFMA = re.compile(r"^fn?m(add|sub)$")
SREG = re.compile(r"^[sd]\d+,")
BRANCH = re.compile(r"^(b\.\w+|cbn?z|tbn?z|b)$")


def classify(op, args):
    if VFMA.match(op) and VREG.search(args):
        return "vfma"
    if SFMA.match(op) and SREG.match(args):
        return "sfma"
    if op in ("ldr", "ldp", "ld1", "ldur", "str", "stp", "st1", "stur") and re.match(r"^q\d+|^\{?v\d+", args):
        return "vmem"
    return None


def functions(dump):
    """{name: [(address, op, args)]} of an objdump -d listing"""
    out, name = {}, None
    for line in dump.splitlines():
        m = FUNC.match(line)
        if m:
            name = m.group(1)
            out[name] = []
            continue
        m = INSN.match(line)
        if m and name:
            out[name].append((int(m.group(1), 16), m.group(2), m.group(3)))
    return out


def inner_loops(insns):
    """[(first index, last index)] of the backward branches whose range holds no other one"""
    addr = {a: i for i, (a, _, _) in enumerate(insns)}
    loops = []
    for i, (a, op, args) in enumerate(insns):
        if BRANCH.match(op):
            m = re.search(r"\b([0-9a-f]+) <", args)
            if m and int(m.group(1), 16) <= a and int(m.group(1), 16) in addr:
                loops.append((addr[int(m.group(1), 16)], i))
    return [(s, e) for s, e in loops if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in loops)]


def count(insns, kinds=("vfma", "sfma", "vmem")):
    c = dict.fromkeys(kinds, 0)
    for _, op, args in insns:
        k = classify(op, args)
        if k in c:
            c[k] += 1
    return c


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cc", default="aarch64-linux-gnu-gcc")
    ap.add_argument("--opt", default="-O3", help="the optimisation flag (setup.py's default: -O3)")
    ap.add_argument("--top", type=int, default=6, help="inner loops shown per object")
    a = ap.parse_args()
    objdump = a.cc.replace("gcc", "objdump") if "gcc" in a.cc else "aarch64-linux-gnu-objdump"
    for tool in (a.cc, objdump):
        if not shutil.which(tool):
            sys.exit(f"{tool} not found (apt-get install gcc-aarch64-linux-gnu)")
    inst = os.path.join(ROOT, "csrc", "inst")
    version = subprocess.run([a.cc, "--version"], capture_output=True, text=True).stdout.splitlines()[0]
    print(f"# {version}, {a.opt} {' '.join(FLAGS)}: static counts per object, function and inner loop\n")
    with tempfile.TemporaryDirectory() as tmp:
        for src in sorted(f for f in os.listdir(inst) if f.endswith("_v0.c")):
            obj = os.path.join(tmp, src[:-2] + ".o")
            subprocess.run([a.cc, a.opt, *FLAGS, "-I", os.path.join(ROOT, "csrc"), "-c", os.path.join(inst, src),
                            "-o", obj], check=True)
            funcs = functions(subprocess.run([objdump, "-d", obj],
                                             capture_output=True, text=True, check=True).stdout)
            total = count([i for f in funcs.values() for i in f])
            print(f"## {src}: {sum(map(len, funcs.values()))} instructions, {total['vfma']} vector FMAs, "
                  f"{total['sfma']} scalar FMAs")
            rows = []
            for name, insns in funcs.items():
                for s, e in inner_loops(insns):
                    c = count(insns[s:e + 1])
                    if c["vfma"] + c["sfma"]:
                        rows.append((c["vfma"] + c["sfma"], name, e - s + 1, c))
            rows.sort(key=lambda r: (-r[0], r[1]))
            print("| function | loop insns | vector FMAs | scalar FMAs | vector loads/stores |")
            print("|---|---|---|---|---|")
            for _, name, n, c in rows[:a.top]:
                print(f"| `{name}` | {n} | {c['vfma']} | {c['sfma']} | {c['vmem']} |")
            print()


if __name__ == "__main__":
    main()
