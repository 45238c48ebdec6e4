"""ddpkit's Lightning strategies against Lightning's own ``strategy="ddp"``.

One torchrun job per world size trains the same LightningModule under every strategy and setting
(tests/lightning_runs.py); the reference is torch's DDP with the same optimizer, run by Lightning itself. The
sharded strategies must give its losses and parameters to 1e-6 on every rank (Adam and SGD, two optimizers, manual
optimization, bf16, fp16 with overflow skips, clipping by norm, accumulation, a step-wise scheduler), with the
optimizer state split over the ranks, one gradient reduction per optimizer step when accumulating, and
``validate``/``test``/``predict`` after ``fit`` evaluating the unwrapped module. SlowMo averaging every step with
plain SGD and no slow momentum must equal DDP too (the average of the local SGD steps is DDP's step).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.distributed.launch import free_port

pytest.importorskip("lightning", reason='the Lightning integration needs the extra: pip install -e ".[lightning]"')

pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent
ALL = ["adam", "sgd", "adam-clip-accum-sched", "sgd-clip-sched", "two-optimizers", "manual", "adam-bf16"]
ALL += ["sgd-fp16-skips-clip"]
RUNS = {"ddp": [*ALL, "sgd-plain"], "ddpkit_sharded": ALL}
RUNS |= {"ddpkit_oss": ["adam", "sgd-clip-sched", "sgd-fp16-skips-clip"], "ddpkit_slowmo-every-step": ["sgd-plain"]}
FABRIC = ["adam", "adam-clip-accum-sched", "sgd-clip-sched", "sgd-fp16-skips-clip"]  # the same, as a Fabric loop
RUNS |= {f"fabric/{strategy}": FABRIC for strategy in ("ddp", "ddpkit_sharded")}
RUNS |= {"fabric/ddpkit_oss": ["adam-clip-accum-sched"]}
# oss_kwargs={"min_split_numel": 1}: the optimizer state 1/N per rank (within 10%) on this small model too
RUNS |= {"ddpkit_sharded-split": ["adam", "adam-clip-accum-sched"], "fabric/ddpkit_sharded-split": ["adam"]}
# checkpoints, in this order: the uninterrupted reference, ddpkit_sharded's first epoch saved, then its second
# epoch resumed from that checkpoint by ddpkit_sharded and by Lightning's own ddp
CHECKPOINTS = ["ddp:adam-2epochs", "ddpkit_sharded:adam-save-after-1", "ddpkit_sharded:adam-resume", "ddp:adam-resume"]
# and SlowMo's own state (slow momentum) carried by the checkpoint: resumed equals uninterrupted
CHECKPOINTS += [f"ddpkit_slowmo-momentum:sgd-plain-{step}" for step in ("2epochs", "save-after-1", "resume")]


def _run(args: list, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess:
    """`args` run with tests/ and the repository on the path, in a session of their own (a launcher's workers
    included) that is killed whole after 280 s; fails the test with its output if it fails or times out."""
    path = os.pathsep.join([str(HERE), str(HERE.parent), os.environ.get("PYTHONPATH", "")])
    environment = {**os.environ, "PYTHONPATH": path, **env}
    process = subprocess.Popen(
        [str(a) for a in args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=cwd,
        env=environment,
        start_new_session=True,
    )
    try:
        stdout, stderr = process.communicate(timeout=280)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        stderr += "\n(killed after 280 s, with every process it started)"
    result = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


def _torchrun(
    world: int, script: Path, *args: object, cwd: Path | None = None, **env: str
) -> subprocess.CompletedProcess:
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", world, "--master-port", free_port()]
    return _run([*launch, script, *args], cwd, **env)


def _train(out: Path, world: int, names: list[str], resume: Path | None = None) -> None:
    env = {"LIGHTNING_RESUME": str(resume)} if resume is not None else {}
    _torchrun(world, HERE / "lightning_runs.py", out, ",".join(names), **env)


_saved_by_two_processes: dict[str, Path] = {}  # checkpoint name -> the file the 2-process runs saved


@pytest.fixture(scope="module", params=[2, 4], ids=["2procs", "4procs"])
def runs(request, tmp_path_factory):
    """Every run's records at this world size. At 4 processes the resumed runs start from a checkpoint that a
    2-process job wrote (resuming at another device count): the 2-process runs' own, when they ran first."""
    world, out = request.param, tmp_path_factory.mktemp(f"lightning{request.param}")
    names = [f"{strategy}:{setting}" for strategy, settings in RUNS.items() for setting in settings] + CHECKPOINTS
    resume = None
    if world != 2:
        resume = _saved_by_two_processes.get("ddpkit_sharded")
        if resume is None:
            (out / "two").mkdir()
            _train(out / "two", 2, ["ddpkit_sharded:adam-save-after-1"])
            resume = out / "two" / "ddpkit_sharded.ckpt"
    _train(out, world, names, resume)
    if world == 2:  # (written by its ddpkit_sharded:adam-save-after-1 run, read by its resumed runs only)
        _saved_by_two_processes["ddpkit_sharded"] = out / "ddpkit_sharded.ckpt"
    return {
        name: [json.loads((out / f"{name.replace('/', '-')}.rank{r}.json").read_text()) for r in range(world)]
        for name in names
    }


