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
