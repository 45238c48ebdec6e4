"""The rounds of `ddpkit train --fault-tolerant`: a Trainer callback that averages over whoever is alive.

No process group spans a fault-tolerant job. Each rank trains its own replica (the module and a torch optimizer)
and the ranks meet in rounds through the job's store (`ddpkit.distributed.membership`), each round over the
members of its quorum only:

- **per step** (``--strategy ddp``): the quorum of step s+1 is formed when step s ends (round s+1; round 0 when
  training starts). After the backward of the step the gradients are averaged over the members (one all-reduce
  of the P gradients and a count), and the round is committed before the optimizer steps: a step that failed on
  any member (a member died during the all-reduce) is skipped on every member (the gradients are dropped; torch
  optimizers then leave the parameters and their state alone).
- **per outer sync** (``--strategy slowmo``: local SGD, SlowMo's slow momentum, DiLoCo's Nesterov outer step):
  a round on every step SlowMo would sync (every ``--localsgd-frequency`` and every ``--slowmo-frequency`` steps):
  the parameters are averaged over the members (one all-reduce of the P parameters and a count); once the round
  is committed, slow momentum moves the average when due; a round that failed leaves every member's parameters
  as they were.
- **per step, gossiping** (``--strategy slowmo --slowmo-base sgp``): SGP's push-sum over a graph rebuilt over
  each round's members (`ddpkit.algorithms.fault_tolerant.FaultTolerantGossip`): the round of step s is formed
  while the step computes and run after its optimizer step: a gossip exchange with the round's peers, or on
  slow-momentum steps (and every ``--localsgd-frequency`` steps with ``--slowmo-sgp-average-params``) the exact
  push-sum average ``sum x / sum w`` over the members, moved by slow momentum; committed like the others (a
  round that failed anywhere leaves every member's buffer as it was). A lost member takes its push-sum mass
  with it; a joiner shares its healer's.

A rank that joins (it started late, was started again, or fell behind a round: `FellBehind`) receives the live
state from a member in the first round it is part of: parameters, optimizer state, slow-momentum buffers, SGP's
push-sum buffer and graph phase, and the trainer's counters (epoch, position in the epoch's permutation, step, the
metrics so far). Its parameters are then
bit-identical to the others' and it trains on from there; in the round's average it counts zero. Its data shard
stays its own (the sampler splits each epoch over ``--world-size`` ranks; the shards of absent ranks are not
trained while they are away).

Checkpoints (optional, `LiveCheckpoints`): after a committed round at or past every ``--checkpoint-every`` steps
the round's lowest member saves the live state; with ``--resume`` the first member of round 0 reads the newest and
round 0 sends it to every member instead of the first member's fresh parameters.

Memory: a flat copy of the parameters (and of the gradients per step), the slow buffers (2P) with slow momentum,
SGP's push-sum buffer (P + 1) and its copy during a round, and the live state serialised once when someone joins.
"""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ddpkit.algorithms.fault_tolerant import FaultTolerantGossip
from ddpkit.algorithms.slow_momentum import SlowBuffers, SlowMoRule
from ddpkit.distributed import comm_stats
from ddpkit.distributed.buckets import unflatten_into
from ddpkit.distributed.membership import (
    Membership,
    Quorum,
    broadcast_from_first,
    broadcast_object_from,
    heal_object,
    quorum_mean,
)
from ddpkit.distributed.rank_guard import say
from ddpkit.train.checkpoints.checkpoint_files import CheckpointError
from ddpkit.train.checkpoints.live_checkpoint import LiveCheckpoints
from ddpkit.train.loop.callbacks import MetricsRecorder
from ddpkit.train.loop.trainer import Callback, Trainer, TrainerState


class FellBehind(Exception):
    """This rank missed a round (it was stopped or too slow): it must take the live state again (`rejoin`)."""


@dataclass
class MembershipEvent:
    """A round where the members changed, or that failed: at optimizer step `step` (steps done), who `left` and
    who `joined`, whether it `committed`, the seconds this rank waited for the quorum (partly in the background,
    per step), and the seconds the round held up its training (`blocked_seconds`: the quorum's wait that the step
    did not hide, the live state sent, the average and the commit): the time the round cost this rank."""

    step: int
    round: int
    members: list[int]
    joined: list[int]
    left: list[int]
    committed: bool | None
    waited_seconds: float
    blocked_seconds: float = 0.0


