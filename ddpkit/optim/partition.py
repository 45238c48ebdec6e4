"""Which rank owns which parameter: a pure, deterministic function of sizes and current loads."""

from __future__ import annotations

from collections.abc import Sequence


def assign_owners(sizes: Sequence[int], loads: list[int]) -> list[int]:
    """Gives each item (by its size) to one rank and returns the owner of each item, in input order.

    Largest items first, each to the least-loaded rank (lowest rank on ties): the classic greedy rule, within
    the largest item of a perfect balance. `loads` (what each rank already owns, in the unit of `sizes`: OSS
    uses bytes, so that parameters of different dtypes balance memory, not element counts) is updated in place,
    so a later call for new parameters leaves earlier owners where they are. Ties are broken by position, never
    by anything that differs between processes, so every rank computes the same answer.
    """
    if not loads:
        raise ValueError("assign_owners: loads must have one entry per rank")
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(len(loads)), key=lambda r: (loads[r], r))
        owners[index] = rank
        loads[rank] += sizes[index]
    return owners


def even_spans(numel: int, parts: int) -> list[tuple[int, int]]:
    """`parts` contiguous ``[start, end)`` ranges covering ``range(numel)``, sizes differing by at most one
    (the first ``numel % parts`` ranges one element longer)."""
    base, extra = divmod(numel, parts)
    spans, start = [], 0
    for index in range(parts):
        end = start + base + (1 if index < extra else 0)
        spans.append((start, end))
        start = end
    return spans


def choose_splits(sizes: Sequence[int], candidates: Sequence[bool], ranks: int, tolerance: float) -> set[int]:
    """The items (indices into `sizes`) to cut into `ranks` equal pieces, one per rank, so that the most-loaded
    rank holds at most ``(1 + tolerance)`` times a perfect share: none when greedy ownership of whole items
    already does; otherwise the fewest candidates, largest first (ties by position), that do; when no number of
    them does, the number that leaves the smallest maximum. A pure function of its inputs, so every rank agrees."""
    order = sorted((i for i in range(len(sizes)) if candidates[i]), key=lambda i: (-sizes[i], i))
    limit = (1.0 + tolerance) * sum(sizes) / ranks
    best, best_load = 0, float("inf")
    for count in range(len(order) + 1):
        load = _max_load(sizes, set(order[:count]), ranks)
        if load <= limit:
            return set(order[:count])
        if load < best_load:
            best, best_load = count, load
    return set(order[:best])


def _max_load(sizes: Sequence[int], cut: set[int], ranks: int) -> int:
    loads = [sum(sizes[i] for i in cut) // ranks] * ranks  # every rank holds one piece of each cut item
    assign_owners([size for i, size in enumerate(sizes) if i not in cut], loads)
    return max(loads)
