"""The data layer: corpora, tokenizers, the token cache and :class:`TextDataModule` (see ``docs/data.md``)."""

from lightning_async.data.datamodule import TextDataModule
from lightning_async.data.errors import DataConfigError, DataFileNotFoundError, EmptyCorpusError, NotEnoughDataError
from lightning_async.data.kinds import SOURCES, TOKENIZERS
from lightning_async.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer, train_bpe

__all__ = [
    "SOURCES",
    "TOKENIZERS",
    "ByteTokenizer",
    "DataConfigError",
    "DataFileNotFoundError",
    "EmptyCorpusError",
    "HFTokenizer",
    "NotEnoughDataError",
    "TextDataModule",
    "load_tokenizer",
    "train_bpe",
]
