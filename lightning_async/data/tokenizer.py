"""Tokenizers: UTF-8 bytes, a byte-level BPE trained locally, or any Hugging Face ``tokenizer.json``.

All three share one small interface: ``vocab_size``, ``eod_id`` (the id appended after each
document, or ``None``), ``encode``/``encode_batch`` (to ``uint32`` arrays), ``decode`` and
``identity()`` (what keys the token cache: changing the tokenizer invalidates it).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from lightning_async.data.cache import atomic_write_text, file_lock
from lightning_async.data.errors import DataConfigError, DataFileNotFoundError, EmptyCorpusError
from lightning_async.data.sources import Corpus, Piece, capped, digest

#: the BPE's end-of-document token, and the names looked for in a loaded tokenizer
EOD_TOKEN = "<|endoftext|>"
EOD_CANDIDATES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|im_end|>")

#: pieces are encoded in batches of about this many characters (the Rust side runs them in parallel)
ENCODE_BATCH_CHARS = 4 << 20


class ByteTokenizer:
    """UTF-8 bytes 0..255 plus one end-of-document id 256: vocabulary 257, nothing to train."""

    name = "byte"
    vocab_size = 257
    eod_id = 256

    def encode(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")

    def identity(self) -> dict[str, Any]:
        return {"kind": "byte", "version": 1}


class HFTokenizer:
    """A :class:`tokenizers.Tokenizer` (loaded from a ``tokenizer.json`` or trained here)."""

    def __init__(self, tokenizer, name: str = "hf", eod_token: str | None = None, source: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.name = name
        self.source = source
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(vocab.values()) + 1 if vocab else 0
        if eod_token is None:
            eod_token = next((t for t in EOD_CANDIDATES if t in vocab), None)
        self.eod_token = eod_token if eod_token in vocab else None
        self.eod_id = vocab[self.eod_token] if self.eod_token is not None else None
        self._fast = getattr(tokenizer, "encode_batch_fast", None)
        self._sha = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tokenizer.encode(text, add_special_tokens=False).ids, dtype=np.uint32)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        encode = self._fast or self.tokenizer.encode_batch
        return [np.asarray(e.ids, dtype=np.uint32) for e in encode(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    def identity(self) -> dict[str, Any]:
        return {"kind": "tokenizer.json", "sha256": self._sha}


def _eos_from_config(directory: Path) -> str | None:
    """The ``eos_token`` of a ``tokenizer_config.json`` next to the ``tokenizer.json``, if any."""
    config = directory / "tokenizer_config.json"
    if not config.is_file():
        return None
    try:
        eos = json.loads(config.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def tokenizer_json_path(path: str | os.PathLike) -> Path:
    """The ``tokenizer.json`` named by ``path`` (the file itself, or a directory that holds one)."""
    p = Path(path).expanduser()
    if p.is_dir():
        if not (p / "tokenizer.json").is_file():
            raise DataFileNotFoundError(
                f"`tokenizer_path`: directory {str(path)!r} has no tokenizer.json. Point it at a tokenizer.json "
                "file or at a directory saved by `save_pretrained` (which writes one)."
            )
        return p / "tokenizer.json"
    if not p.is_file():
        raise DataFileNotFoundError(f"`tokenizer_path`: no such file or directory: {str(path)!r}. Give a tokenizer.json or its directory.")
    return p


def load_tokenizer(path: str | os.PathLike) -> HFTokenizer:
    """Load a Hugging Face ``tokenizers`` tokenizer from a ``tokenizer.json`` or a directory with one."""
    from tokenizers import Tokenizer

    file = tokenizer_json_path(path)
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as err:
        raise DataConfigError(f"`tokenizer_path`: {str(file)!r} is not a valid tokenizer.json ({err}).") from err
    return HFTokenizer(tok, name="hf", eod_token=_eos_from_config(file.parent), source=str(file))


def train_bpe(texts: Iterable[str], vocab_size: int, progress: bool = False):
    """Train a byte-level BPE (GPT-2 style pre-tokenization, lossless on any UTF-8) on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=progress,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def bpe_for_corpus(
    corpus: Corpus, vocab_size: int, train_chars: int | None, cache_dir: str | os.PathLike, progress: bool = True
) -> HFTokenizer:
    """The BPE of ``corpus``: loaded from ``cache_dir`` when trained before, else trained and saved.

    The file is keyed by the corpus fingerprint, the vocabulary size and the training-text cap.
    The returned tokenizer's ``status`` is ``"loaded"`` or ``"trained"``.
    """
    from tokenizers import Tokenizer

    key = digest({"bpe": 1, "vocab_size": vocab_size, "train_chars": train_chars, "corpus": corpus.fingerprint()})
    folder = Path(cache_dir) / "tokenizers"
    folder.mkdir(parents=True, exist_ok=True)
    file = folder / f"bpe{vocab_size}-{key}.json"
    with file_lock(folder / f"bpe{vocab_size}-{key}.lock"):
        if file.is_file():
            try:
                tok = HFTokenizer(Tokenizer.from_file(str(file)), name="bpe", eod_token=EOD_TOKEN, source=str(file))
                if tok.eod_id is not None:
                    tok.status = "loaded"
                    return tok
            except Exception:  # a damaged file: train again
                pass
        seen = 0

        def texts() -> Iterator[str]:
            nonlocal seen
            for text, _ in capped(corpus.pieces(), train_chars):
                seen += len(text)
                yield text

        trained = train_bpe(texts(), vocab_size, progress)
        if seen == 0:
            raise EmptyCorpusError(f"cannot train the BPE: {corpus.describe()} contains no text. Point the source at a non-empty corpus.")
        atomic_write_text(file, trained.to_str())
    tok = HFTokenizer(trained, name="bpe", eod_token=EOD_TOKEN, source=str(file))
    tok.status = "trained"
    return tok


def encode_pieces(pieces: Iterable[Piece], tokenizer, batch_chars: int = ENCODE_BATCH_CHARS) -> Iterator[np.ndarray]:
    """Token ids of a stream of pieces, with ``eod_id`` after each piece that ends a document."""
    eod = None if tokenizer.eod_id is None else np.asarray([tokenizer.eod_id], dtype=np.uint32)
    batch: list[str] = []
    ends: list[bool] = []
    size = 0

    def flush() -> Iterator[np.ndarray]:
        for ids, end in zip(tokenizer.encode_batch(batch), ends):
            yield ids
            if end and eod is not None:
                yield eod

    for text, end in pieces:
        batch.append(text)
        ends.append(end)
        size += len(text)
        if size >= batch_chars or len(batch) >= 4096:
            yield from flush()
            batch, ends, size = [], [], 0
    if batch:
        yield from flush()
