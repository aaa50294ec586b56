"""Tests of the data layer: tokenizers, sources, the token cache, windows and the error messages."""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import random
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from lightning.pytorch import seed_everything

import lightning_async.data.datamodule as datamodule_mod
from lightning_async.data import (
    ByteTokenizer,
    DataConfigError,
    DataFileNotFoundError,
    EmptyCorpusError,
    NotEnoughDataError,
    TextDataModule,
    load_tokenizer,
    train_bpe,
)
from lightning_async.data.cache import TokenCache
from lightning_async.data.sources import StdlibCorpus, stdlib_files
from lightning_async.data.windows import heldout_windows

WORDS = (
    "the quick brown fox jumps over lazy dog river mountain garden letter story window candle "
    "winter summer morning evening silver golden quiet distant ancient little great young old "
    "said thought walked looked found gave took came went knew"
).split()


def make_text(n_words: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    lines, line = [], []
    for i in range(n_words):
        line.append(rng.choice(WORDS))
        if len(line) >= 12:
            lines.append(" ".join(line).capitalize() + ".")
            line = []
        if i % 200 == 199:
            lines.append("")
    lines.append(" ".join(line))
    return "\n".join(lines) + "\n"


def module(tmp_path: Path, **kwargs) -> TextDataModule:
    kwargs.setdefault("cache_dir", str(tmp_path / "cache"))
    kwargs.setdefault("progress", False)
    return TextDataModule(**kwargs)


def ready(tmp_path: Path, **kwargs) -> TextDataModule:
    dm = module(tmp_path, **kwargs)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def stream(dm: TextDataModule, split: str = "train") -> np.ndarray:
    """The whole cached token stream of ``split`` (one cache file)."""
    (seg,) = dm._segments(split)
    return np.asarray(seg.open(), dtype=np.int64)


def batches(loader, n: int) -> list[torch.Tensor]:
    out = []
    for batch in loader:
        out.append(batch)
        if len(out) == n:
            break
    return out


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(make_text(6000), encoding="utf-8")
    return path


# ---- tokenizers ----------------------------------------------------------------------------------
def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo wörld \U0001f680\n\ttabs and ascii\n"
    ids = tok.encode(text)
    assert tok.vocab_size == 257 and tok.eod_id == 256
    assert ids.tolist() == list(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.decode([*ids.tolist(), 256]) == text  # the end-of-document id decodes to nothing


def test_bpe_trained_on_corpus_round_trips_and_is_cached(tmp_path, text_file):
    dm = module(tmp_path, source="text", path=str(text_file), tokenizer="bpe", bpe_vocab_size=320)
    assert 257 < dm.vocab_size <= 320  # valid right after __init__: trained on first access
    tok = dm.tokenizer
    assert tok.status == "trained"
    assert tok.eod_id is not None and tok.tokenizer.id_to_token(tok.eod_id) == "<|endoftext|>"
    sample = "The quick brown fox walked to the garden. Ünïcödé \U0001f600 too!\n"
    ids = dm.encode(sample)
    assert dm.decode(ids) == sample
    common = text_file.read_text()[:2000]
    assert len(dm.encode(common)) < 0.6 * len(common.encode())  # merges learned from the corpus
    saved = Path(tok.source)
    mtime = saved.stat().st_mtime_ns

    again = module(tmp_path, source="text", path=str(text_file), tokenizer="bpe", bpe_vocab_size=320)
    assert again.tokenizer.status == "loaded"
    assert again.tokenizer.source == str(saved) and saved.stat().st_mtime_ns == mtime
    assert again.encode(sample) == ids

    other = module(tmp_path, source="text", path=str(text_file), tokenizer="bpe", bpe_vocab_size=300)
    assert other.tokenizer.status == "trained" and other.vocab_size <= 300


def test_hf_tokenizer_from_file_and_directory(tmp_path):
    trained = train_bpe([make_text(3000, seed=1)], vocab_size=300)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    trained.save(str(tok_dir / "tokenizer.json"))
    sample = "Silver candle by the river, año 2024 \u2014 done.\n"
    from_file = load_tokenizer(tok_dir / "tokenizer.json")
    from_dir = load_tokenizer(tok_dir)
    assert from_file.vocab_size == from_dir.vocab_size == trained.get_vocab_size()
    assert from_file.eod_id == trained.token_to_id("<|endoftext|>")
    assert from_file.decode(from_file.encode(sample)) == sample
    assert from_dir.encode(sample).tolist() == from_file.encode(sample).tolist()

    corpus = tmp_path / "c.txt"
    corpus.write_text(make_text(3000, seed=2))
    dm = ready(tmp_path, source="text", path=str(corpus), tokenizer="hf", tokenizer_path=str(tok_dir), seq_len=16, batch_size=4)
    assert dm.vocab_size == trained.get_vocab_size()
    ids = stream(dm)
    assert ids[-1] == from_file.eod_id
    assert dm.decode(ids) == corpus.read_text()


# ---- sources -------------------------------------------------------------------------------------
def test_stdlib_source_batches_and_file_split(tmp_path):
    dm = ready(tmp_path, max_chars=200_000, seq_len=64, batch_size=8)
    batch = next(iter(dm.train_dataloader()))
    assert batch.dtype == torch.int64 and batch.shape == (8, 65)
    assert int(batch.max()) < dm.vocab_size == 257
    val = next(iter(dm.val_dataloader()))
    assert val.shape == (8, 65)

    train_files = StdlibCorpus("train", 20).relpaths
    val_files = StdlibCorpus("val", 20).relpaths
    assert train_files and val_files
    assert not set(train_files) & set(val_files)
    assert sorted(train_files + val_files) == [rel for rel, _ in stdlib_files()]
    assert all("site-packages" not in r and "/test/" not in f"/{r}" for r in train_files)
    # the training stream is the first training files, in sorted order, capped at 200,000 characters
    first = StdlibCorpus("train", 20).files[0].read_bytes()
    ids = stream(dm)
    assert ids[:200].tolist() == list(first[:200])
    assert 200_000 <= len(ids) <= 200_000 * 4


def test_text_plain_gz_xz_directory_and_glob(tmp_path):
    text = make_text(3000)
    (tmp_path / "raw").mkdir()
    plain = tmp_path / "raw" / "a.txt"
    plain.write_text(text)
    with gzip.open(tmp_path / "a.txt.gz", "wt", encoding="utf-8") as f:
        f.write(text)
    with lzma.open(tmp_path / "a.txt.xz", "wt", encoding="utf-8") as f:
        f.write(text)
    expected = [*text.encode(), 256]
    for path in (plain, tmp_path / "a.txt.gz", tmp_path / "a.txt.xz"):
        dm = module(tmp_path, source="text", path=str(path), seq_len=32, batch_size=4)
        dm.prepare_data()
        assert stream(dm).tolist() == expected, path

    second = make_text(1000, seed=5)
    (tmp_path / "raw" / "b.md").write_text(second)
    (tmp_path / "raw" / ".hidden").write_text("never read")
    whole = module(tmp_path, source="text", path=str(tmp_path / "raw"), seq_len=32, batch_size=4)
    whole.prepare_data()
    assert stream(whole).tolist() == expected + [*second.encode(), 256]  # sorted: a.txt then b.md
    only_txt = module(tmp_path, source="text", path=str(tmp_path / "raw" / "*.txt"), seq_len=32, batch_size=4)
    only_txt.prepare_data()
    assert stream(only_txt).tolist() == expected


def test_text_val_path_windows_are_consecutive_non_overlapping(tmp_path, text_file):
    val_file = tmp_path / "val.txt"
    val_file.write_text(make_text(1500, seed=9))
    dm = ready(tmp_path, source="text", path=str(text_file), val_path=str(val_file), seq_len=31, batch_size=4)
    ids = stream(dm)
    assert len(dm.train_dataset) == len(ids) // 32
    for i in (0, 1, len(dm.train_dataset) - 1):
        assert dm.train_dataset[i].tolist() == ids[i * 32 : (i + 1) * 32].tolist()
    val_ids = stream(dm, "val")
    first_val = next(iter(dm.val_dataloader()))  # fixed order: the first windows of the val file
    assert first_val.reshape(-1).tolist() == val_ids[: 4 * 32].tolist()
    capped = ready(tmp_path, source="text", path=str(text_file), val_path=str(val_file), seq_len=31, batch_size=4, val_batches=2)
    assert len(capped.val_dataset) == 8 and len(list(capped.val_dataloader())) == 2


def test_heldout_validation_is_disjoint_and_deterministic(tmp_path, text_file):
    dm = ready(tmp_path, source="text", path=str(text_file), seq_len=15, batch_size=4, val_fraction=0.1)
    train, val = set(dm.train_dataset.indices.tolist()), set(dm.val_dataset.indices.tolist())
    assert val and train and not train & val
    assert train | val == set(range(dm.train_dataset.total_windows))
    assert 0.05 < len(val) / (len(val) + len(train)) < 0.2
    again = ready(tmp_path, source="text", path=str(text_file), seq_len=15, batch_size=4, val_fraction=0.1)
    assert again.val_dataset.indices.tolist() == dm.val_dataset.indices.tolist()
    tr, va = heldout_windows(3, 0.05)  # tiny data still gets a validation window
    assert tr.tolist() == [0, 1] and va.tolist() == [2]


def test_hf_source_from_local_jsonl(tmp_path):
    docs = [make_text(80 + 7 * i, seed=i) for i in range(40)]
    train_file, val_file = tmp_path / "train.jsonl", tmp_path / "val.jsonl"
    train_file.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs)))
    val_file.write_text("".join(json.dumps({"id": i, "body": d}) + "\n" for i, d in enumerate(docs[:10])))
    dm = ready(
        tmp_path,
        source="hf",
        dataset="json",
        data_files={"train": str(train_file), "validation": str(val_file)},
        val_split="validation",
        text_field="body",
        seq_len=32,
        batch_size=4,
    )
    expected = [t for d in docs for t in [*d.encode(), 256]]
    assert stream(dm).tolist() == expected
    assert stream(dm, "val").tolist() == expected[: len(expected) - sum(len(d.encode()) + 1 for d in docs[10:])]
    assert next(iter(dm.train_dataloader())).shape == (4, 33)

    wrong = module(tmp_path, source="hf", dataset="json", data_files=str(train_file), seq_len=32, batch_size=4)
    with pytest.raises(DataConfigError, match=r"no field 'text'.*'body'.*Set `text_field`"):
        wrong.prepare_data()


