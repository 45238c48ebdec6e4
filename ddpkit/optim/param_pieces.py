"""Large parameters cut into one contiguous piece per rank, each piece optimized by its own rank.

Why: OSS gives each parameter whole to one rank, so a model dominated by one tensor (a 2048x2048 weight and its
Adam moments) cannot spread its optimizer state below that tensor's share, however many ranks there are. Cutting
such a parameter into N pieces of its flattened elements, piece k owned by rank k, brings the state per rank to
about 1/N of the model.

This is exact only for optimizers whose update of an element reads nothing but that element's own values and
per-parameter scalars that every piece has alike (its step count): torch's SGD, Adam, AdamW, Adamax, NAdam, RAdam,
RMSprop, Adagrad, Adadelta and Rprop (`SPLITTABLE`). An optimizer that looks at a whole tensor (LAMB's trust
ratio, Adafactor's row and column factors, Shampoo) would compute another update on a piece, so it is never cut.

A piece is a leaf tensor that views its slice of the parameter's (contiguous) storage: the local optimizer updates
the parameter in place, and its state has the piece's shape (1-D). Before every step the view and its gradient
(a view of the slice of ``param.grad``) are refreshed, since a parameter's storage can be replaced
(``module.to(...)``). Where ShardedDataParallel let the full-size gradient go after the reduce (``param.grad`` is
None), the piece holds its own gradient, only its share (`ParamPiece.hold`). Checkpoints stay in torch's
whole-parameter format: `join_states` puts the pieces' states back together and `cut_state` takes a piece's share
out of a whole parameter's state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.optim import Optimizer

from ddpkit.optim.state_dict import clone_state

SPLITTABLE: frozenset[type[Optimizer]] = frozenset(
    {
        torch.optim.SGD,
        torch.optim.Adam,
        torch.optim.AdamW,
        torch.optim.Adamax,
        torch.optim.NAdam,
        torch.optim.RAdam,
        torch.optim.RMSprop,
        torch.optim.Adagrad,
        torch.optim.Adadelta,
        torch.optim.Rprop,
    }
)
"""torch optimizers whose update is element-wise (exactly these classes: a subclass may change that)."""

MIN_SPLIT_NUMEL = 2**20
"""Parameters below this many elements are never cut by default: their state is small, and each piece costs a
message of its own."""


@dataclass(eq=False)
class ParamPiece:
    """Elements ``[start, end)`` of `param` (flattened), optimized by `owner` through the leaf tensor `tensor`."""

    param: torch.Tensor
    start: int
    end: int
    owner: int
    tensor: torch.Tensor
    held: bool = False  # `tensor.grad` is the piece's own gradient, kept apart while ``param.grad`` is None (`hold`)

    @classmethod
    def cut(cls, param: torch.Tensor, start: int, end: int, owner: int) -> ParamPiece:
        return cls(param, start, end, owner, _slice(param.detach(), start, end).clone())

    def refresh(self) -> None:
        """Points `tensor` at its slice of the parameter's current storage, and its gradient at the slice of the
        parameter's gradient (None without one)."""
        if not self.param.is_contiguous():
            raise RuntimeError(
                "OSS: a parameter cut into pieces over the ranks became non-contiguous (e.g. channels_last); "
                "keep its memory format, or build OSS with split_params=False"
            )
        view = _slice(self.param.detach(), self.start, self.end)
        if self.tensor.data_ptr() != view.data_ptr() or self.tensor.device != view.device:
            self.tensor.data = view
        grad = self.param.grad
        if grad is not None:
            self.tensor.grad, self.held = _slice(grad, self.start, self.end), False
        elif not self.held:
            self.tensor.grad = None

    def grad_slice(self) -> torch.Tensor | None:
        """This piece's gradient: its slice of ``param.grad``, else the one it holds apart (`hold`), else None."""
        grad = self.param.grad
        if grad is not None:
            return _slice(grad, self.start, self.end)
        return self.tensor.grad if self.held else None

    def hold(self, grad: torch.Tensor) -> None:
        """Keeps `grad` (the piece's 1-D gradient, a tensor of its own) as the piece's gradient, for a parameter
        whose full-size gradient was let go (ShardedDataParallel does so after the reduce)."""
        self.tensor.grad, self.held = grad, True

    def clear_grad(self, set_to_none: bool = True) -> None:
        """Clears a gradient the piece holds apart (as ``zero_grad`` clears ``param.grad``)."""
        if not self.held or self.tensor.grad is None:
            return
        if set_to_none:
            self.tensor.grad, self.held = None, False
        else:
            self.tensor.grad.zero_()


def _slice(tensor: torch.Tensor, start: int, end: int) -> torch.Tensor:
    return tensor.reshape(-1)[start:end]


def can_split(optim: type[Optimizer], param: torch.Tensor) -> bool:
    """Whether `param` may be cut into pieces under `optim` (element-wise, floating-point, contiguous)."""
    return optim in SPLITTABLE and param.is_floating_point() and param.is_contiguous()


def join_states(param: torch.Tensor, pieces: Sequence[Mapping[str, Any]], spans: Sequence[tuple[int, int]]) -> dict:
    """One parameter's state in torch's format from its pieces' states (in piece order): per-element entries (a
    tensor of the piece's 1-D shape) are concatenated and take the parameter's shape; any other entry (the step
    count, per-parameter scalars) is the same on every piece and taken from the first."""
    joined: dict[str, Any] = {}
    for name, first in pieces[0].items():
        if _per_element(first, spans[0]):
            parts = [state[name] for state in pieces]
            joined[name] = torch.cat([part.reshape(-1) for part in parts]).reshape(param.shape)
        else:
            joined[name] = first
    return joined


def cut_state(state: Mapping[str, Any], param: torch.Tensor, start: int, end: int) -> dict[str, Any]:
    """A piece's share of a whole parameter's state (torch's format): entries with the parameter's shape are
    sliced, others copied; nothing is shared with `state`."""
    out = clone_state(state)
    for name, value in out.items():
        if isinstance(value, torch.Tensor) and tuple(value.shape) == tuple(param.shape):
            out[name] = _slice(value, start, end).clone()
    return out


def _per_element(value: Any, span: tuple[int, int]) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == span[1] - span[0]
