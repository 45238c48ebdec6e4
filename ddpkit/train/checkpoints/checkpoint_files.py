"""The files of a checkpoint: one folder per saved step, written atomically, committed by a marker with checksums.

Layout of ``OUT/checkpoint/``::

    step-00000045/          one folder per checkpoint, named by the optimizer steps taken
        shared.pt           rank 0: model (all replicas equal), whole optimizer state, SlowMo state, trainer state
        rank1.pt ...        SlowMo only: each rank's own replica and optimizer state (they differ between nodes)
        COMMIT.json         written last, by rank 0: what was saved and the SHA-256 of every file

Every file is written under a temporary name, flushed to disk (fsync), then renamed, so a file with the final name
is always complete. The marker is written only after every rank reported its file written and synced, so a folder
without one is torn (a rank died while saving) and is never picked. On resume the checksum of every file is
verified before it is read: a changed, truncated or missing file is an error naming it. A disk that fills up is
an error naming the path; the folders of earlier checkpoints are removed only after the new one is committed.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import os
import re
import shutil
from typing import Any

import torch

MARKER = "COMMIT.json"
SHARED = "shared.pt"
_FOLDER = re.compile(r"step-(\d{8,})")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message names the file and the cause."""


def checkpoint_root(out: str) -> str:
    return os.path.join(out, "checkpoint")


def folder_name(step: int) -> str:
    return f"step-{step:08d}"


def rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: str, data: bytes) -> None:
    """Writes `data` to `path` through a temporary file that is synced and renamed; raises CheckpointError."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if exc.errno == errno.ENOSPC:
            raise CheckpointError(f"no space left on device writing {path}") from None
        raise CheckpointError(f"cannot write {path}: {exc.strerror or exc}") from None
    _fsync_dir(os.path.dirname(path) or ".")


def save_file(obj: Any, path: str) -> str:
    """torch.save of `obj` to `path`, atomically; returns the file's SHA-256 (hex)."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    data = buffer.getvalue()
    write_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def write_marker(folder: str, manifest: dict[str, Any]) -> None:
    write_atomic(os.path.join(folder, MARKER), json.dumps(manifest, indent=1, sort_keys=True).encode())


def read_marker(folder: str) -> dict[str, Any]:
    """The commit marker of `folder`; a CheckpointError naming it when it cannot be read or parsed."""
    path = os.path.join(folder, MARKER)
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read().decode())
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint marker {path}: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"checkpoint marker {path} is corrupt (not valid JSON: {exc})") from None
    required = {"step", "epoch", "world_size", "strategy", "files"}
    if not isinstance(manifest, dict) or not required <= set(manifest) or not isinstance(manifest["files"], dict):
        raise CheckpointError(f"checkpoint marker {path} is corrupt (missing {sorted(required)})")
    return manifest


def step_folders(out: str) -> list[tuple[int, str]]:
    """(step, folder) of every checkpoint folder under `out`, committed or not, oldest first."""
    root = checkpoint_root(out)
    try:
        names = os.listdir(root)
    except OSError:
        return []
    found = [(int(m.group(1)), os.path.join(root, n)) for n in names if (m := _FOLDER.fullmatch(n))]
    return sorted(found)


def committed(out: str) -> list[tuple[int, str]]:
    """(step, folder) of the checkpoints whose commit marker exists, oldest first (torn ones are left out)."""
    return [(step, folder) for step, folder in step_folders(out) if os.path.exists(os.path.join(folder, MARKER))]


def latest(out: str) -> str | None:
    """The folder of the newest committed checkpoint under `out`, or None."""
    done = committed(out)
    return done[-1][1] if done else None


def check_written_by(out: str, fault_tolerant: bool) -> None:
    """--resume: a CheckpointError when the newest committed checkpoint under `out` comes from the other kind of
    job (with or without --fault-tolerant: one replica's live state against every rank's files)."""
    newest = latest(out)
    if newest is None or bool(read_marker(newest).get("fault_tolerant")) == fault_tolerant:
        return
    kind = "without" if fault_tolerant else "with"
    raise CheckpointError(
        f"--resume: {newest} was written by a job {kind} --fault-tolerant; resume it {kind} --fault-tolerant (a "
        "fault-tolerant job saves and resumes the live state of one replica)"
    )


