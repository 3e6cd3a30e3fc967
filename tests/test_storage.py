"""The path helper (meshensemble/runtime/storage.py): the same calls on a local folder and
on a local GCS server (tests/gcs.py), and what its atomic write promises on each."""

from __future__ import annotations

import os

import numpy as np
import pytest

from meshensemble.runtime import storage


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path) -> str:
    """A fresh folder: a local one, or a prefix in the emulator's bucket."""
    if request.param == "local":
        return str(tmp_path / "run")
    server = request.getfixturevalue("gcs")
    return server.path(request.node.name.replace("[", "-").rstrip("]"))


def test_write_read_list_walk_and_remove(root):
    storage.makedirs(storage.join(root, "checkpoints", "4", "state"))
    storage.atomic_write_json(storage.join(root, "config.json"), {"epochs": 1, "lr": 0.1})
    storage.atomic_write(storage.join(root, "notes.txt"), "two hosts")
    storage.atomic_write(storage.join(root, "checkpoints", "4", "state", "d"), b"\0\1")
    storage.atomic_write(storage.join(root, "checkpoints", "4", "_METADATA"), b"{}")
    assert storage.read_json(storage.join(root, "config.json")) == {"epochs": 1, "lr": 0.1}
    assert storage.read_text(storage.join(root, "notes.txt")) == "two hosts"
    assert storage.listdir(root) == ["checkpoints", "config.json", "notes.txt"]
    # os.walk's order: a folder's files, then its folders, each by name
    assert storage.walk_files(root) == [
        "config.json",
        "notes.txt",
        "checkpoints/4/_METADATA",
        "checkpoints/4/state/d",
    ]
    assert b"".join(storage.read_blocks(storage.join(root, "checkpoints/4/state/d"), 1)) == b"\0\1"
    assert storage.file_size(storage.join(root, "notes.txt")) == 9
    assert storage.isdir(storage.join(root, "checkpoints")) and storage.exists(root)
    assert not storage.isdir(storage.join(root, "notes.txt"))
    storage.move(storage.join(root, "checkpoints", "4"), storage.join(root, "damaged", "4"))
    assert storage.walk_files(storage.join(root, "damaged")) == ["4/_METADATA", "4/state/d"]
    assert not storage.exists(storage.join(root, "checkpoints", "4"))
    storage.remove(storage.join(root, "notes.txt"))
    storage.remove(storage.join(root, "notes.txt"))  # gone already: fine
    storage.rmtree(storage.join(root, "damaged"))
    storage.rmtree(storage.join(root, "damaged"))
    # a local folder stays when emptied; on a store a folder is its objects' prefix
    left = ["checkpoints", "config.json"] if storage.is_local(root) else ["config.json"]
    assert storage.listdir(root) == left
    with pytest.raises(FileNotFoundError):
        storage.listdir(storage.join(root, "none"))
    with pytest.raises(FileNotFoundError):
        storage.read_bytes(storage.join(root, "none.json"))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_failed_write_leaves_the_old_file_whole_and_nothing_beside_it(root):
    storage.makedirs(root)
    path = storage.join(root, "predictions.npz")
    storage.atomic_write(path, lambda f: np.savez(f, probs=np.ones(3)))

    def fails_midway(f):
        f.write(b"PK half an archive")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        storage.atomic_write(path, fails_midway)
    with storage.as_path(path).open("rb") as f:
        np.testing.assert_array_equal(np.load(f)["probs"], np.ones(3))
    assert storage.listdir(root) == ["predictions.npz"]  # no temporary file left


def test_strict_json_refuses_nan_and_writes_nothing(root):
    storage.makedirs(root)
    with pytest.raises(ValueError):
        storage.atomic_write_json(storage.join(root, "m.json"), {"loss": float("nan")})
    assert not storage.exists(storage.join(root, "m.json"))


def test_a_local_write_is_durable_and_keeps_the_usual_mode(tmp_path, monkeypatch):
    """Locally: the file is fsync-ed before it is renamed into place, and gets the mode
    ``open`` gives (a temporary file's 0600 would hide a run from the others who read it)."""
    synced, renamed = [], []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(fd) or real_fsync(fd))
    monkeypatch.setattr(
        os, "replace", lambda a, b: renamed.append((len(synced), b)) or real_replace(a, b)
    )
    path = str(tmp_path / "config.json")
    storage.atomic_write(path, "{}")
    assert renamed == [(1, path)]  # the file's fsync came before the rename
    assert len(synced) == 2  # and the folder's after it
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(path).st_mode & 0o777 == 0o666 & ~mask


def test_paths_join_and_stay_urls():
    assert storage.join("gs://b/run", "checkpoints") == "gs://b/run/checkpoints"
    assert storage.absolute("gs://b/run") == "gs://b/run"
    assert storage.absolute("run") == os.path.abspath("run")
    assert not storage.is_local(storage.as_path("gs://b/run")) and storage.is_local("/tmp")
