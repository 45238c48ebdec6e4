"""SlowMo's averaging between nodes through pseudo-gradients: compressed, in fragments, overlapped (DiLoCo family).

`OuterSync` replaces SlowMo's exact parameter average between nodes when one of `OuterSyncSettings` asks for it.
Its algorithm (DiLoCo, Douillard et al. 2023; Streaming DiLoCo, Douillard et al. 2025; error feedback as in
Seide et al. 2014 and Karimireddy et al. 2019) is spelled out in `OuterSync`'s docstring. Whom a sync averages
with is its `OuterLink`: the plain job's nodes (`NodeLink`, fixed for the job), or a fault-tolerant job's round,
given per sync (`ddpkit.algorithms.fault_tolerant.FaultTolerantOuterSync`): one implementation for both.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from ddpkit.algorithms.averager import AveragingContext, AveragingOptions, register_averager
from ddpkit.algorithms.compressed_mean import PendingMean, start_compressed_mean
from ddpkit.algorithms.exact import average_between_nodes
from ddpkit.algorithms.gossip_checks import warn_sgp_only
from ddpkit.algorithms.pseudo_gradient_settings import MERGE_ALPHA, OuterSyncSettings
from ddpkit.algorithms.quantize import dequantize, quantize
from ddpkit.algorithms.slow_momentum import SlowBuffers, SlowMoRule
from ddpkit.distributed import comm
from ddpkit.distributed.groups import NodeGroups

__all__ = ["MERGE_ALPHA", "NodeLink", "OuterLink", "OuterSync", "OuterSyncSettings", "PseudoGradientAverager"]
__all__ += ["fragment_bounds", "fragment_shifts"]


def fragment_bounds(sizes: list[int], k: int) -> list[tuple[int, int]]:
    """Splits a flat vector of tensors of `sizes` elements into `k` contiguous [start, end) fragments of nearly
    equal size: cut j lies at j/k of the elements, moved to the nearest tensor boundary when that is at most
    1/(4k) of the elements away (so whole tensors where possible). Every fragment holds at most 1/k of the
    elements plus one tensor, and at least one element."""
    total = sum(sizes)
    edges = list(itertools.accumulate(sizes))
    cuts = [0]
    for j in range(1, k):
        ideal = (j * total + k // 2) // k
        low, high = cuts[-1] + 1, total - (k - j)
        near = [e for e in edges if low <= e <= high and 4 * k * abs(e - ideal) <= total]
        cut = min(near, key=lambda e: (abs(e - ideal), e)) if near else min(max(ideal, low), high)
        cuts.append(cut)
    cuts.append(total)
    return list(itertools.pairwise(cuts))


def fragment_shifts(localsgd_frequency: int, fragments: int) -> list[int]:
    """Each fragment's offset ``s_j = H - (j + 1) H // K`` (`OuterSync`): fragment j syncs after step t when
    ``(t + s_j) % H == 0`` (H = `localsgd_frequency`, K = `fragments`)."""
    h, k = localsgd_frequency, fragments
    return [h - (j + 1) * h // k for j in range(k)]


class OuterLink(Protocol):
    """Whom one sync averages with, and how (`OuterSync`): the plain job's nodes (`NodeLink`, the same for every
    sync) or a fault-tolerant round's members (`ddpkit.algorithms.fault_tolerant.RoundLink`, given per sync)."""

    @property
    def replicas(self) -> int:
        """The replicas (nodes) the mean is over; 1: there is nothing to average with."""
        ...

    @property
    def counts(self) -> bool:
        """Whether this rank's pseudo-gradient counts in the mean (else it takes the others' mean, and its
        residual is left as it was: nothing it sent was used)."""
        ...

    def start(self, d: torch.Tensor, settings: OuterSyncSettings) -> PendingMean | None:
        """Starts the compressed mean of `d`; None on a rank that receives it at `share` instead."""
        ...

    def share(self, mean: torch.Tensor | None, numel: int, device: torch.device) -> torch.Tensor:
        """The mean on every rank of this replica (`mean`: what `start`'s mean gave, None where it gave none)."""
        ...


