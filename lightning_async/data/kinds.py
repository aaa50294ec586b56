"""The values of ``TextDataModule(source=..., tokenizer=...)``: one class each, so nothing compares names.

A *data source* (:class:`DataSource`) knows what ``source: <name>`` needs and reads: which arguments it
requires (and the error when one is missing), the text it has tokenized into the cache or the pre-tokenized
shards it reads as they are, its default cap, how its vocabulary is found and what it needs from the
tokenizer. A *tokenizer kind* (:class:`TokenizerKind`) knows how the tokenizer of ``tokenizer: <name>`` is
checked and made. ``TextDataModule`` builds one of each from its own arguments and asks them.

Adding a source or a tokenizer is one class here and its line in :data:`DATA_SOURCES` or
:data:`TOKENIZER_KINDS` (and its row in ``docs/data.md``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
from lightning.pytorch.utilities import rank_zero_warn

from lightning_async.data.errors import DataConfigError, choices
from lightning_async.data.shards import max_token_id, shard_segment
from lightning_async.data.sources import Corpus, FileCorpus, HFCorpus, StdlibCorpus, check_data_files, resolve_paths
from lightning_async.data.tokenizer import ByteTokenizer, bpe_for_corpus, load_tokenizer, tokenizer_json_path
from lightning_async.data.windows import Segment, TokenWindows

#: ``datasets`` builders that read local ``data_files`` (no warning about streaming a whole hub dataset)
LOCAL_BUILDERS = ("json", "text", "csv", "parquet", "arrow")

#: characters of the standard library read when neither ``max_chars`` nor ``max_tokens`` is set
STDLIB_DEFAULT_MAX_CHARS = 4_000_000

#: the cache files of the text of one split: ``tokenize(corpus)`` (built or reused by the data module)
Tokenize = Callable[[Corpus], "list[Segment]"]

K = TypeVar("K", bound="Kind")


@dataclass
class Kind:
    """Base of the source and tokenizer classes: built from the data module's arguments of the same names."""

    #: the value of ``source=``/``tokenizer=`` that selects the class
    name: ClassVar[str]

    @classmethod
    def from_settings(cls: type[K], settings: Any) -> K:
        """The object for ``settings`` (the data module): each field is its attribute of the same name."""
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls) if f.init})

    def check(self) -> None:
        """Raise a :class:`DataConfigError` for a missing or wrong argument (at construction, before any process starts)."""


def named(registry: dict[str, type[K]], name: Any, what: str, plural: str) -> type[K]:
    """The class of ``name`` in ``registry``, or a :class:`DataConfigError` listing the valid names."""
    kind = registry.get(name) if isinstance(name, str) else None
    if kind is None:
        raise DataConfigError(f"unknown {what} {name!r}; valid {plural} are {choices(registry)}.")
    return kind


# ---- tokenizers ----------------------------------------------------------------------------------
@dataclass
class TokenizerKind(Kind):
    """One value of ``tokenizer=``: how its tokenizer is checked and made."""

    #: learns its vocabulary from the training text, so it cannot number ids made elsewhere
    trained_on_text: ClassVar[bool] = False
    #: its vocabulary numbers ids made elsewhere (the pre-tokenized shards made with it)
    numbers_shard_ids: ClassVar[bool] = False

    def make(self, training_text: Callable[[], Corpus], char_cap: int | None):
        """The tokenizer (``encode``/``decode``/``vocab_size``/``eod_id``/``identity``).

        ``training_text()`` is the training corpus and ``char_cap`` the characters read from it, for a
        tokenizer trained here.
        """
        raise NotImplementedError


@dataclass
class ByteKind(TokenizerKind):
    """``byte``: UTF-8 bytes and one end-of-document id (vocabulary 257), nothing to train or load."""

    name = "byte"

    def make(self, training_text: Callable[[], Corpus], char_cap: int | None) -> ByteTokenizer:
        return ByteTokenizer()


@dataclass
class BPEKind(TokenizerKind):
    """``bpe``: a byte-level BPE trained on the training text (or loaded from the cache where trained before)."""

    name = "bpe"
    trained_on_text = True

    bpe_vocab_size: int
    bpe_train_chars: int | None
    cache_dir: str
    progress: bool

    def make(self, training_text: Callable[[], Corpus], char_cap: int | None):
        chars = self.bpe_train_chars
        if char_cap is not None:
            chars = char_cap if chars is None else min(chars, char_cap)
        return bpe_for_corpus(training_text(), self.bpe_vocab_size, chars, self.cache_dir, progress=self.progress)


