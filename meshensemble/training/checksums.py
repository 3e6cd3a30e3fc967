"""Checkpoint checksums: the SHA-256 of each finished checkpoint folder, written twice.

:class:`meshensemble.training.checkpoint.Checkpointer` records each checkpoint's digest
(:func:`checkpoint_digest`) in ``checkpoints/checksums.json`` once orbax has finished
saving it, and :func:`meshensemble.restore_checkpoint` compares it before using the
checkpoint. The file is written twice, ``checksums.json`` then ``checksums.copy.json``
(each with :func:`meshensemble.runtime.storage.atomic_write`): a lost or garbled
``checksums.json`` falls back to the copy, and when neither can be read while checksummed
checkpoints exist the restore is refused (:func:`load_checksums`). Folders may be local or
on a bucket (``gs://...``).

Example:
  >>> write_checksums("runs/tiny/checkpoints", read_checksums("runs/tiny/checkpoints"))
  >>> sorted(read_checksums("runs/tiny/checkpoints"))
  ['2', '4']
"""

from __future__ import annotations

import hashlib

from meshensemble.runtime import storage
from meshensemble.training.bundle import CheckpointError

CHECKSUMS = "checksums.json"
"""File in the checkpoint folder with the SHA-256 of each finished checkpoint."""
CHECKSUMS_COPY = "checksums.copy.json"
"""A second copy of :data:`CHECKSUMS`, read when that one is missing or damaged (a lost
file never lets a damaged checkpoint through as merely "unverified")."""


def checkpoint_digest(path: str) -> str:
    """SHA-256 over the relative names and contents of every file under ``path``.

    Args:
      path: a checkpoint's folder (local, or ``gs://...``).

    Returns:
      The hex digest. The files are taken in the order of ``os.walk`` with sorted names.

    Raises:
      FileNotFoundError: ``path`` is not a folder (a missing checkpoint has no digest;
        the SHA-256 of nothing would look like one).

    Example:
      >>> digest = checkpoint_digest("runs/tiny/checkpoints/4")  # 64 hex digits
    """
    if not storage.isdir(path):
        raise FileNotFoundError(f"no checkpoint folder {path}")
    digest = hashlib.sha256()
    for rel in storage.walk_files(path):
        digest.update(rel.encode() + b"\0")
        for block in storage.read_blocks(storage.join(path, rel)):
            digest.update(block)
    return digest.hexdigest()


def _read_sums(path: str) -> dict[str, str] | None:
    """The checksums in ``path``; None when it is missing; raises ValueError when damaged."""
    try:
        data = storage.read_json(path)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise ValueError(error_summary(err)) from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise ValueError("not a JSON object of checksums")
    return {str(k): v for k, v in data.items()}


def read_checksums(directory: str) -> dict[str, str]:
    """The recorded checksums of a checkpoint folder (``{}`` when there are none).

    ``checksums.json`` is read, or its copy :data:`CHECKSUMS_COPY` when it is missing or
    damaged; when neither is readable the result is ``{}`` (use :func:`load_checksums` to
    know why).

    Args:
      directory: the checkpoint folder (``workdir/checkpoints``).

    Returns:
      ``{step: sha256}``.

    Example:
      >>> read_checksums("runs/tiny/checkpoints")
      {'2': '...', '4': '...'}
    """
    try:
        return load_checksums(directory)[0]
    except CheckpointError:
        return {}


def load_checksums(directory: str, checkpoints: int = 0) -> tuple[dict[str, str], str | None]:
    """The recorded checksums, from ``checksums.json`` or else its copy.

    Args:
      directory: the checkpoint folder.
      checkpoints: how many finished checkpoints it holds: with two or more, a folder
        without either file has lost its checksums (a run records them at every save).

    Returns:
      ``(sums, note)``: ``note`` is one line when the copy was used, else None.

    Raises:
      CheckpointError: both files are damaged or missing while checkpoints exist that
        were checksummed; one line naming the file and the fix. Nothing is trusted
        unverified silently.

    Example:
      >>> sums, note = load_checksums("runs/tiny/checkpoints", 2)  # note: None, both files read
    """
    path, copy = storage.join(directory, CHECKSUMS), storage.join(directory, CHECKSUMS_COPY)
    problems = []
    for name in (path, copy):
        try:
            sums = _read_sums(name)
        except ValueError as err:
            problems.append(f"{name} is damaged ({err})")
            continue
        if sums is None:
            problems.append(f"{name} is missing")
            continue
        return sums, (f"{problems[0]}; using its copy {name}" if problems else None)
    damaged = any("damaged" in p for p in problems)
    if not damaged and checkpoints < 2:
        return {}, None  # a run stopped before its first checksum was recorded
    raise CheckpointError(
        f"{'; '.join(problems)}: the {checkpoints} checkpoint(s) in {directory} cannot be "
        f"verified; to use them unverified (each is still read back) write {{}} into "
        f"{path}, or train again"
    )


def write_checksums(directory: str, sums: dict[str, str]) -> None:
    """Writes ``checksums.json`` and its copy, each atomically
    (:func:`meshensemble.runtime.storage.atomic_write`).

    Args:
      directory: the checkpoint folder.
      sums: ``{step: sha256}``.

    Example:
      >>> write_checksums("runs/tiny/checkpoints", read_checksums("runs/tiny/checkpoints"))
    """
    for name in (CHECKSUMS, CHECKSUMS_COPY):
        storage.atomic_write_json(storage.join(directory, name), sums, indent=1)


def error_summary(err: BaseException, limit: int = 200) -> str:
    """An exception in one line: its type and the first line of its message, shortened.

    Args:
      err: the exception.
      limit: the most characters returned.

    Returns:
      ``"Type: first line"`` (the type alone when the message is empty), cut to ``limit``
      characters with ``...``.

    Example:
      >>> error_summary(OSError("disk full\\ntraceback..."))
      'OSError: disk full'
    """
    text = str(err).strip().splitlines()[0] if str(err).strip() else ""
    text = f"{type(err).__name__}: {text}" if text else type(err).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."
