"""Fixed-length training windows over memory-mapped token files.

A *segment* is one flat array of ids on disk (a cache file or a pre-tokenized shard). Each is cut
into non-overlapping windows of ``seq_len + 1`` ids; windows never cross a segment boundary and
a segment's tail shorter than a window is dropped. Item ``i`` of :class:`TokenWindows` is the
window ``indices[i]`` as a ``LongTensor`` of shape ``[seq_len + 1]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import Dataset


@dataclass(frozen=True)
class Segment:
    """``num_tokens`` ids of type ``dtype`` stored in ``path`` from byte ``offset`` on."""

    path: str
    dtype: str
    num_tokens: int
    offset: int = 0

    def open(self) -> np.memmap:
        return np.memmap(self.path, dtype=np.dtype(self.dtype), mode="r", offset=self.offset, shape=(self.num_tokens,))


class TokenWindows(Dataset):
    """Map-style dataset of windows of ``seq_len + 1`` ids (memmaps opened lazily in each process)."""

    def __init__(self, segments: list[Segment], seq_len: int, indices: np.ndarray | None = None) -> None:
        self.segments = list(segments)
        self.seq_len = seq_len
        self.window = seq_len + 1
        counts = np.asarray([s.num_tokens // self.window for s in self.segments], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.total_windows = int(self.starts[-1])
        self.indices = None if indices is None else np.asarray(indices, dtype=np.int64)
        self._maps: list[np.memmap] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.segments)

    def __len__(self) -> int:
        return self.total_windows if self.indices is None else len(self.indices)

    def subset(self, indices: np.ndarray) -> TokenWindows:
        """The same segments restricted to the windows ``indices`` (global window numbers)."""
        return TokenWindows(self.segments, self.seq_len, indices)

    def window_index(self, i: int) -> int:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"window {i} out of range for {len(self)} windows")
        return i if self.indices is None else int(self.indices[i])

    def __getitem__(self, i: int) -> torch.Tensor:
        g = self.window_index(int(i))
        seg = int(np.searchsorted(self.starts, g, side="right")) - 1
        if self._maps is None:
            self._maps = [s.open() for s in self.segments]
        start = (g - int(self.starts[seg])) * self.window
        ids = np.asarray(self._maps[seg][start : start + self.window], dtype=np.int64)
        return torch.from_numpy(ids)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_maps"] = None  # workers reopen the memmaps instead of pickling their contents
        return state


def heldout_windows(num_windows: int, val_fraction: float, block: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Deterministic ``(train, val)`` window numbers: every k-th block of windows is held out.

    ``k = round(1 / val_fraction)``. Blocks of consecutive windows (up to 64, smaller for small
    data so that several blocks exist) keep validation text contiguous; if no block lands in
    validation (tiny data), the last block does. Needs at least two windows.
    """
    if num_windows < 2:
        return np.arange(num_windows, dtype=np.int64), np.zeros(0, dtype=np.int64)
    every = max(2, round(1 / val_fraction))
    if block is None:
        block = int(min(64, max(1, num_windows // (every * 8))))
    block_of = np.arange(num_windows, dtype=np.int64) // block
    is_val = block_of % every == every - 1
    if not is_val.any():
        is_val = block_of == block_of[-1]
    all_windows = np.arange(num_windows, dtype=np.int64)
    return all_windows[~is_val], all_windows[is_val]
