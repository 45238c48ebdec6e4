"""`ddpkit.fault_tolerance.reachability`: which ranks a round keeps after a failed round's members reported whom
they could not reach. The definition: the kept ranks can reach each other (no report separates any two of them),
every candidate no report names is kept, a rank that every other candidate names is dropped once there are three
or more, and the probe itself counts a closed port unreached and a listening one reached."""

from __future__ import annotations

import itertools
import socket

from hypothesis import given
from hypothesis import strategies as st

from ddpkit.fault_tolerance.reachability import (
    ReachListener,
    format_report,
    parse_reports,
    reachable_side,
)


def test_a_rank_cut_off_from_every_peer_is_dropped_and_the_others_kept():
    reports = {0: [3], 1: [3], 2: [3], 3: [0, 1, 2]}
    assert reachable_side([0, 1, 2, 3], reports) == [0, 1, 2]
    assert reachable_side([0, 1, 2, 3], {3: [0, 1, 2]}) == [0, 1, 2]  # (only the cut-off rank reported)
    assert reachable_side([0, 1], {0: [1], 1: [0]}) == [0]  # two apart: one side, the same for every decider
    assert reachable_side([0, 1, 2], {}) == [0, 1, 2]


def _cuts(n: int) -> st.SearchStrategy:
    rank = st.integers(0, n - 1)
    return st.tuples(st.just(n), st.sets(st.tuples(rank, rank)))


@given(st.integers(1, 7).flatmap(_cuts))
def test_the_kept_ranks_reach_each_other_and_nobody_unnamed_is_dropped(case):
    n, cuts = case
    cuts = {(a, b) for a, b in cuts if a != b}
    reports: dict[int, list[int]] = {}
    for a, b in sorted(cuts):
        reports.setdefault(a, []).append(b)
    kept = reachable_side(list(range(n)), reports)
    separated = cuts | {(b, a) for a, b in cuts}
    assert all((a, b) not in separated for a, b in itertools.combinations(kept, 2))
    named = {x for pair in separated for x in pair}
    assert set(range(n)) - named <= set(kept)  # a rank nobody's report touches is always kept
    assert kept  # a decision always has members
    assert parse_reports("".join(format_report(r, p) for r, p in reports.items())) == reports


def test_a_probe_counts_a_listener_reached_and_a_closed_port_unreached():
    from ddpkit.fault_tolerance.reachability import _connects

    listener = ReachListener("127.0.0.1")
    assert _connects(listener.address)
    listener.close()
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{s.getsockname()[1]}"
    assert not _connects(closed)