def test_tokens_source_raw_header_and_vocab(tmp_path):
    ids = (np.arange(20_000) * 7919 % 1000).astype(np.uint16)
    ids.tofile(tmp_path / "train_000.bin")
    ids[:5000].tofile(tmp_path / "val.bin")
    dm = ready(tmp_path, source="tokens", path=str(tmp_path / "train_*.bin"), val_path=str(tmp_path / "val.bin"), seq_len=63, batch_size=8)
    assert dm.vocab_size == 1000  # largest id + 1
    assert dm.train_dataset[3].tolist() == ids[3 * 64 : 4 * 64].tolist()
    assert next(iter(dm.val_dataloader())).reshape(-1).tolist() == ids[: 8 * 64].tolist()

    big = np.arange(70_000, 70_000 + 4096, dtype=np.uint32)
    big.tofile(tmp_path / "big.bin")
    wide = ready(tmp_path, source="tokens", path=str(tmp_path / "big.bin"), dtype="uint32", seq_len=31, batch_size=4)
    assert wide.vocab_size == 70_000 + 4096
    assert int(next(iter(wide.train_dataloader())).min()) >= 70_000

    header = np.zeros(256, dtype=np.int32)
    header[:3] = [20240520, 1, len(ids)]
    with open(tmp_path / "llmc.bin", "wb") as f:
        f.write(header.tobytes())
        f.write(ids.tobytes())
    llmc = ready(tmp_path, source="tokens", path=str(tmp_path / "llmc.bin"), dtype="uint32", seq_len=63, batch_size=8)
    assert llmc.train_dataset.segments[0].dtype == "uint16"  # the header overrides dtype
    assert llmc.train_dataset.num_tokens == len(ids)
    assert llmc.train_dataset[llmc.train_dataset.indices[0]].numel() == 64

    small = module(tmp_path, source="tokens", path=str(tmp_path / "train_000.bin"), token_vocab_size=500, seq_len=63, batch_size=8)
    with pytest.raises(DataConfigError, match=r"id 999, outside the vocabulary of size 500"):
        small.setup("fit")
    (tmp_path / "odd.bin").write_bytes(b"\x01\x02\x03")
    with pytest.raises(DataConfigError, match=r"3 bytes, not a multiple of 2.*set `dtype`"):
        module(tmp_path, source="tokens", path=str(tmp_path / "odd.bin")).setup("fit")


