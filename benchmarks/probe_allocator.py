"""Why glibc keeps freed memory resident under ZeRO-2: large aligned blocks that no freed block fits.

``python -m benchmarks.probe_allocator [--block-mib 16] [--steps 4]``

Not a registered benchmark (no ``QUESTION``): a developer's probe of the C allocator, with no torch in the loop.
PyTorch's CPU tensors come from ``posix_memalign(64, n)`` (c10's 64-byte alignment). After the first large block
is freed, glibc serves blocks of that size from its heap, and for an aligned request it asks its heap for the
worst case, ``n + 64 + 32`` bytes, then gives back what it did not use. A freed block of exactly ``n`` bytes whose
neighbours are in use can never serve the next request of the same size: each such hole stays resident, unused,
and the heap grows past what is live.

The probe replays ZeRO-2's pattern of one rank with blocks the size of one layer's gradient (12 layers, half of
them owned): per step the gradients arrive one by one (those the rank does not own are let go at once, after
their copy into a mailbox), the optimizer makes two temporaries per owned parameter and frees them, and
``zero_grad`` frees the owned gradients; the optimizer's two moments per owned parameter are made at the first
step and kept. It prints, for each alignment (plain ``malloc``, 16 and 64 bytes), the heap's size at its largest
against the most bytes live at once (glibc's ``mallinfo2``), so the allocator's share of a job's peak is seen
apart from ddpkit's. Each alignment runs in a process of its own (a fresh heap).
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp

LAYERS = 12


class _MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2``, as `ddpkit.distributed.allocator.MallocInfo`: defined again here because the
    probe imports nothing that allocates before its pattern (importing ddpkit moved its 64-byte figure 1.56 -> 1.51)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def replay(alignment: int, block: int, steps: int) -> tuple[int, int]:
    """ZeRO-2's allocation pattern of one rank (module doc) with `alignment` (0: plain malloc); returns the heap's
    largest size and the most bytes live at once."""
    libc = _libc()

    def take() -> int:
        if alignment == 0:
            return libc.malloc(block)
        pointer = ctypes.c_void_p()
        if libc.posix_memalign(ctypes.byref(pointer), alignment, block) != 0:
            raise MemoryError(f"posix_memalign({alignment}, {block}) failed")
        return pointer.value

    libc.free(take())  # the first large block freed: glibc serves this size from its heap from now on
    owned = [layer % 2 == 0 for layer in range(LAYERS)]
    heap = live = most_live = 0
    moments: list[int] = []

    def note(change: int) -> None:
        nonlocal heap, live, most_live
        live += change * block
        most_live = max(most_live, live)
        heap = max(heap, libc.mallinfo2().arena)

    for step in range(steps):
        kept = []
        for layer in range(LAYERS):  # backward: one gradient after the other
            grad = take()
            note(+1)
            if owned[layer]:
                kept.append(grad)
            else:
                libc.free(grad)  # copied into the owner's mailbox: let go at once
                note(-1)
        if step == 0:
            moments = [take() for _ in range(2 * len(kept))]
            note(len(moments))
        for _ in kept:  # the optimizer's temporaries, two per owned parameter
            first, second = take(), take()
            note(+2)
            libc.free(first)
            libc.free(second)
            note(-2)
        for grad in kept:  # zero_grad(set_to_none=True)
            libc.free(grad)
            note(-1)
    return heap, most_live


def _replay_into(queue: mp.Queue, alignment: int, block: int, steps: int) -> None:
    queue.put(replay(alignment, block, steps))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--block-mib", type=int, default=16, help="one gradient's size in MiB (2048 x 2048 fp32: 16)")
    parser.add_argument("--steps", type=int, default=4, help="training steps replayed")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    block = args.block_mib * 2**20
    context = mp.get_context("spawn")
    print(f"ZeRO-2's pattern of one rank: {LAYERS} gradients of {args.block_mib} MiB, half owned, {args.steps} steps")
    print("| allocation | heap at its largest (MiB) | most live at once (MiB) | heap / live |")
    print("|---|---|---|---|")
    for alignment, label in ((0, "malloc"), (16, "posix_memalign(16)"), (64, "posix_memalign(64): torch's")):
        queue = context.Queue()
        process = context.Process(target=_replay_into, args=(queue, alignment, block, args.steps))
        process.start()
        heap, live = queue.get()
        process.join()
        print(f"| {label} | {heap / 2**20:.0f} | {live / 2**20:.0f} | {heap / live:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
