"""Checkpoints of a fault-tolerant job (`ddpkit train --fault-tolerant --checkpoint-every N`, `--resume`).

A fault-tolerant job has no job-wide group to save collectively, and needs none: after a committed round at (or
past) every N-th step, the lowest member of the round writes the *live state* it would send a joiner (model,
optimizer, slow-momentum buffers, SGP's push-sum buffer, the trainer's counters) as one file, ``live.pt``, in a
step folder of its own ``--out``, then the folder's commit marker with the file's SHA-256 (the same folder layout
and marker as `ddpkit.train.checkpoints.checkpoint`, so a torn or damaged checkpoint is passed over the same way).
With ``--out`` on a shared file system the job keeps one series of checkpoints whichever member writes, and each
write is fenced by its round (`ddpkit.train.checkpoints.out_fence`): a writer replaced while it stalled cannot
write over its successor's checkpoints when it wakes.

The state is serialised on the training thread (a copy in memory) and written, committed and pruned by a thread
of its own, so that a slow disk never holds up the next round (a save longer than `--quorum-timeout` would
otherwise drop that round on every member); `wait` ends the job's last write before it exits, and a write that
failed (a full disk) is raised at the next save or at `wait`.

On ``--resume`` the first member of the job's first round reads the newest intact one from its ``--out`` and
sends it to the others over that round's group (`FaultTolerantSync`), so only that machine needs the file.
Memory: the live state serialised once per checkpoint, until it is written. Communication: none here.
"""

from __future__ import annotations

import hashlib
import io
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from ddpkit.train.checkpoints import checkpoint_files as files
from ddpkit.train.checkpoints.checkpoint_files import CheckpointError
from ddpkit.train.checkpoints.out_fence import fenced

LIVE = "live.pt"


@dataclass
class LiveCheckpoints:
    """Where and how often a fault-tolerant job checkpoints: `out`, every `every` steps (None: never), the newest
    `keep` kept, `settings` (`checkpoint_files.resume_settings`) recorded; `resume`: start from the newest one."""

    out: str
    every: int | None
    keep: int
    settings: dict[str, Any]
    resume: bool = False
    _writer: ThreadPoolExecutor = field(default_factory=lambda: ThreadPoolExecutor(1, "ddpkit-checkpoint"), repr=False)
    _pending: Future[str] | None = field(default=None, repr=False)

    def due(self, last_saved: int, step: int) -> bool:
        """Whether a committed round at `step` should be saved, the last save being at `last_saved`."""
        return self.every is not None and step // self.every > last_saved // self.every

    def save(self, live_state: dict[str, Any], step: int, epoch: int, epoch_samples: int, round_: int) -> None:
        """Serialises `live_state` now and writes, commits and prunes the checkpoint of `step` in the background
        (module doc), fenced by `round_` (the committed round this rank writes for); raises what the previous
        write raised (`StaleWriter` when this rank was replaced as the writer)."""
        self.wait()
        buffer = io.BytesIO()
        torch.save(live_state, buffer)
        self._pending = self._writer.submit(self._write, buffer.getvalue(), step, epoch, epoch_samples, round_)

    def wait(self) -> str | None:
        """Ends the write in progress (if any); returns its folder, raising what it raised."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else None

    def _write(self, data: bytes, step: int, epoch: int, epoch_samples: int, round_: int) -> str:
        with fenced(self.out, round_, f"the checkpoint of step {step}") as stage:
            self._write_folder(stage, data, step, epoch, epoch_samples)
        files.prune(self.out, [os.path.basename(f) for _, f in files.committed(self.out)][-self.keep :])
        return os.path.join(files.checkpoint_root(self.out), files.folder_name(step))

    def _write_folder(self, root: str, data: bytes, step: int, epoch: int, epoch_samples: int) -> None:
        """The checkpoint of `step`, written under `root` (the fence's staging folder)."""
        folder = os.path.join(files.checkpoint_root(root), files.folder_name(step))
        os.makedirs(folder, exist_ok=True)
        files.write_atomic(os.path.join(folder, LIVE), data)
        digest = hashlib.sha256(data).hexdigest()
        manifest = {
            "step": step,
            "epoch": epoch,
            "epoch_samples": epoch_samples,
            "files": {LIVE: digest},
            "world_size": self.settings["world_size"],
            "strategy": self.settings["strategy"],
            "settings": self.settings,
            "fault_tolerant": True,
        }
        files.write_marker(folder, manifest)

    def load(self) -> tuple[dict[str, Any], list[str]]:
        """The live state of the newest intact checkpoint and notes on what resuming it changes or skipped; a
        CheckpointError naming the problem when there is none, or it was not written by a fault-tolerant job."""
        files.check_written_by(self.out, fault_tolerant=True)
        _, manifest, loaded, skipped = files.newest_intact(self.out, verify=(LIVE,))
        try:
            notes = [*skipped, *files.resume_notes(manifest, self.settings)]
        except ValueError as exc:
            raise CheckpointError(str(exc)) from None
        return loaded[LIVE], notes
