"""Paths that may be on cloud storage, and the one way the package writes a file atomically.

A path is a local path or the URL of an object store (``gs://bucket/run``; ``gs://`` needs
``gcsfs``: ``pip install meshensemble[gcs]``). Every function
here takes either, as a ``str`` or a path object, so one code path serves a laptop and a
pod whose hosts share a bucket: local paths go through ``os``, URLs through ``fsspec``
(``gcsfs`` for ``gs://``, the package orbax's ``etils.epath`` uses too), and
:func:`as_path` gives the ``etils.epath.Path`` that orbax takes. Listings always ask the
store (gcsfs's cached listings do not see other hosts' writes).

What :func:`atomic_write` guarantees, by store:

* **local folder**: the bytes go to a temporary file beside the target (its mode as
  ``open`` would give it), are flushed and ``fsync``-ed, then renamed over the target
  (``os.replace``) and the folder is ``fsync``-ed: a reader sees the old file or the new
  one whole, never a part, and once the call returns the new content survives a crash.
* **object store** (``gs://``, ``s3://`` ...): one object written by one upload, which
  the store publishes only when the upload completes: a reader sees the old object or the
  new one whole. Nothing is renamed: gcsfs renames by copy and delete, which is not
  atomic (and slow), so the library never relies on a rename there.

Other operations where a store cannot do what a local disk does, and what is done instead,
are said in each function's docstring (:func:`move`).

Example:
  >>> makedirs("runs/r")
  >>> atomic_write_json("runs/r/config.json", {"epochs": 1})
  >>> read_json("runs/r/config.json"), listdir("runs/r")
  ({'epochs': 1}, ['config.json'])
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    from etils import epath

PathLike = str | os.PathLike
"""What every function here accepts: a local path or an object store URL, ``str`` or path."""
BLOCK = 1 << 20
"""Bytes per read in :func:`read_blocks` (1 MiB)."""


def is_local(path: PathLike) -> bool:
    """Whether ``path`` is on the local file system (not an ``scheme://`` URL).

    Args:
      path: a path or URL.

    Returns:
      False for ``gs://...`` and other URLs, True otherwise.

    Example:
      >>> is_local("runs/r"), is_local("gs://bucket/run")
      (True, False)
    """
    return "://" not in os.fspath(path)


def as_path(path: PathLike) -> epath.Path:
    """``path`` as an ``etils.epath.Path`` (local, or on an object store).

    Args:
      path: a path or URL.

    Returns:
      The path object.

    Example:
      >>> str(as_path("gs://bucket/run") / "checkpoints")
      'gs://bucket/run/checkpoints'
    """
    from etils import epath  # orbax's own dependency

    return path if isinstance(path, epath.Path) else epath.Path(path)


def join(path: PathLike, *parts: str) -> str:
    """``path`` joined with ``parts``, as a string (``/`` on object stores).

    Args:
      path: a path or URL.
      *parts: names to append.

    Returns:
      The joined path.

    Example:
      >>> join("gs://bucket/run", "checkpoints", "4")
      'gs://bucket/run/checkpoints/4'
    """
    if is_local(path):
        return os.path.join(os.fspath(path), *parts)
    return str(as_path(path).joinpath(*parts))


def absolute(path: PathLike) -> str:
    """``path`` made absolute when local (the working folder in front); a URL as it is.

    Args:
      path: a path or URL.

    Returns:
      The absolute path, as a string.

    Example:
      >>> absolute("gs://bucket/run")
      'gs://bucket/run'
    """
    return os.path.abspath(os.fspath(path)) if is_local(path) else str(as_path(path))


def _store(path: PathLike) -> tuple[Any, str]:
    """``(fsspec file system, path without its scheme)`` of a URL, with the file system's
    cached listings under it dropped: gcsfs remembers listings (and the sizes in them)
    until told otherwise and does not see what others write (another host, or orbax's
    tensorstore writing the same bucket), so every call here asks the store."""
    import fsspec  # with gcsfs for gs:// (the `gcs` extra)

    fs, bare = fsspec.core.url_to_fs(os.fspath(path))
    fs.invalidate_cache(bare)
    return fs, bare


def _ask(path: PathLike, local: Callable[[Any], Any], method: str) -> Any:
    """``local(path)`` for a local path, else the store's ``method`` of the bare path."""
    if is_local(path):
        return local(path)
    fs, bare = _store(path)
    return getattr(fs, method)(bare)


def exists(path: PathLike) -> bool:
    """Whether a file or folder is at ``path`` (on an object store: any object under it).

    Example:
      >>> exists("runs/none")
      False
    """
    return _ask(path, os.path.exists, "exists")


def isdir(path: PathLike) -> bool:
    """Whether ``path`` is a folder (on an object store: a prefix holding objects).

    Example:
      >>> makedirs("runs/r")
      >>> isdir("runs/r"), isdir("runs/none")
      (True, False)
    """
    return _ask(path, os.path.isdir, "isdir")


def isfile(path: PathLike) -> bool:
    """Whether ``path`` is a file (on an object store: an object).

    Example:
      >>> atomic_write("notes.txt", "x")
      >>> isfile("notes.txt"), isfile(".")
      (True, False)
    """
    return _ask(path, os.path.isfile, "isfile")


def listdir(path: PathLike) -> list[str]:
    """The names in folder ``path``, sorted.

    Raises:
      FileNotFoundError: no folder there.

    Example:
      >>> makedirs("runs/r/checkpoints")
      >>> atomic_write("runs/r/config.json", "{}")
      >>> listdir("runs/r")
      ['checkpoints', 'config.json']
    """
    if is_local(path):
        return sorted(os.listdir(path))
    fs, bare = _store(path)
    if not fs.isdir(bare):
        raise FileNotFoundError(f"no folder {path}")
    return sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(bare, detail=False))


