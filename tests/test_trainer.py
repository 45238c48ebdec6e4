"""In-process checks of `ddpkit train`'s pieces: the Trainer and its callbacks, the config (flags, TOML, the
checks that run before any process starts), the offline datasets, the replica digest and torchrun detection.

The multi-process runs of the command itself are in test_train_cli.py.
"""

from __future__ import annotations

import gzip
import json
import os
import struct
import time

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from ddpkit import cli
from ddpkit.distributed import launch, local_processes
from ddpkit.train import Callback, Trainer, TrainerState
from ddpkit.train.loop import launcher as launcher_mod
from ddpkit.train.loop import run as run_mod
from ddpkit.train.loop.report import format_summary, parameter_digest, write_metrics
from ddpkit.train.settings.config import TrainConfig
from ddpkit.train.workloads.data import MNIST_FILES, digits, digits_arrays, mnist, read_idx, synthetic

# --------------------------------------------------------------------------------------------------- helpers


def _dataset(n=24, features=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    return TensorDataset(x, (x[:, 0] > 0).long() + (x[:, 1] > 1).long())


def _model(features=6, classes=3, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 8), nn.ReLU(), nn.Linear(8, classes))


class Recorder(Callback):
    def __init__(self):
        self.events = []

    def on_train_start(self, trainer):
        self.events.append("train_start")

    def on_train_end(self, trainer):
        self.events.append("train_end")

    def on_epoch_start(self, trainer):
        self.events.append(f"epoch_start{trainer.state.epoch}")

    def on_epoch_end(self, trainer):
        self.events.append(f"epoch_end{trainer.state.epoch}")

    def after_backward(self, trainer):
        # gradients exist and the optimizer has not stepped yet
        assert all(p.grad is not None for p in trainer.model.parameters())
        self.events.append("backward")

    def after_step(self, trainer):
        assert all(p.grad is None for p in trainer.model.parameters())  # zero_grad(set_to_none=True)
        self.events.append(f"step{trainer.state.step}")


class EpochSampler(torch.utils.data.Sampler):
    def __init__(self, n):
        self.n = n
        self.epochs = []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self):
        return self.n


# --------------------------------------------------------------------------------------------------- Trainer


def test_callbacks_fire_in_order_and_sampler_epoch_is_set():
    data = _dataset(n=20)
    sampler = EpochSampler(len(data))
    loader = DataLoader(data, batch_size=8, sampler=sampler)  # 3 batches: 8, 8, 4
    model = _model()
    rec = Recorder()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), loader, grad_accum=2, callbacks=[rec])
    trainer.fit(2)
    per_epoch = lambda e, s: [f"epoch_start{e}", "backward", f"step{s + 1}", "backward", f"step{s + 2}"]  # noqa: E731
    assert rec.events == ["train_start", *per_epoch(0, 0), "epoch_end1", *per_epoch(1, 2), "epoch_end2", "train_end"]
    assert sampler.epochs == [0, 1]
    assert trainer.state.epoch == 2 and trainer.state.step == 4
    # the last group of an epoch is shorter (one batch of 4 samples)
    assert trainer.last is not None and trainer.last.samples == 4 and trainer.last.epoch == 1
    assert trainer.last.sent_bytes == 0  # nothing is communicated on one process


def test_grad_accum_equals_one_big_batch():
    data = _dataset(n=16)
    x, y = data.tensors
    accumulated, whole = _model(), _model()
    opt_a = torch.optim.SGD(accumulated.parameters(), lr=0.5)
    opt_w = torch.optim.SGD(whole.parameters(), lr=0.5)
    trainer = Trainer(accumulated, opt_a, DataLoader(data, batch_size=4), grad_accum=4)
    record = trainer.train_step([(x[i : i + 4], y[i : i + 4]) for i in range(0, 16, 4)])
    Trainer(whole, opt_w, DataLoader(data, batch_size=16)).train_step([(x, y)])
    for a, w in zip(accumulated.parameters(), whole.parameters(), strict=True):
        torch.testing.assert_close(a, w, rtol=1e-5, atol=1e-6)
    assert record.samples == 16
    with torch.no_grad():
        expected = float(nn.functional.cross_entropy(_model()(x), y))
    assert record.loss == pytest.approx(expected, rel=1e-5)