def newest_intact(out: str, verify: tuple[str, ...] = ()) -> tuple[str, dict[str, Any], dict[str, Any], list[str]]:
    """The newest committed checkpoint whose marker reads and whose files in `verify` match their checksums:
    (folder, marker, {name: loaded file}, a note per newer committed checkpoint skipped, saying why).

    A checkpoint damaged after it was committed (a disk error, a partial copy) is passed over for the previous
    committed one, and the notes say so; a CheckpointError when none is intact, naming the newest one's fault."""
    done = committed(out)
    if not done:
        raise CheckpointError(f"--resume: no complete checkpoint in {checkpoint_root(out)}")
    skipped: list[str] = []
    first_error: CheckpointError | None = None
    for step, folder in reversed(done):
        try:
            manifest = read_marker(folder)
            loaded = {name: load_verified(folder, name, manifest) for name in verify}
        except CheckpointError as exc:
            first_error = first_error or exc
            skipped.append(f"skipped the checkpoint of step {step}: {exc}")
            continue
        return folder, manifest, loaded, skipped
    assert first_error is not None
    raise CheckpointError(f"{first_error}; no earlier committed checkpoint in {checkpoint_root(out)} is intact")


def load_verified(folder: str, name: str, manifest: dict[str, Any]) -> Any:
    """Reads `name` from `folder` after checking its SHA-256 against the marker; CheckpointError naming the file."""
    path = os.path.join(folder, name)
    expected = manifest["files"].get(name)
    if expected is None:
        raise CheckpointError(f"{path} is not listed in {os.path.join(folder, MARKER)}: it belongs to no checkpoint")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {exc.strerror or exc}") from None
    if hashlib.sha256(data).hexdigest() != expected:
        raise CheckpointError(
            f"checkpoint file {path} is corrupt: its SHA-256 differs from the one recorded when it was written "
            f"({len(data)} bytes now)"
        )
    try:
        # weights_only: tensors, numbers, strings and containers of them come back, nothing a file names is run
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)  # GPU-written: onto CPU too
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint file {path}: {type(exc).__name__}: {exc}") from None


def prune(out: str, keep: list[str]) -> None:
    """Removes every checkpoint folder under `out` whose name is not in `keep` (older and torn ones)."""
    for _, folder in step_folders(out):
        if os.path.basename(folder) not in keep:
            shutil.rmtree(folder, ignore_errors=True)


HYPERPARAMETERS = ("lr", "momentum", "weight_decay")


def resume_settings(cfg: Any) -> dict[str, Any]:
    """What a checkpoint records about the run that wrote it, to judge a later --resume (from a TrainConfig)."""
    return {
        "strategy": cfg.strategy,
        "world_size": cfg.world_size,
        "optimizer": cfg.optimizer,
        "adascale": cfg.adascale,
        "amp": cfg.amp,
        "lr": cfg.learning_rate,
        "momentum": cfg.momentum if cfg.optimizer == "sgd" else None,
        "weight_decay": cfg.resolved_weight_decay,
        "data": cfg.data,
        "slowmo": _slowmo_settings(cfg) if cfg.strategy == "slowmo" else None,
    }


def _slowmo_settings(cfg: Any) -> dict[str, Any]:
    return {
        "base": cfg.slowmo_base,
        "compression": cfg.slowmo_compression,
        "error_feedback": cfg.slowmo_error_feedback,
        "fragments": cfg.slowmo_fragments,
        "sync_delay": cfg.slowmo_sync_delay,
    }


def _pseudo_gradients(slowmo: dict[str, Any]) -> bool:
    """Whether these SlowMo settings average through pseudo-gradient syncs (else exactly, or by gossip)."""
    return slowmo["compression"] != "none" or slowmo["fragments"] > 1 or slowmo["sync_delay"] > 0