def walk_files(path: PathLike) -> list[str]:
    """Every file under folder ``path``, as ``/``-separated paths relative to it, sorted
    by folder then name (the order :func:`os.walk` gives with sorted names).

    Args:
      path: a folder.

    Returns:
      e.g. ``["_CHECKPOINT_METADATA", "state/_METADATA", "state/d/..."]``.

    Example:
      >>> makedirs("runs/r/checkpoints")
      >>> atomic_write("runs/r/config.json", "{}")
      >>> atomic_write("runs/r/checkpoints/checksums.json", "{}")
      >>> walk_files("runs/r")
      ['config.json', 'checkpoints/checksums.json']
    """
    if is_local(path):
        found = []
        for root, _, files in os.walk(path):
            rel = os.path.relpath(root, path).replace(os.sep, "/")
            found += [n if rel == "." else f"{rel}/{n}" for n in files]
    else:
        fs, bare = _store(path)
        base = bare.rstrip("/") + "/"
        found = [p[len(base) :] for p in fs.find(bare) if p.startswith(base)]
    return sorted(found, key=_walk_order)


def _walk_order(rel: str) -> tuple:
    """Sort key of a relative file path: a folder's files (by name) before its subfolders
    (by name), recursively, which is what ``os.walk`` gives with sorted names."""
    *folders, name = rel.split("/")
    return (*((1, f) for f in folders), (0, name))


def makedirs(path: PathLike) -> None:
    """Makes folder ``path`` and its parents (nothing on an object store, where a folder
    is only a prefix of its objects' names).

    Example:
      >>> makedirs("runs/new/inference")
      >>> isdir("runs/new/inference")
      True
    """
    if is_local(path):
        os.makedirs(path, exist_ok=True)


def remove(path: PathLike) -> None:
    """Deletes file ``path``; a missing one is fine.

    Example:
      >>> remove("none.json")   # nothing there: nothing to do
      >>> atomic_write("notes.txt", "x"); remove("notes.txt"); exists("notes.txt")
      False
    """
    if is_local(path):
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
        return
    fs, bare = _store(path)
    if fs.exists(bare):
        fs.rm_file(bare)


