"""GGUF files written the way llama.cpp's converter lays them out, for the loaders' tests."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import gguf
import numpy as np


@contextlib.contextmanager
def llama_gguf_writer(path: Path) -> Iterator[gguf.GGUFWriter]:
    """A writer of a llama GGUF file at `path`: add metadata and tensors in the block; the file is written
    when it ends."""
    writer = gguf.GGUFWriter(str(path), "llama")
    yield writer
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def permute_like_llama_cpp(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row permutation of q and k (what the loaders must undo); `weight` is [rows,
    anything], floats or the rows' bytes of blocks."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(weight.shape)
