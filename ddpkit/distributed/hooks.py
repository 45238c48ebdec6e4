"""A DDP communication hook that averages gradients like DDP's default and records them in `comm_stats`.

torch's DDP all-reduces its buckets from C++, out of sight of Python wrappers; registering this hook
(``ddp.register_comm_hook(None, counting_allreduce_hook)``) makes DDP's traffic count like ddpkit's, so the two
can be compared byte for byte. (No postponed annotations here: DDP inspects the hook's real annotations.)
"""

import torch
import torch.distributed as dist

from ddpkit.distributed import comm
from ddpkit.distributed.env import ProcessGroup, group_size


def counting_allreduce_hook(
    process_group: "ProcessGroup | None", bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Divides the bucket by the world size and all-reduces it (sum), counting the call.

    Args:
        process_group: the hook's state: DDP's process group (None: the default group).
        bucket: the gradient bucket DDP hands the hook.
    """
    buffer = bucket.buffer()
    buffer.div_(group_size(process_group))
    work = comm.all_reduce(buffer, group=process_group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])  # type: ignore[union-attr]
