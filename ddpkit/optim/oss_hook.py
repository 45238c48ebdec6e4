"""ZeRO-1 at DDP's bytes: a DDP communication hook that sums each gradient onto its OSS owner only.

OSS + torch DDP normally all-reduces every gradient (2 (N-1)/N of the model per rank) and then broadcasts every
parameter from its owner ((N-1)/N more): 1.5x DDP's bytes. Only the owner of a parameter ever reads its averaged
gradient, so this hook replaces DDP's all-reduce by one reduce per run of a bucket's elements that share an owner
(OSS's owners, or the pieces of a split parameter): each gradient byte is sent once to its owner, and with OSS's
broadcast the step moves exactly DDP's bytes (2 (N-1)/N per rank with bandwidth-optimal collectives).

After backward the owners hold DDP's averaged gradient for what they own; the other ranks' gradients for those
elements are not meaningful (the backend may use them as scratch), as with ShardedDataParallel, which drops them.
So accumulate gradients over several backward passes inside ``ddp_model.no_sync()`` (then one synced backward),
and clear them before the next synced backward: a second synced backward on top of uncleared gradients would add
the other ranks' meaningless values (plain DDP tolerates that because every rank holds the average).
`OSS.clip_grad_norm` and `ShardedGradScaler` read only the owners'. (No postponed annotations here: DDP inspects
the hook's real annotations.)
"""

import torch
import torch.distributed as dist

from ddpkit.distributed import comm
from ddpkit.optim.oss import OSS


def owner_runs(optimizer: OSS, params: list[torch.Tensor]) -> list[tuple[int, int, int]]:
    """(owner, start, end) over the concatenated flat gradients of `params`, consecutive elements of one owner
    merged; a parameter OSS does not optimize counts as rank 0's."""
    runs: list[tuple[int, int, int]] = []
    offset = 0
    for p in params:
        pieces = optimizer.pieces_of(p)
        spans = [(piece.owner, piece.start, piece.end) for piece in pieces] or [
            (optimizer.owner_of(p) or 0, 0, p.numel())
        ]
        for owner, start, end in spans:
            if end == start:
                continue
            if runs and runs[-1][0] == owner and runs[-1][2] == offset + start:
                runs[-1] = (owner, runs[-1][1], offset + end)
            else:
                runs.append((owner, offset + start, offset + end))
        offset += p.numel()
    return runs


def reduce_to_owners_hook(optimizer: OSS, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Sums each run of the bucket onto its owner (one reduce per run) and divides the owner's runs by N.

    Register with ``ddp_model.register_comm_hook(optimizer, reduce_to_owners_hook)``, where `optimizer` is the
    OSS that optimizes the model's parameters over DDP's process group.

    Args:
        optimizer: the hook's state: the OSS over DDP's process group.
        bucket: the gradient bucket DDP hands the hook.
    """
    buffer = bucket.buffer()
    world = optimizer.world_size
    runs = owner_runs(optimizer, list(bucket.parameters()))
    futures = [comm.reduce_collective(buffer[a:b], owner, optimizer.group).get_future() for owner, a, b in runs]
    mine = [(a, b) for owner, a, b in runs if owner == optimizer.rank]

    def average(_: torch.futures.Future) -> torch.Tensor:
        for a, b in mine:
            buffer[a:b].div_(world)
        return buffer

    return torch.futures.collect_all(futures).then(average)
