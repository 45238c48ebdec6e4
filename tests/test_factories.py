"""Your own model and data: `--model/--data PACKAGE.MODULE:FACTORY`, `--loss`, `--max-steps`, and bad specs failing
before any process starts. The factories below are the ones the 2-process `ddpkit train` run imports (this folder
is put on its PYTHONPATH), so they are module-level functions."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import warm_processes
from torch import nn
from torch.nn import functional as F
from torch.utils.data import TensorDataset

from ddpkit import cli
from ddpkit.train.checkpoints import checkpoint_files
from ddpkit.train.loop import launcher as launcher_mod
from ddpkit.train.loop.trainer import count_correct
from ddpkit.train.workloads import factories
from ddpkit.train.workloads.factories import build_data, build_model, cross_entropy, load_factory, pick_loss

HERE = Path(__file__).resolve().parent
TEACHER = torch.tensor([[1.5], [-2.0], [0.5], [1.0]])

# ------------------------------------------------------------------------------------- factories under test


def regression_data() -> tuple[TensorDataset, TensorDataset]:
    """A linear teacher with float targets: 240 training and 60 held-out samples."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(300, 4, generator=g)
    y = x @ TEACHER
    return TensorDataset(x[:240], y[:240]), TensorDataset(x[240:], y[240:])


def regression_model() -> tuple[nn.Module, factories.LossFn]:
    """A linear model trained with mean absolute error (the factory's loss)."""
    return nn.Linear(4, 1), F.l1_loss


def plain_model() -> nn.Module:
    return nn.Linear(4, 1)


def three_classes_model() -> nn.Module:
    return nn.Linear(4, 3)


def returns_a_number() -> int:
    return 3


def frozen_model() -> nn.Module:
    return nn.Linear(2, 2).requires_grad_(False)


def three_datasets() -> tuple[TensorDataset, ...]:
    return regression_data() + regression_data()[:1]


def unpaired_items() -> tuple[list[int], list[int]]:
    return [1, 2, 3], [4]


def bad_loss_model() -> tuple[nn.Module, str]:
    return nn.Linear(4, 1), "l1"


def raising_model() -> nn.Module:
    raise KeyError("hidden_size")


def per_process_data() -> tuple[TensorDataset, TensorDataset]:
    """Data drawn with the process id as the seed: every rank gets other samples of the same shapes (all but the
    first, which is the same everywhere)."""
    g = torch.Generator().manual_seed(os.getpid())
    x = torch.randn(64, 4, generator=g)
    x[0] = 1.0
    return TensorDataset(x[:48], x[:48] @ TEACHER), TensorDataset(x[48:], x[48:] @ TEACHER)


NOT_CALLABLE = 3
SPEC = "test_factories:"

# --------------------------------------------------------------------------------------- in-process checks


@pytest.fixture
def on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))


@pytest.mark.parametrize(
    ("spec", "error", "needle"),
    [
        ("no_such_module_xyz:f", ValueError, "cannot import module 'no_such_module_xyz'"),
        ("test_factories:missing", ValueError, "has no attribute 'missing'"),
        ("test_factories:NOT_CALLABLE", TypeError, "is a int, not a callable factory"),
        ("test_factories", ValueError, "expected PACKAGE.MODULE:FACTORY"),
        ("test_factories:returns_a_number", TypeError, "must return an nn.Module or (nn.Module, loss_fn); got int"),
        ("test_factories:frozen_model", ValueError, "no trainable parameters"),
        ("test_factories:bad_loss_model", TypeError, "second value must be a loss function"),
        # a factory's own failure names the flag, the factory and the exception
        ("test_factories:raising_model", RuntimeError, "'test_factories:raising_model': the factory raised KeyError"),
    ],
)
def test_bad_model_specs(on_path, spec, error, needle):
    with pytest.raises(error, match="--model") as info:
        build_model(spec)
    assert needle in str(info.value)


def test_bad_data_specs(on_path):
    with pytest.raises(TypeError, match=r"--data .*must return \(train, held_out\).*got tuple"):
        build_data(SPEC + "three_datasets")
    with pytest.raises(TypeError, match=r"--data .*must return .*got int"):
        build_data(SPEC + "returns_a_number")
    with pytest.raises(TypeError, match=r"items must be \(input, target\) pairs; got int"):
        build_data(SPEC + "unpaired_items")
    train, held = build_data(SPEC + "regression_data")
    assert len(train) == 240 and len(held) == 60


