"""Text data sets: Shakespeare's plays as characters, and pre-tokenised token files (nanoGPT's train.bin, val.bin).

A sample is a window of seq_len + 1 consecutive tokens as (x, y) int64 tensors of shape (seq_len,), y being x
shifted by one token. Each split is one stream of tokens held as a small-int numpy array (or a memory-mapped file)
and indexed a batch at a time. What data_check.py checks before a job is submitted, this module relies on.
"""

from __future__ import annotations

import functools
import hashlib
import tarfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from tula_hpc.core.job import DataSettings
from tula_hpc.training.data_check import (
    shakespeare_archive,
    shakespeare_training_characters,
    token_files,
    token_settings,
)

SHAKESPEARE_TEXTS = "shksprdata/texts/"
SHAKESPEARE_SUFFIX = "_gut.txt"  # modern spelling; the First Folio's files end in _gut_f.txt
# Whole works held out, so no passage leaks across splits; poems (sonnets, venus_and_adonis, rape_of_lucrece, ...)
# stay in training. Of the corpus's 5,057,198 characters, validation holds 262,151 (5.2 %), test 245,180 (4.8 %).
VALIDATION_WORKS = ("comedy_of_errors_gut.txt", "hamlet_gut.txt")
TEST_WORKS = ("macbeth_gut.txt", "romeo_and_juliet_gut.txt")
# The distinct characters of the pinned archive (its sha256 fixes them; a test reads them): the vocabulary's size
# without reading the corpus.
SHAKESPEARE_VOCAB_SIZE = 84


class TokenWindows(Dataset):
    """Windows of seq_len + 1 tokens of one stream: sample i starts at offset + i * seq_len, so windows do not
    overlap and each token after the first is a target once.

    Evaluation's offset is 0. Training's (`seed` given) is drawn from (seed, epoch) alone, in [0, seq_len), so each
    epoch cuts the text elsewhere and every loader worker, rank and resumed run cuts it alike; the epoch lives in
    shared memory, as datasets.Samples' does, where persistent workers see what `set_epoch` sets. The number of
    windows is the same under every offset."""

    def __init__(self, tokens, seq_len: int, *, seed: int | None = None):
        self.tokens, self.seq_len, self.seed = tokens, seq_len, seed
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        spare = 1 if seed is None else seq_len  # training keeps room for an offset of up to seq_len - 1
        self.windows = max(0, (len(tokens) - spare) // seq_len)

    def __len__(self) -> int:
        return self.windows

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def offset(self) -> int:
        if self.seed is None:
            return 0
        key = hashlib.blake2b(f"{self.seed}:{int(self.epoch)}".encode(), digest_size=8).digest()
        return int.from_bytes(key, "little") % self.seq_len

    def __getitem__(self, i: int):
        return self.__getitems__([i])[0]

    def __getitems__(self, positions: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        windows = np.asarray(positions, dtype=np.int64)
        if len(windows) and not (0 <= windows.min() and windows.max() < self.windows):
            raise IndexError(f"windows {positions} outside 0..{self.windows - 1}")
        starts = self.offset() + windows * self.seq_len
        tokens = torch.from_numpy(np.asarray(self.tokens[starts[:, None] + np.arange(self.seq_len + 1)], np.int64))
        return list(zip(tokens[:, :-1], tokens[:, 1:]))


class MappedTokens:
    """Ids [start, stop) of a token file, read through numpy.memmap opened in each process that reads them: a
    pickled memmap (a spawned loader worker's copy) would carry the whole file."""

    def __init__(self, path: Path, dtype: str, start: int = 0, stop: int | None = None):
        self.path, self.dtype = Path(path), dtype
        total = self.path.stat().st_size // np.dtype(dtype).itemsize
        self.start, self.stop = start, total if stop is None else stop
        self._ids = None

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index):
        if self._ids is None:
            self._ids = np.memmap(self.path, dtype=self.dtype, mode="r")[self.start : self.stop]
        return self._ids[index]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_ids": None}


@functools.lru_cache(maxsize=1)
def shakespeare_works(archive: Path) -> dict[str, str]:
    """Every modern-spelling work of the archive by file name, read out of the .tar.gz (never installed)."""
    with tarfile.open(archive) as tar:
        return {
            Path(member.name).name: tar.extractfile(member).read().decode("utf-8")
            for member in sorted(tar.getmembers(), key=lambda member: member.name)
            if f"/{SHAKESPEARE_TEXTS}" in f"/{member.name}" and member.name.endswith(SHAKESPEARE_SUFFIX)
        }


def vocabulary(works: dict[str, str]) -> str:
    """The sorted distinct characters of the whole corpus: a character's id is its place here."""
    return "".join(sorted(set().union(*works.values())))


def encode(text: str, characters: str) -> np.ndarray:
    """The ids of `text`'s characters in `characters` (sorted), as uint8 where they fit."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    table = np.frombuffer(characters.encode("utf-32-le"), dtype=np.uint32)
    ids = np.searchsorted(table, codes)
    if len(codes) and (ids.max() >= len(table) or not np.array_equal(table[np.minimum(ids, len(table) - 1)], codes)):
        raise ValueError("text holds characters outside the vocabulary")
    return ids.astype(np.uint8 if len(table) <= 256 else np.uint16)


def split_works(works: dict[str, str]) -> dict[str, list[str]]:
    """The works of each split, in file-name order: validation and test are VALIDATION_WORKS and TEST_WORKS."""
    held_out = {"val": list(VALIDATION_WORKS), "test": list(TEST_WORKS)}
    missing = sorted(set(VALIDATION_WORKS + TEST_WORKS) - set(works))
    if missing:
        raise ValueError(f"the corpus lacks the held-out works {missing}")
    train = [name for name in sorted(works) if name not in VALIDATION_WORKS + TEST_WORKS]
    return {"train": train, **held_out}


def shakespeare_streams(works: dict[str, str]) -> tuple[dict[str, np.ndarray], int]:
    """Each split's works concatenated in file-name order and encoded (a window may span two works' seam), and the
    vocabulary's size."""
    characters = vocabulary(works)
    streams = {
        split: encode("".join(works[name] for name in names), characters) for split, names in split_works(works).items()
    }
    return streams, len(characters)