def test_an_epochs_short_accumulation_is_measured_by_adascale_without_a_warning():
    """24 samples in batches of 4 accumulated by 4: the epoch's second update has 2 batches. AdaScale is told so
    for that update (it warned and kept its estimates before) and set back to 4; the result is what a hand-written
    loop does with AdaScale's public set_num_gradients_to_accumulate."""
    import warnings

    from ddpkit.optim import AdaScale

    data = _dataset(n=24)
    x, y = data.tensors
    model, by_hand = _model(), _model()
    optimizer = AdaScale(torch.optim.SGD(model.parameters(), lr=0.1), num_gradients_to_accumulate=4)
    reference = AdaScale(torch.optim.SGD(by_hand.parameters(), lr=0.1), num_gradients_to_accumulate=4)
    trainer = Trainer(model, optimizer, DataLoader(data, batch_size=4), grad_accum=4)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # any warning fails the test
        trainer.fit(epochs=1)
    assert trainer.state.step == 2 and optimizer.num_gradients_to_accumulate == 4
    for start, count in ((0, 4), (16, 2)):
        reference.set_num_gradients_to_accumulate(count, update_smoothing=False)
        for i in range(start, start + 4 * count, 4):
            (nn.functional.cross_entropy(by_hand(x[i : i + 4]), y[i : i + 4]) / count).backward()
        reference.step()
        reference.zero_grad()
    assert optimizer.estimates() == pytest.approx(reference.estimates(), rel=1e-6)
    assert optimizer.scale_invariant_steps == pytest.approx(reference.scale_invariant_steps, rel=1e-6)
    for a, b in zip(model.parameters(), by_hand.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_fit_resumes_from_a_restored_state_exactly():
    data = _dataset(n=32)

    def make(model):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        return Trainer(model, optimizer, DataLoader(data, batch_size=8)), optimizer

    straight, _ = make(_model())
    straight.fit(3)
    first, first_opt = make(_model())
    first.fit(1)
    second, second_opt = make(_model())
    second.model.load_state_dict(first.model.state_dict())
    second_opt.load_state_dict(first_opt.state_dict())
    second.state = TrainerState(epoch=first.state.epoch, step=first.state.step)
    second.fit(3)
    assert second.state.step == straight.state.step == 12
    for a, b in zip(straight.model.parameters(), second.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_evaluate_restores_training_mode_and_counts_right():
    model = nn.Sequential(nn.Linear(2, 2, bias=False))
    with torch.no_grad():
        model[0].weight.copy_(torch.eye(2))
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    y = torch.tensor([0, 1, 1, 1])  # the identity gets 3 of 4
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(TensorDataset(x, y)))
    model.train()
    accuracy, loss = trainer.evaluate(DataLoader(TensorDataset(x, y), batch_size=3))
    assert accuracy == 0.75
    assert loss == pytest.approx(float(nn.functional.cross_entropy(x, y)))
    assert model.training


def test_bf16_autocast_step_runs_on_cpu():
    data = _dataset()
    model = _model()
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, batch_size=8))
    trainer.amp_dtype = torch.bfloat16
    record = trainer.train_step([data[:8]])
    assert np.isfinite(record.loss)


@pytest.mark.parametrize("bad", [0, -1, 1.5])
def test_trainer_rejects_bad_grad_accum(bad):
    model = _model()
    with pytest.raises(ValueError, match="grad_accum"):
        Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(_dataset()), grad_accum=bad)


# --------------------------------------------------------------------------------------------------- config


def _config(*argv):
    return cli.make_config(cli.build_parser().parse_args(["train", *argv]))


def test_defaults_then_toml_then_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('strategy = "oss"\nepochs = 3\nbatch-size = 8\nhidden = 128\nlr = 0.02\noptimizer = "sgd"\n')
    cfg = _config("--config", str(path), "--epochs", "1", "--optimizer", "adamw")
    assert (cfg.strategy, cfg.batch_size, cfg.hidden, cfg.lr) == ("oss", 8, 128, 0.02)  # from the file
    assert (cfg.epochs, cfg.optimizer) == (1, "adamw")  # flags win
    assert cfg.depth == TrainConfig.depth and cfg.nproc_per_node == 2  # defaults where neither says
    # the file may set where it runs too, and a flag still wins
    path.write_text("nproc_per_node = 3\nprogress = false\n")
    assert _config("--config", str(path)).nproc_per_node == 3
    assert _config("--config", str(path), "--nproc-per-node", "1").nproc_per_node == 1
    assert _config("--config", str(path)).progress is False


def test_boolean_flags_default_off_and_toml_sets_them(tmp_path):
    # an unset switch must neither hide the default progress bar nor erase what the TOML file says
    cfg = _config()
    assert (cfg.progress, cfg.adascale, cfg.resume) == (True, False, False)
    assert _config("--no-progress").progress is False
    path = tmp_path / "run.toml"
    path.write_text('optimizer = "sgd"\nadascale = true\nprogress = false\n')
    cfg = _config("--config", str(path))
    assert (cfg.adascale, cfg.progress) == (True, False)
    assert _config("--config", str(path), "--adascale").adascale is True


