"""Text corpora: where documents come from, streamed as pieces of text.

A corpus yields ``(text, ends_document)`` pieces in a fixed order. Large files are read in
chunks of about 64 K characters cut at line ends, so a 100 MB file is never one string; the
tokenizer adds an end-of-document id after each piece that ends a document. Every corpus also
has a *fingerprint*: a small JSON-able description of the exact inputs (paths, sizes,
modification times, dataset names) that keys the caches.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import io
import lzma
import os
import sys
import sysconfig
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from lightning_async.data.errors import DataConfigError, DataFileNotFoundError

Piece = tuple[str, bool]

#: characters per piece when streaming a file (extended to the next line end; BPE encodes short pieces faster)
CHUNK_CHARS = 1 << 16

#: directories of the standard library that are not used (tests, IDLE, third-party packages)
STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "turtledemo", "__pycache__", "ensurepip"}
)


# ---- files -------------------------------------------------------------------------------------
def open_text(path: str | os.PathLike) -> io.TextIOBase:
    """Open a plain, ``.gz`` or ``.xz`` file as UTF-8 text (undecodable bytes become U+FFFD)."""
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix == ".gz":
        return gzip.open(path, "rt", encoding="utf-8", errors="replace", newline="")
    if suffix in (".xz", ".lzma"):
        return lzma.open(path, "rt", encoding="utf-8", errors="replace", newline="")
    return open(path, encoding="utf-8", errors="replace", newline="")


def read_chunks(path: str | os.PathLike, chunk_chars: int = CHUNK_CHARS) -> Iterator[str]:
    """Stream a text file in pieces of about ``chunk_chars`` characters, each ending at a line end."""
    with open_text(path) as f:
        while True:
            block = f.read(chunk_chars)
            if not block:
                return
            if not block.endswith("\n"):
                block += f.readline()
            yield block


def _is_hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def resolve_paths(spec: str | os.PathLike | Iterable[str | os.PathLike], what: str = "path") -> list[Path]:
    """Files named by ``spec``: a file, a directory (all non-hidden files below it) or a glob.

    A list of such specs is resolved item by item. The result is sorted within each item, so the
    order never depends on the file system. Raises :class:`DataFileNotFoundError` when nothing matches.
    """
    if not isinstance(spec, (str, os.PathLike)):
        files: list[Path] = []
        for item in spec:
            files.extend(resolve_paths(item, what))
        if not files:
            raise DataFileNotFoundError(f"`{what}` is an empty list: give a file, a directory or a glob.")
        return files
    text = os.fspath(spec)
    path = Path(text).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and not _is_hidden(p, path))
        if not files:
            raise DataFileNotFoundError(f"`{what}`: directory {text!r} contains no files. Point it at a directory with text files.")
        return files
    if glob.has_magic(text):
        files = sorted(Path(p) for p in glob.glob(os.path.expanduser(text), recursive=True) if Path(p).is_file())
        if not files:
            raise DataFileNotFoundError(
                f"`{what}`: the glob {text!r} matches no file (relative to {os.getcwd()!r}). Fix the pattern or the working directory."
            )
        return files
    raise DataFileNotFoundError(
        f"`{what}`: no such file or directory: {text!r} (relative to {os.getcwd()!r}). Give an existing file, directory or glob."
    )


def files_identity(files: Iterable[Path]) -> list[list[Any]]:
    """``[absolute path, size, mtime_ns]`` of each file: changes when any file is replaced or edited."""
    out = []
    for f in files:
        st = f.stat()
        out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def digest(obj: Any) -> str:
    """A short stable hash of a JSON-able object."""
    import json

    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


# ---- corpora -----------------------------------------------------------------------------------
class Corpus:
    """A source of documents. Subclasses define :meth:`pieces` and :meth:`fingerprint`."""

    def pieces(self) -> Iterator[Piece]:
        raise NotImplementedError

    def fingerprint(self) -> dict[str, Any]:
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class FileCorpus(Corpus):
    """Text files, each one document, read streaming in their given order."""

    def __init__(self, files: list[Path], chunk_chars: int = CHUNK_CHARS) -> None:
        self.files = list(files)
        self.chunk_chars = chunk_chars

    def pieces(self) -> Iterator[Piece]:
        for f in self.files:
            previous = None
            for block in read_chunks(f, self.chunk_chars):
                if previous is not None:
                    yield previous, False
                previous = block
            if previous is not None:
                yield previous, True

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": "files", "files": files_identity(self.files)}

    def describe(self) -> str:
        if len(self.files) == 1:
            return f"file {str(self.files[0])!r}"
        return f"{len(self.files)} files ({str(self.files[0])!r} ...)"


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[tuple[str, Path]]:
    """``(relative posix path, path)`` of the standard library's ``.py`` sources, sorted by relative path."""
    root = Path(root) if root is not None else stdlib_root()
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in STDLIB_SKIP_DIRS and not d.startswith(".")]
        for name in filenames:
            if name.endswith(".py"):
                path = Path(dirpath) / name
                found.append((path.relative_to(root).as_posix(), path))
    found.sort(key=lambda item: item[0])
    return found


