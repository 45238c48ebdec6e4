"""A pytest plugin that records the CPU time each test costs, its processes included: where the suite's time goes
when the machine's cores are all busy (wall time then says more about the neighbours than about the test).

Each pytest process (each xdist worker) moves itself into its own cgroup-v1 ``cpuacct`` group, so every process a
test starts (launchers, ranks, fork servers, torchrun agents, processes in network namespaces) is counted with it,
orphans included, until they end. Needs root and cgroup v1's cpuacct; otherwise it records nothing and says so.

Usage (a table of the most expensive files and tests at the end)::

    python -m pytest -p tools.cpu_per_test -m '' --cpu-per-test=/tmp/cpu.jsonl
    python tools/cpu_per_test.py /tmp/cpu.jsonl
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--cpu-per-test", default=None, help="append one JSON line per test (CPU seconds) to this file")


def _own_group() -> Path | None:
    """This process's new cpuacct group (its children follow it), or None where there is none to make."""
    group = CPUACCT / "ddpkit-tests" / f"{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-{os.getpid()}"
    try:
        group.mkdir(parents=True, exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError as error:
        print(f"cpu_per_test: no cpuacct group ({error}); nothing recorded", file=sys.stderr)
        return None
    return group


def pytest_configure(config: pytest.Config) -> None:
    """Each pytest process (the main one, each xdist worker) takes its own group when the option is given."""
    config._cpu_group = _own_group() if config.getoption("--cpu-per-test") else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    path, group = item.config.getoption("--cpu-per-test"), item.config._cpu_group
    if group is None:
        yield
        return
    began, cpu = time.monotonic(), int((group / "cpuacct.usage").read_text())
    yield
    used = (int((group / "cpuacct.usage").read_text()) - cpu) / 1e9
    line = {"test": item.nodeid, "cpu_s": round(used, 2), "wall_s": round(time.monotonic() - began, 2)}
    with open(path, "a") as f:
        f.write(json.dumps(line) + "\n")


def report(path: str, top: int = 40) -> None:
    """Prints the files and the tests that cost the most CPU, from the lines of `path`."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    files: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0, 0])
    for line in lines:
        entry = files[line["test"].split("::")[0]]
        entry[0] += line["cpu_s"]
        entry[1] += line["wall_s"]
        entry[2] += 1
    print(f"{len(lines)} tests, {sum(x['cpu_s'] for x in lines):.0f} CPU s, {sum(x['wall_s'] for x in lines):.0f} s")
    print("| file | tests | CPU s | wall s |\n|---|---|---|---|")
    for name, (cpu, wall, n) in sorted(files.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"| {name} | {n} | {cpu:.0f} | {wall:.0f} |")
    print("\n| test | CPU s | wall s |\n|---|---|---|")
    for line in sorted(lines, key=lambda x: -x["cpu_s"])[:top]:
        print(f"| {line['test']} | {line['cpu_s']:.0f} | {line['wall_s']:.0f} |")


if __name__ == "__main__":
    report(sys.argv[1])
