"""The Example of each main class's docstring runs as written on 2 pooled ranks, with the names it leaves to the
reader (`model`, `x`, `y`, `loss_fn`, a loader...) filled in and the few changes `CHANGES` lists; each trains its
model (the parameters move) and, where the class keeps replicas equal after a step, leaves them equal."""

from __future__ import annotations

import inspect
import textwrap
from typing import Any

import pytest
import torch
from torch import nn

from ddpkit.testing import run_distributed

MAIN_CLASSES = {  # class -> whether its example's replicas are equal when it ends
    "ddpkit.optim.OSS": True,
    "ddpkit.optim.AdaScale": True,
    "ddpkit.optim.ShardedGradScaler": True,
    "ddpkit.nn.ShardedDataParallel": True,
    "ddpkit.nn.SlowMoDistributedDataParallel": False,  # one local step: averaged only every localsgd_frequency
    "ddpkit.fault_tolerance.Manager": True,
    "ddpkit.train.Trainer": True,
}

CHANGES = (  # (in the example, what runs instead): the machine's layout and device
    ("nprocs_per_node=8", "nprocs_per_node=1"),  # 2 ranks here, one per node
    ("max_world=3", "max_world=2"),  # 2 ranks here
    ('torch.autocast("cuda", dtype=torch.float16)', 'torch.autocast("cpu", dtype=torch.bfloat16)'),  # no GPU
)


def resolve(dotted: str) -> Any:
    module, name = dotted.rsplit(".", 1)
    return getattr(__import__(module, fromlist=[name]), name)


def example(dotted: str) -> str:
    """The code of the docstring's Example section (its ``::`` block), dedented, with `CHANGES` applied."""
    lines = (inspect.getdoc(resolve(dotted)) or "").splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith("Example")), None)
    assert start is not None, f"{dotted}: no Example section"
    opener = next(i for i in range(start, len(lines)) if lines[i].rstrip().endswith("::"))
    depth = len(lines[opener]) - len(lines[opener].lstrip())
    block = []
    for line in lines[opener + 1 :]:
        if line.strip() and len(line) - len(line.lstrip()) <= depth:
            break
        block.append(line)
    code = textwrap.dedent("\n".join(block)).strip()
    for old, new in CHANGES:
        code = code.replace(old, new)
    return code


def namespace(rank: int, store_port: int) -> dict[str, Any]:
    """The names the examples leave to the reader, for this rank."""
    import ddpkit.fault_tolerance
    import ddpkit.nn
    import ddpkit.optim
    import ddpkit.train

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    generator = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 8, generator=generator), torch.randint(0, 4, (16,), generator=generator)
    dataset = torch.utils.data.TensorDataset(x, y)
    names = {
        name: getattr(module, name)
        for module in (ddpkit.optim, ddpkit.nn, ddpkit.fault_tolerance, ddpkit.train)
        for name in getattr(module, "__all__", dir(module))
        if not name.startswith("_")
    }
    names.update(
        torch=torch,
        nn=nn,
        model=model,
        x=x,
        y=y,
        loss_fn=nn.functional.cross_entropy,
        lr=0.1,
        T=3,
        rank=rank,
        DDP=torch.nn.parallel.DistributedDataParallel,
        data=[(x, y)] * 2,
        host="127.0.0.1",
        port=store_port,
        loader=torch.utils.data.DataLoader(dataset, batch_size=8),
        test_loader=torch.utils.data.DataLoader(dataset),
        MyCallback=ddpkit.train.Callback,
    )
    names["optimizer"] = ddpkit.optim.OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)  # (Trainer's)
    if store_port:  # Manager's: a replica holds a whole torch optimizer (live state a joiner can load)
        names["optimizer"] = torch.optim.SGD(model.parameters(), lr=0.1)
    return names


def _run_example(rank: int, world_size: int, code: str, store_port: int) -> dict[str, torch.Tensor]:
    names = namespace(rank, store_port)
    model = names["model"]
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    try:
        exec(compile(code, "<example>", "exec"), names)
    finally:
        if "manager" in names:  # its heartbeat thread must not outlive the test on the pooled rank
            names["manager"].close()
    after = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    return {"before": before, "after": after}


@pytest.mark.parametrize("dotted", list(MAIN_CLASSES))
def test_the_main_classes_examples_run(dotted):
    store = None
    if dotted.endswith("Manager"):  # the job's store, as `ddpkit store` would hold it
        store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    code = example(dotted)
    results = run_distributed(_run_example, 2, code, store.port if store else 0)
    for r in results:
        assert not torch.equal(r["before"], r["after"]), f"{dotted}: the example did not train its model"
    if MAIN_CLASSES[dotted]:
        assert torch.equal(results[0]["after"], results[1]["after"]), f"{dotted}: the replicas differ"