def rmtree(path: PathLike) -> None:
    """Deletes folder ``path`` with everything in it; a missing one is fine.

    Example:
      >>> makedirs("runs/old/checkpoints")
      >>> rmtree("runs/old"); exists("runs/old")
      False
    """
    if is_local(path):
        shutil.rmtree(path, ignore_errors=True)
        return
    fs, bare = _store(path)
    if fs.exists(bare):
        fs.rm(bare, recursive=True)


def move(src: PathLike, dst: PathLike) -> None:
    """Moves file or folder ``src`` to ``dst`` (both on the same store).

    Locally a rename. An object store has no rename: every object is copied (on the
    store's side), then ``src`` is deleted, so an interruption leaves both, never neither.

    Args:
      src: the file or folder.
      dst: where it goes (must not exist).

    Example:
      >>> makedirs("runs/r/checkpoints/4"); makedirs("runs/r/checkpoints_damaged")
      >>> move("runs/r/checkpoints/4", "runs/r/checkpoints_damaged/4")
      >>> listdir("runs/r/checkpoints"), listdir("runs/r/checkpoints_damaged")
      ([], ['4'])
    """
    if is_local(src):
        shutil.move(os.fspath(src), os.fspath(dst))
        return
    fs, source = _store(src)
    target = _store(dst)[1]
    if fs.isdir(source):
        for rel in walk_files(src):
            fs.copy(f"{source.rstrip('/')}/{rel}", f"{target.rstrip('/')}/{rel}")
        fs.rm(source, recursive=True)
    else:
        fs.copy(source, target)
        fs.rm_file(source)


def read_bytes(path: PathLike) -> bytes:
    """The bytes of file ``path``.

    Raises:
      FileNotFoundError: no file there.

    Example:
      >>> atomic_write("config.json", b'{"epochs": 1}')
      >>> read_bytes("config.json")
      b'{"epochs": 1}'
    """
    if is_local(path):
        with open(path, "rb") as f:
            return f.read()
    fs, bare = _store(path)
    return fs.cat_file(bare)


def read_text(path: PathLike) -> str:
    """The text of file ``path`` (UTF-8).

    Raises:
      FileNotFoundError: no file there.
      UnicodeDecodeError: not UTF-8.

    Example:
      >>> atomic_write("config.json", '{"epochs": 1}')
      >>> read_text("config.json")
      '{"epochs": 1}'
    """
    return read_bytes(path).decode("utf-8")


def read_json(path: PathLike) -> Any:
    """The JSON value in file ``path``.

    Raises:
      FileNotFoundError: no file there.
      ValueError: not JSON (``json.JSONDecodeError``) or not UTF-8.

    Example:
      >>> atomic_write("config.json", '{"epochs": 1}')
      >>> read_json("config.json")
      {'epochs': 1}
    """
    return json.loads(read_text(path))


def read_blocks(path: PathLike, size: int = BLOCK) -> Iterator[bytes]:
    """The bytes of file ``path`` in blocks of ``size`` (for hashing big files).

    Example:
      >>> atomic_write("config.json", '{"epochs": 1}')
      >>> b"".join(read_blocks("config.json", size=4))
      b'{"epochs": 1}'
    """
    with _ask(path, lambda p: open(p, "rb"), "open") as f:  # a store's open reads bytes too
        yield from iter(lambda: f.read(size), b"")


def openable(path: PathLike) -> str | io.BytesIO:
    """What ``np.load``, ``Image.open`` or ``zipfile`` take for file ``path``: a local path as
    it is (so a ``.npy`` can still be memory-mapped), a file on an object store read whole
    into memory (one download; a reader that seeks would otherwise ask the store per seek).

    Args:
      path: a file.

    Returns:
      The local path as a string, or an ``io.BytesIO`` of the object's bytes.

    Raises:
      FileNotFoundError: no file there (on an object store; locally the reader raises it).

    Example:
      >>> atomic_write("x.txt", "42")
      >>> openable("x.txt")
      'x.txt'
    """
    return os.fspath(path) if is_local(path) else io.BytesIO(read_bytes(path))