class NodeLink:
    """The plain job's `OuterLink`: the node masters' group between nodes, and a broadcast inside each node
    (`NodeGroups`, fixed for the job); every node counts."""

    counts = True

    def __init__(self, groups: NodeGroups) -> None:
        self.groups = groups

    @property
    def replicas(self) -> int:
        return self.groups.num_nodes

    def start(self, d: torch.Tensor, settings: OuterSyncSettings) -> PendingMean | None:
        if self.groups.master is None:
            return None
        return start_compressed_mean(d, self.groups.master, settings.compression, settings.block)

    def share(self, mean: torch.Tensor | None, numel: int, device: torch.device) -> torch.Tensor:
        if self.groups.nprocs_per_node > 1:  # the node master shares it
            mean = mean if mean is not None else torch.empty(numel, device=device)
            comm.broadcast(mean, 0, self.groups.local)
        assert mean is not None
        return mean


@dataclass
class _InFlight:
    """One fragment's sync between its start and its merge."""

    start: int  # the step after which it started
    slow: bool  # whether the merge applies slow momentum
    lr: float  # the base optimizer's learning rate when it started
    work: PendingMean | None = None  # node masters, while the mean travels
    mean: torch.Tensor | None = None  # node masters, once it arrived (non-masters get it at the merge)
    link: OuterLink | None = None  # whom it averages with (None: the sync's own link, `OuterSync.link`)


