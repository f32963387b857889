# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the vLLM project
"""A GGUF's tensors as the weight loaders take them.

- `file_view`: a tensor's data as a torch tensor over the file's mapping, not a
  copy. A tensor-parallel rank's weight loader narrows it to the rank's shard
  before it copies, so each rank reads and copies its own bytes of each tensor,
  and the file's pages stay the page cache's (shared between the ranks,
  reclaimable), not each rank's memory. The view is read-only memory: a consumer
  that keeps it beyond its copy, or writes to it, must copy it (its slice) first.
- `release`: a tensor's pages unmapped from the process once its loaders copied
  it, so that a rank's resident memory holds its copies, not every page it read.
- `LoadProgress`: the load's progress (tensors, bytes, rate) on the first rank,
  as vLLM shows the shards of a safetensors checkpoint.
"""

from __future__ import annotations

import mmap
import warnings
from collections.abc import Iterable

import numpy as np
import torch


def file_view(data: np.ndarray) -> torch.Tensor:
    """`data` (a view of the file's mapping, as `GGUFFile.tensors[i].data` is) as a
    torch tensor sharing its memory. The mapping is read-only, which torch warns
    about once a process; the loaders only read it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(data)


def bf16_view(data: np.ndarray, byteswap: bool = False) -> torch.Tensor:
    """BF16 data (bytes, or 16-bit words) as a torch bfloat16 tensor: a view of the
    file's mapping, or a copy where the file's byte order is not the host's."""
    words = data.view(np.uint16)
    if byteswap:
        return torch.from_numpy(words.byteswap()).view(torch.bfloat16)
    return file_view(words).view(torch.bfloat16)


def release(mapping: np.memmap, tensor=None) -> None:
    """Drop the pages of `tensor` (a reader `Tensor` of the file `mapping` maps; None:
    the whole file) from this process's mapping, once the loaders copied what they
    take of it. A rank of a row-parallel tensor reads a slice of every row, so every
    page of it: kept mapped, a tensor-parallel rank's resident memory would hold
    most of the file. The pages stay in the page cache (shared, reclaimable); a
    later read maps them again."""
    mapped = getattr(mapping, "_mmap", None)
    if mapped is None or not hasattr(mapped, "madvise"):
        return
    start, end = 0, len(mapped)
    if tensor is not None:
        start = int(tensor.data_offset) // mmap.PAGESIZE * mmap.PAGESIZE
        end = min(end, int(tensor.data_offset) + int(tensor.n_bytes))
    mapped.madvise(mmap.MADV_DONTNEED, start, end - start)


def _use_tqdm() -> bool:
    """vLLM's rule for a load's progress bar: `LoadConfig.use_tqdm_on_load`, on the
    first rank only."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.model_executor.model_loader.weight_utils import enable_tqdm

    config = get_current_vllm_config_or_none()
    return enable_tqdm(config.load_config.use_tqdm_on_load if config is not None else True)


class LoadProgress:
    """The progress of loading `n_bytes` of GGUF tensor data in `n_tensors` tensors:
    one line a rank 0 process updates as the loader takes each tensor, e.g.
    `Loading GGUF tensors:  45%, 1234/1750 tensors, 180GB/402GB [01:25<01:45, 2.10GB/s]`
    (the bytes are the tensors' in the file; a tensor-parallel rank reads its share
    of them)."""

    # tqdm writes the postfix after ", "
    BAR_FORMAT = ("{desc}: {percentage:3.0f}%{postfix}, {n_fmt}B/{total_fmt}B "
                  "[{elapsed}<{remaining}, {rate_fmt}]\n")

    def __init__(self, n_tensors: int, n_bytes: int, enable: bool | None = None):
        from tqdm.auto import tqdm

        self.n_tensors, self.done = n_tensors, 0
        self.bar = tqdm(total=n_bytes, desc="Loading GGUF tensors", unit="B", unit_scale=True,
                        unit_divisor=1000, bar_format=self.BAR_FORMAT,
                        postfix=self._postfix(), mininterval=1.0,
                        disable=not (_use_tqdm() if enable is None else enable))

    @classmethod
    def of(cls, tensors: Iterable, enable: bool | None = None) -> LoadProgress:
        """The progress of loading `tensors` (the reader's `Tensor`s)."""
        tensors = list(tensors)
        return cls(len(tensors), sum(int(t.n_bytes) for t in tensors), enable)

    def _postfix(self) -> str:
        return f"{self.done}/{self.n_tensors} tensors"

    def update(self, tensor) -> None:
        """`tensor` (a reader `Tensor`) was loaded."""
        self.done += 1
        self.bar.postfix = self._postfix()
        self.bar.update(int(tensor.n_bytes))

    def close(self) -> None:
        self.bar.close()
