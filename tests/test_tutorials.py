"""The tutorials (docs/tutorials/*.md), run as they say: each script saved from its page, each command as written
(with the changes test_readme.SUBSTITUTIONS lists: fewer epochs, free ports)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest
from test_readme import TIMEOUT, argv, command, finish, free_port, run_command, snippet, start

pytestmark = pytest.mark.slow


def save(anchor: str, path: Path) -> None:
    path.write_text(snippet(anchor).lstrip("\n"))


def test_the_lightning_tutorial(tmp_path):
    """Lightning's Trainer with ddpkit_sharded trains the digits to a useful accuracy, checkpoints, and the resumed
    run goes on from the next epoch."""
    pytest.importorskip("lightning")
    save('strategy="ddpkit_sharded",  # was "ddp"', tmp_path / "train_lightning.py")
    out = run_command(argv(command("python train_lightning.py --epochs 3")), tmp_path)
    assert re.search(r"^epoch 0: held-out accuracy 0\.[6-9]", out, re.M), out
    out = run_command(argv(command("python train_lightning.py --epochs 5 --resume")), tmp_path)
    assert re.search(r"^epoch 1: held-out accuracy 0\.[7-9]", out, re.M), out
    assert "Restoring states from the checkpoint" in out, out


def test_the_fault_tolerant_loop_tutorial(tmp_path):
    """The tutorial's job: rank 1 crashes at step 300, rank 0 trains on alone, rank 1 started again receives the
    live state, and both end at the last step with the same parameters (the tutorial's commands, with `--steps`
    halved: every event of the run happens in the first 750 steps)."""
    save('parser.add_argument("--crash-at"', tmp_path / "train_ft.py")
    port = str(free_port())

    def launch(text: str):
        line = command(text).removesuffix(" &")
        return start(argv(line + (" --steps 750" if line.startswith("python") else ""), port=port), tmp_path)

    store = launch("ddpkit store --port 29510 &")
    try:
        rank0 = launch("python train_ft.py --rank 0 --world-size 2 &")
        crashing = launch("python train_ft.py --rank 1 --world-size 2 --crash-at 300")
        crashed, _ = crashing.communicate(timeout=TIMEOUT)
        assert crashing.returncode == 1 and "rank 1: step 250, 2 member(s)" in crashed, crashed
        _wait_for_line(rank0, "rank 1 left")  # as a person restarts it: after rank 0 went on alone
        out0, out1 = finish([rank0, launch("python train_ft.py --rank 1 --world-size 2")])
        said, _ = store.communicate(timeout=30)  # every replica called finish(): the store ends by itself
        assert store.returncode == 0 and "job finished; its store stops" in said, said
    finally:
        if store.poll() is None:
            store.kill()
            store.wait()
    assert "rank 1 left; training with 1 of 2" in out0 and "rank 1 joined; training with 2 of 2" in out0, out0
    left = re.search(r"round (\d+) \(step \d+\): rank 1 left", out0)
    joined = re.search(r"round (\d+) \(step \d+\): rank 1 joined", out0)
    assert left and joined and int(joined.group(1)) > int(left.group(1)), f"rank 0 never trained alone:\n{out0}"
    done = r"done at step 750, held-out accuracy (0\.\d+), parameter checksum (\S+)"
    last = [re.search(done, out) for out in (out0, out1)]
    assert last[0] and last[1], (out0, out1)
    assert last[0].group(2) == last[1].group(2), (out0, out1)  # the same parameters on both
    assert float(last[0].group(1)) > 0.85, out0


def _wait_for_line(command, text: str) -> None:
    deadline = time.monotonic() + TIMEOUT
    while text not in command.output():
        assert command.poll() is None and time.monotonic() < deadline, f"no {text!r} in:\n{command.output()}"
        time.sleep(0.1)


def test_the_diloco_tutorial(tmp_path):
    """DiLoCo on 2 one-process sites: a useful accuracy, and the bytes rank 0 sent are those of the definition:
    per sync of F fp32 parameters between 2 sites, each sends its half of the int4 pseudo-gradient to the other's
    owner and its averaged half back (F/2 bytes of values and 4 bytes of scale per 64 values, in all), and the
    final exact average is one all-reduce of 4F bytes, of which each of 2 ranks sends half twice."""
    save("model.perform_slowmo(optimizer)  # a sync every H steps", tmp_path / "train_diloco.py")
    text = command("torchrun --nproc-per-node 2 train_diloco.py --epochs 20")
    out = run_command(argv(text, port=str(free_port())), tmp_path)
    steps = 5 * -(-750 // 16)  # 5 epochs of 750 samples per rank, 16 a step
    f = 64 * 256 + 256 + 256 * 10 + 10
    expected = steps // 50 * (f / 2 + 4 * f / 64) + 4 * f
    found = re.search(
        r"^(\d+) steps, held-out accuracy (0\.\d+)\nsent ([\d.]+) MB by rank 0; DDP would send", out, re.M
    )
    assert found and int(found.group(1)) == steps and float(found.group(2)) > 0.7, out
    assert float(found.group(3)) == pytest.approx(expected / 1e6, abs=0.0015), (expected, out)