def slowmo_resume_notes(then: dict[str, Any] | None, now: dict[str, Any] | None) -> list[str]:
    """What a change of SlowMo's averaging settings does on --resume; a ValueError where the saved state cannot
    drive the new mode (another base algorithm, exact averaging to pseudo-gradients, other fragments)."""
    if then is None or now is None:
        return []
    if then["base"] != now["base"]:
        raise ValueError(
            f"--resume: the checkpoint was written with --slowmo-base {then['base']}, whose state (gossip buffer or "
            f"none) cannot drive --slowmo-base {now['base']}. Resume with --slowmo-base {then['base']}"
        )
    if _pseudo_gradients(now) and not _pseudo_gradients(then):
        raise ValueError(
            "--resume: the checkpoint averaged nodes exactly; --slowmo-compression, --slowmo-fragments and "
            "--slowmo-sync-delay need the synchronised copy its syncs keep. Resume without them, or start afresh"
        )
    if _pseudo_gradients(then) and not _pseudo_gradients(now):
        return ["slowmo pseudo-gradient syncs -> exact averaging: syncs in flight at the checkpoint are dropped"]
    if then["fragments"] != now["fragments"]:
        raise ValueError(
            f"--resume: the checkpoint was written with --slowmo-fragments {then['fragments']}; its syncs in flight "
            f"and residual are cut that way. Resume with --slowmo-fragments {then['fragments']}"
        )
    notes = []
    if then["compression"] != now["compression"]:
        notes.append(
            f"slowmo compression {then['compression']} -> {now['compression']}: the next syncs are sent "
            f"as {now['compression']}"
        )
    if then["error_feedback"] != now["error_feedback"]:
        kept = "starts at zero" if now["error_feedback"] else "is dropped"
        notes.append(f"slowmo error feedback {_on(then)} -> {_on(now)}: the residual {kept}")
    if then["sync_delay"] != now["sync_delay"]:
        notes.append(
            f"slowmo sync delay {then['sync_delay']} -> {now['sync_delay']}: a sync in flight at the "
            f"checkpoint merges {now['sync_delay']} steps after it started, or at the first step if that "
            "has passed"
        )
    return notes


def _on(slowmo: dict[str, Any]) -> str:
    return "on" if slowmo["error_feedback"] else "off"


def resume_notes(manifest: dict[str, Any], now: dict[str, Any]) -> list[str]:
    """What changes when a run with settings `now` resumes the checkpoint `manifest` describes: a line per kept or
    changed setting; a ValueError when the run cannot continue correctly from it."""
    then = {**{k: None for k in now}, **manifest.get("settings", {})}
    then.update(strategy=manifest["strategy"], world_size=manifest["world_size"])
    where = f"the checkpoint of step {manifest['step']} was written by --strategy {then['strategy']}"
    if then["optimizer"] is not None and then["optimizer"] != now["optimizer"]:
        raise ValueError(
            f"--resume: {where} with --optimizer {then['optimizer']}; its state cannot drive --optimizer "
            f"{now['optimizer']}. Resume with --optimizer {then['optimizer']}, or start afresh in another --out"
        )
    if bool(then["adascale"]) != bool(now["adascale"]):
        raise ValueError(f"--resume: {where} {'with' if then['adascale'] else 'without'} --adascale; resume the same")
    if "slowmo" in (then["strategy"], now["strategy"]) and then["strategy"] != now["strategy"]:
        raise ValueError(
            f"--resume: {where}; SlowMo keeps a replica and optimizer state per rank and the others one for all, "
            f"so it cannot continue as --strategy {now['strategy']}. Resume with --strategy {then['strategy']}"
        )
    notes = [f"resuming from step {manifest['step']} (epoch {manifest['epoch']})"]
    if then["strategy"] != now["strategy"]:
        notes.append(f"strategy {then['strategy']} -> {now['strategy']}: model and optimizer state carried over")
    if then["world_size"] != now["world_size"]:
        notes.append(
            f"world size {then['world_size']} -> {now['world_size']}: optimizer state re-split, "
            "the epoch's remaining samples divided over the new ranks"
        )
        if now["strategy"] == "slowmo":
            notes.append(
                f"every rank starts from the mean of the {then['world_size']} saved SlowMo replicas and "
                "optimizer states; the slow buffers are carried"
            )
    for name in HYPERPARAMETERS:
        if then[name] is not None and now[name] is not None and then[name] != now[name]:
            notes.append(f"{name} {then[name]:g} -> {now[name]:g}: the new value takes effect")
    if then.get("data") is not None and now.get("data") is not None and then["data"] != now["data"]:
        notes.append(
            f"data {then['data']} -> {now['data']}: training goes on with the new data, from the saved "
            "position in the epoch"
        )
    if then["amp"] is not None and then["amp"] != now["amp"]:
        notes.append(f"amp {then['amp']} -> {now['amp']}: the loss scaler starts afresh")
    if then["strategy"] == now["strategy"] == "slowmo":
        notes.extend(slowmo_resume_notes(then.get("slowmo"), now.get("slowmo")))
    return notes