# ---- determinism, workers, cache -----------------------------------------------------------------
def test_same_arguments_same_batches(tmp_path, text_file):
    kw = dict(source="text", path=str(text_file), seq_len=15, batch_size=4, seed=3)
    a, b = ready(tmp_path, **kw), ready(tmp_path, **kw)
    first_a, first_b = batches(a.train_dataloader(), 5), batches(b.train_dataloader(), 5)
    assert all(torch.equal(x, y) for x, y in zip(first_a, first_b))
    in_order = [a.train_dataset[i] for i in range(4)]
    assert not torch.equal(first_a[0], torch.stack(in_order))  # shuffled
    other = ready(tmp_path, **{**kw, "seed": 4})
    assert not torch.equal(batches(other.train_dataloader(), 1)[0], first_a[0])
    assert all(torch.equal(x, y) for x, y in zip(batches(a.val_dataloader(), 3), batches(b.val_dataloader(), 3)))
    workers = ready(tmp_path, **kw, num_workers=1)
    assert all(torch.equal(x, y) for x, y in zip(batches(workers.train_dataloader(), 3), first_a))


def test_shuffle_follows_the_run_seed_unless_given(tmp_path, text_file, monkeypatch):
    kw = dict(source="text", path=str(text_file), seq_len=15, batch_size=4)
    fixed = batches(ready(tmp_path, **kw, seed=3).train_dataloader(), 2)
    follows = ready(tmp_path, **kw)
    monkeypatch.delenv("PL_GLOBAL_SEED", raising=False)
    assert follows.shuffle_seed == 0
    seed_everything(3)
    assert all(torch.equal(x, y) for x, y in zip(batches(follows.train_dataloader(), 2), fixed))
    seed_everything(4)
    assert not torch.equal(batches(follows.train_dataloader(), 1)[0], fixed[0])
    pinned = ready(tmp_path, **kw, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(batches(pinned.train_dataloader(), 2), fixed))  # an explicit seed wins


