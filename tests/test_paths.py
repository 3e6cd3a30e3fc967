"""Every run-folder, data and output path goes through meshensemble/runtime/storage.py.

A path may be ``gs://bucket/run``; ``open``, ``os.path.exists``, ``os.listdir``, ``shutil``
and their kin only see the local disk (and ``os.path.abspath``/``normpath`` turn
``gs://b`` into ``/cwd/gs:/b``). This reads the package's code (its syntax tree, so the
docstring examples, which run in a local folder, are not counted) and finds every such
call outside the one path module; each left is named in :data:`ALLOWED` with why it is
local by nature. Pure string functions that keep a URL whole (``os.path.join``,
``basename``, ``dirname``, ``splitext``, ``expanduser``) are not file access.
"""

from __future__ import annotations

import ast
import pathlib

import numpy as np

import meshensemble as me
from meshensemble.runtime import storage

ROOT = pathlib.Path(__file__).resolve().parent.parent
PATH_MODULE = "meshensemble/runtime/storage.py"
STRING_ONLY = {"join", "basename", "dirname", "splitext", "expanduser", "split", "sep"}
"""``os.path`` functions that only compute a string and keep ``gs://`` whole."""
OS_FILE_CALLS = {
    "listdir", "walk", "replace", "rename", "remove", "unlink", "rmdir", "makedirs", "mkdir",
    "stat", "scandir", "access", "chmod", "fdopen",
}  # fmt: skip
"""``os`` functions that touch the local file system."""
LOCAL_MODULES = ("shutil", "tempfile", "glob")
"""Modules every function of which is about local files."""

ALLOWED = {
    ("meshensemble/bench/accuracy.py", "time_to_accuracy"):
        "a private local scratch folder for the benchmark's two runs, deleted after",
    ("meshensemble/bench/accuracy.py", "launch"):
        "the package's own source folder, put on the child process's PYTHONPATH",
    ("meshensemble/bench/report.py", "_cpu_name"): "this host's /proc/cpuinfo",
    ("meshensemble/data/folder.py", "load_image_folder"):
        "normpath only to take the folder's last name as the dataset's name",
    ("meshensemble/data/lazy.py", "write_array_record_dataset"):
        "its local branch: a temporary sibling folder renamed into place (a bucket: _upload)",
    ("meshensemble/data/lazy.py", "_upload"):
        "the local scratch folder the files are made in, before each is uploaded",
    ("meshensemble/data/lazy.py", "_swap_in"):
        "the local folder swap by rename (a bucket cannot rename: never called for one)",
    ("meshensemble/runtime/compilation.py", "enable_compilation_cache"):
        "os.access probes a local cache folder only (a gs:// one is JAX's, through etils)",
    ("meshensemble/serving/outputs.py", "check_out_file"):
        "probes a local --out's folder (a gs:// --out returns before the probe)",
    ("meshensemble/training/outputs.py", "check_writable"):
        "probes the local disk (a gs:// workdir returns before the probe)",
}  # fmt: skip
"""``(module, function) -> why its local file calls are right`` (kept short: every entry
must still be needed)."""


