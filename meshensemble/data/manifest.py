"""The content manifest of a file dataset: what its files hold, checked without rehashing.

:func:`~meshensemble.data.lazy.write_array_record_dataset` (``meshensemble convert``)
writes ``manifest.json`` next to the files once: each file's size, SHA-256 and record
count. A run start then costs a ``stat`` per file (:func:`check_manifest`: a missing, extra
or resized file is refused, naming it), and the dataset's identity is a hash of the
manifest (:func:`manifest_fingerprint`), not of the files. The bytes are verified where
they are read: a :class:`FileVerifier` hashes each file the first time a process reads a
record from it and refuses a file whose content differs from the manifest; a host
remembers the files it verified (by size, mtime and inode), so nobody rehashes the dataset
at every start: each host hashes each file it reads once, until the file changes.

Example:
  >>> import os
  >>> os.makedirs("mnist_ar")
  >>> paths = me.data.stream.write_array_record("mnist_ar/test.array_record", images, labels)
  >>> write_manifest("mnist_ar", ["test.array_record"], {"test.array_record": len(images)})
  'mnist_ar/manifest.json'
  >>> check_manifest("mnist_ar", read_manifest("mnist_ar"))   # None: every file is there
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from meshensemble.data.dataset import DataError, first_line
from meshensemble.runtime import storage

MANIFEST_FILE = "manifest.json"
"""The manifest's name in a dataset folder."""
MANIFEST_FORMAT = 1
"""Version of the manifest's layout (``{"format", "files": {name: {bytes, sha256, records}}}``,
and since record codecs an optional ``"codec"``: the records' layout, absent for MNIST
folders written before it)."""
REWRITE_FIX = (
    "write the dataset again: meshensemble convert --data-file mnist.npz --out DIR --overwrite"
)
"""How messages about a changed or damaged file dataset say to repair it."""