def test_factory_and_loss_resolution(on_path):
    module, loss = build_model(SPEC + "regression_model")
    assert isinstance(module, nn.Linear) and loss is F.l1_loss
    assert build_model(SPEC + "plain_model")[1] is None
    assert load_factory("ddpkit.train.workloads.gpt:gpt", "--model") is not None  # dotted packages work
    assert pick_loss(None, F.l1_loss) is F.l1_loss  # the factory's loss
    assert pick_loss("mse", F.l1_loss) is factories.mse  # the flag wins
    assert pick_loss(None, None) is cross_entropy  # the default


def test_cross_entropy_takes_classes_last_for_sequences():
    logits, target = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    expected = F.cross_entropy(logits.permute(0, 2, 1), target)  # torch's layout: classes on dimension 1
    torch.testing.assert_close(cross_entropy(logits, target), expected)
    torch.testing.assert_close(cross_entropy(logits[:, 0], target[:, 0]), F.cross_entropy(logits[:, 0], target[:, 0]))
    assert count_correct(logits, logits.argmax(-1)) == (10, 10)
    assert count_correct(logits[:, 0], target[:, 0])[1] == 2
    assert count_correct(torch.randn(3, 1), torch.randn(3, 1)) == (0, 0)  # regression: no accuracy


@pytest.fixture
def no_process(monkeypatch):
    """`ddpkit train` fails the test if it gets as far as launching anything."""
    monkeypatch.setattr(launcher_mod, "launch_training", lambda cfg, *_: pytest.fail("a launch was attempted"))


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--model", "no_such_module_xyz:f"], "--model 'no_such_module_xyz:f': cannot import"),
        (["--model", SPEC + "returns_a_number", "--data", SPEC + "regression_data"], "must return an nn.Module"),
        (["--data", SPEC + "unpaired_items", "--model", SPEC + "plain_model"], "items must be (input, target)"),
        (["--model", "mlp", "--data", SPEC + "regression_data"], "--model mlp classifies"),
        (["--model", "gpt", "--data", "digits"], "--model gpt reads byte sequences"),
        (["--model", "gpt", "--data", "text", "--loss", "mse"], "--loss mse needs float targets"),
        (["--model", "gpt", "--data", "text", "--gpt-width", "30", "--gpt-heads", "4"], "divisible by --gpt-heads"),
        (["--model", "gpt", "--data", "text", "--context", "0"], "--context must be an integer >= 1"),
        (["--max-steps", "0"], "--max-steps must be an integer >= 1"),
        (  # a 4-input model on 8x8 images: refused here, it was a shape error on every rank after spawning
            ["--model", SPEC + "plain_model", "--data", "digits"],
            "--model test_factories:plain_model does not fit --data digits: the model's forward failed on two "
            "training items (inputs [2, 1, 8, 8] float32, targets [2] int64): RuntimeError",
        ),
        (  # the forward works, the loss cannot compare 3 class scores with one float target
            ["--model", SPEC + "three_classes_model", "--data", SPEC + "regression_data"],
            "does not fit --data test_factories:regression_data: the loss failed on two training items (inputs "
            "[2, 4] float32, targets [2, 1] float32, model output [2, 3] float32)",
        ),
    ],
)
def test_bad_workloads_fail_before_any_process(on_path, no_process, capsys, argv, needle):
    with pytest.raises(SystemExit) as info:
        cli.main(["train", *argv])
    assert info.value.code == 1
    assert needle in capsys.readouterr().err


def test_unknown_names_are_usage_errors(no_process, capsys):
    for flag in ("--model", "--data"):
        with pytest.raises(SystemExit) as info:
            cli.main(["train", flag, "imagenet"])
        assert info.value.code == 2 and "invalid choice 'imagenet'" in capsys.readouterr().err


