"""What failed, from an exception raised inside a fault-tolerant round: a peer, the store, or this rank itself.

A fault-tolerant round treats a peer's failure (it died or stalled in a collective) as a failed round that the
members drop and retry, and the loss of the job's store as the end of this rank's part; every other error is a
bug or a refusal of this rank's own, and is raised as it is: retrying could never make it pass.
"""

from __future__ import annotations

import torch.distributed as dist

from ddpkit.fault_tolerance.membership import TooFewReplicas


def is_store_loss(exc: BaseException) -> bool:
    """Whether `exc` says the store's connection broke (its host is gone, or no etcd member answered), not a wait
    that timed out."""
    return isinstance(exc, dist.DistNetworkError)


def is_peer_failure(exc: BaseException) -> bool:
    """Whether `exc`, raised by a collective of the round, says a peer failed in it: torch's distributed errors
    (a broken connection, a timeout), or the errors gloo's transport raises (a reset connection, a receive that
    timed out), which name a file of gloo's source. Errors of this rank's own making (a shape that differs, a
    bug, `TooFewReplicas`) are not."""
    if isinstance(exc, TooFewReplicas):
        return False
    if isinstance(exc, dist.DistError):
        return True
    return type(exc) is RuntimeError and "gloo/" in str(exc)
