"""OSS(shared_parameters=True): on one host the parameters a rank does not own are the owner's pages.

The reference is the same training without the option (OSS's ordinary replica per rank, itself checked against DDP
in tests/test_oss.py and tests/test_sharded_ddp.py): every step's parameters must be bit-identical, with Adam,
gradient clipping, AdaScale and a rank made slow in backward (so that a rank that stepped early would change
parameters the other still reads), and the non-owned parameters must be views of another rank's segment (one copy
per host).
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import warm_processes
from torch import nn

from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS, AdaScale
from ddpkit.testing import run_distributed

STEPS = 12


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8))


def _train(rank: int, shared: bool, slow: bool, adascale: bool) -> tuple[list[torch.Tensor], list[bool]]:
    model = _model()
    optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2, shared_parameters=shared)
    stepper: OSS | AdaScale = AdaScale(optimizer) if adascale else optimizer
    sdp = ShardedDataParallel(model, stepper)
    if slow and rank == 0:  # rank 0's backward lags: rank 1 reaches its step first
        model[0].register_full_backward_hook(lambda *_: time.sleep(0.05))
    g = torch.Generator().manual_seed(rank)
    history: list[torch.Tensor] = []
    for _ in range(STEPS):
        optimizer.zero_grad(set_to_none=True)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        nn.functional.mse_loss(sdp(x), y).backward()
        optimizer.clip_grad_norm(0.5)
        stepper.step()
        history.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
    borrowed = [optimizer.owner_of(p) not in (None, rank) for p in model.parameters()]
    mapped = [_is_mapped(p) for p in model.parameters()]
    return history, [m for b, m in zip(borrowed, mapped, strict=True) if b]  # where the borrowed ones live


def _is_mapped(param: torch.Tensor) -> bool:
    """Whether `param`'s memory lies in a file mapping of /dev/shm (another rank's segment or this rank's own)."""
    address = param.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, *_, path = line.split(maxsplit=5) if len(line.split()) >= 6 else (line.split()[0], "")
            low, high = (int(a, 16) for a in span.split("-"))
            if low <= address < high:
                return "/dev/shm/" in path
    return False


def _both(rank: int, world_size: int, slow: bool, adascale: bool) -> dict:
    plain, private = _train(rank, shared=False, slow=slow, adascale=adascale)
    shared, layout = _train(rank, shared=True, slow=slow, adascale=adascale)
    equal = [torch.equal(a, b) for a, b in zip(plain, shared, strict=True)]
    return {"equal": equal, "shared": layout, "plain": private}


@pytest.mark.parametrize(
    ("slow", "adascale"),
    [(False, False), (True, False), (True, True)],
    ids=["even", "rank-0-slow", "rank-0-slow-adascale"],
)
def test_shared_parameters_train_bit_identically_to_a_replica_per_rank(slow, adascale):
    for rank, got in enumerate(run_distributed(_both, 2, slow, adascale)):
        assert all(got["equal"]), (rank, got["equal"])
        # the parameters another rank owns: the owner's segment, mapped, with the option; a copy of this rank's
        # own (not in /dev/shm) without it
        assert got["shared"] and all(got["shared"]), (rank, got)
        assert got["plain"] and not any(got["plain"]), (rank, got)


def test_ddpkit_train_shared_parameters_gives_the_same_steps_and_is_refused_where_it_cannot_act(tmp_path):
    """`ddpkit train --shared-parameters` trains bit for bit as without it (the training on the pooled ranks,
    tests/pooled_train.py), and the command refuses the flag, naming it, where no OSS shares parameters."""
    import csv

    import pooled_train
    from test_train_cli import DDPKIT, _env

    flags = ["--strategy", "sharded", "--nproc-per-node", "2", "--max-steps", "8", "--epochs", "1", "--no-progress"]
    rows = []
    for extra in ([], ["--shared-parameters"]):
        out = tmp_path / ("shared" if extra else "plain")
        pooled_train.train([*flags, *extra, "--out", out], tmp_path)
        with open(out / "steps.csv") as f:
            rows.append([r["loss"] for r in csv.DictReader(f)])
    assert rows[0] == rows[1] and len(rows[0]) == 8  # bit for bit
    words = [*DDPKIT, "train", "--strategy", "ddp", "--shared-parameters"]
    refused = warm_processes.run(words, _env(), os.getcwd(), 60)
    assert refused.returncode != 0 and "--shared-parameters is an option of OSS" in refused.stderr
    for words, env, needle in (
        (["--strategy", "oss", "--shared-parameters", "--device", "cuda"], {}, "cannot act on GPUs"),
        (["--strategy", "sharded", "--shared-parameters"], {"DDPKIT_SHARED_MEMORY": "0"}, "DDPKIT_SHARED_MEMORY=0"),
    ):
        with pytest.raises(ValueError, match=needle):
            with pytest.MonkeyPatch.context() as patch:
                for name, value in env.items():
                    patch.setenv(name, value)
                pooled_train.train_config(["train", *words])


def _refusals(rank: int, world_size: int) -> dict[str, str]:
    """What OSS(shared_parameters=True) says where it cannot act: with broadcast_fp16 and with
    DDPKIT_SHARED_MEMORY=0 at construction, before any collective; with the ranks on two (fake) hosts of
    world_size / 2 ranks at the first step, on every rank alike."""
    import os

    from ddpkit.distributed import shared_memory

    said = {}
    model = _model()
    for name, kwargs, env in (("fp16", {"broadcast_fp16": True}, "1"), ("no-shm", {}, "0")):
        os.environ["DDPKIT_SHARED_MEMORY"] = env
        try:
            OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, shared_parameters=True, **kwargs)
        except ValueError as exc:
            said[name] = str(exc)
        finally:
            del os.environ["DDPKIT_SHARED_MEMORY"]
    identity = shared_memory.host_identity
    shared_memory.host_identity = lambda: f"test-host-{2 * rank // world_size}"  # type: ignore[assignment]
    try:
        optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, shared_parameters=True)
        model(torch.ones(1, 32)).sum().backward()
        optimizer.step()
    except ValueError as exc:
        said["hosts"] = str(exc)
    finally:
        shared_memory.host_identity = identity  # (the pooled rank serves later tests)
    return said


@pytest.mark.parametrize("world_size", [2, 4])
def test_shared_parameters_is_refused_by_name_where_it_cannot_act(world_size):
    """Never silently nothing: broadcast_fp16, DDPKIT_SHARED_MEMORY=0 and ranks on several hosts are refused,
    naming the option and what to do (at 2 ranks the fake hosts hold one rank each: no shared memory between
    them; at 4, two hosts of two: hierarchical, where sharing cannot act)."""
    for said in run_distributed(_refusals, world_size):
        assert "shared_parameters cannot act with broadcast_fp16" in said["fp16"], said
        assert "DDPKIT_SHARED_MEMORY=0 turns off" in said["no-shm"], said
        hosts = "are on several hosts" if world_size == 4 else "every rank on one host"
        assert "shared_parameters" in said["hosts"] and hosts in said["hosts"], said