def test_second_prepare_reuses_the_cache(tmp_path, text_file, monkeypatch):
    calls = []
    real = datamodule_mod.encode_pieces
    monkeypatch.setattr(datamodule_mod, "encode_pieces", lambda *a, **k: calls.append(1) or real(*a, **k))
    kw = dict(source="text", path=str(text_file), seq_len=15, batch_size=4)
    first = ready(tmp_path, **kw)
    assert first.cache_status == {"train": "built"} and len(calls) == 1
    bin_file = Path(first.train_dataset.segments[0].path)
    mtime = bin_file.stat().st_mtime_ns
    second = ready(tmp_path, **kw)
    assert second.cache_status == {"train": "reused"} and len(calls) == 1
    assert bin_file.stat().st_mtime_ns == mtime
    changed = ready(tmp_path, **kw, max_tokens=5000)  # another option: another cache
    assert changed.cache_status == {"train": "built"} and len(calls) == 2
    assert changed.train_dataset.num_tokens == 5000


@pytest.mark.parametrize("damage", ["truncate", "flip", "metadata", "mismatch", "missing"])
def test_corrupt_or_stale_cache_is_rebuilt(tmp_path, text_file, damage):
    kw = dict(source="text", path=str(text_file), seq_len=15, batch_size=4)
    dm = ready(tmp_path, **kw)
    good = stream(dm)
    bin_file = Path(dm.train_dataset.segments[0].path)
    meta_file = bin_file.with_suffix(".json")
    if damage == "truncate":
        bin_file.write_bytes(bin_file.read_bytes()[:-10])
    elif damage == "flip":
        data = bytearray(bin_file.read_bytes())
        data[100:104] = b"\xff\xff\xff\xff"
        bin_file.write_bytes(bytes(data))
    elif damage == "metadata":
        meta_file.write_text("{not json")
    elif damage == "mismatch":
        meta = json.loads(meta_file.read_text())
        meta["identity"]["max_tokens"] = 123
        meta_file.write_text(json.dumps(meta))
    else:
        bin_file.unlink()
    again = module(tmp_path, **kw)
    again.prepare_data()
    assert again.cache_status["train"].startswith("rebuilt"), again.cache_status
    again.setup("fit")
    assert np.array_equal(stream(again), good)


