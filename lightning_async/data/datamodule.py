"""``TextDataModule``: corpus -> tokenizer -> cached token file -> shuffled windows of ``seq_len + 1``.

``prepare_data()`` (one process) tokenizes each split into the cache; ``setup()`` (every process)
memory-maps it and cuts it into windows. The training loader draws through a ``ResumableShuffleSampler``
(a ``DistributedSampler``: shuffled per epoch from ``(seed, epoch)``, sharded over data-parallel replicas,
resumed mid-epoch from the trainer's loop state, :mod:`~lightning_async.data.sampler`); the evaluation
loaders are plain, ordered ``DataLoader``s. What differs between the values of ``source`` and ``tokenizer``
is asked of their objects (:mod:`~lightning_async.data.kinds`). See ``docs/data.md``.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_info
from torch.utils.data import DataLoader

from lightning_async.data.cache import CACHE_FORMAT, TokenCache, dtype_for_vocab
from lightning_async.data.errors import DataConfigError, NotEnoughDataError
from lightning_async.data.kinds import DATA_SOURCES, TOKENIZER_KINDS, DataSource, TokenizerKind, named
from lightning_async.data.shards import check_dtype
from lightning_async.data.sampler import ResumableDataLoader, ResumableShuffleSampler, trainer_position
from lightning_async.data.sources import Corpus, capped
from lightning_async.data.tokenizer import encode_pieces
from lightning_async.data.windows import Segment, TokenWindows, heldout_windows


def _positive(name: str, value: int | None, allow_none: bool = True, minimum: int = 1) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise DataConfigError(f"`{name}` must be an integer >= {minimum}, got {value!r}.")


class TextDataModule(LightningDataModule):
    """Token windows for causal-LM pretraining from a text corpus or pre-tokenized shards.

    Args:
        source: ``stdlib`` (this interpreter's standard library), ``text`` (files), ``hf``
            (a Hugging Face dataset, streamed) or ``tokens`` (pre-tokenized ``.bin`` shards).
        path: ``text``/``tokens``: a file, a directory or a glob (``.gz``/``.xz`` read as text).
        val_path: like ``path``, for validation; without it a ``val_fraction`` of the windows is held out.
        dataset, dataset_config, data_files, split, val_split, text_field: ``hf`` options, passed to
            ``datasets.load_dataset(dataset, dataset_config, split=..., data_files=..., streaming=True)``.
        dtype: ``tokens``: ``uint16`` or ``uint32`` (ignored for shards with an llm.c header).
        tokenizer: ``byte`` (vocab 257), ``bpe`` (trained here on the training text) or ``hf``.
        tokenizer_path: ``hf``: a ``tokenizer.json`` or a directory holding one.
        bpe_vocab_size: size of the trained BPE's vocabulary.
        bpe_train_chars: characters of training text the BPE is trained on (``None``: all).
        seq_len: tokens per input; batches are ``[batch_size, seq_len + 1]``.
        batch_size: windows per batch (per data-parallel replica).
        val_batches: cap on validation batches (``None``: all).
        val_fraction: share of windows held out when there is no separate validation data
            (and of standard-library files for ``stdlib``).
        max_tokens: cap on the tokens read from the training source.
        max_chars: cap on the characters read from the training source (``stdlib`` defaults to
            4,000,000 when neither cap is set).
        token_vocab_size: vocabulary size reported to the model (default: the tokenizer's; for
            ``tokens`` with no ``hf`` tokenizer, the largest id + 1). Must cover every id.
        num_workers: ``DataLoader`` workers.
        seed: seed of the training shuffle; ``None`` (default) follows the run's seed (the value given to
            ``seed_everything``, i.e. ``PL_GLOBAL_SEED``; 0 when none was set), so runs that differ in seed
            also see the data in a different order.
        cache_dir: where tokenized data and trained tokenizers are kept.
        progress: show progress bars while tokenizing.
    """

    def __init__(
        self,
        source: str = "stdlib",
        path: str | None = None,
        val_path: str | None = None,
        dataset: str | None = None,
        dataset_config: str | None = None,
        data_files: str | list[str] | dict[str, str | list[str]] | None = None,
        split: str = "train",
        val_split: str | None = None,
        text_field: str = "text",
        dtype: str = "uint16",
        tokenizer: str = "byte",
        tokenizer_path: str | None = None,
        bpe_vocab_size: int = 4096,
        bpe_train_chars: int | None = 20_000_000,
        seq_len: int = 128,
        batch_size: int = 16,
        val_batches: int | None = None,
        val_fraction: float = 0.05,
        max_tokens: int | None = None,
        max_chars: int | None = None,
        token_vocab_size: int | None = None,
        num_workers: int = 0,
        seed: int | None = None,
        cache_dir: str = ".cache/lightning-async",
        progress: bool = True,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.source = source
        self.path, self.val_path = path, val_path
        self.dataset, self.dataset_config, self.data_files = dataset, dataset_config, data_files
        self.split, self.val_split, self.text_field = split, val_split, text_field
        self.dtype = dtype
        self.tokenizer_name, self.tokenizer_path = tokenizer, tokenizer_path
        self.bpe_vocab_size, self.bpe_train_chars = bpe_vocab_size, bpe_train_chars
        self.seq_len, self.batch_size, self.val_batches = seq_len, batch_size, val_batches
        self.val_fraction = val_fraction
        self.max_tokens, self.max_chars = max_tokens, max_chars
        self.token_vocab_size = token_vocab_size
        self.num_workers, self.seed = num_workers, seed
        self.cache_dir = os.fspath(cache_dir)
        self.progress = progress

        self._tokenizer = None
        self._vocab_size: int | None = None
        self.train_dataset: TokenWindows | None = None
        self.val_dataset: TokenWindows | None = None
        #: per split, what ``prepare_data``/``setup`` did with the cache: built, reused or rebuilt (why)
        self.cache_status: dict[str, str] = {}
        #: the objects behind ``tokenizer`` and ``source`` (:mod:`~lightning_async.data.kinds`), built from the arguments
        self.tokenizer_kind: TokenizerKind
        self.data_source: DataSource
        self._check_arguments()

    # ---- arguments -------------------------------------------------------------------------------
    def _check_arguments(self) -> None:
        """Check every argument and build :attr:`tokenizer_kind` and :attr:`data_source` (errors before any rank starts)."""
        source_class = named(DATA_SOURCES, self.source, "data source", "sources")
        tokenizer_class = named(TOKENIZER_KINDS, self.tokenizer_name, "tokenizer", "tokenizers")
        _positive("seq_len", self.seq_len, allow_none=False)
        _positive("batch_size", self.batch_size, allow_none=False)
        _positive("val_batches", self.val_batches)
        _positive("max_tokens", self.max_tokens)
        _positive("max_chars", self.max_chars)
        _positive("bpe_train_chars", self.bpe_train_chars)
        _positive("token_vocab_size", self.token_vocab_size)
        _positive("num_workers", self.num_workers, allow_none=False, minimum=0)
        _positive("bpe_vocab_size", self.bpe_vocab_size, allow_none=False, minimum=258)
        if not 0.0 < float(self.val_fraction) < 1.0:
            raise DataConfigError(f"`val_fraction` must be between 0 and 1 (exclusive), got {self.val_fraction!r}.")
        check_dtype(self.dtype)
        self.tokenizer_kind = tokenizer_class.from_settings(self)
        self.tokenizer_kind.check()
        self.data_source = source_class.from_settings(self)  # reads tokenizer_kind
        self.data_source.check()

    # ---- tokenizer ---------------------------------------------------------------------------------
    @property
    def tokenizer(self):
        """The tokenizer object (``encode``/``decode``/``vocab_size``/``eod_id``); BPE trains on first use."""
        if self._tokenizer is None:
            self._tokenizer = self.tokenizer_kind.make(lambda: self.data_source.corpus("train"), self._train_char_cap())
        return self._tokenizer

    @property
    def vocab_size(self) -> int:
        """Vocabulary size for the model's embedding (valid right after ``__init__``)."""
        if self._vocab_size is None:
            self._vocab_size = self.data_source.vocab_size(
                lambda: self.tokenizer, lambda: self._segments("train") + (self._segments("val") or [])
            )
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self.tokenizer.encode(text)]

    def decode(self, ids) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return self.tokenizer.decode(ids)

    # ---- caches ------------------------------------------------------------------------------------
    def _train_char_cap(self) -> int | None:
        if self.max_chars is None and self.max_tokens is None:
            return self.data_source.default_max_chars
        return self.max_chars

    def _val_token_cap(self) -> int | None:
        return None if self.val_batches is None else self.val_batches * self.batch_size * (self.seq_len + 1)

    def _cache(self, split: str, corpus: Corpus) -> tuple[TokenCache, dict[str, Any]]:
        tok = self.tokenizer
        dtype = dtype_for_vocab(tok.vocab_size)
        max_tokens = self.max_tokens if split == "train" else self._val_token_cap()
        max_chars = self._train_char_cap() if split == "train" else None
        identity = {
            "format": CACHE_FORMAT,
            "split": split,
            "source": corpus.fingerprint(),
            "tokenizer": tok.identity(),
            "max_tokens": max_tokens,
            "max_chars": max_chars,
            "dtype": dtype,
        }
        cache = TokenCache(self.cache_dir, f"{self.data_source.name}-{split}", identity)

        def chunks():
            return encode_pieces(capped(corpus.pieces(), max_chars), tok)

        kwargs = {
            "make_chunks": chunks,
            "dtype": dtype,
            "max_tokens": max_tokens,
            "progress": self.progress,
            "desc": f"tokenizing {split} ({tok.name})",
            "what": corpus.describe(),
        }
        return cache, kwargs

    def _segments(self, split: str, verify_checksum: bool = False) -> list[Segment] | None:
        """The token files of ``split`` (``None``: held out of train): the source's own, or the cache of its text."""
        return self.data_source.segments(split, lambda corpus: self._cached(split, corpus, verify_checksum))

    def _cached(self, split: str, corpus: Corpus, verify_checksum: bool) -> list[Segment]:
        """The cache file of ``corpus`` as the tokens of ``split``, built or rebuilt if needed."""
        cache, kwargs = self._cache(split, corpus)
        status = cache.ensure(verify_checksum=verify_checksum, **kwargs)
        if status != "reused" or split not in self.cache_status:
            self.cache_status[split] = status
        meta = cache.metadata()
        if status != "reused":
            rank_zero_info(f"data: {split} cache {status}: {meta['num_tokens']:,} tokens in {cache.bin}")
        return [Segment(str(cache.bin), meta["dtype"], int(meta["num_tokens"]))]

    # ---- LightningDataModule hooks -----------------------------------------------------------------
    def prepare_data(self) -> None:
        """Tokenize every split into the cache (or verify and reuse it). Runs in one process per node."""
        self.cache_status = {}
        for split in ("train", "val"):
            self._segments(split, verify_checksum=True)

    def setup(self, stage: str | None = None) -> None:
        """Memory-map the cache (rebuilt here if missing or damaged) and cut it into windows."""
        window = self.seq_len + 1
        train_segments = self._segments("train")
        val_segments = self._segments("val")
        self.data_source.check_token_ids(train_segments + (val_segments or []), lambda: self.vocab_size)
        total = sum(s.num_tokens for s in train_segments)
        if total < window or TokenWindows(train_segments, self.seq_len).total_windows == 0:
            raise NotEnoughDataError(
                f"the training data has {total:,} tokens, fewer than one window of seq_len + 1 = {window}. "
                f"Lower `seq_len` to at most {max(total - 1, 0)}{self._more_data_hint()}."
            )
        train, val = self._split_windows(train_segments, val_segments, self.seq_len)
        replicas = self._replicas()
        need = self.batch_size * replicas
        for name, windows, tokens in (
            ("training", train, total),
            ("validation", val, sum(s.num_tokens for s in val_segments) if val_segments else len(val) * window),
        ):
            if len(windows) < need:
                longest = self._longest_seq_len(train_segments, val_segments, name, need)
                self._raise_too_few_windows(name, windows, tokens, replicas, longest)
        self.train_dataset, self.val_dataset = train, val
        rank_zero_info(
            f"data: {self.data_source.label()}: "
            f"{len(train):,} training and {len(val):,} validation windows of {window} tokens"
        )

    def _split_windows(
        self, train_segments: list[Segment], val_segments: list[Segment] | None, seq_len: int
    ) -> tuple[TokenWindows, TokenWindows]:
        """Training and validation windows of ``seq_len + 1`` (held out of training when no val data)."""
        train = self.data_source.cap_training(TokenWindows(train_segments, seq_len))
        if val_segments is None:
            train_idx, val_idx = heldout_windows(len(train), self.val_fraction)
            base = np.arange(len(train)) if train.indices is None else train.indices
            train, val = train.subset(base[train_idx]), train.subset(base[val_idx])
        else:
            val = TokenWindows(val_segments, seq_len)
        if self.val_batches is not None:
            keep = self.val_batches * self.batch_size
            val = val.subset((np.arange(len(val)) if val.indices is None else val.indices)[:keep])
        return train, val

    def _longest_seq_len(self, train_segments, val_segments, name: str, need: int) -> int:
        """The largest ``seq_len`` giving ``name`` at least ``need`` windows (binary search; 0: none)."""
        lo, hi = 0, self.seq_len - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            train, val = self._split_windows(train_segments, val_segments, mid)
            if len(train if name == "training" else val) >= need:
                lo = mid
            else:
                hi = mid - 1
        return lo

    @property
    def shuffle_seed(self) -> int:
        """Seed of the training shuffle: ``seed``, or the run's seed (``PL_GLOBAL_SEED``) when ``seed`` is None."""
        if self.seed is not None:
            return self.seed
        return int(os.environ.get("PL_GLOBAL_SEED", 0))

    def train_dataloader(self) -> DataLoader:
        """Shuffled per epoch, sharded over data-parallel replicas, resumable mid-epoch (``ResumableShuffleSampler``)."""
        dataset = self._require(self.train_dataset)
        kwargs = self._sampler_kwargs()
        seed = self.shuffle_seed
        trainer = getattr(self, "trainer", None)
        if trainer is not None and trainer.world_size > 1:
            # every process must draw the same permutation (pipeline stages read the same batches, replicas
            # split one permutation), even if the script seeded its ranks differently: rank 0's seed wins
            seed = trainer.strategy.broadcast(seed, src=0)
        sampler = ResumableShuffleSampler(
            dataset, self.batch_size, seed, kwargs.get("num_replicas", 1), kwargs.get("rank", 0),
            resume_point=trainer_position(trainer) if trainer is not None else None,
        )
        return ResumableDataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    def val_dataloader(self) -> DataLoader:
        return DataLoader(
            self._require(self.val_dataset),
            batch_size=self.batch_size,
            shuffle=False,
            drop_last=True,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=torch.cuda.is_available(),
        )

    # ---- checks ------------------------------------------------------------------------------------
    @staticmethod
    def _require(dataset: TokenWindows | None) -> TokenWindows:
        if dataset is None:
            raise RuntimeError("call `setup()` before asking for a dataloader (the Trainer does this for you).")
        return dataset

    def _sampler_kwargs(self) -> dict:
        """The strategy's data-parallel sharding (``num_replicas``, ``rank``); empty without a distributed Trainer."""
        trainer = getattr(self, "trainer", None)
        kwargs = getattr(trainer, "distributed_sampler_kwargs", None) if trainer is not None else None
        return dict(kwargs or {})

    def _replicas(self) -> int:
        return int(self._sampler_kwargs().get("num_replicas", 1))

    def _more_data_hint(self) -> str:
        hints = []
        if self.max_tokens is not None:
            hints.append("raise `max_tokens`")
        if self._train_char_cap() is not None:
            hints.append("raise `max_chars`")
        hints.append("give more data")
        return ", or " + " or ".join(hints)

    def _raise_too_few_windows(self, name: str, windows: TokenWindows, tokens: int, replicas: int, longest: int) -> None:
        per = f"batch_size = {self.batch_size}" + (f" x {replicas} data-parallel replicas" if replicas > 1 else "")
        if name == "validation":
            fix = "raise `val_fraction`, or give more validation data (`val_path`/`val_split`)"
        else:
            fix = self._more_data_hint().removeprefix(", or ")
        lower_seq = f"`seq_len` (to at most {longest})" if longest > 0 else "`seq_len`"
        raise NotEnoughDataError(
            f"the {name} split has {tokens:,} tokens, which make {len(windows)} windows of seq_len + 1 = "
            f"{self.seq_len + 1}: fewer than one batch ({per}). Lower {lower_seq} or `batch_size` "
            f"(to at most {max(len(windows) // replicas, 1)}), or {fix}."
        )

    def __repr__(self) -> str:  # short, for logs
        return f"{type(self).__name__}(source={self.source!r}, tokenizer={self.tokenizer_name!r}, seq_len={self.seq_len})"