def is_heldout(key: str, every: int) -> bool:
    """Stable membership of ``key`` in the held-out 1/``every`` (a hash, not Python's salted ``hash``)."""
    return int.from_bytes(hashlib.sha1(key.encode()).digest()[:8], "big") % every == 0


class StdlibCorpus(FileCorpus):
    """The running interpreter's standard library, split into train and validation *by file*."""

    def __init__(self, split: str, val_every: int, root: Path | None = None) -> None:
        if split not in ("train", "val"):
            raise ValueError(f"split must be 'train' or 'val', not {split!r}")
        self.root = Path(root) if root is not None else stdlib_root()
        self.split = split
        self.val_every = val_every
        entries = [(rel, p) for rel, p in stdlib_files(self.root) if is_heldout(rel, val_every) == (split == "val")]
        self.relpaths = [rel for rel, _ in entries]
        super().__init__([p for _, p in entries])
        if not self.files:
            raise DataFileNotFoundError(f"no standard-library sources found under {str(self.root)!r}; use source: text with a path.")

    def fingerprint(self) -> dict[str, Any]:
        listing = []
        for rel, f in zip(self.relpaths, self.files):
            st = f.stat()
            listing.append([rel, st.st_size, st.st_mtime_ns])
        return {
            "kind": "stdlib",
            "root": str(self.root),
            "python": sys.version.split()[0],
            "split": self.split,
            "val_every": self.val_every,
            "files": digest(listing),
            "num_files": len(listing),
        }

    def describe(self) -> str:
        return f"the standard library's {self.split} files ({len(self.files)} under {str(self.root)!r})"


def _local_data_files(data_files: Any) -> Any:
    """``data_files`` with each local path or glob replaced by the identity of the files it names."""
    if data_files is None:
        return None
    if isinstance(data_files, dict):
        return {str(k): _local_data_files(v) for k, v in sorted(data_files.items())}
    if isinstance(data_files, (list, tuple)):
        return [_local_data_files(v) for v in data_files]
    text = os.fspath(data_files)
    if "://" in text:
        return text
    return files_identity(resolve_paths(text, "data_files"))


def check_data_files(data_files: Any) -> None:
    """Raise :class:`DataFileNotFoundError` for a local ``data_files`` entry that matches nothing."""
    _local_data_files(data_files)


class HFCorpus(Corpus):
    """A Hugging Face ``datasets`` dataset streamed with ``streaming=True``: one example, one document."""

    def __init__(
        self,
        dataset: str,
        config: str | None = None,
        split: str = "train",
        data_files: Any = None,
        text_field: str = "text",
    ) -> None:
        self.dataset = dataset
        self.config = config
        self.split = split
        self.data_files = data_files
        self.text_field = text_field

    def _load(self):
        try:
            import datasets
        except ImportError as err:  # pragma: no cover - datasets is a dev dependency
            raise DataConfigError("source 'hf' needs the `datasets` package: pip install 'lightning-async[hf]'.") from err
        kwargs = {"data_files": self.data_files} if self.data_files is not None else {}
        try:
            return datasets.load_dataset(self.dataset, self.config, split=self.split, streaming=True, **kwargs)
        except Exception as err:
            raise DataConfigError(
                f"could not open Hugging Face dataset {self.dataset!r} (dataset_config={self.config!r}, "
                f"split={self.split!r}): {err}. Check `dataset`, `dataset_config`, `split`/`val_split` and "
                "`data_files`; without network only local files load (e.g. dataset: json, data_files: my.jsonl)."
            ) from err

    def pieces(self) -> Iterator[Piece]:
        for i, example in enumerate(self._load()):
            if self.text_field not in example:
                raise DataConfigError(
                    f"Hugging Face dataset {self.dataset!r} has no field {self.text_field!r} (example {i} has "
                    f"{sorted(example)}). Set `text_field` to one of those."
                )
            text = example[self.text_field]
            if text:
                yield str(text), True

    def fingerprint(self) -> dict[str, Any]:
        local = Path(self.dataset).expanduser()
        dataset_id: Any = self.dataset
        if local.exists():
            dataset_id = files_identity(resolve_paths(local, "dataset"))
        return {
            "kind": "hf",
            "dataset": dataset_id,
            "config": self.config,
            "split": self.split,
            "data_files": _local_data_files(self.data_files),
            "text_field": self.text_field,
        }

    def describe(self) -> str:
        return f"Hugging Face dataset {self.dataset!r} (config {self.config!r}, split {self.split!r})"


def capped(pieces: Iterable[Piece], max_chars: int | None) -> Iterator[Piece]:
    """Stop after ``max_chars`` characters; a cut piece still ends its document."""
    if max_chars is None:
        yield from pieces
        return
    left = max_chars
    for text, ends in pieces:
        if left <= 0:
            return
        if len(text) >= left:
            yield text[:left], True
            return
        left -= len(text)
        yield text, ends