def test_setup_alone_detects_a_truncated_cache(tmp_path, text_file):
    kw = dict(source="text", path=str(text_file), seq_len=15, batch_size=4)
    dm = ready(tmp_path, **kw)
    bin_file = Path(dm.train_dataset.segments[0].path)
    bin_file.write_bytes(bin_file.read_bytes()[:1000])
    again = module(tmp_path, **kw)
    again.setup("fit")  # no prepare_data: setup checks sizes itself
    assert again.cache_status["train"].startswith("rebuilt (token file has 1000 bytes")
    assert again.train_dataset.num_tokens == dm.train_dataset.num_tokens


def test_cache_key_changes_with_tokenizer_identity(tmp_path):
    a = TokenCache(tmp_path, "x", {"tokenizer": {"kind": "byte"}})
    b = TokenCache(tmp_path, "x", {"tokenizer": {"kind": "tokenizer.json", "sha256": "0"}})
    assert a.bin != b.bin and a.problem() == "no metadata"


# The cache files and the trained BPE's file as the data module named them when it compared source names
# (commit 488f101, before lightning_async/data/kinds.py): the same arguments must find the files written then.
BYTE_IDENTITY = {"kind": "byte", "version": 1}


def sha20(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def old_cache_file(cache_dir: Path, source: str, split: str, fingerprint, tokenizer, max_tokens, max_chars) -> Path:
    identity = {"format": 1, "split": split, "source": fingerprint, "tokenizer": tokenizer,
                "max_tokens": max_tokens, "max_chars": max_chars, "dtype": "uint16"}
    return cache_dir / "tokens" / f"{source}-{split}-{sha20(json.loads(json.dumps(identity, default=str)))}.bin"


def files_fingerprint(*paths: Path) -> list:
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in paths]


def json_identity(path: Path) -> dict:
    from tokenizers import Tokenizer

    return {"kind": "tokenizer.json", "sha256": hashlib.sha256(Tokenizer.from_file(str(path)).to_str().encode()).hexdigest()}


def cache_files(dm: TextDataModule) -> dict[str, Path]:
    dm.prepare_data()
    return {split: Path(segments[0].path) for split in ("train", "val") if (segments := dm._segments(split))}


def stdlib_fingerprint(split: str, every: int) -> dict:  # every = max(2, round(1 / val_fraction))
    return StdlibCorpus(split, every).fingerprint()


