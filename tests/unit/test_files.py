import json
import os
import stat

import pytest

from tula_hpc.core.atomic_files import StageInputError, atomic_path, read_json, read_jsonl, write_json


def test_interrupted_write_keeps_the_earlier_file(tmp_path):
    path = tmp_path / "result.json"
    write_json(path, {"version": 1})
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            tmp.write_text('{"version": 2, "trunc')
            raise RuntimeError("killed midway")
    assert read_json(path) == {"version": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["result.json"]


def test_unreadable_inputs_name_the_file(tmp_path):
    with pytest.raises(StageInputError, match="missing.json: file not found"):
        read_json(tmp_path / "missing.json")
    (tmp_path / "torn.json").write_text('{"a": ')
    with pytest.raises(StageInputError, match="torn.json: not valid JSON"):
        read_json(tmp_path / "torn.json")


def test_torn_last_line_of_a_log_is_skipped(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps({"epoch": 1}) + "\n" + '{"epoch": 2, "lo')
    assert read_jsonl(path) == [{"epoch": 1}]


def test_atomic_write_syncs_the_file_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        events.append("fsync dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        real_fsync(fd)

    def replace(src, dst):
        events.append("replace")
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    write_json(tmp_path / "result.json", {"version": 1})
    assert events == ["fsync file", "replace", "fsync dir"]