def test_toml_names_factories(on_path, tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(f'model = "{SPEC}regression_model"\ndata = "{SPEC}regression_data"\nmax-steps = 7\n')
    cfg = cli.make_config(cli.build_parser().parse_args(["train", "--config", str(path), "--loss", "mse"]))
    assert (cfg.model, cfg.data, cfg.max_steps, cfg.loss) == (
        SPEC + "regression_model",
        SPEC + "regression_data",
        7,
        "mse",
    )


# ------------------------------------------------------------------------------------- 2 processes, real CLI


@pytest.mark.slow
def test_train_from_factories_at_two_processes(tmp_path):
    """`ddpkit train` imports this module's factories in the launcher and in both workers, trains with the
    factory's L1 loss for exactly --max-steps steps (fewer than one epoch) and reports that loss."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    argv = ["--model", SPEC + "regression_model", "--data", SPEC + "regression_data", "--strategy", "ddp"]
    argv += ["--optimizer", "sgd", "--lr", "0.05", "--batch-size", "8", "--max-steps", "12", "--no-progress"]
    argv += ["--nproc-per-node", "2", "--out", str(tmp_path), "--timeout", "60"]
    done = warm_processes.run([sys.executable, "-m", "ddpkit", "train", *argv], env, os.getcwd(), 240)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads((tmp_path / "metrics.json").read_text())["summary"]
    assert summary["steps"] == 12 and summary["replicas_equal"] and summary["world_size"] == 2
    assert summary["workload"] == f"{SPEC}regression_model on {SPEC}regression_data"
    # the reported held-out loss is the factory's L1 loss of the trained model
    module = nn.Linear(4, 1)
    folder = checkpoint_files.latest(str(tmp_path))  # the last committed checkpoint: step 12
    assert folder is not None and folder.endswith(checkpoint_files.folder_name(12))
    module.load_state_dict(torch.load(os.path.join(folder, checkpoint_files.SHARED), weights_only=False)["model"])
    x, y = regression_data()[1].tensors
    with torch.no_grad():
        l1, initial = F.l1_loss(module(x), y).item(), F.l1_loss(torch.zeros_like(y), y).item()
    assert summary["test_loss"] == pytest.approx(l1, rel=1e-5)
    assert l1 < 0.5 * initial  # it learned something in 12 steps
    assert summary["test_accuracy"] is None  # null: float targets have no accuracy


def test_max_steps_stops_mid_epoch_and_ends_that_epoch():
    from torch.utils.data import DataLoader

    from ddpkit.train.loop.callbacks import MetricsRecorder
    from ddpkit.train.loop.trainer import Trainer

    train, held = regression_data()
    module = nn.Linear(4, 1)
    recorder = MetricsRecorder(DataLoader(held, batch_size=30))
    trainer = Trainer(
        module,
        torch.optim.SGD(module.parameters(), lr=0.05),
        DataLoader(train, batch_size=60),
        F.l1_loss,
        callbacks=[recorder],
    )
    trainer.fit(epochs=3, max_steps=6)  # 4 steps per epoch: epoch 0 whole, epoch 1 cut after 2 steps
    assert trainer.state.step == 6 and trainer.state.epoch == 1 and len(recorder.steps) == 6
    assert trainer.state.epoch_samples == 120  # epoch 1 keeps its place: a resumed run trains its other half
    assert [(h["epoch"], h["steps"]) for h in trainer.state.history] == [(0, 4), (1, 6)]
    assert all(h["train_accuracy"] != h["train_accuracy"] for h in trainer.state.history)  # NaN: no classes
    trainer.fit(epochs=3, max_steps=6)  # already there: nothing more
    assert trainer.state.step == 6
    trainer.fit(epochs=3, max_steps=8)  # the rest of epoch 1, which replaces its cut-short entry
    assert (trainer.state.step, trainer.state.epoch, trainer.state.epoch_samples) == (8, 2, 0)
    assert [(h["epoch"], h["steps"]) for h in trainer.state.history] == [(0, 4), (1, 8)]


def test_a_data_factory_that_differs_between_ranks_is_refused(tmp_path):
    """Same sizes and shapes on every rank, other samples: the start-up check reads a digest of a sample of the
    items and stops every rank naming the data (it used to train on, "replicas equal")."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["PYTHONPATH"] = os.pathsep.join([str(HERE), str(HERE.parent), env.get("PYTHONPATH", "")])
    argv = ["--model", SPEC + "plain_model", "--data", SPEC + "per_process_data", "--loss", "mse"]
    argv += ["--max-steps", "2", "--no-progress", "--nproc-per-node", "2", "--timeout", "60"]
    done = warm_processes.run([sys.executable, "-m", "ddpkit", "train", *argv], env, os.getcwd(), 240)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "disagree" in done.stderr and "data" in done.stderr and "items " in done.stderr, done.stderr
