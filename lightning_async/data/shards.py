"""Pre-tokenized shards: flat ``.bin`` files of ids, memory-mapped as they are.

Two layouts are read:

* raw (nanoGPT's ``prepare.py``): the file is just ids of ``dtype`` (``uint16`` or ``uint32``);
* llm.c / modded-nanoGPT: a 256 x int32 header (magic ``20240520`` for ``uint16`` ids, ``20240801``
  for ``uint32``; ``header[2]`` = number of ids) followed by the ids. It is recognised by its
  magic number and a file size that agrees with the header, and overrides ``dtype``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lightning_async.data.errors import DataConfigError, EmptyCorpusError, choices
from lightning_async.data.windows import Segment

DTYPES = ("uint16", "uint32")
HEADER_INTS = 256
HEADER_MAGIC = {20240520: "uint16", 20240801: "uint32"}


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise DataConfigError(f"unknown dtype {dtype!r} for token shards; valid dtypes are {choices(DTYPES)}.")


def shard_segment(path: str | Path, dtype: str = "uint16") -> Segment:
    """The :class:`Segment` of one shard file (header detected, size checked)."""
    path = Path(path)
    size = path.stat().st_size
    header_bytes = HEADER_INTS * 4
    if size >= header_bytes:
        header = np.fromfile(path, dtype=np.int32, count=3)
        magic_dtype = HEADER_MAGIC.get(int(header[0]))
        if magic_dtype is not None:
            itemsize = np.dtype(magic_dtype).itemsize
            if size == header_bytes + int(header[2]) * itemsize:
                return Segment(str(path), magic_dtype, int(header[2]), offset=header_bytes)
    itemsize = np.dtype(dtype).itemsize
    if size % itemsize:
        raise DataConfigError(
            f"token shard {str(path)!r} has {size} bytes, not a multiple of {itemsize} ({dtype}); "
            "set `dtype` to how the shard was written (uint16 or uint32)."
        )
    if size == 0:
        raise EmptyCorpusError(f"token shard {str(path)!r} is empty; remove it from `path`.")
    return Segment(str(path), dtype, size // itemsize)


def max_token_id(segments: list[Segment]) -> int:
    """The largest id in the shards (one pass over the memmaps)."""
    best = -1
    for seg in segments:
        data = seg.open()
        for start in range(0, seg.num_tokens, 1 << 26):
            best = max(best, int(data[start : start + (1 << 26)].max()))
    return best