class OuterSync:
    """Averaging between nodes through quantised pseudo-gradients, fragment by fragment, optionally overlapped.

    Every node (all its ranks alike) keeps the synchronised copy ``g`` of the parameters (bit-identical on every
    rank). Fragment j of the flat parameters (`fragment_bounds`: K pieces balanced by elements, i.e. by bytes as
    every parameter is fp32; whole tensors where possible) starts a sync after step t when
    ``(t + s_j) % localsgd_frequency == 0`` (and, slow momentum on, when ``(t + s_j) % slowmo_frequency == 0``),
    with ``s_j = H - (j + 1) H // K`` (H = localsgd_frequency): the fragments start at evenly spaced steps of each
    period, the last one where SlowMo alone would average. A sync:

    1. each node's pseudo-gradient ``d = g - x`` (+ its error-feedback residual e) goes to `compressed_mean`
       among node masters (quantised all-to-all to chunk owners, fp32 sum, re-quantised all-gather); with error
       feedback ``e = d - dequantize(quantize(d))``, what quantisation dropped, joins the next sync;
    2. after `sync_delay` (tau) more steps, during which the mean travels in the background, the mean D is
       broadcast inside each node and merged: ``g = g - D``, then on a slow step SlowMo's rule moves g (``u = beta
       u + (x0 - g)/lr; x0 -= alpha lr u`` or Nesterov's, g = x0, lr from the sync's start);
    3. the node's parameters become ``x = g`` (tau = 0), or Streaming DiLoCo's merge ``x = a x + (1 - a) g`` with
       a = `merge_alpha` (tau > 0: x has moved on for tau steps).

    Communication per sync of a fragment of F elements: between node masters, 2 (N-1)/N of its quantised size
    (`payload_bytes`) per master (exactly 2 (N-1) of it over all masters; a master owning a chunk one block longer
    sends up to N-2 blocks' bytes more); inside a node, one fp32 broadcast of F elements. No step starts more
    than about 1/K of the model (when slowmo_frequency is a multiple of localsgd_frequency).
    Memory: g (P fp32), the residual (P fp32, with error feedback and compression), each sync in flight (its
    pseudo-gradient and mean, about P/K each), and SlowMo's x0 and u whole (2P) on every rank.

    Whom a sync averages with is its `OuterLink`: `groups` (a plain job's nodes, `NodeLink`), or, with `groups`
    None, the link each `step` is given (a fault-tolerant job's round: `ddpkit.algorithms.fault_tolerant.
    FaultTolerantOuterSync`, whose members change between syncs). A rank whose link says it does not count sends
    its part but is left out of the mean (it receives the others'), and keeps its residual; a link of one replica
    averages nothing: the pseudo-gradient is applied whole, residual included (which becomes zero).
    """

    def __init__(
        self,
        flat: torch.Tensor,
        sizes: list[int],
        settings: OuterSyncSettings,
        groups: NodeGroups | None,
        slow: tuple[SlowBuffers, SlowMoRule] | None,
        frequencies: tuple[int, int | None],
    ) -> None:
        self.settings = settings
        self.groups = groups
        self.link: OuterLink | None = NodeLink(groups) if groups is not None else None
        self.slow = slow
        self.localsgd_frequency, self.slowmo_frequency = frequencies
        self.bounds = fragment_bounds(sizes, settings.fragments)
        self.shifts = fragment_shifts(self.localsgd_frequency, settings.fragments)
        self.synced = flat.detach().float().clone()
        several = groups is None or groups.num_nodes > 1  # (a fault-tolerant job's rounds may have several)
        keep_residual = settings.error_feedback and settings.compression != "none" and several
        self.residual = torch.zeros_like(self.synced) if keep_residual else None
        self.in_flight: dict[int, _InFlight] = {}

    def starting(self, step: int) -> list[tuple[int, bool]]:
        """The fragments whose sync starts after step `step`, each with whether it is a slow step."""
        out = []
        for j, shift in enumerate(self.shifts):
            slow = self.slowmo_frequency is not None and (step + shift) % self.slowmo_frequency == 0
            if slow or (step + shift) % self.localsgd_frequency == 0:
                out.append((j, slow))
        return out

    def merging(self, step: int) -> list[int]:
        # "<=": a sync restored from a checkpoint of a longer delay merges at once (exactly "==" otherwise)
        return sorted(j for j, f in self.in_flight.items() if f.start + self.settings.sync_delay <= step)

    def busy(self, step: int) -> bool:
        """Whether step `step` starts or merges a sync (else `step` has nothing to do)."""
        return bool(self.merging(step) or self.starting(step))

    def step(self, flat: torch.Tensor, step: int, lr: float, link: OuterLink | None = None) -> None:
        """After the base optimizer's step `step`: merges the syncs due, starts the new ones (in place on `flat`),
        those over `link` (default: the nodes of `groups`)."""
        for j in self.merging(step):
            self._merge(flat, j)
        for j, slow in self.starting(step):
            self._start(flat, j, _InFlight(step, slow, lr, link=link or self.link))
            if self.settings.sync_delay == 0:
                self._merge(flat, j)

    def flush(self, flat: torch.Tensor) -> None:
        """Merges every sync in flight now (a collective inside nodes)."""
        for j in sorted(self.in_flight):
            self._merge(flat, j)

    def _start(self, flat: torch.Tensor, j: int, flight: _InFlight) -> None:
        a, b = self.bounds[j]
        d = self.synced[a:b] - flat[a:b]
        link = flight.link
        assert link is not None, "OuterSync.step: no link (a job without groups gives one per sync)"
        if self.residual is not None:
            d.add_(self.residual[a:b])
        if link.replicas == 1:
            flight.mean = d  # nothing to average with
        else:  # travels in the background until `_arrived` waits for it (None: not a node master)
            flight.work = link.start(d, self.settings)
        if self.residual is not None and link.counts:
            self.residual[a:b] = d - self._sent(d, flight) if link.replicas > 1 else 0.0
        self.in_flight[j] = flight

    def _sent(self, d: torch.Tensor, flight: _InFlight) -> torch.Tensor:
        """What this rank's messages of `d` carry (a master's say it; a node's other ranks quantise as it did)."""
        s = self.settings
        return flight.work.sent_values() if flight.work is not None else dequantize(quantize(d, s.compression, s.block))

    def _arrived(self, flight: _InFlight) -> torch.Tensor | None:
        """The mean of a sync on node masters (waiting for it if it still travels); None on the other ranks."""
        if flight.work is not None:
            flight.mean, flight.work = flight.work.wait(), None
        return flight.mean

    def _merge(self, flat: torch.Tensor, j: int) -> None:
        flight = self.in_flight.pop(j)
        a, b = self.bounds[j]
        mean = self._arrived(flight)
        if flight.link is not None and flight.link.replicas > 1:
            mean = flight.link.share(mean, b - a, self.synced.device)
        assert mean is not None
        synced = self.synced[a:b]
        synced.sub_(mean)
        if flight.slow and self.slow is not None:
            buffers, rule = self.slow
            assert buffers.x0 is not None and buffers.u is not None
            rule.apply(buffers.x0[a:b], buffers.u[a:b], synced, flight.lr)
        if self.settings.sync_delay:
            alpha = self.settings.merge_alpha
            flat[a:b].mul_(alpha).add_(synced, alpha=1.0 - alpha)
        else:
            flat[a:b].copy_(synced)

    # -- checkpoints ------------------------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """The synchronised copy, the residual and the syncs in flight (on node masters their mean, waited for:
        every rank sent its part when the sync started; the others get it from their master at the merge)."""
        flights = {
            j: {"start": f.start, "slow": f.slow, "lr": f.lr, "mean": _clone(self._arrived(f))}
            for j, f in self.in_flight.items()
        }
        return {
            "outer_synced": self.synced.clone(),
            "outer_residual": _clone(self.residual),
            "outer_bounds": list(self.bounds),
            "outer_in_flight": flights,
        }

    def load(self, state: dict[str, Any]) -> None:
        """Restores `state()`'s output, saved by the same rank of a job of the same shape and fragments. Another
        compression, error feedback or delay is taken: a residual saved without error feedback starts at zero (one
        saved with it is dropped without), and a sync whose merge step has passed under a shorter delay merges at
        the next step."""
        if "outer_synced" not in state:
            raise ValueError(
                "load_slowmo_state_dict: the checkpoint has no pseudo-gradient state (it was saved without "
                "slowmo_compression, slowmo_fragments or slowmo_sync_delay)"
            )
        if [tuple(b) for b in state["outer_bounds"]] != self.bounds:
            raise ValueError(
                f"load_slowmo_state_dict: the checkpoint's fragments {state['outer_bounds']} differ from this "
                f"model's {self.bounds} (another slowmo_fragments or model)"
            )
        for flight in self.in_flight.values():  # a live sync of this run: complete its transfers before dropping it
            self._arrived(flight)
        self.synced.copy_(state["outer_synced"])
        if self.residual is not None:  # saved without error feedback: the residual starts at zero
            saved = state["outer_residual"]
            self.residual.copy_(saved) if saved is not None else self.residual.zero_()
        device = self.synced.device
        self.in_flight = {
            int(j): _InFlight(f["start"], f["slow"], f["lr"], mean=_clone(f["mean"], device), link=self.link)
            for j, f in state["outer_in_flight"].items()
        }


def _clone(t: torch.Tensor | None, device: torch.device | None = None) -> torch.Tensor | None:
    return None if t is None else t.to(device if device is not None else t.device, copy=True)


@register_averager("pseudo_gradient")
class PseudoGradientAverager(OuterSync):
    """`OuterSync` as SlowMo's averaging mode (chosen by `slowmo_compression`, `slowmo_fragments` or
    `slowmo_sync_delay`); it keeps the slow buffers whole on every rank."""

    name = "pseudo_gradient"
    shards_slow_buffers = False

    def __init__(self, ctx: AveragingContext) -> None:
        slow = (ctx.slow.buffers, ctx.slow.rule) if ctx.slow.buffers is not None else None
        frequencies = (ctx.options.localsgd_frequency, ctx.slow.frequency if slow is not None else None)
        super().__init__(ctx.flat, ctx.sizes, ctx.options.outer, ctx.groups, slow, frequencies)

    @classmethod
    def prepare(cls, options: AveragingOptions) -> tuple[dict[str, Any], Any]:
        warn_sgp_only(**options.sgp_args)
        return {}, None

    def due(self, step: int) -> bool:
        return self.busy(step)

    def average_now(self, flat: torch.Tensor) -> None:
        self.flush(flat)
        assert self.groups is not None
        average_between_nodes(flat, self.groups)