def file_digest(path: str | os.PathLike) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB blocks.

    Args:
      path: the file.

    Returns:
      64 hex digits.

    Example:
      >>> np.savez("labels.npz", labels=labels)
      >>> len(file_digest("labels.npz"))
      64
    """
    digest = hashlib.sha256()
    for block in storage.read_blocks(path):
        digest.update(block)
    return digest.hexdigest()


def write_manifest(
    directory: str | os.PathLike,
    names: Sequence[str],
    records: Mapping[str, int] | None = None,
    codec: Mapping[str, Any] | None = None,
) -> str:
    """Writes ``manifest.json`` for the files ``names`` of ``directory`` (atomically).

    Args:
      directory: the dataset's folder.
      names: file names in it (not paths).
      records: the record count of each file, where it has one.
      codec: the records' layout (:meth:`meshensemble.data.codec.RecordCodec.record`),
        recorded as ``"codec"``; a manifest without one holds MNIST records.

    Returns:
      The manifest's path.

    Example:
      >>> import os
      >>> os.makedirs("mnist_ar")
      >>> paths = me.data.stream.write_array_record("mnist_ar/test.array_record", images, labels)
      >>> write_manifest("mnist_ar", ["test.array_record"], {"test.array_record": len(images)})
      'mnist_ar/manifest.json'
    """
    directory, records = os.fspath(directory), dict(records or {})
    files = {}
    for name in names:
        path = storage.join(directory, name)
        entry = {"bytes": storage.file_size(path), "sha256": file_digest(path)}
        if name in records:
            entry["records"] = int(records[name])
        files[name] = entry
    path = storage.join(directory, MANIFEST_FILE)
    doc: dict[str, Any] = {"format": MANIFEST_FORMAT, "files": files}
    if codec is not None:
        doc["codec"] = dict(codec)
    storage.atomic_write_json(path, doc, indent=1, sort_keys=True)
    return path


def read_manifest(directory: str | os.PathLike) -> dict[str, Any] | None:
    """The manifest of ``directory``, or None when it has none (written before manifests).

    Args:
      directory: the dataset's folder.

    Returns:
      ``{"format", "files": {name: {"bytes", "sha256"[, "records"]}}}`` or None.

    Raises:
      DataError: the manifest exists but is unreadable or malformed (one line, the fix).

    Example:
      >>> ds = me.data.synthetic(256, 64)
      >>> paths = me.data.write_array_record_dataset("mnist_ar", ds)
      >>> sorted(read_manifest("mnist_ar")["files"])[:1]
      ['labels.npz']
    """
    path = storage.join(directory, MANIFEST_FILE)
    if not storage.exists(path):
        return None
    try:
        manifest = storage.read_json(path)
        files = manifest["files"]
        ok = isinstance(files, dict) and all(
            isinstance(e, dict)
            and isinstance(e.get("bytes"), int)
            and isinstance(e.get("sha256"), str)
            for e in files.values()
        )
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"{path}: unreadable manifest ({first_line(err)}); {REWRITE_FIX}") from None
    if not ok:
        raise DataError(
            f"{path}: malformed manifest (each file needs bytes and sha256); {REWRITE_FIX}"
        )
    return manifest


def check_manifest(
    directory: str | os.PathLike, manifest: Mapping[str, Any], present: Sequence[str] = ()
) -> None:
    """Checks that the files of ``manifest`` are there with their sizes (a ``stat`` each).

    Args:
      directory: the dataset's folder.
      manifest: from :func:`read_manifest`.
      present: names of data files found in the folder (e.g. the train shards): one the
        manifest does not list is a leftover of another conversion and is refused.

    Raises:
      DataError: one line naming the first missing, resized or unlisted file and the fix.

    Example:
      >>> ds = me.data.synthetic(256, 64)
      >>> paths = me.data.write_array_record_dataset("mnist_ar", ds)
      >>> check_manifest("mnist_ar", read_manifest("mnist_ar"))   # None: all there
      >>> os.remove(paths[0])
      >>> check_manifest("mnist_ar", read_manifest("mnist_ar"))
      Traceback (most recent call last):
      ...
      meshensemble.errors.DataError: ...
    """
    directory, files = os.fspath(directory), manifest["files"]
    for name, entry in sorted(files.items()):
        path = storage.join(directory, name)
        if not storage.isfile(path):
            raise DataError(f"{path}: missing (listed in {MANIFEST_FILE}); {REWRITE_FIX}")
        size = storage.file_size(path)
        if size != entry["bytes"]:
            raise DataError(
                f"{path}: {size} bytes, {MANIFEST_FILE} records {entry['bytes']}: the file "
                f"changed or is truncated; {REWRITE_FIX}"
            )
    extra = sorted(os.path.basename(p) for p in present if os.path.basename(p) not in files)
    if extra:
        raise DataError(
            f"{storage.join(directory, extra[0])}: not listed in {MANIFEST_FILE} (a leftover "
            f"of another conversion?); {REWRITE_FIX}"
        )


def manifest_fingerprint(manifest: Mapping[str, Any], names: Sequence[str]) -> str:
    """A hash of the manifest's entries for ``names`` (the identity of those files' bytes).

    Args:
      manifest: from :func:`read_manifest`.
      names: the file names, in order.

    Returns:
      64 hex digits.

    Example:
      >>> ds = me.data.synthetic(256, 64)
      >>> paths = me.data.write_array_record_dataset("mnist_ar", ds)
      >>> len(manifest_fingerprint(read_manifest("mnist_ar"), ["train.array_record"]))
      64
    """
    digest = hashlib.sha256()
    for name in names:
        entry = manifest["files"][name]
        digest.update(f"{entry['bytes']}:{entry['sha256']}\0".encode())
    return digest.hexdigest()


VERIFY_CACHE_ENV = "MESHENSEMBLE_VERIFY_CACHE"
"""Environment variable: the file where a host remembers the files it verified (default
``~/.cache/meshensemble/verified-files.json``); ``off`` verifies every file in every
process."""


def verify_cache_path() -> str | None:
    """The host's cache of verified files (:data:`VERIFY_CACHE_ENV`), or None when off.

    Returns:
      A path, or None.

    Example:
      >>> verify_cache_path()   # ~/.cache/..., or $MESHENSEMBLE_VERIFY_CACHE when set
      '.../verified-files.json'
    """
    value = os.environ.get(VERIFY_CACHE_ENV)
    if value is not None:
        return None if value.strip().lower() in ("", "off", "0") else value
    return os.path.join(os.path.expanduser("~"), ".cache", "meshensemble", "verified-files.json")


class FileVerifier:
    """Checks each file against its manifest SHA-256 the first time it is read.

    A file is hashed once per verifier (thread-safe: Grain's reader threads share it), and
    once per host as long as it stays the same file: a verified file's size, mtime and
    inode are remembered in the host's cache (:func:`verify_cache_path`), so later runs on
    that host skip the hash; a rewritten or replaced file is hashed again.

    Args:
      digests: ``{path: sha256}`` of the files to verify.
      cache: the cache file; default :func:`verify_cache_path` (None: no cache).

    Example:
      >>> np.savez("a.npz", labels=labels)
      >>> v = FileVerifier({"a.npz": file_digest("a.npz")}, cache="verified.json")
      >>> v.verify("a.npz")   # hashes it now; later calls are free
      >>> v.verify("a.npz")
    """

    def __init__(self, digests: Mapping[str, str], cache: str | None | bool = True):
        self.digests = {storage.absolute(k): v for k, v in digests.items()}
        self.cache = verify_cache_path() if cache is True else cache or None
        self._done: set[str] = set()
        self._lock = threading.Lock()

    def verify(self, path: str) -> None:
        """Hashes ``path`` unless already verified; raises when it differs from the manifest.

        Args:
          path: a file of ``digests`` (other paths are not checked).

        Raises:
          DataError: one line naming the file, the manifest and the fix.
        """
        path = storage.absolute(path)
        want = self.digests.get(path)
        if want is None or path in self._done:
            return
        with self._lock:
            if path in self._done:
                return
            stamp = storage.version(path)
            if _cache_entry(self.cache, path) != {"stamp": stamp, "sha256": want}:
                if file_digest(path) != want:
                    raise DataError(
                        f"{path}: its content differs from the SHA-256 in {MANIFEST_FILE} "
                        f"(the file was changed or damaged after conversion); {REWRITE_FIX}"
                    )
                _cache_store(self.cache, path, stamp, want)
            self._done.add(path)


def _cache_entry(cache: str | None, path: str) -> Any:
    """The host cache's entry for ``path`` (``{"stamp", "sha256"}``), or None."""
    if cache is None:
        return None
    try:
        return storage.read_json(cache).get(path)
    except (OSError, ValueError, AttributeError):
        return None


def _cache_store(cache: str | None, path: str, stamp: str, sha256: str) -> None:
    """Remembers ``path``'s digest at ``stamp`` in the host cache (best effort, atomic)."""
    if cache is None:
        return
    try:  # best effort: a read-only home only costs a hash next time
        try:
            known = storage.read_json(cache)
            known = known if isinstance(known, dict) else {}
        except (OSError, ValueError):
            known = {}
        known[path] = {"stamp": stamp, "sha256": sha256}
        storage.makedirs(os.path.dirname(storage.absolute(cache)))
        storage.atomic_write_json(cache, known)
    except OSError:
        pass


def cached_digest(path: str | os.PathLike, cache: str | None | bool = True) -> str:
    """The SHA-256 of a file, hashed once per host until the file changes.

    For files that carry no manifest (TFDS's prepared data): the digest is remembered in
    the host's cache (:func:`verify_cache_path`) under the file's size, mtime and inode, so
    a later start on that host costs a ``stat``; a rewritten or replaced file is hashed
    again.

    Args:
      path: the file.
      cache: the cache file; default :func:`verify_cache_path` (None: always hash).

    Returns:
      64 hex digits (:func:`file_digest`).

    Example:
      >>> np.savez("a.npz", labels=labels)
      >>> cached_digest("a.npz", cache="verified.json") == file_digest("a.npz")
      True
    """
    path = storage.absolute(path)
    cache = verify_cache_path() if cache is True else cache or None
    stamp = storage.version(path)
    entry = _cache_entry(cache, path)
    if isinstance(entry, dict) and entry.get("stamp") == stamp and "sha256" in entry:
        return str(entry["sha256"])
    digest = file_digest(path)
    if storage.version(path) == stamp:  # not rewritten while it was hashed
        _cache_store(cache, path, stamp, digest)
    return digest