@dataclass
class HFKind(TokenizerKind):
    """``hf``: a Hugging Face ``tokenizer.json`` (``tokenizer_path``: the file or a directory that holds one)."""

    name = "hf"
    numbers_shard_ids = True

    tokenizer_path: str | None

    def check(self) -> None:
        if not self.tokenizer_path:
            raise DataConfigError(
                f"tokenizer {self.name!r} needs `tokenizer_path`: a tokenizer.json file or a directory that holds one."
            )
        tokenizer_json_path(self.tokenizer_path)

    def make(self, training_text: Callable[[], Corpus], char_cap: int | None):
        return load_tokenizer(self.tokenizer_path)


# ---- data sources --------------------------------------------------------------------------------
@dataclass
class DataSource(Kind):
    """One value of ``source=``: where the tokens come from and what the data module needs to know about them.

    The methods' defaults are those of a source of *text* that the data module tokenizes into its cache
    (:meth:`corpus` gives the text); :class:`TokenShards` overrides them for ids read as they are.
    """

    #: characters read from the training text when neither ``max_chars`` nor ``max_tokens`` is set
    default_max_chars: ClassVar[int | None] = None

    tokenizer_kind: TokenizerKind
    token_vocab_size: int | None

    def corpus(self, split: str) -> Corpus | None:
        """The text of ``split`` (``"train"``/``"val"``; ``None``: validation is held out of the training windows)."""
        raise NotImplementedError

    def segments(self, split: str, tokenize: Tokenize) -> list[Segment] | None:
        """The token files of ``split`` (``None``: held out of train); text goes through ``tokenize``."""
        corpus = self.corpus(split)
        return None if corpus is None else tokenize(corpus)

    def vocab_size(self, tokenizer: Callable[[], Any], segments: Callable[[], list[Segment]]) -> int:
        """The model's vocabulary: the tokenizer's, which ``token_vocab_size`` may raise (never lower)."""
        natural = tokenizer().vocab_size
        if self.token_vocab_size is not None and self.token_vocab_size < natural:
            raise DataConfigError(
                f"`token_vocab_size` = {self.token_vocab_size} is smaller than the {self.tokenizer_kind.name!r} "
                f"tokenizer's vocabulary ({natural}); raise it or leave it unset."
            )
        return self.token_vocab_size or natural

    def check_token_ids(self, segments: list[Segment], vocab_size: Callable[[], int]) -> None:
        """Raise when an id in ``segments`` is outside the vocabulary (ids tokenized here fit by construction)."""

    def cap_training(self, windows: TokenWindows) -> TokenWindows:
        """The training windows after the source's token cap (text is capped while it is tokenized)."""
        return windows

    def label(self) -> str:
        """``source/tokenizer`` for the log line of ``setup()``."""
        return f"{self.name}/{self.tokenizer_kind.name}"


@dataclass
class StdlibSource(DataSource):
    """``stdlib``: this interpreter's standard-library sources, validation every ~``1/val_fraction``-th file."""

    name = "stdlib"
    default_max_chars = STDLIB_DEFAULT_MAX_CHARS

    val_fraction: float

    def corpus(self, split: str) -> StdlibCorpus:
        return StdlibCorpus(split, max(2, round(1 / float(self.val_fraction))))


@dataclass
class FileSource(DataSource):
    """A source read from ``path`` (and ``val_path``): files, a directory or a glob, resolved at construction."""

    #: what ``path`` names, for the error when it is missing
    files_are: ClassVar[str]

    path: str | None
    val_path: str | None
    _files: dict[str, list[Path] | None] = field(init=False, repr=False, default_factory=dict)

    def check(self) -> None:
        if not self.path:
            raise DataConfigError(f"source {self.name!r} needs `path`: a file, a directory or a glob of {self.files_are}.")
        self._files = {
            "train": resolve_paths(self.path, "path"),
            "val": resolve_paths(self.val_path, "val_path") if self.val_path else None,
        }

    def files(self, split: str) -> list[Path] | None:
        """The files of ``split`` (``None``: no ``val_path``)."""
        return self._files.get(split)


