"""The token cache: a flat ``.bin`` of token ids plus a small JSON metadata file.

The file names carry a hash of the cache *identity* (source fingerprint, tokenizer identity,
caps, dtype), so any change of input or option maps to a new file. A cache is used only when
its metadata parses, matches the identity, and the ``.bin`` has exactly the recorded size (and,
where asked, the recorded checksum); anything else is rebuilt. Writes go to a temporary file
renamed into place, the metadata last, under a lock file, so concurrent processes never see a
half-written cache.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lightning_async.data.errors import EmptyCorpusError

#: bump when the on-disk layout or the meaning of the tokens changes
CACHE_FORMAT = 1

_BLOCK = 8 << 20


@contextlib.contextmanager
def file_lock(path: str | os.PathLike) -> Iterator[None]:
    """An exclusive inter-process lock on ``path`` (POSIX ``flock``; a no-op elsewhere)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename."""
    path = Path(path)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def file_checksum(path: str | os.PathLike) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


def _canonical(obj: Any) -> Any:
    return json.loads(json.dumps(obj, sort_keys=True, default=str))


def dtype_for_vocab(vocab_size: int) -> str:
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


#: seconds of tokenizing before a bar appears: a fast cache build (the quick start's, about a second) shows none
PROGRESS_DELAY_S = 2.0


def progress_bar_settings(progress: bool, total: int | None, desc: str) -> dict[str, Any]:
    """tqdm's arguments for the tokenizing bar: only in a terminal (``disable=None``: off when stderr is not one, where
    its redraws were a stray ``0.00tok [00:00, ?tok/s]`` in the log) and only after :data:`PROGRESS_DELAY_S`, so that
    it never shows an empty count; the ``data: ... cache built: N tokens`` line says what was done either way."""
    return dict(total=total, desc=desc, unit="tok", unit_scale=True, leave=False, delay=PROGRESS_DELAY_S,
                disable=None if progress else True)


class TokenCache:
    """One tokenized split on disk: ``<cache_dir>/tokens/<name>-<key>.{bin,json}``."""

    def __init__(self, cache_dir: str | os.PathLike, name: str, identity: dict[str, Any]) -> None:
        self.identity = _canonical(identity)
        blob = json.dumps(self.identity, sort_keys=True).encode()
        self.key = hashlib.sha256(blob).hexdigest()[:20]
        self.folder = Path(cache_dir) / "tokens"
        self.bin = self.folder / f"{name}-{self.key}.bin"
        self.meta = self.folder / f"{name}-{self.key}.json"
        self.lock = self.folder / f"{name}-{self.key}.lock"

    # ---- reading -------------------------------------------------------------------------------
    def metadata(self) -> dict[str, Any]:
        return json.loads(self.meta.read_text(encoding="utf-8"))

    def problem(self, verify_checksum: bool = True) -> str | None:
        """Why the cache cannot be used (``None`` when it can)."""
        if not self.meta.is_file():
            return "no metadata"
        try:
            meta = self.metadata()
            num_tokens = int(meta["num_tokens"])
            itemsize = np.dtype(meta["dtype"]).itemsize
        except (OSError, ValueError, KeyError, TypeError) as err:
            return f"unreadable metadata ({err.__class__.__name__})"
        if meta.get("format") != CACHE_FORMAT or meta.get("key") != self.key or meta.get("identity") != self.identity:
            return "metadata does not match the requested data"
        if not self.bin.is_file():
            return "token file missing"
        size = self.bin.stat().st_size
        if size != num_tokens * itemsize:
            return f"token file has {size} bytes, metadata says {num_tokens * itemsize} (truncated or overwritten)"
        if verify_checksum and file_checksum(self.bin) != meta.get("checksum"):
            return "checksum mismatch (corrupt token file)"
        return None

    def tokens(self) -> np.memmap:
        meta = self.metadata()
        return np.memmap(self.bin, dtype=np.dtype(meta["dtype"]), mode="r", shape=(int(meta["num_tokens"]),))

    # ---- writing -------------------------------------------------------------------------------
    def write(
        self,
        chunks: Iterable[np.ndarray],
        dtype: str,
        max_tokens: int | None = None,
        progress: bool = False,
        desc: str = "tokenizing",
        what: str = "the corpus",
        extra: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Write ``chunks`` of ids (at most ``max_tokens``) and the metadata; return the metadata."""
        from tqdm.auto import tqdm

        self.folder.mkdir(parents=True, exist_ok=True)
        self.meta.unlink(missing_ok=True)  # the old pair is invalid from now on
        tmp = self.bin.with_name(f"{self.bin.name}.tmp-{os.getpid()}")
        h = hashlib.blake2b(digest_size=16)
        count = 0
        np_dtype = np.dtype(dtype)
        limit = np.iinfo(np_dtype).max
        try:
            with open(tmp, "wb") as f, tqdm(**progress_bar_settings(progress, max_tokens, desc)) as bar:
                for ids in chunks:
                    if max_tokens is not None and count + len(ids) > max_tokens:
                        ids = ids[: max_tokens - count]
                    if len(ids) and int(ids.max()) > limit:
                        raise ValueError(f"token id {int(ids.max())} does not fit {dtype}")
                    data = np.ascontiguousarray(ids, dtype=np_dtype).tobytes()
                    f.write(data)
                    h.update(data)
                    count += len(ids)
                    bar.update(len(ids))
                    if max_tokens is not None and count >= max_tokens:
                        break
            if count == 0:
                raise EmptyCorpusError(f"{what} produced no tokens (it is empty). Point the data module at a non-empty corpus.")
            os.replace(tmp, self.bin)
        finally:
            tmp.unlink(missing_ok=True)
        meta = {
            "format": CACHE_FORMAT,
            "key": self.key,
            "identity": self.identity,
            "num_tokens": count,
            "dtype": np_dtype.name,
            "checksum": h.hexdigest(),
            **(extra or {}),
        }
        atomic_write_text(self.meta, json.dumps(meta, indent=1, sort_keys=True))
        return meta

    def ensure(self, make_chunks, verify_checksum: bool = True, **write_kwargs) -> str:
        """Make sure a valid cache exists: ``"reused"``, ``"built"`` or ``"rebuilt (<why>)"``.

        ``make_chunks()`` is called (and the corpus tokenized) only when the cache is unusable.
        """
        with file_lock(self.lock):
            reason = self.problem(verify_checksum)
            if reason is None:
                return "reused"
            existed = self.meta.exists() or self.bin.exists()
            self.write(make_chunks(), **write_kwargs)
            return f"rebuilt ({reason})" if existed else "built"