def test_every_source_finds_the_cache_files_of_before(tmp_path, text_file):
    cache = tmp_path / "cache"
    val_file = tmp_path / "val.txt"
    val_file.write_text(make_text(800, seed=3))
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"text": make_text(60, seed=i)}) + "\n" for i in range(30)))
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    train_bpe([make_text(2000, seed=4)], vocab_size=300).save(str(tok_dir / "tokenizer.json"))
    text_print = {"kind": "files", "files": files_fingerprint(text_file)}
    hf_files = {"train": files_fingerprint(jsonl), "validation": files_fingerprint(jsonl)}

    def hf(split: str) -> dict:
        return {"kind": "hf", "dataset": "json", "config": None, "split": split, "data_files": hf_files, "text_field": "text"}

    # (arguments, {split: (fingerprint, tokenizer identity, max_tokens, max_chars)})
    cases = [
        (dict(source="stdlib", val_batches=1), {  # the default cap of 4,000,000 characters
            "train": (stdlib_fingerprint("train", 20), BYTE_IDENTITY, None, 4_000_000),
            "val": (stdlib_fingerprint("val", 20), BYTE_IDENTITY, 1 * 4 * 16, None)}),
        (dict(source="stdlib", max_chars=30_000, val_batches=1), {
            "train": (stdlib_fingerprint("train", 20), BYTE_IDENTITY, None, 30_000),
            "val": (stdlib_fingerprint("val", 20), BYTE_IDENTITY, 1 * 4 * 16, None)}),
        (dict(source="stdlib", max_tokens=20_000, val_fraction=0.1, val_batches=1), {
            "train": (stdlib_fingerprint("train", 10), BYTE_IDENTITY, 20_000, None),
            "val": (stdlib_fingerprint("val", 10), BYTE_IDENTITY, 1 * 4 * 16, None)}),
        (dict(source="text", path=str(text_file), val_path=str(val_file), val_batches=2), {
            "train": (text_print, BYTE_IDENTITY, None, None),
            "val": ({"kind": "files", "files": files_fingerprint(val_file)}, BYTE_IDENTITY, 2 * 4 * 16, None)}),
        (dict(source="text", path=str(text_file), tokenizer="hf", tokenizer_path=str(tok_dir), max_tokens=5000), {
            "train": (text_print, json_identity(tok_dir / "tokenizer.json"), 5000, None)}),
        (dict(source="hf", dataset="json", data_files={"train": str(jsonl), "validation": str(jsonl)}, val_split="validation"), {
            "train": (hf("train"), BYTE_IDENTITY, None, None),
            "val": (hf("validation"), BYTE_IDENTITY, None, None)}),
    ]
    for kwargs, expected in cases:
        found = cache_files(module(tmp_path, seq_len=15, batch_size=4, **kwargs))
        assert found == {split: old_cache_file(cache, kwargs["source"], split, *identity) for split, identity in expected.items()}, kwargs

    # the BPE trained on the first max_chars characters: its file, then the cache tokenized with it
    bpe = module(tmp_path, source="text", path=str(text_file), tokenizer="bpe", bpe_vocab_size=300, max_chars=50_000)
    bpe_file = cache / "tokenizers" / f"bpe300-{sha20({'bpe': 1, 'vocab_size': 300, 'train_chars': 50_000, 'corpus': text_print})}.json"
    assert cache_files(bpe) == {"train": old_cache_file(cache, "text", "train", text_print, json_identity(bpe_file), None, 50_000)}
    assert Path(bpe.tokenizer.source) == bpe_file