def test_plain_world_size_rank_host_map_to_nodes():
    cfg = _config("--world-size", "3", "--rank", "2", "--host", "10.0.0.1", "--master-port", "1234")
    assert (cfg.nnodes, cfg.node_rank, cfg.nproc_per_node, cfg.master_addr) == (3, 2, 1, "10.0.0.1")
    assert cfg.world_size == 3 and cfg.master_port == 1234


def test_learning_rate_default_depends_on_optimizer():
    assert _config("--optimizer", "sgd").learning_rate == 0.05
    assert _config("--optimizer", "adam").learning_rate == 1e-3
    assert _config("--optimizer", "sgd", "--lr", "0.3").learning_rate == 0.3


@pytest.fixture
def no_process_may_start(monkeypatch):
    """Any attempt to start a process (spawn or run in this one) fails the test."""

    def forbidden(*args, **kwargs):
        raise AssertionError("a process was started although the flags are invalid")

    monkeypatch.setattr(launcher_mod, "spawn", forbidden)
    monkeypatch.setattr(local_processes, "_start", forbidden)
    monkeypatch.setattr(run_mod, "run_placed", forbidden)  # (the launcher imports it when it runs a rank itself)
    for name in launch.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def _fails_fast(capsys, argv, *needles, code=1):
    start = time.perf_counter()
    with pytest.raises(SystemExit) as info:
        cli.main(["train", *argv])
    assert info.value.code == code
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err
    for needle in needles:
        assert needle in err, f"{needle!r} not in {err!r}"
    return err


@pytest.mark.parametrize(
    ("argv", "needles"),
    [
        (["--adascale", "--optimizer", "adam"], ["--adascale", "--optimizer sgd"]),
        (["--adascale", "--optimizer", "sgd", "--strategy", "slowmo"], ["--adascale", "--strategy slowmo"]),
        (["--adascale", "--optimizer", "sgd", "--nproc-per-node", "1"], ["--adascale", "--grad-accum"]),
        (["--world-size", "2", "--rank", "2", "--host", "127.0.0.1"], ["--rank", "--world-size=2", "got 2"]),
        (["--world-size", "2", "--rank", "-1", "--host", "127.0.0.1"], ["--rank"]),
        (["--world-size", "2", "--rank", "0"], ["--world-size, --rank and --host go together"]),
        (["--rank", "0", "--host", "127.0.0.1"], ["--world-size, --rank and --host go together"]),
        (["--world-size", "2", "--rank", "0", "--host", "h", "--nproc-per-node", "2"], ["--nproc-per-node"]),
        (["--world-size", "2", "--rank", "0", "--host", "h", "--nnodes", "2"], ["--nnodes"]),
        (["--nnodes", "2", "--node-rank", "2"], ["--node-rank 2", "--nnodes 2"]),
        (["--node-rank", "-1"], ["--node-rank"]),
        (["--nproc-per-node", "0"], ["--nproc-per-node"]),
        (["--epochs", "0"], ["--epochs"]),
        (["--grad-accum", "0"], ["--grad-accum"]),
        (["--batch-size", "0"], ["--batch-size"]),
        (["--master-port", "70000"], ["--master-port"]),
        (["--timeout", "0"], ["--timeout"]),
        (["--lr", "-0.1"], ["--lr"]),
        (["--data", "mnist"], ["--data mnist", "--data-dir"]),
        (["--data-dir", "/tmp"], ["--data-dir", "--data mnist"]),
        (["--model", "cnn", "--data", "synthetic", "--synthetic-features", "10"], ["--model cnn", "square"]),
        (["--strategy", "slowmo", "--slowmo-nprocs-per-node", "3"], ["--slowmo-nprocs-per-node 3"]),
        (["--resume"], ["--resume", "--out"]),
    ],
)
def test_impossible_flags_fail_before_any_process(capsys, no_process_may_start, argv, needles):
    _fails_fast(capsys, argv, "ddpkit: error:", *needles)


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--strategy", "zero3"], "--strategy"),
        (["--optimizer", "lamb"], "--optimizer"),
        (["--amp", "fp8"], "--amp"),
        (["--data", "imagenet"], "--data"),
        (["--epochs", "two"], "--epochs"),
    ],
)
def test_bad_choices_are_usage_errors(capsys, no_process_may_start, argv, flag):
    _fails_fast(capsys, argv, "invalid", flag, code=2)


