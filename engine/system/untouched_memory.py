"""Host tensors backed by pages of their own, which cost no resident memory until they are written.

`torch.empty` on the CPU goes through malloc, and glibc serves an allocation of a few MiB from a heap it
already dirtied once earlier tensors have been freed (its mmap threshold rises with every large free): a
KV cache sized for 4 GiB would then be resident from the first step, whatever it holds. A private
anonymous mapping starts as untouched pages, so the cache costs RSS only as requests fill it, and
`madvise(MADV_DONTNEED)` hands those pages back to the kernel (sleep) while the tensors, and every view
of them, stay valid: they read zeros until written again.

A `Population` backs the pages ahead of their first writes instead (the engine's `populate_kv_cache`), on
a thread of its own at the scheduler's idle priority, so it only takes CPU time nothing else wants. A
first write faults: on the 2-core Xeon VM about 4-8 us a page, 5 s for 1 GiB page by page, each on the
serving path; `madvise(MADV_POPULATE_WRITE)` backed 1 GiB in 0.65 s, but a whole 4 GiB cache took 6.5-13 s
with the model loaded beside it, too long to make a start wait for.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import mmap
import os
import sys
import threading
from collections.abc import Callable, Sequence

import torch

logger = logging.getLogger(__name__)

# Linux 5.14's MADV_POPULATE_WRITE (Python's mmap module names it from 3.12): back the pages as a write
# would, without changing what they hold.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if sys.platform.startswith("linux") else None)
# A transparent huge page on x86-64 and on arm64 with 4 KiB pages.
HUGE_PAGE_BYTES = 2 << 20
# Bytes of one tensor a Population backs in one call: a few milliseconds, so a stop waits no longer.
POPULATION_CHUNK_BYTES = 2 << 20


class UntouchedHostTensor:
    """One CPU tensor over a private anonymous mapping, and the means to drop its pages.

    With `huge_pages`, the tensor starts on a 2 MiB boundary of its mapping and the kernel is asked to
    back it with transparent huge pages (`MADV_HUGEPAGE`; many hosts enable them only where asked). A
    tensor read from end to end at every step, as the linear kernel's panels are, then takes one TLB
    entry per 2 MiB instead of one per 4 KiB: see `engine.runner.packed_linear` for what that bought.
    Where the kernel has no transparent huge pages the tensor is backed by small pages as without it."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, huge_pages: bool = False) -> None:
        self.nbytes = math.prod(shape) * dtype.itemsize
        # mmap refuses a zero length; one page stands in for an empty tensor.
        span = max(self.nbytes, mmap.PAGESIZE)
        if huge_pages:
            # Room for the tensor's huge pages wherever the mapping starts: the last one may run past the
            # tensor's end, never past the mapping's.
            span = -(-span // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
        length = span + HUGE_PAGE_BYTES if huge_pages else span
        self._mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # The tensor holds a reference to the mapping through the buffer protocol, so the pages live as
        # long as any view of the tensor does.
        raw = torch.frombuffer(self._mapping, dtype=torch.uint8)
        offset = 0
        if huge_pages:
            offset = -raw.data_ptr() % HUGE_PAGE_BYTES
            _advise_huge_pages(self._mapping, offset, span)
        self.tensor = raw[offset : offset + self.nbytes].view(dtype).view(shape)

    @property
    def address(self) -> int:
        """Where the tensor's bytes start: the mapping's first page, or its first 2 MiB boundary with huge
        pages."""
        return int(self.tensor.data_ptr())

    def drop_pages(self) -> int:
        """Returns the tensor's pages to the kernel; it reads zeros afterwards. Returns its size in bytes."""
        if hasattr(mmap, "MADV_DONTNEED"):  # Linux zeroes the pages; elsewhere they may keep their bytes
            self._mapping.madvise(mmap.MADV_DONTNEED)
        return self.nbytes


class Population:
    """Backs the pages of `tensors` on a thread of its own, at the scheduler's idle priority (SCHED_IDLE: it
    runs only on a CPU nothing else wants), without changing what they hold, so the engine may read and
    write them meanwhile. Chunk by chunk in address order, across the tensors in turn: the first blocks of
    every layer are backed first, which is where a fresh block pool hands blocks out from.

    It holds the tensors until it ends, so their memory outlives their other owners by at most the rest of
    its work. `stop` before dropping their pages, or a chunk backed after the drop would be memory held
    again. It ends by itself, with a log line, where the kernel cannot back pages ahead of their writes (not
    Linux, or older than 5.14) or the host runs short of memory: the pages left are then backed at their
    first write, as without it."""

    def __init__(
        self, tensors: Sequence[UntouchedHostTensor], chunk_bytes: int = POPULATION_CHUNK_BYTES
    ) -> None:
        self._tensors = list(tensors)
        self._chunk_bytes = max(mmap.PAGESIZE, chunk_bytes - chunk_bytes % mmap.PAGESIZE)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cbserve-kv-population", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Ends the work at the next chunk and waits for it; idempotent."""
        self._stopping.set()
        self._thread.join()

    def wait(self, timeout: float | None = None) -> bool:
        """Waits until every page is backed or the work ended early; False on timeout."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        _lower_to_idle_priority()
        madvise = _libc_madvise()
        if madvise is None or MADV_POPULATE_WRITE is None:
            logger.info(
                "KV cache pages are backed at their first write: %s has no MADV_POPULATE_WRITE", sys.platform
            )
            return
        longest = max((tensor.nbytes for tensor in self._tensors), default=0)
        for offset in range(0, longest, self._chunk_bytes):
            for tensor in self._tensors:
                if self._stopping.is_set():
                    return
                length = min(self._chunk_bytes, tensor.nbytes - offset)
                if length <= 0:
                    continue
                if madvise(tensor.address + offset, length, MADV_POPULATE_WRITE) != 0:
                    error = ctypes.get_errno()
                    logger.warning(
                        "KV cache pages are backed at their first write from here on: madvise: %s",
                        os.strerror(error)
                        if error != errno.EINVAL
                        else "the kernel has no MADV_POPULATE_WRITE",
                    )
                    return


def _advise_huge_pages(mapping: mmap.mmap, offset: int, length: int) -> None:
    """Asks for huge pages over `length` bytes of `mapping` from `offset`; a kernel without them (not
    Linux, or built without) leaves the mapping on small pages."""
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return
    try:
        mapping.madvise(advice, offset, length)
    except OSError as error:
        logger.debug("no transparent huge pages here: %s", error)


def _lower_to_idle_priority() -> None:
    """Moves the calling thread (Linux schedules threads one by one) to SCHED_IDLE, else to nice 19."""
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except (AttributeError, OSError):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            logger.debug("the KV cache population runs at normal priority")


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise through ctypes, which lets go of the GIL for the call (mmap.madvise keeps it)."""
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    function.restype = ctypes.c_int
    return function
