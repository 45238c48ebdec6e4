"""Fault injection for `ddpkit train`, run by hand (not in CI): each fault N times, counting what went wrong.

    python tools/fault_injection.py --runs 10 [--faults rank-kill,rank-stop,...] [--timeout 6]

Faults: a rank SIGKILLed or SIGSTOPped mid-run, the launcher sent SIGTERM or SIGKILL, a rank SIGKILLed while the
ranks save a checkpoint every step, two machines that disagree (one runs a wider model), and a disk that fills up
(a 4 MB tmpfs, as root; skipped otherwise). For every run it counts a hang (the job not over within --timeout +
60 s), an orphan (a process of the job alive 15 s after its launcher ended), a segment file left in /dev/shm, a
corrupt checkpoint (the newest committed one not verifying), and whether the exit code and message were ddpkit's.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ddpkit.distributed.launch import free_port  # noqa: E402
from ddpkit.distributed.segment_files import SHM_DIR  # noqa: E402
from ddpkit.train.checkpoints import checkpoint_files as files  # noqa: E402

DDPKIT = [sys.executable, "-m", "ddpkit", "train"]
RUN = ["--epochs", "100000", "--no-progress", "--data", "synthetic", "--synthetic-samples", "512", "--hidden", "32"]
RUN += ["--depth", "1", "--checkpoint-every", "5"]
FAULTS = ("rank-kill", "rank-stop", "launcher-term", "launcher-kill", "kill-during-save", "disagree", "full-disk")


def process_table() -> dict[int, tuple[int, str]]:
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            table[int(entry)] = (int(fields[1]), fields[0])
    return table


def descendants(pids: set[int]) -> set[int]:
    table, found, frontier = process_table(), set(), set(pids)
    while frontier:
        frontier = {p for p, (ppid, _) in table.items() if ppid in frontier} - found
        found |= frontier
    return found


def alive(pids: set[int]) -> set[int]:
    table = process_table()
    return {p for p in pids if p in table and table[p][1] not in ("Z", "X")}


class Job:
    """Commands of one job in their own sessions; remembers every descendant it saw."""

    def __init__(self, commands: list[list[str]], folder: Path, env: dict[str, str]) -> None:
        self.procs = []
        for i, args in enumerate(commands):
            with open(folder / f"err{i}", "w") as err:
                self.procs.append(
                    subprocess.Popen(
                        args, stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=ROOT, start_new_session=True
                    )
                )
        self.folder, self.seen = folder, set()

    def watch(self) -> None:
        self.seen |= descendants({p.pid for p in self.procs if p.poll() is None})

    def workers(self, index: int = 0) -> list[int]:
        self.watch()
        table = process_table()
        kids = [p for p, (ppid, _) in table.items() if ppid == self.procs[index].pid]
        return sorted(p for p in kids if b"spawn_main" in Path(f"/proc/{p}/cmdline").read_bytes())

    def wait(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while any(p.poll() is None for p in self.procs):
            self.watch()
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def stderr(self) -> str:
        return "".join((self.folder / f"err{i}").read_text() for i in range(len(self.procs)))

    def kill_all(self) -> None:
        for pid in alive(self.seen | {p.pid for p in self.procs}):
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass


def wait_checkpoint(out: Path, job: Job, limit: float = 120) -> bool:
    deadline = time.monotonic() + limit
    while files.latest(str(out)) is None:
        job.watch()
        if time.monotonic() > deadline or any(p.poll() is not None for p in job.procs):
            return False
        time.sleep(0.1)
    return True


def checkpoint_ok(out: Path) -> bool:
    """The newest committed checkpoint verifies (every file's checksum), or there is none."""
    folder = files.latest(str(out))
    if folder is None:
        return True
    try:
        manifest = files.read_marker(folder)
        for name in manifest["files"]:
            files.load_verified(folder, name, manifest)
    except files.CheckpointError as exc:
        print(f"    corrupt: {exc}")
        return False
    return True


def start(fault: str, folder: Path, timeout: float, env: dict[str, str]) -> tuple[Job, Path] | None:
    out = folder / "out"
    flags = [*RUN, "--timeout", str(timeout), "--out", str(out), "--master-port", str(free_port())]
    if fault == "kill-during-save":
        flags += ["--checkpoint-every", "1"]
    if fault == "disagree":
        common = [*DDPKIT, *flags, "--world-size", "2", "--host", "127.0.0.1", "--strategy", "ddp"]
        return Job([[*common, "--rank", "0"], [*common, "--rank", "1", "--hidden", "48"]], folder, env), out
    if fault == "full-disk":
        disk = folder / "disk"
        disk.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(disk)]).returncode != 0:
            return None
        out = disk / "out"
        flags[flags.index("--out") + 1] = str(out)
    return Job([[*DDPKIT, *flags, "--strategy", random.choice(["ddp", "oss", "sharded", "slowmo"])]], folder, env), out


def inject(fault: str, job: Job, out: Path) -> None:
    if fault == "disagree":
        return
    if not wait_checkpoint(out, job):
        return
    if fault == "full-disk":
        with open(out.parent / "filler", "wb") as f:
            try:
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
            except OSError:
                pass
        return
    time.sleep(random.uniform(0.0, 1.0))
    ranks = job.workers()
    target = job.procs[0].pid if fault.startswith("launcher") else random.choice(ranks)
    sig = {"rank-stop": signal.SIGSTOP, "launcher-term": signal.SIGTERM}.get(fault, signal.SIGKILL)
    os.kill(target, sig)


def one_run(fault: str, timeout: float) -> dict[str, bool] | None:
    folder = Path(tempfile.mkdtemp(prefix=f"ddpkit-fault-{fault}-"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DDPKIT_DEBUG")}
    env["PYTHONPATH"] = str(ROOT)
    started = start(fault, folder, timeout, env)
    if started is None:
        return None
    job, out = started
    try:
        inject(fault, job, out)
        ended = job.wait(timeout + 60)
        time.sleep(15 if fault == "launcher-kill" else 2)
        orphans = alive(job.seen)
        litter = [
            n
            for n in os.listdir(SHM_DIR)
            if re.search(r"-(\d+)-", n) and n.startswith("ddpkit-") and int(n.split("-")[3]) in job.seen
        ]
        text = job.stderr()
        codes = [p.poll() for p in job.procs]
        clear = all(c not in (0, None) for c in codes) and (fault == "launcher-kill" or "ddpkit: " in text)
        return {
            "hang": not ended,
            "orphans": bool(orphans),
            "shm": bool(litter),
            "corrupt": not checkpoint_ok(out),
            "unclear": not clear,
        }
    finally:
        job.kill_all()
        subprocess.run(["umount", "-l", str(folder / "disk")], capture_output=True)
        shutil.rmtree(folder, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--timeout", type=float, default=6.0)
    args = parser.parse_args()
    print(f"{'fault':<18}{'runs':>5}{'hangs':>7}{'orphans':>9}{'shm left':>10}{'corrupt':>9}{'unclear':>9}")
    for fault in args.faults.split(","):
        counts = {"runs": 0, "hang": 0, "orphans": 0, "shm": 0, "corrupt": 0, "unclear": 0}
        for _ in range(args.runs):
            result = one_run(fault, args.timeout)
            if result is None:
                break
            counts["runs"] += 1
            for key, bad in result.items():
                counts[key] += int(bad)
        c = counts
        print(
            f"{fault:<18}{c['runs']:>5}{c['hang']:>7}{c['orphans']:>9}{c['shm']:>10}{c['corrupt']:>9}{c['unclear']:>9}",
            flush=True,
        )


if __name__ == "__main__":
    main()
