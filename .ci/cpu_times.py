"""pytest plugin: CPU seconds per test file, for the time budget of the CI passes (docs/build.md, CI).

    PYTHONPATH=.ci:$PWD python -m pytest -q -p cpu_times tests/kernels

prints, after the run, each file's test count, wall seconds and CPU seconds (this process, all its
threads, plus the child processes it waited for), costliest first. On a shared machine the CPU
seconds are the firm figure: wall time there measures the other jobs too.
"""

import collections
import resource
import time

import pytest

_rows = collections.defaultdict(lambda: [0, 0.0, 0.0])


def _cpu():
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    wall, cpu = time.perf_counter(), _cpu()
    yield
    row = _rows[item.nodeid.split("::")[0]]
    row[0] += 1
    row[1] += time.perf_counter() - wall
    row[2] += _cpu() - cpu


def pytest_terminal_summary(terminalreporter):
    tr = terminalreporter
    tr.section("CPU seconds per file (cpu_times)")
    tr.write_line(f"{'file':56s} {'tests':>5s} {'wall s':>8s} {'CPU s':>8s}")
    total = [0, 0.0, 0.0]
    for name, (n, wall, cpu) in sorted(_rows.items(), key=lambda kv: -kv[1][2]):
        tr.write_line(f"{name:56s} {n:5d} {wall:8.1f} {cpu:8.1f}")
        total = [total[0] + n, total[1] + wall, total[2] + cpu]
    tr.write_line(f"{'total':56s} {total[0]:5d} {total[1]:8.1f} {total[2]:8.1f}")