def test_trainer_fit_and_replica_check(tmp_path, text_file):
    from lightning.pytorch import LightningModule, Trainer

    class Tiny(LightningModule):
        def __init__(self, vocab):
            super().__init__()
            self.emb = torch.nn.Embedding(vocab, vocab)
            self.shapes = []

        def training_step(self, batch, _):
            self.shapes.append(tuple(batch.shape))
            logits = self.emb(batch[:, :-1])
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())

        def validation_step(self, batch, _):
            self.shapes.append(tuple(batch.shape))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dm = module(tmp_path, source="text", path=str(text_file), seq_len=15, batch_size=4)
    model = Tiny(dm.vocab_size)
    trainer = Trainer(fast_dev_run=2, accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(model, datamodule=dm)
    assert model.shapes and set(model.shapes) == {(4, 16)}

    # under data parallelism Lightning rebuilds the loader around its DistributedSampler
    from lightning.pytorch.utilities.data import _update_dataloader
    from torch.utils.data import DistributedSampler

    np.arange(16 * 100, dtype=np.uint16).tofile(tmp_path / "unique.bin")  # every window is distinct
    unique = str(tmp_path / "unique.bin")
    loader = ready(tmp_path, source="tokens", path=unique, val_path=unique, seq_len=15, batch_size=4).train_dataloader()
    shards = []
    for rank in range(2):
        sampler = DistributedSampler(loader.dataset, num_replicas=2, rank=rank, shuffle=True, seed=0)
        rebuilt = _update_dataloader(loader, sampler)
        assert rebuilt.drop_last and rebuilt.batch_size == 4
        shards.append({tuple(row) for batch in rebuilt for row in batch.tolist()})
    assert len(shards[0]) == len(shards[1]) == 48 and not shards[0] & shards[1]  # 50 windows each, drop_last

    sharded = module(tmp_path, source="text", path=str(text_file), seq_len=15, batch_size=64)
    sharded.trainer = SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 64, "rank": 0})
    with pytest.raises(NotEnoughDataError, match=r"fewer than one batch \(batch_size = 64 x 64 data-parallel replicas\)"):
        sharded.setup("fit")


# ---- bad input -----------------------------------------------------------------------------------
def test_unknown_source_and_tokenizer(tmp_path):
    with pytest.raises(DataConfigError, match=r"unknown data source 'web'; valid sources are 'stdlib', 'text', 'hf', 'tokens'"):
        module(tmp_path, source="web")
    with pytest.raises(DataConfigError, match=r"unknown tokenizer 'gpt2'; valid tokenizers are 'byte', 'bpe', 'hf'"):
        module(tmp_path, tokenizer="gpt2")


def test_missing_paths(tmp_path):
    with pytest.raises(DataFileNotFoundError, match=r"no such file or directory: '.*nope\.txt'"):
        module(tmp_path, source="text", path=str(tmp_path / "nope.txt"))
    with pytest.raises(FileNotFoundError, match=r"the glob '.*\*\.zst' matches no file"):
        module(tmp_path, source="text", path=str(tmp_path / "*.zst"))
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DataFileNotFoundError, match=r"contains no files"):
        module(tmp_path, source="tokens", path=str(tmp_path / "empty_dir"))
    with pytest.raises(DataConfigError, match=r"source 'text' needs `path`"):
        module(tmp_path, source="text")
    with pytest.raises(DataFileNotFoundError, match=r"`val_path`: no such file"):
        (tmp_path / "t.txt").write_text("x")
        module(tmp_path, source="text", path=str(tmp_path / "t.txt"), val_path=str(tmp_path / "v.txt"))


def test_tokenizer_and_hf_arguments(tmp_path):
    with pytest.raises(DataConfigError, match=r"tokenizer 'hf' needs `tokenizer_path`"):
        module(tmp_path, tokenizer="hf")
    with pytest.raises(DataFileNotFoundError, match=r"has no tokenizer.json"):
        module(tmp_path, tokenizer="hf", tokenizer_path=str(tmp_path))
    with pytest.raises(DataConfigError, match=r"source 'hf' needs `dataset`"):
        module(tmp_path, source="hf")
    with pytest.raises(DataFileNotFoundError, match=r"`data_files`: no such file"):
        module(tmp_path, source="hf", dataset="json", data_files=str(tmp_path / "missing.jsonl"))
    with pytest.raises(DataConfigError, match=r"`seq_len` must be an integer >= 1"):
        module(tmp_path, seq_len=0)


