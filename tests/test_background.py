"""The device rules of background collectives (`ddpkit.distributed.background`): a worker
thread on gloo only; on NCCL a job runs on the caller's thread, so no second thread ever issues NCCL calls.
(The gloo path itself runs in every compressed-mean and SlowMo pseudo-gradient test.)"""

import threading

from ddpkit.distributed import background
from ddpkit.distributed.background import BackgroundChannel


def test_only_gloo_gets_a_worker_thread():
    assert background.runs_in_thread("gloo")
    assert not background.runs_in_thread("nccl")
    assert not background.runs_in_thread("")


def test_an_unthreaded_channel_runs_each_job_at_once_on_the_caller():
    channel = object.__new__(BackgroundChannel)  # the rule alone, without a process group
    channel.threaded = False
    ran: list[tuple[str, BackgroundChannel]] = []
    channel.submit(lambda ch: ran.append((threading.current_thread().name, ch)))
    assert ran == [(threading.current_thread().name, channel)]


def test_no_second_thread_is_started_for_an_unthreaded_backend(monkeypatch):
    started = []
    monkeypatch.setattr(background.threading.Thread, "start", lambda self: started.append(self.name))
    monkeypatch.setattr(background, "backend_name", lambda group, device: "" if device == "cpu" else "nccl")
    monkeypatch.setattr(background.dist, "new_group", lambda *a, **k: "nccl-group")
    monkeypatch.setattr(background.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(background.dist.distributed_c10d, "_get_default_group", lambda: None)
    monkeypatch.setattr(background, "job_timeout", lambda group=None: None)
    channel = BackgroundChannel([0, 1], None, 0)
    assert (channel.gloo, channel.threaded, channel.backend, started) == (False, False, "nccl-group", [])