def _what(node: ast.AST) -> str | None:
    """The local file call ``node`` is (``"open("``, ``"os.path.isdir"``...), or None."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "open":
        return "open("
    if not isinstance(node, ast.Attribute):
        return None
    base = node.value
    if (
        isinstance(base, ast.Attribute)
        and isinstance(base.value, ast.Name)
        and (base.value.id, base.attr) == ("os", "path")
        and node.attr not in STRING_ONLY
    ):
        return f"os.path.{node.attr}"
    if isinstance(base, ast.Name) and (
        (base.id == "os" and node.attr in OS_FILE_CALLS) or base.id in LOCAL_MODULES
    ):
        return f"{base.id}.{node.attr}"
    return None


def local_file_calls(root: pathlib.Path) -> list[tuple[str, str, str, int]]:
    """``(module, outermost function, call, line)`` of each local file call under ``root``."""
    found = []
    for file in sorted(root.rglob("*.py")):
        rel = file.relative_to(root.parent).as_posix()
        if rel == PATH_MODULE:
            continue
        tree = ast.parse(file.read_text(encoding="utf-8"))
        for top in tree.body:
            for node in ast.walk(top):
                what = _what(node)
                if what:
                    found.append((rel, _function(top, node), what, node.lineno))
    return found


def _function(top: ast.stmt, node: ast.AST) -> str:
    """The name of the function around ``node`` (a method's own name) under ``top``."""
    if isinstance(top, ast.ClassDef):
        for item in top.body:
            if isinstance(item, ast.FunctionDef) and any(n is node for n in ast.walk(item)):
                return item.name
    return getattr(top, "name", "<module>")


def test_no_local_file_call_on_a_path_outside_the_path_module():
    found = local_file_calls(ROOT / "meshensemble")
    stray = [f"{m}:{line} {f}: {what}" for m, f, what, line in found if (m, f) not in ALLOWED]
    assert not stray, (
        "local-only file calls on paths that may be gs://; use meshensemble.runtime.storage "
        "(or name the function in ALLOWED with why it is local):\n" + "\n".join(stray)
    )
    used = {(m, f) for m, f, _, _ in found}
    assert not set(ALLOWED) - used, f"ALLOWED entries no longer needed: {set(ALLOWED) - used}"


def test_the_scan_finds_each_kind_of_local_file_call(tmp_path):
    pkg = tmp_path / "meshensemble"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        '"""open("in a docstring") is not a call."""\n'
        "import os, shutil\n"
        "def read(p):\n    return open(p).read()\n"
        "class W:\n    def check(self, p):\n        return os.path.isdir(p)\n"
        "def clear(p):\n    shutil.rmtree(p); os.listdir(p)\n"
        "def name(p):\n    return os.path.join(p, os.path.basename(p))\n"
    )
    got = [(f, what) for _, f, what, _ in local_file_calls(pkg)]
    assert got == [
        ("read", "open("), ("check", "os.path.isdir"), ("clear", "shutil.rmtree"),
        ("clear", "os.listdir"),
    ]  # fmt: skip


def test_an_array_record_folder_on_a_bucket_is_refused_in_one_line():
    """array_record's reader does not read a bucket: the load says so before any access."""
    import pytest

    from meshensemble.data import DataError, lazy

    with pytest.raises(DataError, match=r"gs://b/ar: .*local or mounted folder; .*gcsfuse"):
        lazy.load_array_record_dataset("gs://b/ar")


def test_an_npz_on_a_bucket_is_read_in_its_own_layout():
    """--source npz with a file on a store (fsspec's in-memory one here; gs:// takes the
    same path): 8x8 images are their own dataset (not refused as MNIST's layout) and float
    targets make regression data, as for a local file."""
    x, y = np.arange(10 * 8 * 8, dtype=np.uint8).reshape(10, 8, 8), np.arange(10) % 3
    images = "memory://c41/digits.npz"
    storage.atomic_write(
        images, lambda f: np.savez(f, x_train=x[:6], y_train=y[:6], x_test=x[6:], y_test=y[6:])
    )
    got = me.data.load_dataset(source="npz", data_file=images)
    assert (got.name, got.num_classes, got.x_train.shape) == ("digits", 3, (6, 8, 8, 1))
    feats = np.arange(20, dtype=np.float32).reshape(10, 2)
    floats = "memory://c41/house.npz"
    storage.atomic_write(
        floats,
        lambda f: np.savez(
            f, x_train=feats[:6], y_train=feats[:6, :1], x_test=feats[6:], y_test=feats[6:, :1]
        ),
    )
    got = me.data.load_dataset(source="npz", data_file=floats)
    assert got.num_classes is None and got.note.startswith("regression data from"), got.note