def test_empty_corpus(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    dm = module(tmp_path, source="text", path=str(tmp_path / "empty.txt"))
    with pytest.raises(EmptyCorpusError, match=r"file '.*empty\.txt' produced no tokens \(it is empty\)"):
        dm.prepare_data()
    bpe = module(tmp_path, source="text", path=str(tmp_path / "empty.txt"), tokenizer="bpe")
    with pytest.raises(EmptyCorpusError, match=r"cannot train the BPE: file '.*empty\.txt' contains no text"):
        _ = bpe.vocab_size


def test_seq_len_longer_than_the_data(tmp_path):
    (tmp_path / "small.txt").write_text("a" * 99)  # 99 bytes + end of document = 100 tokens
    dm = module(tmp_path, source="text", path=str(tmp_path / "small.txt"), seq_len=500)
    with pytest.raises(NotEnoughDataError, match=r"has 100 tokens, fewer than one window of seq_len \+ 1 = 501\. Lower `seq_len` to at most 99"):
        dm.prepare_data()
        dm.setup("fit")
    (tmp_path / "medium.txt").write_text("b" * 4999)
    (tmp_path / "val.txt").write_text("c" * 20_000)
    kw = dict(source="text", path=str(tmp_path / "medium.txt"), val_path=str(tmp_path / "val.txt"), batch_size=64)
    with pytest.raises(NotEnoughDataError, match=r"training split has 5,000 tokens, which make 39 windows .*fewer than one batch \(batch_size = 64\)\. Lower `seq_len` \(to at most (\d+)\) or `batch_size` \(to at most 39\)") as err:
        module(tmp_path, **kw, seq_len=127).setup("fit")
    longest = int(re.search(r"at most (\d+)\)", str(err.value)).group(1))
    assert longest == 5000 // 64 - 1
    assert len(list(ready(tmp_path, **kw, seq_len=longest).train_dataloader())) == 1  # the suggestion works
    with pytest.raises(NotEnoughDataError):
        ready(tmp_path, **kw, seq_len=longest + 1)

    # held-out validation needs a full batch too: the message says how to get one
    held = module(tmp_path, source="text", path=str(tmp_path / "medium.txt"), seq_len=31, batch_size=32)
    with pytest.raises(NotEnoughDataError, match=r"validation split has \d+ tokens, which make \d+ windows .*Lower `seq_len` \(to at most (\d+)\).*raise `val_fraction`") as err:
        held.setup("fit")
    longest = int(re.search(r"at most (\d+)\)", str(err.value)).group(1))
    fits = ready(tmp_path, source="text", path=str(tmp_path / "medium.txt"), seq_len=longest, batch_size=32)
    assert len(list(fits.val_dataloader())) >= 1


class _Terminal:
    """A stderr that says it is a terminal and keeps what is written to it."""

    def __init__(self) -> None:
        self.text = ""

    def write(self, text: str) -> int:
        self.text += text
        return len(text)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return True


def test_a_fast_cache_build_prints_no_empty_progress_bar(tmp_path, monkeypatch, capsys):
    """The quick start's tokenizing took about a second and printed `0.00tok [00:00, ?tok/s]`: in a log (stderr not a
    terminal) no bar is drawn at all, and in a terminal only a build slower than the bar's delay draws one."""
    chunks = [np.arange(256, dtype=np.int64)] * 4
    TokenCache(tmp_path / "log", "x", {"k": 1}).write(iter(chunks), "uint16", progress=True, desc="tokenizing train")
    assert "tok" not in capsys.readouterr().err
    terminal = _Terminal()
    monkeypatch.setattr("sys.stderr", terminal)
    meta = TokenCache(tmp_path / "tty", "x", {"k": 1}).write(iter(chunks), "uint16", progress=True, desc="tokenizing train")
    assert meta["num_tokens"] == 1024 and "0.00tok" not in terminal.text and "tokenizing" not in terminal.text
