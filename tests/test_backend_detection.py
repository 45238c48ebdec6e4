"""The backend is read from the process group itself, per device type: a job started with
``init_process_group()`` and no backend name runs gloo for CPU tensors, although ``get_backend`` reports
"undefined"; ddpkit used to take that for "not gloo" and silently turn off its shared-memory and early-receive
paths."""

import os

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.distributed import comm
from ddpkit.distributed.env import backend_name
from ddpkit.nn import ShardedDataParallel
from ddpkit.optim import OSS
from ddpkit.testing import run_distributed


def _without_backend_name(rank: int, world: int, store: str) -> dict:
    dist.init_process_group(init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = nn.Linear(8, 4)
        opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        sdp = ShardedDataParallel(model, opt)
        sdp(torch.randn(2, 8)).sum().backward()
        opt.step()
        return {
            "reported": str(dist.get_backend()),
            "cpu": backend_name(None, "cpu"),
            "cuda": backend_name(None, "cuda"),
            "mailboxes": sdp._mailboxes is not None,
            "shared_broadcast": any(m.shared for m in opt._broadcaster.messages),
            "posts_receives": comm.can_post_reduce(torch.device("cpu"), None),
        }
    finally:
        dist.destroy_process_group()


def test_a_job_without_a_backend_name_keeps_the_gloo_paths(tmp_path):
    store = os.path.join(tmp_path, "store")
    for r in run_distributed(_without_backend_name, 2, store, init=False, timeout=120.0):
        assert r["reported"] == "undefined", r  # what torch says: the reason for reading the group itself
        assert r["cpu"] == "gloo" and r["cuda"] == "", r
        assert r["mailboxes"] and r["shared_broadcast"] and r["posts_receives"], r


def test_control_tensors_of_an_nccl_group_go_to_the_device_of_the_data(monkeypatch):
    """With NCCL alone, norms and flags live where the data is: a rank whose model is on cuda:1 and that never
    called set_device used to put them on the current device, cuda:0, the device of another rank (defect 5)."""
    from ddpkit.distributed import env

    monkeypatch.setattr(
        env, "backend_name", lambda group=None, device_type="cpu": "nccl" if device_type == "cuda" else ""
    )
    assert env.comm_device(None, torch.device("cuda", 1)) == torch.device("cuda", 1)
    monkeypatch.setattr(env, "backend_name", lambda group=None, device_type="cpu": "gloo")
    assert env.comm_device(None, torch.device("cuda", 1)) == torch.device("cpu")  # gloo takes CPU tensors
