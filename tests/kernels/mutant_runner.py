"""Runs many pytest selections, each in its own forked process, for tests/kernels/test_mutants.py.

    python tests/kernels/mutant_runner.py JOBS.json RESULTS.json

JOBS.json is a list of {"key": any JSON value, "args": [pytest arguments], "mutant": "name:rel" or null}.
Each job is `pytest ARGS` in a child forked from this process with SSMGRAD_MUTANT set to "mutant" (or
unset), its stdout and stderr (file descriptors 1 and 2) in files of its own; two children at a time.
RESULTS.json gets [{"key", "returncode", "stdout", "stderr", "seconds"}] in the order of JOBS.json.

Why fork: a new `python -m pytest` spends about 2.5 of its 4 CPU s importing torch, NumPy, hypothesis
and pytest's plugins before a test runs. This process imports them once; each child starts with them
loaded and imports the rest itself. It never imports ssmgrad: each child loads the extension, which
reads SSMGRAD_MUTANT then (csrc/ssm_mutant.c), so every child selects its own mutant. The parent starts
no thread pool before it forks (no torch op runs here).
"""

import json
import os
import signal
import sys
import tempfile
import time

import hypothesis  # noqa: F401  (imported for the children: the plugin pytest loads)
import numpy  # noqa: F401
import pytest
import torch  # noqa: F401

TIMEOUT = 900          # seconds a child may take (SIGALRM ends it: a negative return code)


def _child(args, mutant, out_path, err_path):
    """In the forked child: never returns."""
    rc = 70
    try:
        if mutant:
            os.environ["SSMGRAD_MUTANT"] = mutant
        else:
            os.environ.pop("SSMGRAD_MUTANT", None)
        for fd, path in ((1, out_path), (2, err_path)):
            f = os.open(path, os.O_WRONLY | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        signal.alarm(TIMEOUT)
        rc = int(pytest.main(list(args)))
    except BaseException as exc:  # noqa: BLE001  (reported as the child's failure, whatever it is)
        print(f"mutant_runner: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)


def main(jobs_path, results_path, parallel=2):
    with open(jobs_path, encoding="utf-8") as f:
        jobs = json.load(f)
    tmp = tempfile.mkdtemp(prefix="ssmgrad-mutant-runs.")
    results = [None] * len(jobs)
    running = {}                       # pid: (index, start time, out path, err path)
    todo = list(range(len(jobs)))
    while todo or running:
        while todo and len(running) < parallel:
            i = todo.pop(0)
            out_path, err_path = os.path.join(tmp, f"{i}.out"), os.path.join(tmp, f"{i}.err")
            for p in (out_path, err_path):
                open(p, "w").close()
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                _child(jobs[i]["args"], jobs[i]["mutant"], out_path, err_path)
            running[pid] = (i, time.time(), out_path, err_path)
        pid, status = os.wait()
        i, t0, out_path, err_path = running.pop(pid)
        with open(out_path, encoding="utf-8", errors="replace") as f:
            out = f.read()
        with open(err_path, encoding="utf-8", errors="replace") as f:
            err = f.read()
        results[i] = {"key": jobs[i]["key"], "returncode": os.waitstatus_to_exitcode(status), "stdout": out,
                      "stderr": err, "seconds": time.time() - t0}
        os.unlink(out_path)
        os.unlink(err_path)
    os.rmdir(tmp)
    with open(results_path, "w", encoding="utf-8") as f:
        json.dump(results, f)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    sys.path[0] = os.getcwd()          # as under `python -m pytest`: the working directory, not tests/kernels
    main(sys.argv[1], sys.argv[2])
