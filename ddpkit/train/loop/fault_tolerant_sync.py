"""The rounds of `ddpkit train --fault-tolerant`: a Trainer callback, a client of the library's `Manager`.

No process group spans a fault-tolerant job. Each rank trains its own replica (the module and a torch optimizer)
and the ranks meet in rounds through the job's store, each round over the members of its quorum only. The
rounds, their averaging, commits, live state and membership records are `ddpkit.fault_tolerance.manager.Manager`'s
(the same object a user's own loop holds); this callback decides when a round happens and what it averages:

- **per step** (``--strategy ddp``): the quorum of step s+1 is formed when step s ends (round s+1; round 0 when
  training starts). The gradients are averaged over the members in buckets all-reduced while backward runs
  (`Manager.overlap_gradients`; one flat all-reduce after backward with ``--grad-accum`` > 1), and the round is
  committed before the optimizer steps: a step that failed on
  any member (a member died during the all-reduce) is skipped on every member (the gradients are dropped; torch
  optimizers then leave the parameters and their state alone).
- **per step, sharded** (``--strategy oss`` / ``sharded``: each machine's processes are one replica sharding the
  optimizer state, `ddpkit.fault_tolerance.replica_membership`): as per step, but each process averages only the
  gradients of the shard it owns (`OSS.owned_grads`, after ShardedDataParallel or DDP reduced them within the
  machine) with the same process of the other members, in one flat all-reduce after backward; its live state is
  its own shard of the optimizer state (the local optimizer and the hyper-parameters of the groups).
- **per outer sync** (``--strategy slowmo``: local SGD, SlowMo's slow momentum, DiLoCo's Nesterov outer step):
  a round on every step SlowMo would sync (every ``--localsgd-frequency`` and every ``--slowmo-frequency`` steps):
  the parameters are averaged over the members (one all-reduce of the P parameters and a count); once the round
  is committed, slow momentum moves the average when due; a round that failed leaves every member's parameters
  as they were. With ``--slowmo-compression`` or ``--slowmo-fragments`` the round runs DiLoCo's pseudo-gradient
  sync instead (`ddpkit.algorithms.fault_tolerant.FaultTolerantOuterSync`: the plain job's `OuterSync` over the
  round's members, quantised with error feedback), one round per step at which some fragment syncs; a failed
  round puts back the parameters, the synchronised copy, the residual and the slow buffers. The job's last round
  is an exact average either way.
- **per step, gossiping** (``--strategy slowmo --slowmo-base sgp``): SGP's push-sum over a graph rebuilt over
  each round's members (`ddpkit.algorithms.fault_tolerant.FaultTolerantGossip`): the round of step s is formed
  while the step computes and run after its optimizer step: a gossip exchange with the round's peers, or on
  slow-momentum steps (and every ``--localsgd-frequency`` steps with ``--slowmo-sgp-average-params``) the exact
  push-sum average ``sum x / sum w`` over the members, moved by slow momentum; committed like the others (a
  round that failed anywhere leaves every member's buffer as it was). A lost member takes its push-sum mass
  with it; a joiner shares its healer's.

A rank that joins (it started late, was started again, or fell behind a round: `FellBehind`) receives the live
state from a member in the first round it is part of: parameters, optimizer state, slow-momentum buffers, SGP's
push-sum buffer and graph phase, the pseudo-gradient sync's synchronised copy (its error-feedback residual starts
at zero: it is the rank's own), and the trainer's counters (epoch, position in the epoch's permutation, step, the
metrics so far), registered with the manager. Its parameters are then bit-identical to the others' and it trains
on from there; in its first round it counts as every member with DDP (its gradient is computed from the live
parameters) and zero with local SGD and the pseudo-gradient sync (it takes the others' mean). Its data shard
stays its own (the sampler splits each epoch over ``--world-size`` ranks; the shards of absent ranks are not
trained while they are away).

Checkpoints (optional, `LiveCheckpoints`): after a committed round at or past every ``--checkpoint-every`` steps
the round's lowest member saves the live state; with ``--resume`` the first member of round 0 reads the newest and
round 0 sends it to every member instead of the first member's fresh parameters.

Memory: a flat copy of the parameters (and of the gradients per step), the slow buffers (2P) with slow momentum,
the pseudo-gradient sync's synchronised copy and residual (2P, `FaultTolerantOuterSync`),
SGP's push-sum buffer (P + 1) and its copy during a round, and the live state serialised once when someone joins.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from torch import nn

from ddpkit.algorithms.fault_tolerant import FaultTolerantGossip, FaultTolerantLocalSGD, FaultTolerantOuterSync
from ddpkit.algorithms.pseudo_gradient import fragment_shifts
from ddpkit.algorithms.pseudo_gradient_settings import OuterSyncSettings
from ddpkit.algorithms.slow_momentum import SlowBuffers, SlowMoRule
from ddpkit.distributed import comm_stats
from ddpkit.distributed.buckets import unflatten_into
from ddpkit.distributed.rank_guard import say
from ddpkit.fault_tolerance.manager import FellBehind, Manager
from ddpkit.fault_tolerance.membership import Quorum
from ddpkit.optim import OSS
from ddpkit.train.checkpoints.checkpoint_files import CheckpointError
from ddpkit.train.checkpoints.live_checkpoint import LiveCheckpoints
from ddpkit.train.loop.callbacks import MetricsRecorder
from ddpkit.train.loop.trainer import Callback, Trainer, TrainerState

FINAL_ATTEMPTS = 3  # times the job's last average is tried when a member is lost in it


@dataclass
class OuterSchedule:
    """When the per-outer-sync mode syncs: every `every` steps, and every `slow_every` steps with a slow step
    (`rule`, with the optimizer's learning rate) on the committed average. With `sync` (active: compression or
    fragments), DiLoCo's pseudo-gradient sync instead of the exact average (`FaultTolerantOuterSync`), fragment j
    on the steps shifted by its offset (`fragment_shifts`): a round at every step where some fragment syncs."""

    every: int
    slow_every: int
    rule: SlowMoRule | None
    sync: OuterSyncSettings | None = None

    @cached_property
    def shifts(self) -> list[int]:
        return fragment_shifts(self.every, self.sync.fragments) if self.sync is not None else [0]

    def due(self, step: int) -> bool:
        return any((step + s) % self.every == 0 or (step + s) % self.slow_every == 0 for s in self.shifts)

    def rounds_until(self, step: int) -> int:
        """The number of syncs in steps 1..`step` (the round number of the sync at `step`, round 0 the start)."""
        full, rest = divmod(step, len(self._period))
        return full * sum(self._period) + sum(self._period[:rest])

    @cached_property
    def _period(self) -> list[bool]:
        """Whether steps 1..L sync, L = lcm(every, slow_every): the pattern repeats every L steps."""
        period = math.lcm(self.every, self.slow_every)
        return [self.due(t) for t in range(1, period + 1)]


@dataclass
class GossipSchedule:
    """The per-step gossip mode: graph `graph` with `peers_per_itr` peers; an exact average every `slow_every`
    steps with a slow step (`rule`) on it, and every `exact_every` steps (0: never) without one."""

    graph: str
    peers_per_itr: int
    slow_every: int
    rule: SlowMoRule | None
    exact_every: int = 0

    def exact(self, step: int) -> bool:
        return step % self.slow_every == 0 or (self.exact_every > 0 and step % self.exact_every == 0)


class FaultTolerantSync(Callback):
    """Rounds over the live ranks, per step or per outer sync (module doc), through `manager`. `outer`: None for
    per step, else the outer schedule; `gossip`: per step, gossiping (SGP) instead of averaging gradients.
    `total_steps`: the run's length (no round is formed for a step that will not come). `overlap`: per step, the
    gradients are all-reduced in buckets while backward runs (off with gradient accumulation)."""

    def __init__(
        self,
        manager: Manager,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        recorder: MetricsRecorder,
        total_steps: int,
        outer: OuterSchedule | None = None,
        gossip: GossipSchedule | None = None,
        checkpoints: LiveCheckpoints | None = None,
        overlap: bool = True,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if outer is not None and gossip is not None:
            raise ValueError("FaultTolerantSync: give an outer schedule (local SGD) or a gossip schedule, not both")
        self.manager, self.module, self.optimizer, self.scaler = manager, module, optimizer, scaler
        self.recorder, self.total_steps, self.outer, self.gossip = recorder, total_steps, outer, gossip
        self.params = list(module.parameters())
        with torch.no_grad():
            flat = self._flat_params()
        rule = outer.rule if outer is not None else gossip.rule if gossip is not None else None
        self.slow = SlowBuffers(flat, 0, None) if rule is not None else None
        slow = (self.slow, rule) if self.slow is not None and rule is not None else None
        self.local_sgd = FaultTolerantLocalSGD(manager, slow) if outer is not None else None
        self.pseudo = None  # DiLoCo's compressed / fragmented sync (the exact average stays for the last round)
        if outer is not None and outer.sync is not None and outer.sync.active:
            sizes, frequencies = [p.numel() for p in self.params], (outer.every, outer.slow_every)
            self.pseudo = FaultTolerantOuterSync(manager, flat, sizes, outer.sync, slow, frequencies)
        self.checkpoints = checkpoints
        self._saved_at = 0  # the step of the last checkpoint (or of the one resumed)
        self._annotated_round = -1
        self.trainer: Trainer | None = None
        self.final = False  # the job's last round is done (or, on a joiner, was the one it joined)
        self._finishing = False  # the job's last round is being formed: the live state sent says so
        self._register_live_state()
        if outer is None and gossip is None and overlap:
            manager.overlap_gradients(self.params)  # DDP's average starts while backward runs
        self.push_sum = None
        if gossip is not None:
            self.push_sum = FaultTolerantGossip(flat, gossip.graph, gossip.peers_per_itr, manager, slow)

    # -- the live state ------------------------------------------------------------------------------------------

    def _register_live_state(self) -> None:
        """What a joiner receives (and a checkpoint holds), besides SGP's push-sum buffer (`FaultTolerantGossip`
        registers it): the model, the optimizer, the trainer's counters, the slow buffers, whether it is the end."""
        manager = self.manager
        manager.register("model", self.module)
        if isinstance(self.optimizer, OSS):  # a replica's process: its own shard (the same one on every replica)
            manager.register("optimizer", self.optimizer.optim)
            manager.register_state("optimizer_groups", self._oss_groups, self._load_oss_groups)
        else:
            manager.register("optimizer", self.optimizer)
        if self.scaler is not None:  # fp16: the loss scale and its growth tracker (the same on every DDP member)
            manager.register("scaler", self.scaler)
        manager.register_state("trainer", self._trainer_state, self._load_trainer_state)
        if self.slow is not None:
            manager.register_state("slow", self._slow_state, self._load_slow_state)
        manager.register_state("final", lambda: self.final or self._finishing, self._load_final)

    def _oss_groups(self) -> list[dict[str, Any]]:
        return [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]

    def _load_oss_groups(self, groups: list[dict[str, Any]]) -> None:
        for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
            group.update(saved)

    def _trainer_state(self) -> dict[str, Any]:
        assert self.trainer is not None
        return dataclasses.asdict(self.trainer.state)

    def _load_trainer_state(self, state: dict[str, Any]) -> None:
        assert self.trainer is not None
        self.trainer.state = TrainerState(**state)

    def _slow_state(self) -> dict[str, torch.Tensor]:
        assert self.slow is not None
        return {k: v.clone() for k, v in self.slow.state().items()}

    def _load_slow_state(self, state: dict[str, torch.Tensor]) -> None:
        assert self.slow is not None
        self.slow.x0.copy_(state["x0"])  # type: ignore[union-attr]
        self.slow.u.copy_(state["u"])  # type: ignore[union-attr]

    def _load_final(self, final: bool) -> None:
        self.final = bool(final)

    def _flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in self.params])

    def _set_params(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            unflatten_into(flat, self.params)

    # -- the start -----------------------------------------------------------------------------------------------

    def begin(self, trainer: Trainer) -> None:
        """The job's first round (`Manager.start`: the settings agreement, every member on the first member's
        live state, or with --resume on the state of the checkpoint the first member reads), before
        `trainer.fit` (so that a resumed state is in place before the other callbacks read it); `fit` calls it
        itself if it was not called."""
        self.trainer = trainer
        resume = self.checkpoints is not None and self.checkpoints.resume
        quorum = self.manager.start(share_state=not resume)
        if resume:
            self._resume(quorum)
        elif not self.manager.should_commit():
            raise RuntimeError("the fault-tolerant job's first round failed (a rank was lost while it started)")
        if self.outer is None and trainer.state.step < self.total_steps:
            self._form_next(trainer)

    def _resume(self, quorum: Quorum) -> None:
        """Round 0 with --resume: the first member reads the newest checkpoint and every member loads it."""
        resumed = self.manager.broadcast_object(self._read_checkpoint() if quorum.index == 0 else None, 0) or {}
        if "error" in resumed:  # the same error on every member
            self.manager.fail()
            self.manager.should_commit()
            raise CheckpointError(resumed["error"])
        if "state" in resumed:
            self.manager.load_live_state(resumed["state"])
        assert self.trainer is not None
        step = self._saved_at = self.trainer.state.step
        self.manager.membership.continue_at(quorum, self.outer.rounds_until(step) if self.outer is not None else step)
        self.manager.next_round = quorum.round + 1
        if not self.manager.should_commit():
            raise RuntimeError("the fault-tolerant job's first round failed (a rank was lost while it started)")

    def _read_checkpoint(self) -> dict[str, Any]:
        """The first member's --resume: {"state": the live state} or {"error": why not}."""
        assert self.checkpoints is not None
        try:
            state, notes = self.checkpoints.load()
        except CheckpointError as exc:
            return {"error": str(exc)}
        for note in notes:
            say(f"ddpkit: {note}")
        return {"state": state}

    def start(self, trainer: Trainer, process_rank: int) -> None:
        """Before `fit`: the job's first round (`begin`), or, for a rank that comes to a job under way (or whose
        first round was decided without it), the live state of the next round it is taken into (`rejoin`).
        `process_rank`: this process's rank in the launch, for the message."""
        if self.manager.under_way():
            say(f"ddpkit: rank {process_rank} joins the fault-tolerant job under way; waiting for live state")
            self.rejoin(trainer)
            return
        try:
            self.begin(trainer)
        except FellBehind:
            self.rejoin(trainer)

    def fit(self, trainer: Trainer, epochs: int, max_steps: int | None) -> None:
        """`trainer.fit`, taking the live state again whenever this rank fell behind a round (`FellBehind`)."""
        while True:
            try:
                trainer.fit(epochs, max_steps)
                return
            except FellBehind as exc:
                say(f"ddpkit: {exc}; taking the live state again")
                self.rejoin(trainer)

    def on_train_start(self, trainer: Trainer) -> None:
        if self.manager.quorum is None:  # a rank that joined has its quorum already (and the next one on its way)
            self.begin(trainer)

    def rejoin(self, trainer: Trainer) -> None:
        """Takes part in the next round decided with this rank in it, as a joiner: receives the live state
        (`Manager.rejoin`) and does the round's work with the others. A joiner of a round that failed joins
        again."""
        self.trainer = trainer
        while True:
            self.manager.rejoin()
            self.manager.step = trainer.state.step
            if self.gossip is not None:
                if not self._gossip_work(trainer, final=self.final):
                    continue  # the round failed: the state taken is not the others'
                if not self.final and trainer.state.step < self.total_steps:
                    self._form_next(trainer)
            elif self.outer is not None:
                self._outer_work(trainer, slow=not self.final)
            elif self.final:
                self.manager.should_commit()
            return  # (DDP: the joined round's gradients are averaged at the end of the next backward)

    # -- per step ------------------------------------------------------------------------------------------------

    def _form_next(self, trainer: Trainer) -> None:
        """Per step: the next step's quorum is formed in the background while the step computes (the store's
        waits overlap forward and backward); the manager takes it when the round's work begins."""
        self.manager.step = trainer.state.step + 1
        self.manager.start_round(background=True)

    def after_backward(self, trainer: Trainer) -> None:
        if self.outer is not None or self.gossip is not None:
            return
        manager = self.manager
        manager.current()  # the live state sent to a joiner now is the step's start: nothing stepped yet
        if isinstance(self.optimizer, OSS):  # a replica's process: the shard it owns, with the other replicas'
            manager.average_tensors(self.optimizer.owned_grads(self.params))
        else:
            manager.average_gradients(self.params)
        if not manager.should_commit():
            trainer.skip_step = True  # on every member: no optimizer step, no loss-scale update

    def after_step(self, trainer: Trainer) -> None:
        step = trainer.state.step
        self.manager.step = step
        with comm_stats.measure() as sent:  # the step's record is made: what this round sends is added to it
            if self.gossip is not None:
                assert self.push_sum is not None
                self.push_sum.absorb(self._flat_params())  # before the live state goes to a joiner
                self._gossip_work(trainer)
            if self.outer is None:
                if step < self.total_steps:
                    self._form_next(trainer)
            elif self.outer.due(step):
                self.manager.round(self.outer.rounds_until(step))
                self._outer_work(trainer)
        self._annotate(trainer, self.manager.quorum, sent.sent_bytes())
        self._checkpoint(trainer)

    def _checkpoint(self, trainer: Trainer) -> None:
        """After a committed round at or past a multiple of --checkpoint-every: the round's first member saves
        (written in the background: `LiveCheckpoints`)."""
        step, quorum, plan = trainer.state.step, self.manager.quorum, self.checkpoints
        if plan is None or quorum is None or not quorum.committed or not plan.due(self._saved_at, step):
            return
        if quorum.round != step if self.outer is None else not self.outer.due(step):
            return  # not this step's round: replicas differ until their next one (SlowMo), or it failed
        self._saved_at = step
        if quorum.index == 0:
            state = trainer.state
            state.carried["totals"] = self.recorder.totals()
            plan.save(self.manager.live_state(), step, state.epoch, state.epoch_samples, quorum.round)

    def _annotate(self, trainer: Trainer, quorum: Quorum | None, sent: float) -> None:
        """steps.csv: the members of the step's round, who joined or left in it (rank ids: "-2 +2"), and the bytes
        of the round sent after the step's record was made."""
        assert trainer.last is not None
        trainer.last.sent_bytes += sent
        columns: dict[str, Any] = {"sent_bytes": trainer.last.sent_bytes}
        if quorum is not None:
            fresh = quorum.round != self._annotated_round  # a change is written once, at the step of its round
            change = " ".join([f"+{r}" for r in quorum.joined] + [f"-{r}" for r in quorum.left]) if fresh else ""
            columns |= {"members": len(quorum.members), "membership_change": change}
            self._annotated_round = quorum.round
        self.recorder.annotate_last(**columns)

    # -- per step, gossiping ------------------------------------------------------------------------------------

    def _gossip_work(self, trainer: Trainer, final: bool = False) -> bool:
        """The open round's push-sum work on the buffer the optimizer's step was absorbed into (or, on a joiner, the
        one it received), with slow momentum on an exact round when due (`FaultTolerantGossip.finish_round`), and
        its model into the parameters. Returns the verdict. The `final` round (the job's last) is an exact average
        without a slow step (the last step's round made it already when due)."""
        gossip, push_sum, step = self.gossip, self.push_sum, trainer.state.step
        assert gossip is not None and push_sum is not None
        flat = self._flat_params()
        slow_step = not final and step % gossip.slow_every == 0
        committed = push_sum.finish_round(flat, final or gossip.exact(step), slow_step, self._lr())
        self._set_params(flat)
        return committed

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    # -- per outer sync ------------------------------------------------------------------------------------------

    def _outer_work(self, trainer: Trainer, slow: bool = True) -> bool:
        """The parameters' mean over the members (`FaultTolerantLocalSGD`), committed; then slow momentum when
        due (and `slow`). With the pseudo-gradient sync, its round instead (a joiner counts zero there too), but
        for the last round (not `slow`): an exact average, as SlowMo's `average_parameters` ends a plain job."""
        assert self.local_sgd is not None and self.outer is not None
        flat, step = self._flat_params(), trainer.state.step
        if self.pseudo is not None and slow:
            committed = self.pseudo.run(flat, step, self._lr())
        else:
            committed = self.local_sgd.step(flat, slow and step % self.outer.slow_every == 0, self._lr())
        if committed:
            self._set_params(flat)
        return committed

    # -- the end -------------------------------------------------------------------------------------------------

    def _final_work(self, trainer: Trainer) -> bool:
        """The last round's work (module doc: an exact average with local SGD or SGP), committed; its verdict."""
        if self.gossip is not None:  # a last exact average: every replica ends with the same model
            return self._gossip_work(trainer, final=True)
        if self.outer is None:
            return self.manager.should_commit()
        return self._outer_work(trainer, slow=False)

    def finish(self, trainer: Trainer) -> Quorum:
        """The job's last round (unless this rank joined in it): the live state to late joiners, and with local
        SGD or SGP a last exact average, so that every replica ends alike (as SlowMo's `average_parameters`)."""
        if self.final:
            assert self.manager.quorum is not None
            return self.manager.quorum
        step = trainer.state.step
        self.manager.step = step
        self._finishing = True
        last = self.outer.rounds_until(step) + 1 if self.outer is not None else step + 1
        for attempt in range(1, FINAL_ATTEMPTS + 1):
            quorum = self.manager.round(last)
            if self._final_work(trainer):
                break
            last = quorum.next_round  # (a member was lost in it: the survivors average again, in the next round)
            if attempt == FINAL_ATTEMPTS:
                say(
                    f"ddpkit: rank {self.manager.rank}: the job's last average failed {attempt} times: the "
                    "replicas may end unequal (the summary's replicas_equal says)"
                )
        self.final = True
        if self.checkpoints is not None:
            self.checkpoints.wait()  # the last checkpoint is written before the job ends
        return quorum
