"""Training on through lost machines: a fault-tolerant job's rounds, their protocol and the stores they meet in.

`Manager` is what a training loop holds (the CLI's ``--fault-tolerant``, the Lightning and Fabric strategies and
your own loop are its clients); `membership` forms each round's quorum and commit through a store; the store is
the embedded TCPStore on machine 0 (`job_store`) or an etcd cluster (`etcd_store.EtcdStore`), where no machine is
special. The averaging done in a round lives in `ddpkit.algorithms`.
"""

from ddpkit.fault_tolerance.etcd_store import EtcdStore, StoreCutOff
from ddpkit.fault_tolerance.manager import FellBehind, Manager, MembershipEvent, StoreLost
from ddpkit.fault_tolerance.membership import JobFinished, TooFewReplicas

__all__ = [
    "EtcdStore",
    "FellBehind",
    "JobFinished",
    "Manager",
    "MembershipEvent",
    "StoreCutOff",
    "StoreLost",
    "TooFewReplicas",
]