def _close(a: list[float], b: list[float], tol: float = 1e-6) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("strategy", ["ddpkit_sharded", "ddpkit_oss", "ddpkit_sharded-split"])
def test_sharded_strategies_train_as_lightnings_ddp(runs, strategy):
    for setting in RUNS[strategy]:
        references, ranks = runs[f"ddp:{setting}"], runs[f"{strategy}:{setting}"]
        for rank, (reference, got) in enumerate(zip(references, ranks, strict=True)):  # each rank its own batches
            where = (strategy, setting, rank)
            assert _close(got["losses"], reference["losses"]) < 1e-6, where
            assert _close(got["params"], reference["params"]) < 1e-6, where
            assert got["lrs"] == reference["lrs"], where  # the scheduler drives the OSS
            assert got["val_loss"] == pytest.approx(reference["val_loss"], abs=1e-6), where
            assert got["test_accuracy"] == reference["test_accuracy"] > 0.3, where
            assert got["predicted"] == reference["predicted"] == 512 // len(ranks), where  # its share, unwrapped
            assert set(got["optimizers"]) == {"OSS"}, where
        # the optimizer state is split: together the ranks hold DDP's one copy, each a part of it
        held = [r["state_bytes"] for r in ranks]
        full = references[0]["state_bytes"]
        assert sum(held) == full and max(held) < full, (setting, held)
        if strategy.endswith("-split"):  # the goal: 1/N of DDP's state per rank (within OSS's 10% balance)
            assert max(held) <= 1.1 * full / len(ranks), (setting, held, full)


@pytest.mark.parametrize("strategy", ["ddpkit_sharded", "ddpkit_oss", "ddpkit_sharded-split"])
def test_fabric_strategies_train_as_fabrics_ddp(runs, strategy):
    for setting in RUNS[f"fabric/{strategy}"]:
        references, ranks = runs[f"fabric/ddp:{setting}"], runs[f"fabric/{strategy}:{setting}"]
        for rank, (reference, got) in enumerate(zip(references, ranks, strict=True)):
            where = (strategy, setting, rank)
            assert _close(got["losses"], reference["losses"]) < 1e-6, where
            assert _close(got["params"], reference["params"]) < 1e-6, where
            assert got["lrs"] == reference["lrs"] and got["scale"] == reference["scale"], where
            assert got["optimizers"] == ["OSS"], where
        held = [r["state_bytes"] for r in ranks]
        assert sum(held) == references[0]["state_bytes"] and max(held) < references[0]["state_bytes"], held
        if strategy.endswith("-split"):
            assert max(held) <= 1.1 * references[0]["state_bytes"] / len(ranks), held
    if strategy == "ddpkit_sharded":
        scale = runs["fabric/ddpkit_sharded:sgd-fp16-skips-clip"][0]["scale"]
        assert 2.0**12 < scale < 2.0**24, scale  # overflows were skipped, on every rank alike
        plain, accumulated = runs["fabric/ddpkit_sharded:adam"], runs["fabric/ddpkit_sharded:adam-clip-accum-sched"]
        for one, two in zip(plain, accumulated, strict=True):
            assert two["payload_bytes"] < 1.05 * one["payload_bytes"]  # no_backward_sync: one reduction per step


def test_the_scheduler_moved_the_learning_rate(runs):
    lrs = runs["ddpkit_sharded:sgd-clip-sched"][0]["lrs"]
    assert lrs[0] == 0.1 and lrs[-1] == pytest.approx(0.1 * 0.5**4)  # StepLR(step_size=3, gamma=0.5) by step


def test_fp16_overflows_are_skipped_on_every_rank_alike(runs):
    for strategy in ("ddp", "ddpkit_sharded", "ddpkit_oss"):
        scale = runs[f"{strategy}:sgd-fp16-skips-clip"][0]["scale"]
        assert 2.0**12 < scale < 2.0**24, (strategy, scale)  # some steps overflowed and were skipped, not all
    assert runs["ddpkit_sharded:sgd-fp16-skips-clip"][1]["scale"] == runs["ddp:sgd-fp16-skips-clip"][0]["scale"]