@dataclass
class OuterSchedule:
    """When the per-outer-sync mode syncs: every `every` steps, and every `slow_every` steps with a slow step
    (`rule`, with the optimizer's learning rate) on the committed average."""

    every: int
    slow_every: int
    rule: SlowMoRule | None

    def due(self, step: int) -> bool:
        return step % self.every == 0 or step % self.slow_every == 0

    def rounds_until(self, step: int) -> int:
        """The number of syncs in steps 1..`step` (the round number of the sync at `step`, round 0 the start)."""
        both = self.every * self.slow_every // _gcd(self.every, self.slow_every)
        return step // self.every + step // self.slow_every - step // both


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


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


class FaultTolerantSync(Callback):
    """Rounds over the live ranks, per step or per outer sync (module doc). `outer`: None for per step, else the
    outer schedule; `gossip`: per step, gossiping (SGP) instead of averaging gradients. `total_steps`: the run's
    length (no round is formed for a step that will not come)."""

    def __init__(
        self,
        membership: Membership,
        module: nn.Module,
        optimizer: torch.optim.Optimizer,
        recorder: MetricsRecorder,
        total_steps: int,
        outer: OuterSchedule | None = None,
        gossip: GossipSchedule | None = None,
        checkpoints: LiveCheckpoints | None = None,
    ) -> None:
        if outer is not None and gossip is not None:
            raise ValueError("FaultTolerantSync: give an outer schedule (local SGD) or a gossip schedule, not both")
        self.membership, self.module, self.optimizer = membership, module, optimizer
        self.recorder, self.total_steps, self.outer, self.gossip = recorder, total_steps, outer, gossip
        self.params = list(module.parameters())
        with torch.no_grad():
            flat = self._flat_params()
        rule = outer.rule if outer is not None else gossip.rule if gossip is not None else None
        self.slow = SlowBuffers(flat, 0, None) if rule is not None else None
        self.push_sum = FaultTolerantGossip(flat, gossip.graph, gossip.peers_per_itr) if gossip is not None else None
        self.checkpoints = checkpoints
        self._saved_at = 0  # the step of the last checkpoint (or of the one resumed)
        self.quorum: Quorum | None = None
        self.round_ok = True  # whether the current round went well so far (per step: its heal)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpkit-quorum")
        self._next: Future[Quorum] | None = None  # per step: the next round's quorum, being formed
        self._annotated_round = -1
        self._blocked = (-1, 0.0)  # (round, seconds its sync held up training on this rank so far)
        self.events: list[MembershipEvent] = []
        self.rejoined = 0  # times this process took the live state from a peer
        self.final = False  # the job's last round is done

    # -- the live state ------------------------------------------------------------------------------------------

    def _flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in self.params])

    def _set_params(self, flat: torch.Tensor) -> None:
        with torch.no_grad():
            unflatten_into(flat, self.params)

    def _live_state(self, trainer: Trainer, final: bool) -> dict[str, Any]:
        slow = {k: v.clone() for k, v in self.slow.state().items()} if self.slow is not None else None
        return {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "trainer": dataclasses.asdict(trainer.state),
            "slow": slow,
            "push_sum": self.push_sum.state() if self.push_sum is not None else None,
            "final": final,
        }

    def _load_state(self, trainer: Trainer, state: dict[str, Any], rejoined: bool = True) -> None:
        self.module.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        trainer.state = TrainerState(**state["trainer"])
        if self.slow is not None and state["slow"] is not None:
            self.slow.x0.copy_(state["slow"]["x0"])  # type: ignore[union-attr]
            self.slow.u.copy_(state["slow"]["u"])  # type: ignore[union-attr]
        if self.push_sum is not None and state["push_sum"] is not None:
            self.push_sum.load(state["push_sum"])
        elif self.push_sum is not None:  # a checkpoint of local SGD: push-sum starts from its model, weight one
            self.push_sum.load({"buffer": torch.cat([self._flat_params(), torch.ones(1)]), "phase": 0})
        self.final = bool(state["final"])
        self.rejoined += int(rejoined)

    # -- rounds --------------------------------------------------------------------------------------------------

    def _note(self, quorum: Quorum, step: int) -> None:
        if quorum.changed or quorum.committed is False:
            blocked = self._blocked[1] if self._blocked[0] == quorum.round else 0.0
            event = MembershipEvent(step, quorum.round, quorum.members, quorum.joined, quorum.left,
                                    quorum.committed, round(quorum.waited, 3), round(blocked, 3))  # fmt: skip
            if self.events and self.events[-1].round == quorum.round:
                self.events[-1] = event
            else:
                self.events.append(event)

    def _live_round(
        self, round_: int, trainer: Trainer, final: bool = False, formed: Quorum | None = None
    ) -> tuple[Quorum, bool]:
        """Forms round `round_` as a live rank (or takes the quorum `formed` in the background) and sends the live
        state to its joiners. Returns the quorum and whether all went well so far; raises FellBehind if this rank
        is not a member."""
        quorum = formed if formed is not None else self.membership.quorum(round_)
        if not quorum.is_member:
            raise FellBehind(f"rank {self.membership.rank} was left out of round {round_}")
        self.quorum = quorum
        ok = quorum.group is not None
        if ok and quorum.joined:
            try:
                heal_object(quorum, self._live_state(trainer, final))
            except RuntimeError:
                ok = False
        self._note(quorum, trainer.state.step)
        self.round_ok = ok
        return quorum, ok

    def _start(self, trainer: Trainer) -> None:
        """Round 0: every rank starts from the parameters of the first member (as DDP broadcasts rank 0's), or
        with --resume from the live state of the checkpoint the first member reads."""
        quorum, ok = self._live_round(0, trainer)
        resumed: dict[str, Any] = {}
        try:
            if ok and self.checkpoints is not None and self.checkpoints.resume:
                resumed = broadcast_object_from(quorum, self._read_checkpoint() if quorum.index == 0 else None, 0)
        except RuntimeError:
            ok = False
        if "state" in resumed:
            self._load_state(trainer, resumed["state"], rejoined=False)
            step = self._saved_at = trainer.state.step
            self.membership.continue_at(quorum, self.outer.rounds_until(step) if self.outer is not None else step)
            if not quorum.commit(ok):
                raise RuntimeError("the fault-tolerant job's first round failed (a rank was lost while it started)")
            return
        if "error" in resumed:  # the same error on every member
            quorum.commit(False)
            raise CheckpointError(resumed["error"])
        self._start_afresh(trainer, quorum, ok)

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

    def _start_afresh(self, trainer: Trainer, quorum: Quorum, ok: bool) -> None:
        flat = self._flat_params()
        try:
            if ok:
                broadcast_from_first(quorum, flat)
        except RuntimeError:
            ok = False
        if not quorum.commit(ok):
            raise RuntimeError("the fault-tolerant job's first round failed (a rank was lost while it started)")
        self._set_params(flat)
        if self.slow is not None:
            self.slow.x0.copy_(flat)  # type: ignore[union-attr]
        if self.push_sum is not None:
            self.push_sum.buffer[:-1].copy_(flat)

    def rejoin(self, trainer: Trainer) -> None:
        """Takes part in the next round that is decided with this rank in it, as a joiner: receives the live state
        and does the round's work with the others (counting zero in averages)."""
        round_ = self.membership.announce_join()
        while True:
            quorum = self.membership.quorum(round_)
            round_ = quorum.round + 1
            if not quorum.is_member:
                continue  # too late for it: the next round expects this rank
            try:
                if quorum.group is None:
                    raise RuntimeError("the round's group could not be made")
                state = heal_object(quorum, None)
            except RuntimeError:
                quorum.commit(False)
                round_ = self.membership.announce_join()
                continue
            self.quorum, self.round_ok = quorum, True
            self._load_state(trainer, state)
            self._note(quorum, trainer.state.step)
            if self.gossip is not None:
                if not self._gossip_work(quorum, True, trainer, joined=True, final=self.final):
                    round_ = self.membership.announce_join()  # the round failed: the state taken is not the others'
                    continue
                if not self.final and trainer.state.step < self.total_steps:
                    self._form_next(trainer.state.step + 1)
            elif self.outer is not None and self.final:
                self._outer_work(quorum, True, trainer, counts=False, slow=False)
            elif self.outer is not None:
                self._outer_work(quorum, True, trainer, counts=False)
            elif self.final:
                quorum.commit(True)
            return

    # -- per step ------------------------------------------------------------------------------------------------

    def begin(self, trainer: Trainer) -> None:
        """The job's first round (`_start`), before `trainer.fit` (so that a resumed state is in place before
        the other callbacks read it); `fit` calls it itself if it was not called."""
        self._start(trainer)
        if self.outer is None and trainer.state.step < self.total_steps:
            self._form_next(trainer.state.step + 1)

    def on_train_start(self, trainer: Trainer) -> None:
        if self.quorum is None:  # a rank that joined has its quorum already (and the next one on its way)
            self.begin(trainer)

    def _form_next(self, round_: int) -> None:
        """Per step: the next step's quorum is formed in the background while the step computes (the store's
        waits overlap forward and backward); `after_backward` takes it."""
        self._next = self._pool.submit(self.membership.quorum, round_)

    def _count_blocked(self, round_: int, since: float) -> None:
        """Adds the time since `since` to what round `round_`'s sync held up training on this rank."""
        held = self._blocked[1] if self._blocked[0] == round_ else 0.0
        self._blocked = (round_, held + time.monotonic() - since)

    def _take_next(self, trainer: Trainer) -> None:
        if self._next is not None:
            since = time.monotonic()
            future, self._next = self._next, None
            formed = future.result()  # re-raises what forming it raised (TooFewReplicas)
            self._live_round(formed.round, trainer, formed=formed)
            self._count_blocked(formed.round, since)  # the wait and the live state sent to joiners

    def after_backward(self, trainer: Trainer) -> None:
        if self.outer is not None or self.gossip is not None:
            return
        self._take_next(trainer)  # the live state sent to a joiner now is the step's start: nothing stepped yet
        quorum = self.quorum
        assert quorum is not None
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = torch.cat([g.detach().reshape(-1).to("cpu", torch.float32) for g in grads])
        since = time.monotonic()
        committed = _mean_and_commit(quorum, flat, self.round_ok and quorum.group is not None, counts=True)
        self._count_blocked(quorum.round, since)
        if committed:
            offset = 0
            for p, g in zip(self.params, grads, strict=True):
                p.grad = flat[offset : offset + p.numel()].view_as(p).to(g.device, g.dtype)
                offset += p.numel()
        else:
            for p in self.params:
                p.grad = None  # the step is skipped on every member
        self._note(quorum, trainer.state.step)

    def after_step(self, trainer: Trainer) -> None:
        step = trainer.state.step
        members = self.quorum
        with comm_stats.measure() as sent:  # the step's record is made: what this round sends is added to it
            if self.gossip is not None:
                assert self.push_sum is not None
                self.push_sum.absorb(self._flat_params())  # before the live state goes to a joiner
                self._take_next(trainer)  # (counts its own wait in the round's blocked seconds)
                since = time.monotonic()
                members = self.quorum
                assert members is not None
                self._gossip_work(members, self.round_ok and members.group is not None, trainer, since=since)
            if self.outer is None:
                if step < self.total_steps:
                    self._form_next(step + 1)
            elif self.outer.due(step):
                since = time.monotonic()
                quorum, ok = self._live_round(self.outer.rounds_until(step), trainer)
                self._outer_work(quorum, ok, trainer, counts=True, since=since)
        self._annotate(trainer, members, sent.sent_bytes())
        self._checkpoint(trainer)

    def _checkpoint(self, trainer: Trainer) -> None:
        """After a committed round at or past a multiple of --checkpoint-every: the round's first member saves."""
        step, quorum, plan = trainer.state.step, self.quorum, self.checkpoints
        if plan is None or quorum is None or not quorum.committed or not plan.due(self._saved_at, step):
            return
        if quorum.round != step if self.outer is None else not self.outer.due(step):
            return  # not this step's round: replicas differ until their next one (SlowMo), or it failed
        self._saved_at = step
        if quorum.index == 0:
            state = trainer.state
            state.carried["totals"] = self.recorder.totals()
            plan.save(self._live_state(trainer, final=False), step, state.epoch, state.epoch_samples)

    def _annotate(self, trainer: Trainer, quorum: Quorum | None, sent: float) -> None:
        """steps.csv: the members of the step's round, who joined or left in it, and the bytes of the round sent
        after the step's record was made."""
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

    def _gossip_work(
        self,
        quorum: Quorum,
        ok: bool,
        trainer: Trainer,
        joined: bool = False,
        final: bool = False,
        since: float | None = None,
    ) -> bool:
        """The round's push-sum work on the buffer the optimizer's step was absorbed into (or, for a rank that
        `joined`, the one it received), committed; then slow momentum on an exact round when due, and the model
        ``x / w`` into the parameters. Returns the verdict. The `final` round (the job's last) is an exact
        average without a slow step (the last step's round made it already when due)."""
        gossip, push_sum, step = self.gossip, self.push_sum, trainer.state.step
        assert gossip is not None and push_sum is not None
        exact = final or gossip.exact(step)
        committed = push_sum.run(quorum, ok, exact)
        if since is not None:
            self._count_blocked(quorum.round, since)
        slow_due = not final and step % gossip.slow_every == 0
        if committed and slow_due and self.slow is not None and gossip.rule is not None:
            x = push_sum.buffer[:-1]  # w is one after an exact round
            self.slow.local_step(x, float(self.optimizer.param_groups[0]["lr"]), gossip.rule)
        if committed or not joined:
            self._set_params(push_sum.model())
        self._note(quorum, step)
        return committed

    # -- per outer sync ------------------------------------------------------------------------------------------

    def _outer_work(
        self, quorum: Quorum, ok: bool, trainer: Trainer, counts: bool, slow: bool = True, since: float | None = None
    ) -> None:
        """The parameters' mean over the members, committed; then slow momentum when due (and `slow`). `since`:
        when the round began holding up training (its time is counted in the round's `blocked_seconds`)."""
        flat = self._flat_params()
        committed = _mean_and_commit(quorum, flat, ok, counts)
        if since is not None:
            self._count_blocked(quorum.round, since)
        if committed:
            step, outer = trainer.state.step, self.outer
            assert outer is not None
            if slow and self.slow is not None and outer.rule is not None and step % outer.slow_every == 0:
                lr = float(self.optimizer.param_groups[0]["lr"])
                self.slow.local_step(flat, lr, outer.rule)
            self._set_params(flat)
        self._note(quorum, trainer.state.step)

    # -- the end -------------------------------------------------------------------------------------------------

    def finish(self, trainer: Trainer) -> Quorum:
        """The job's last round (unless this rank joined in it): the live state to late joiners, and with local
        SGD a last exact average, so that every replica ends alike (as SlowMo's `average_parameters`)."""
        if self.final:
            assert self.quorum is not None
            return self.quorum
        step = trainer.state.step
        if self.gossip is not None:  # a last exact average: every replica ends with the same model
            quorum, ok = self._live_round(step + 1, trainer, final=True)
            self._gossip_work(quorum, ok, trainer, final=True)
        elif self.outer is None:
            quorum, ok = self._live_round(step + 1, trainer, final=True)
            quorum.commit(ok)
        else:
            quorum, ok = self._live_round(self.outer.rounds_until(step) + 1, trainer, final=True)
            self._outer_work(quorum, ok, trainer, counts=True, slow=False)
        self._note(quorum, step)
        self.final = True
        return quorum


def _mean_and_commit(quorum: Quorum, flat: torch.Tensor, ok: bool, counts: bool) -> bool:
    """`flat` averaged over the members (if all went well so far), then the round's verdict (`Quorum.commit`)."""
    try:
        if ok:
            quorum_mean(quorum, flat, counts=counts)
    except RuntimeError:
        ok = False
    return quorum.commit(ok)