def version(path: PathLike) -> str:
    """What changes when file ``path`` is replaced or rewritten (to cache its digest by).

    Locally its size, modification time (ns) and inode; on an object store its size and
    the store's version of the object (GCS's ``generation``, else its ETag or update time).

    Args:
      path: a file.

    Returns:
      A string that differs between two writes of the file.

    Raises:
      FileNotFoundError: no file there.

    Example:
      >>> atomic_write("a.txt", "1"); before = version("a.txt")
      >>> atomic_write("a.txt", "2"); version("a.txt") != before
      True
    """
    if is_local(path):
        st = os.stat(path)
        return f"{st.st_size}:{st.st_mtime_ns}:{st.st_ino}"
    fs, bare = _store(path)
    info = fs.info(bare)
    keys = ("generation", "ETag", "etag", "md5Hash", "updated", "mtime", "LastModified")
    return ":".join(str(x) for x in (info.get("size"), *(info.get(k) for k in keys)))


def file_size(path: PathLike) -> int:
    """The size of file ``path`` in bytes.

    Example:
      >>> atomic_write("config.json", '{"epochs": 1}')
      >>> file_size("config.json")
      13
    """
    return int(_ask(path, os.path.getsize, "size"))


def atomic_write(path: PathLike, data: bytes | str | Callable[[BinaryIO], Any]) -> None:
    """Writes file ``path`` whole or not at all (see the module docstring for each store).

    Args:
      path: the file; its folder must exist (locally).
      data: the bytes, a text (written as UTF-8), or ``write(f)`` that writes into an
        open binary file (e.g. ``np.savez``; on an object store into memory first, then
        sent as one upload).

    Raises:
      OSError: the write failed (full disk, permissions...); the old file, if any, is
        left as it was and no temporary file remains.

    Example:
      >>> atomic_write("notes.txt", "trained on 2 hosts")
      >>> read_text("notes.txt"), listdir(".")   # no temporary file left beside it
      ('trained on 2 hosts', ['notes.txt'])
    """
    blob = data.encode("utf-8") if isinstance(data, str) else data
    if not is_local(path):
        if not isinstance(blob, bytes | bytearray):  # whole before anything is sent: a
            buffer = io.BytesIO()  # writer that fails uploads nothing (a file object of
            blob(buffer)  # the store would upload what it holds when closed)
            blob = buffer.getvalue()
        fs, bare = _store(path)
        fs.pipe_file(bare, bytes(blob))  # one object, published when its upload completes
        return
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{uuid.uuid4().hex[:12]}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # mode as open() gives
        with os.fdopen(fd, "wb") as f:
            f.write(blob) if isinstance(blob, bytes | bytearray) else blob(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:  # Ctrl-C included: no temporary file is left behind
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    _sync_folder(folder)


def _sync_folder(folder: str) -> None:
    """Makes a rename in ``folder`` durable (best effort: not every system can)."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_json(path: PathLike, value: Any, **dump: Any) -> None:
    """Writes ``value`` as strict JSON to ``path`` with :func:`atomic_write`.

    Args:
      path: the file.
      value: a JSON-serialisable value.
      **dump: ``json.dumps`` options (``indent``, ``sort_keys``, ``default``...);
        ``allow_nan`` is False unless given.

    Raises:
      ValueError: ``value`` holds a NaN/inf float (strict JSON has none); nothing written.
      OSError: the write failed.

    Example:
      >>> atomic_write_json("config.json", {"epochs": 1})
      >>> read_text("config.json")
      '{"epochs": 1}'
    """
    dump.setdefault("allow_nan", False)
    atomic_write(path, json.dumps(value, **dump))