def test_accumulation_reduces_the_gradients_once_per_optimizer_step(runs):
    """12 optimizer steps with and without accumulate_grad_batches=2: the same gradient traffic (no_sync on the
    first micro-batch; the clipping adds one small all-reduce per step)."""
    plain, accumulated = runs["ddpkit_sharded:adam"], runs["ddpkit_sharded:adam-clip-accum-sched"]
    for rank, (one, two) in enumerate(zip(plain, accumulated, strict=True)):
        assert two["payload_bytes"] < 1.05 * one["payload_bytes"], rank


def test_a_sharded_checkpoint_resumes_under_ddpkit_and_under_lightnings_ddp(runs):
    """At 2 processes the resumed second epoch equals the uninterrupted run; at 4 (from a 2-process checkpoint)
    ddpkit_sharded and Lightning's ddp, both resumed from it, agree."""
    world = len(runs["ddp:adam-resume"])
    for rank in range(world):
        sharded, ddp = runs["ddpkit_sharded:adam-resume"][rank], runs["ddp:adam-resume"][rank]
        assert _close(sharded["losses"], ddp["losses"]) < 1e-6 and _close(sharded["params"], ddp["params"]) < 1e-6
        if world == 2:
            whole = runs["ddp:adam-2epochs"][rank]
            assert len(sharded["losses"]) == len(whole["losses"]) // 2  # the second epoch only
            assert _close(sharded["losses"], whole["losses"][len(sharded["losses"]) :]) < 1e-6, rank
            assert _close(sharded["params"], whole["params"]) < 1e-6, rank


def test_slowmo_resumes_with_its_slow_momentum_from_the_checkpoint(runs):
    """Without its state (slow momentum, the synced copy) in the checkpoint the resumed run differs by 0.035."""
    whole, resumed = runs["ddpkit_slowmo-momentum:sgd-plain-2epochs"], runs["ddpkit_slowmo-momentum:sgd-plain-resume"]
    for rank, (a, b) in enumerate(zip(whole, resumed, strict=True)):
        assert _close(b["losses"], a["losses"][len(b["losses"]) :]) < 1e-6, rank
        assert _close(b["params"], a["params"]) < 1e-6, rank


def test_slowmo_averaging_every_step_without_slow_momentum_is_ddp(runs):
    reference = runs["ddp:sgd-plain"][0]
    for rank, got in enumerate(runs["ddpkit_slowmo-every-step:sgd-plain"]):
        assert _close(got["params"], reference["params"]) < 1e-6, rank
        assert got["sent_bytes"] > 0  # it averaged, through ddpkit


@pytest.mark.parametrize("extra", [[], ["--min-split-numel", "1"]], ids=["whole-tensors", "split"])
def test_the_lightning_example_trains_and_splits_the_optimizer_state(tmp_path, extra):
    example = HERE.parent / "examples" / "lightning_digits.py"
    result = _run([sys.executable, example, "--epochs", "2", *extra], tmp_path)
    accuracy = float(result.stdout.split("held-out accuracy ")[1].split()[0])
    held = json.loads(result.stdout.split("optimizer state per rank (bytes): ")[1].splitlines()[0])
    assert accuracy > 0.9 and len(held) == 2 and min(held) < max(held), result.stdout
    if extra:  # every tensor may be cut: each rank within 10% of half (the step counters: a few bytes more)
        assert max(held) <= 1.1 * sum(held) / 2, held


def test_the_readme_snippet_trains(tmp_path):
    from test_readme import snippet

    prelude = "from lightning_runs import SETTINGS, Net, _data\nfrom torch.utils.data import DataLoader\n"
    prelude += "model = Net(SETTINGS['adam'])\ntrain_loader = DataLoader(_data(), batch_size=16)\n"
    script = tmp_path / "snippet.py"
    script.write_text(
        prelude
        + snippet('L.Trainer(strategy="ddpkit_sharded", accelerator="cpu"')
        + "\nassert trainer.global_step == 8\n"
    )
    _torchrun(2, script, cwd=tmp_path)  # (Lightning's default logger writes lightning_logs/ there)


@pytest.mark.parametrize(
    "name, kwargs, needle",
    [
        (
            "DDPKitShardedStrategy",
            {"reduce_bufer_size": 1024},
            "'reduce_bufer_size' (did you mean 'reduce_buffer_size'?)",
        ),
        ("DDPKitShardedStrategy", {"bucket_cap_mb": 1}, "unexpected keyword argument 'bucket_cap_mb'"),
        ("DDPKitFabricShardedStrategy", {"bucket_cap_mb": 1}, "unexpected keyword argument 'bucket_cap_mb'"),
        ("DDPKitSlowMoStrategy", {"slowmo_momentum": 0.5}, "unexpected keyword argument 'slowmo_momentum'"),
        ("DDPKitFabricSlowMoStrategy", {"nprocs_per_node": 1}, "unexpected keyword argument 'nprocs_per_node'"),
    ],
)
def test_options_the_strategy_would_drop_are_refused(name, kwargs, needle):
    """The sharded and SlowMo strategies never build torch DDP, so what DDPStrategy would pass to it is refused
    (a misspelt option fitted with exit 0 and no warning)."""
    import ddpkit.integrations.lightning as integration

    with pytest.raises(TypeError, match=re.escape(needle)):
        getattr(integration, name)(**kwargs)
    assert integration.DDPKitShardedStrategy(reduce_buffer_size=1024)._sdp_kwargs == {"reduce_buffer_size": 1024}
    assert integration.DDPKitOSSStrategy(bucket_cap_mb=1)._ddp_kwargs == {"bucket_cap_mb": 1}  # torch DDP takes it