@dataclass
class TextFiles(FileSource):
    """``text``: text files (plain, ``.gz`` or ``.xz``), each one document."""

    name = "text"
    files_are = "text files"

    def corpus(self, split: str) -> FileCorpus | None:
        files = self.files(split)
        return FileCorpus(files) if files else None


@dataclass
class HFDataset(DataSource):
    """``hf``: a Hugging Face ``datasets`` dataset, streamed; validation from ``val_split`` when given."""

    name = "hf"

    dataset: str | None
    dataset_config: str | None
    data_files: Any
    split: str
    val_split: str | None
    text_field: str
    max_tokens: int | None

    def check(self) -> None:
        if not self.dataset:
            raise DataConfigError(
                f"source {self.name!r} needs `dataset`: a Hugging Face dataset name (e.g. HuggingFaceFW/fineweb-edu) "
                "or a builder such as 'json'/'text' with `data_files`."
            )
        check_data_files(self.data_files)
        if self.max_tokens is None and self.dataset not in LOCAL_BUILDERS and not os.path.exists(self.dataset):
            rank_zero_warn(
                f"source {self.name!r} streams all of {self.dataset!r} into the cache; set `max_tokens` to stop earlier."
            )

    def corpus(self, split: str) -> HFCorpus | None:
        name = self.split if split == "train" else self.val_split
        if name is None:
            return None
        return HFCorpus(self.dataset, self.dataset_config, name, self.data_files, self.text_field)


@dataclass
class TokenShards(FileSource):
    """``tokens``: pre-tokenized ``.bin`` shards, memory-mapped as they are (no tokenizer reads them).

    The vocabulary is ``token_vocab_size``, else that of a tokenizer that numbers shard ids (``hf``), else
    the largest id + 1; ``max_tokens`` caps the training windows (the shards are not copied).
    """

    name = "tokens"
    files_are = ".bin token shards"

    dtype: str
    max_tokens: int | None

    def check(self) -> None:
        super().check()
        if self.tokenizer_kind.trained_on_text:
            raise DataConfigError(
                f"tokenizer {self.tokenizer_kind.name!r} is trained on text and cannot describe pre-tokenized shards; "
                "use tokenizer 'hf' with the `tokenizer_path` that made them, or set `token_vocab_size`."
            )

    def corpus(self, split: str) -> None:
        return None

    def segments(self, split: str, tokenize: Tokenize) -> list[Segment] | None:
        files = self.files(split)
        return [shard_segment(f, self.dtype) for f in files] if files else None

    @property
    def vocab_from_ids(self) -> bool:
        """Whether the vocabulary is the largest id + 1 (nothing else names it)."""
        return self.token_vocab_size is None and not self.tokenizer_kind.numbers_shard_ids

    def vocab_size(self, tokenizer: Callable[[], Any], segments: Callable[[], list[Segment]]) -> int:
        if self.vocab_from_ids:
            return max_token_id(segments()) + 1
        natural = tokenizer().vocab_size  # loaded even where token_vocab_size wins: a broken tokenizer_path fails here
        return self.token_vocab_size or natural

    def check_token_ids(self, segments: list[Segment], vocab_size: Callable[[], int]) -> None:
        if self.vocab_from_ids:
            return  # the vocabulary was made from the largest id
        largest = max_token_id(segments)
        if largest >= vocab_size():
            raise DataConfigError(
                f"the token shards hold id {largest}, outside the vocabulary of size {vocab_size()}; "
                "set `token_vocab_size` (or the `hf` tokenizer) to the one that made the shards."
            )

    def cap_training(self, windows: TokenWindows) -> TokenWindows:
        if self.max_tokens is None:
            return windows
        return windows.subset(np.arange(min(windows.total_windows, max(1, self.max_tokens // windows.window))))

    def label(self) -> str:
        return f"{self.name}/{self.name}"  # no tokenizer made these ids here


#: ``source=`` name -> its class, in the order the error messages list them
DATA_SOURCES: dict[str, type[DataSource]] = {kind.name: kind for kind in (StdlibSource, TextFiles, HFDataset, TokenShards)}

#: ``tokenizer=`` name -> its class
TOKENIZER_KINDS: dict[str, type[TokenizerKind]] = {kind.name: kind for kind in (ByteKind, BPEKind, HFKind)}

SOURCES = tuple(DATA_SOURCES)
TOKENIZERS = tuple(TOKENIZER_KINDS)
