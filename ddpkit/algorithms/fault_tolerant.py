"""Local SGD whose nodes may come and go: an exact average per round over the ranks that reached its quorum.

The first piece of fault-tolerant training (issue 24), at the library level: `FaultTolerantLocalSGD.sync`, called
every `localsgd_frequency` steps, forms the round's quorum (`ddpkit.distributed.membership`), sends the live state
to ranks that joined since the previous round (`heal`), replaces the parameters by their mean over the members
that were already in step (joiners count zero: they take the mean, they do not move it) and commits: if any step
of the round failed on any member (a member died mid-round, a collective timed out), every member restores its
parameters as they were before the round, so replicas never diverge. A rank left out of a round (late, stalled)
skips to the next round to be decided (its steps since the last round are lost) and is healed when it gets in.
Nothing waits on a dead rank for longer than `quorum_timeout`.

Communication per round: the quorum's store round trips, one gloo group, an all-reduce of the P parameters among
the members (plus a broadcast of the state to joiners). Memory: one copy of the parameters during a round.
"""

from __future__ import annotations

import torch

from ddpkit.distributed.membership import Membership, Quorum, heal, quorum_mean


class FaultTolerantLocalSGD:
    """Exact averaging of a flat parameter vector among the live ranks of a fault-tolerant job (module doc).

    `rejoining`: this process replaces a rank that was lost (or starts late); it announces itself and takes part
    from the next round on, receiving `state` tensors (optimizer state, data position, ...) from a live member.
    """

    def __init__(self, membership: Membership, rejoining: bool = False) -> None:
        self.membership = membership
        self.round = membership.announce_join() if rejoining else 0
        self.history: list[Quorum] = []

    def sync(self, flat: torch.Tensor, state: list[torch.Tensor] | None = None) -> Quorum:
        """One round on the flat fp32 parameters `flat` (in place). Returns the round's quorum; raises
        `TooFewReplicas` on every rank when fewer than `min_replicas` made it."""
        quorum = self.membership.quorum(self.round)
        self.round += 1
        self.history.append(quorum)
        if not quorum.is_member:  # left behind (late, stalled): skip to the next round to be decided, and get healed
            self.round = max(self.round, self.membership.announce_join())
            return quorum
        before = flat.clone()
        ok = quorum.group is not None  # None: a member vanished before the round's group was made
        try:
            if not ok:
                raise RuntimeError("the round's group could not be made")
            heal(quorum, list(state or []))
            quorum_mean(quorum, flat, counts=self.membership.rank not in quorum.joined)
        except RuntimeError:  # a member died or stalled during the round
            ok = False
        if not quorum.commit(ok):
            flat.copy_(before)
        return quorum
