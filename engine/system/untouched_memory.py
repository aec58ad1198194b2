"""Host tensors backed by pages of their own, which cost no resident memory until they are written.

`torch.empty` on the CPU goes through malloc, and glibc serves an allocation of a few MiB from a heap it
already dirtied once earlier tensors have been freed (its mmap threshold rises with every large free): a
KV cache sized for 4 GiB would then be resident from the first step, whatever it holds. A private
anonymous mapping starts as untouched pages, so the cache costs RSS only as requests fill it, and
`madvise(MADV_DONTNEED)` hands those pages back to the kernel (sleep) while the tensors, and every view
of them, stay valid: they read zeros until written again.
"""

from __future__ import annotations

import math
import mmap

import torch


class UntouchedHostTensor:
    """One CPU tensor over a private anonymous mapping, and the means to drop its pages."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.nbytes = math.prod(shape) * dtype.itemsize
        # mmap refuses a zero length; one page stands in for an empty tensor.
        length = max(self.nbytes, mmap.PAGESIZE)
        self._mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # The tensor holds a reference to the mapping through the buffer protocol, so the pages live as
        # long as any view of the tensor does.
        raw = torch.frombuffer(self._mapping, dtype=torch.uint8, count=self.nbytes)
        self.tensor = raw.view(dtype).view(shape)

    def drop_pages(self) -> int:
        """Returns the tensor's pages to the kernel; it reads zeros afterwards. Returns its size in bytes."""
        if hasattr(mmap, "MADV_DONTNEED"):  # Linux zeroes the pages; elsewhere they may keep their bytes
            self._mapping.madvise(mmap.MADV_DONTNEED)
        return self.nbytes