def test_missing_mnist_files_are_named(capsys, no_process_may_start, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    err = _fails_fast(capsys, ["--data", "mnist", "--data-dir", str(empty)], "MNIST files missing", str(empty))
    for name in MNIST_FILES.values():
        assert name in err
    _write_mnist(empty, gzipped={"train_images", "train_labels", "test_images"})
    (empty / "t10k-labels-idx1-ubyte").unlink()
    err = _fails_fast(capsys, ["--data", "mnist", "--data-dir", str(empty)], "t10k-labels-idx1-ubyte")
    assert "train-images" not in err
    _fails_fast(capsys, ["--data", "mnist", "--data-dir", str(tmp_path / "nope")], "--data-dir", "not a directory")


def test_bad_config_files_fail_before_any_process(capsys, no_process_may_start, tmp_path):
    _fails_fast(capsys, ["--config", str(tmp_path / "missing.toml")], "--config", "no such file")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("epochz = 3\n")
    _fails_fast(capsys, ["--config", str(unknown)], "unknown setting 'epochz'")
    bad_value = tmp_path / "bad.toml"
    bad_value.write_text('strategy = "zero3"\n')
    _fails_fast(capsys, ["--config", str(bad_value)], "--strategy must be one of", "zero3")
    bad_type = tmp_path / "type.toml"
    bad_type.write_text('epochs = "3"\n')
    _fails_fast(capsys, ["--config", str(bad_type)], "--epochs must be an integer")


def test_resume_checks_the_checkpoint_before_any_process(capsys, no_process_may_start, tmp_path):
    _fails_fast(capsys, ["--resume", "--out", str(tmp_path)], "--resume: no complete checkpoint")
    folder = tmp_path / "checkpoint" / "step-00000009"
    folder.mkdir(parents=True)
    marker = {"step": 9, "epoch": 1, "world_size": 4, "strategy": "slowmo", "files": {}}
    (folder / "COMMIT.json").write_text(json.dumps(marker))
    _fails_fast(
        capsys, ["--resume", "--out", str(tmp_path)], "--strategy slowmo", "cannot continue as --strategy sharded"
    )


def test_bench_rejects_unknown_strategies(capsys, no_process_may_start):
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "--strategies", "ddp,zero3"])
    assert info.value.code == 1
    assert "--strategies: unknown zero3" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------- data


def _idx(array, dims):
    header = struct.pack(">HBB", 0, 0x08, len(dims)) + struct.pack(">" + "I" * len(dims), *dims)
    return header + array.astype(np.uint8).tobytes()


def _write_mnist(folder, gzipped=(), train=40, test=12, side=28, seed=0):
    """Writes the four MNIST IDX files (those named in `gzipped` as .gz); returns the arrays written."""
    rng = np.random.default_rng(seed)
    arrays = {
        "train_images": rng.integers(0, 256, (train, side, side)),
        "train_labels": rng.integers(0, 10, (train,)),
        "test_images": rng.integers(0, 256, (test, side, side)),
        "test_labels": rng.integers(0, 10, (test,)),
    }
    for key, name in MNIST_FILES.items():
        raw = _idx(arrays[key], arrays[key].shape)
        if key in gzipped:
            (folder / f"{name}.gz").write_bytes(gzip.compress(raw))
        else:
            (folder / name).write_bytes(raw)
    return arrays


@pytest.mark.parametrize("gzipped", [(), tuple(MNIST_FILES), ("train_images", "test_labels")])
def test_mnist_idx_files_load_gzipped_or_not(tmp_path, gzipped):
    arrays = _write_mnist(tmp_path, gzipped=set(gzipped))
    data = mnist(str(tmp_path))
    assert len(data.train) == 40 and len(data.test) == 12
    assert data.image_shape == (1, 28, 28) and data.num_features == 784 and data.num_classes == 10
    x, y = data.train.tensors
    assert x.shape == (40, 1, 28, 28) and torch.equal(y, torch.tensor(arrays["train_labels"]))
    assert torch.equal(data.test.tensors[1], torch.tensor(arrays["test_labels"]))
    # standardised with the training set's statistics; the order of pixel values is kept
    assert abs(float(x.mean())) < 1e-5 and abs(float(x.std()) - 1) < 1e-4
    flat = torch.tensor(arrays["train_images"][0], dtype=torch.float32).flatten()
    assert torch.equal(torch.argsort(x[0].flatten(), stable=True), torch.argsort(flat, stable=True))