@pytest.mark.parametrize(
    "name",
    [
        "DDPKitShardedStrategy",
        "DDPKitOSSStrategy",
        "DDPKitSlowMoStrategy",
        "DDPKitFabricShardedStrategy",
        "DDPKitFabricOSSStrategy",
        "DDPKitFabricSlowMoStrategy",
    ],
)
def test_every_strategy_with_its_precision_plugin_survives_pickling(name):
    """Lightning's spawn launcher pickles the strategy to each process: the plug-in ddpkit adjusts (global-norm
    clipping bound onto it) must come back working (it died with 'Precision' object has no attribute
    '_clip_by_global_norm')."""
    import pickle

    import torch
    from lightning.fabric.plugins.precision import Precision as FabricPrecision
    from lightning.pytorch.plugins.precision import Precision

    import ddpkit.integrations.lightning as integration

    strategy = getattr(integration, name)()
    fabric = "Fabric" in name
    if fabric:
        strategy.precision = FabricPrecision()
    else:
        strategy.precision_plugin = Precision()
    clone = pickle.loads(pickle.dumps(strategy))
    if fabric:
        return
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().mul(100).backward()
    clone.precision_plugin.clip_grad_by_norm(optimizer, 1.0)
    assert float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)) == pytest.approx(1.0, rel=1e-5)


def test_the_sharded_strategy_trains_under_lightnings_spawn_launcher(tmp_path):
    """``strategy="ddpkit_sharded_spawn"`` (``DDPKitShardedStrategy(start_method="spawn")``: Lightning's spawn
    launcher, what notebooks use): two processes train with clipping by norm and return, with the optimizer state
    split over them."""
    script = tmp_path / "spawned.py"
    script.write_text(
        "import json\n"
        "import lightning as L\n"
        "from lightning_runs import SETTINGS, Net, _data\n"
        "from torch.utils.data import DataLoader\n"
        "import ddpkit.integrations.lightning  # registers the names\n"
        "class Report(L.Callback):\n"
        "    def on_train_end(self, trainer, module):\n"
        "        state = trainer.optimizers[0].optim.state  # this process's shard of Adam's state\n"
        "        with open(f'rank{trainer.global_rank}.json', 'w') as f:\n"
        "            json.dump({'step': trainer.global_step, 'states': len(state)}, f)\n"
        "if __name__ == '__main__':\n"
        "    trainer = L.Trainer(accelerator='cpu', devices=2, strategy='ddpkit_sharded_spawn',\n"
        "                        max_steps=4, gradient_clip_val=1.0, logger=False, enable_checkpointing=False,\n"
        "                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Report()])\n"
        "    trainer.fit(Net(SETTINGS['adam']), DataLoader(_data(), batch_size=16))\n"
    )
    from lightning_runs import SETTINGS, Net

    _run([sys.executable, script], cwd=tmp_path)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["step"] for r in reports] == [4, 4], reports  # each process trained every step
    parameters = len(list(Net(SETTINGS["adam"]).parameters()))
    assert all(r["states"] > 0 for r in reports) and sum(r["states"] for r in reports) == parameters, reports


def test_fairscales_variant_names_have_ddpkit_counterparts():
    """Lightning registered ``ddp_sharded_spawn`` and ``ddp_sharded_find_unused_parameters_false`` for fairscale;
    ddpkit registers the same variants of its strategies."""
    from lightning.pytorch.strategies import StrategyRegistry

    import ddpkit.integrations.lightning as integration

    for name in ("ddpkit_sharded", "ddpkit_oss"):
        for suffix, spawn, unused in [
            ("_spawn", True, None),
            ("_find_unused_parameters_false", False, False),
            ("_spawn_find_unused_parameters_false", True, False),
        ]:
            strategy = StrategyRegistry.get(name + suffix)
            assert type(strategy).strategy_name == name
            assert (strategy._start_method == "spawn") == spawn, (name, suffix)
            kwargs = strategy._sdp_kwargs if name == "ddpkit_sharded" else strategy._ddp_kwargs
            assert kwargs.get("find_unused_parameters") == unused, (name, suffix, kwargs)
    assert isinstance(StrategyRegistry.get("ddpkit_slowmo_spawn"), integration.DDPKitSlowMoStrategy)