def token_streams(data: DataSettings) -> tuple[dict, int]:
    """The tokens data set's splits as memory-mapped ids, and its vocabulary's size."""
    files = token_files(data)
    vocab_size, dtype = token_settings(data)
    streams = {"train": MappedTokens(files["train"], dtype)}
    if files["test"] is None:  # the validation file's halves: validation, then test
        half = len(MappedTokens(files["val"], dtype)) // 2
        streams |= {"val": MappedTokens(files["val"], dtype, 0, half), "test": MappedTokens(files["val"], dtype, half)}
    else:
        streams |= {"val": MappedTokens(files["val"], dtype), "test": MappedTokens(files["test"], dtype)}
    return streams, vocab_size


def text_splits(data: DataSettings, seed: int) -> tuple[TokenWindows, TokenWindows, TokenWindows, dict]:
    """(train, val, test, shape) of a text data set: training windows move each epoch, evaluation's do not."""
    if data.name == "shakespeare":
        streams, vocab_size = shakespeare_streams(shakespeare_works(shakespeare_archive(data)))
        streams["train"] = streams["train"][: shakespeare_training_characters(data)]
    else:
        streams, vocab_size = token_streams(data)
    return (
        TokenWindows(streams["train"], data.seq_len, seed=seed),
        TokenWindows(streams["val"], data.seq_len),
        TokenWindows(streams["test"], data.seq_len),
        {"vocab_size": vocab_size, "seq_len": data.seq_len},
    )


def text_shape(data: DataSettings) -> dict:
    """{vocab_size, seq_len} of a text data set without reading its tokens."""
    if data.name == "shakespeare":
        vocab_size = SHAKESPEARE_VOCAB_SIZE
    elif data.name == "tokens":
        vocab_size = token_settings(data)[0]
    else:  # synthetic tokens
        vocab_size = data.kwargs["vocab"]
    return {"vocab_size": vocab_size, "seq_len": data.seq_len}


def token_unit(data: DataSettings) -> str:
    """What a text data set's token is, for reports' "bits per character" or "bits per token"."""
    return "character" if data.name == "shakespeare" else "token"