def test_read_idx_rejects_corrupt_files(tmp_path):
    bad_magic = tmp_path / "magic"
    bad_magic.write_bytes(b"\x00\x00\x0d\x01" + b"\x00" * 8)
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(str(bad_magic))
    short = tmp_path / "short"
    short.write_bytes(_idx(np.zeros(5), (6,)))  # the header promises 6 values, the file holds 5
    with pytest.raises(ValueError, match=r"header says \(6,\) but the file holds 5"):
        read_idx(str(short))


def test_digits_and_synthetic_are_offline_and_deterministic():
    a, b = digits(0), digits(0)
    assert len(a.train) + len(a.test) == 1797 and len(a.test) == 360
    assert torch.equal(a.train.tensors[0], b.train.tensors[0])
    assert a.image_shape == (1, 8, 8) and a.num_features == 64
    # the very values of scikit-learn's load_digits (read from its file without importing scikit-learn)
    from sklearn.datasets import load_digits

    reference = load_digits()
    images, labels = digits_arrays()
    assert np.array_equal(images, reference.data) and np.array_equal(labels, reference.target)
    s = synthetic(100, 16, 4, seed=3)
    assert len(s.train) == 90 and len(s.test) == 10 and s.image_shape == (1, 4, 4)
    assert int(s.train.tensors[1].max()) < 4
    assert torch.equal(s.train.tensors[0], synthetic(100, 16, 4, seed=3).train.tensors[0])
    assert synthetic(50, 10, 3).image_shape is None


# --------------------------------------------------------------------------------------------------- report


def test_parameter_digest_sees_a_single_bit():
    model = _model()
    before = parameter_digest(model)
    assert before == parameter_digest(_model())  # same seed, same digest
    with torch.no_grad():
        w = model[0].weight.view(-1)
        w[3] = torch.nextafter(w[3], torch.tensor(float("inf")))
    assert parameter_digest(model) != before
    # a SHA-256 in hex, computed here from its definition: shape, dtype and bytes of each parameter in order
    import hashlib

    reference = hashlib.sha256()
    for p in _model().parameters():
        reference.update(f"{tuple(p.shape)}|{p.dtype}|".encode() + p.detach().numpy().tobytes())
    assert before == reference.hexdigest() and len(before) == 64
    reshaped = _model()
    reshaped[0].weight = nn.Parameter(reshaped[0].weight.detach().reshape(-1, 2))
    assert parameter_digest(reshaped) != before  # the same bytes in another shape are another model


def test_summary_table_and_metrics_files(tmp_path):
    summary = {
        "strategy": "sharded",
        "world_size": 2,
        "backend": "gloo",
        "test_accuracy": 0.91234,
        "train_loss": 0.2,
        "wall_seconds": 3.0,
        "samples_per_second": 480.0,
        "sent_bytes_per_step": 2e5,
        "sent_bytes_total": 4e6,
        "peak_memory_mb": [300.0, 301.0],
        "replicas_equal": False,
    }
    table = format_summary(summary)
    assert "test accuracy     0.9123" in table
    assert "NO: parameters differ" in table and "300, 301 MB per rank" in table
    history = [{"epoch": 0, "train_accuracy": 0.5, "test_accuracy": 0.6}]
    steps = [{"epoch": 0, "step": i, "loss": 1.0 / (i + 1)} for i in range(3)]
    paths = write_metrics(str(tmp_path / "out"), summary, history, steps)
    assert json.loads(open(paths[0]).read())["epochs"] == history
    assert open(paths[1]).read().splitlines()[0] == "epoch,step,loss"
    assert open(paths[2], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


# --------------------------------------------------------------------------------------------------- launch


def test_torchrun_environment_is_detected(monkeypatch):
    for name in launch.TORCHRUN_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert launch.from_torchrun() is None
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "29400"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert launch.from_torchrun() == launch.Placement(3, 4, 1, "10.0.0.9", 29400)
    monkeypatch.delenv("MASTER_PORT")
    assert launch.from_torchrun() is None


def test_backend_choice():
    assert launch.pick_backend("gloo") == "gloo"
    assert launch.pick_backend("auto") == ("nccl" if torch.cuda.is_available() else "gloo")


def test_gloo_uses_the_interface_that_routes_to_the_master(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "")  # (so that the end of the test restores the value before it:
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")  # a "lo" left behind sent later commands on two hosts to 127.0.0.1)
    assert launch.route_source_address("127.0.0.1", 29500) == "127.0.0.1"  # no packet is sent
    assert launch.interface_with_address("127.0.0.1") == "lo"
    assert launch.interface_with_address("203.0.113.77") is None  # TEST-NET-3: on no interface here
    assert launch.choose_gloo_interface("127.0.0.1", 29500) == "lo"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choice wins
    assert launch.choose_gloo_interface("127.0.0.1", 29500) == "eth7"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"
