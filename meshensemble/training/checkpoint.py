"""Checkpoints with orbax-checkpoint: the stacked, sharded ensemble state, the loop
position and a checksum of every finished checkpoint.

Orbax writes each checkpoint atomically (locally a temporary folder renamed when complete;
on ``gs://`` the step folder and a ``commit_success.txt`` written last) and restores it
onto any mesh; the run folder may be local or on a bucket
(:mod:`meshensemble.runtime.storage`). Orbax notices a truncated file but not a flipped
bit, so :class:`Checkpointer` records each checkpoint's SHA-256 in
``checkpoints/checksums.json`` once orbax says the save is finished: a thread of process
0 waits on orbax's ``CheckpointManager.wait_until_finished`` (which returns when orbax's
own finalisation, rename or commit file included, is done in every process), then reads
the checkpoint once and writes the checksum. (Orbax's ``post_finalization_callback`` comes
earlier, before that rename or commit file, so it is not used.) A process killed in
between (one read of the checkpoint: milliseconds for small ensembles, seconds for
gigabytes) leaves a finished checkpoint without a checksum, which
:func:`restore_checkpoint` reports as "unverified" and uses only if it reads back.
Process 0 reads every process's files: the checksum is one digest of the whole folder,
and combining digests made on each host would need a collective off the main thread or
a wait for the others' files.

The checksums are written twice, ``checksums.json`` then ``checksums.copy.json``
(:mod:`meshensemble.training.checksums`): a lost or garbled ``checksums.json`` falls back
to the copy, and when neither can be read the restore is refused (never "unverified").

On restore, a checksum mismatch or unreadable files (truncated, garbled) mark a
checkpoint damaged: it is reported, moved to ``checkpoints_damaged/`` (kept for
inspection; only when resuming: ``evaluate`` leaves it in place) and the previous one is
used. A checkpoint deleted while it is read (another job's ``--keep`` clean-up) is told
apart from a damaged one. Other failures raise :class:`CheckpointError`.

The state's structure checks and the inference bundle (:func:`extract_members`,
:func:`save_inference`, :func:`load_inference`) are :mod:`meshensemble.training.bundle`'s.
"""

from __future__ import annotations

import errno
import gc
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import orbax.checkpoint as ocp

from meshensemble.core.state import EnsembleState
from meshensemble.runtime import storage
from meshensemble.training.bundle import CheckpointError as CheckpointError
from meshensemble.training.bundle import abstract_state as abstract_state
from meshensemble.training.bundle import check_structure
from meshensemble.training.bundle import extract_members as extract_members
from meshensemble.training.bundle import load_inference as load_inference
from meshensemble.training.bundle import save_inference as save_inference
from meshensemble.training.checksums import CHECKSUMS as CHECKSUMS
from meshensemble.training.checksums import CHECKSUMS_COPY as CHECKSUMS_COPY
from meshensemble.training.checksums import checkpoint_digest as checkpoint_digest
from meshensemble.training.checksums import error_summary
from meshensemble.training.checksums import load_checksums as load_checksums
from meshensemble.training.checksums import read_checksums as read_checksums
from meshensemble.training.checksums import write_checksums as write_checksums

log = logging.getLogger("meshensemble")

CHECKPOINT_DIR = "checkpoints"
"""Folder under a run's workdir that holds its checkpoints."""
SETTLE_INTERVAL = 0.02
"""Seconds between looks for an abandoned save's last writes, after a save failed."""
DAMAGED_DIR = "checkpoints_damaged"
"""Folder under a run's workdir that keeps damaged checkpoints for inspection (outside
:data:`CHECKPOINT_DIR`: orbax never lists them, and the run can save that step again)."""


class _Manager(ocp.CheckpointManager):
    """Orbax's manager, leaving JAX's preemption sync point to the run's stop signal.

    Orbax asks the sync point itself, with checkpoint step numbers, at each save and from
    its finalisation thread; the sync point remembers the last number it was asked with,
    so those calls would move it out of the sequence every process follows
    (:class:`meshensemble.training.guards.StopSignal`) and the agreed step might never
    come. Orbax only logs what it would learn (its saves here are always forced).
    """

    def reached_preemption(self, step: int) -> bool:
        return False


def checkpoint_manager(
    workdir: str, keep: int | None = 3, create: bool = True
) -> ocp.CheckpointManager:
    """An orbax ``CheckpointManager`` for ``workdir/checkpoints`` (asynchronous saves).

    Args:
      workdir: the run's folder (local, or ``gs://...``).
      keep: how many of the latest checkpoints to keep (None: all).
      create: create the folder if missing.

    Returns:
      The manager; items ``state`` (the :class:`EnsembleState`) and ``loop`` (a JSON
      dict with the loop's position). It never asks JAX's preemption sync point (the run's
      :class:`~meshensemble.training.guards.StopSignal` does).

    Example:
      >>> mngr = me.checkpoint_manager("runs/demo")
    """
    path = storage.absolute(storage.join(workdir, CHECKPOINT_DIR))
    options = ocp.CheckpointManagerOptions(max_to_keep=keep, create=create)
    return _Manager(path, options=options, item_names=("state", "loop"))


def save_checkpoint(
    mngr: ocp.CheckpointManager, step: int, state: EnsembleState, loop: dict[str, Any]
) -> None:
    """Saves ``state`` and the loop position ``loop`` as checkpoint ``step`` (async).

    Args:
      mngr: from :func:`checkpoint_manager`.
      step: the run's global step.
      state: the ensemble state.
      loop: JSON-serialisable loop position, written as strict JSON (pass NaN/inf as
        :func:`~meshensemble.training.outputs.strict_json` writes them: null with a note).

    Raises:
      ValueError: ``loop`` holds a NaN/inf float (strict JSON has none), one line.

    Example:
      >>> mngr = me.checkpoint_manager("runs/demo")
      >>> me.save_checkpoint(mngr, 20, state, {"epoch": 1, "step": 20}); mngr.wait_until_finished()
    """
    try:
        json.dumps(loop, allow_nan=False)
    except ValueError:
        raise ValueError(
            "save_checkpoint: the loop position holds a NaN/inf float, which strict JSON "
            "cannot hold; pass meshensemble.training.outputs.strict_json(loop)"
        ) from None
    mngr.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), loop=ocp.args.JsonSave(loop)),
        force=True,
    )


class Checkpointer:
    """Asynchronous saves with checksums; restores the newest good checkpoint.

    Each save runs in orbax's background threads; a thread of process 0 waits for orbax
    to say the save is finished and records its SHA-256 then (see the module docstring
    for the window this leaves). Only process 0 writes the checksum file; all processes
    take part in saves (orbax coordinates multi-process writes). Opening one installs no
    process-wide hook; while one is open, orbax's error logs of a failed background save go
    to DEBUG (the failure is raised as one line instead).

    With ``pinning``, the checkpoints a save names in ``pinned`` (keep-best's) are kept
    beside the newest ``keep``; the others are deleted once the next save starts (after
    the previous one finished, so a failed save never leaves fewer) and at :meth:`close`.
    Every process deletes the same steps (orbax's ``delete`` waits for all of them).

    Args:
      workdir: the run's folder (local, or ``gs://...``).
      keep: how many checkpoints to keep (at least 2 so there is a previous one to use).
      echo: where one-line reports go.
      pinning: keep the steps each save pins (else orbax keeps the newest ``keep``).

    Example:
      >>> ckpt = Checkpointer("runs/demo")
      >>> ckpt.save(20, state, {"epoch": 1, "step": 20})
      >>> ckpt.close()
    """

    def __init__(
        self,
        workdir: str,
        keep: int = 3,
        echo: Callable[[str], None] | None = None,
        pinning: bool = False,
    ):
        self.workdir = workdir
        self.keep, self.pinning, self._pinned = keep, pinning, frozenset()
        self.dir = storage.absolute(storage.join(workdir, CHECKPOINT_DIR))
        self.echo = echo or log.info
        self._main = jax.process_index() == 0
        if self._main:
            for name in _remove_unfinished(self.dir):
                self.echo(f"removed {name} in {self.dir}: an unfinished save of a stopped run")
        try:
            self.mngr = checkpoint_manager(workdir, None if pinning else keep)
        except OSError as err:  # e.g. read-only, or a file in the way
            cause = _save_cause(err) or error_summary(err)
            raise CheckpointError(f"cannot create {self.dir}: {cause}; {_WRITABLE}") from None
        _quiet_orbax(True)
        self._lock = threading.Lock()
        self._unhashed: list[int] = []  # saved (or being saved), checksum not yet recorded
        self._recorder: threading.Thread | None = None
        self._failure: tuple[int, Exception] | None = None  # the save orbax reported failed
        self._watch_error: tuple[int, Exception] | None = None  # a checksum not written
        self._failed = False

    def save(
        self, step: int, state: EnsembleState, loop: dict[str, Any], pinned: Any = ()
    ) -> None:
        """Starts saving checkpoint ``step``; the previous save is finished and hashed first.

        Args:
          step: the run's global step.
          state: the ensemble state.
          loop: JSON-serialisable loop position.
          pinned: steps to keep whatever their age (with ``pinning``), e.g. the best.

        Raises:
          CheckpointError: the disk refused the write (full, read-only...).
        """
        self._pinned = frozenset(int(s) for s in pinned)  # kept by the prune in _finish too
        self._finish()
        try:
            save_checkpoint(self.mngr, step, state, loop)
        except Exception as err:  # orbax wraps OSError in several types
            raise self._error(step, err) from None
        with self._lock:
            self._unhashed.append(step)
        if self._main:
            self._recorder = threading.Thread(target=self._record_when_saved, args=(step,))
            self._recorder.daemon = True
            self._recorder.start()

    def _record_when_saved(self, step: int) -> None:
        """Waits for orbax to finish saving ``step`` (all processes), then records its
        checksum; a failure is kept for the main thread to raise."""
        try:
            self.mngr.wait_until_finished()
        except Exception as err:  # orbax raises it once: the main thread raises it then
            self._failure = (step, err)
            return
        try:
            self._record([step])
        except Exception as err:  # e.g. no space left for the checksum file
            self._watch_error = (step, err)

    def _record(self, steps: list[int]) -> None:
        """Writes the checksums of those of ``steps`` still unhashed (process 0)."""
        with self._lock:
            todo = [s for s in self._unhashed if s in steps]
            if not todo:
                return
            if self._main:
                sums = read_checksums(self.dir)
                for s in todo:
                    path = storage.join(self.dir, str(s))
                    if storage.isdir(path):  # absent: deleted already (keep=1)
                        sums[str(s)] = checkpoint_digest(path)
                live = set(list_checkpoints(self.workdir))
                sums = {k: v for k, v in sums.items() if k.isdigit() and int(k) in live}
                write_checksums(self.dir, sums)
            self._unhashed = [s for s in self._unhashed if s not in todo]

    def _finish(self) -> None:
        """Waits for the save in flight and records the checksums not yet recorded."""
        pending = list(self._unhashed)
        if self._recorder is not None:
            self._recorder.join()
            self._recorder = None
        failure, self._failure = self._failure, None
        if failure is None:
            try:
                self.mngr.wait_until_finished()
            except Exception as err:
                failure = (pending[-1] if pending else -1, err)
        if failure is not None:
            raise self._error(*failure) from None
        try:
            self._record(pending)
        except OSError as err:  # e.g. the disk filled up right after the save
            self._watch_error = self._watch_error or (pending[-1], err)
        if self._watch_error is not None:
            raise self._error(*self._watch_error) from None
        if self.pinning:
            self.prune()

    def prune(self) -> list[int]:
        """Deletes the finished checkpoints that are neither among the newest ``keep`` nor
        pinned (with ``pinning``; call it when no save is in flight); the steps deleted.

        Example:
          >>> ckpt = Checkpointer("runs/demo", keep=1, pinning=True)
          >>> for step in (10, 20, 30):
          ...     ckpt.save(step, state, {"step": step}, pinned=[10])
          >>> ckpt.close()                   # the newest and the pinned one stay
          >>> list_checkpoints("runs/demo")
          [10, 30]
        """
        steps = sorted(self.mngr.all_steps())
        keep = set(steps[-self.keep :]) | self._pinned
        gone = [s for s in steps if s not in keep]
        for s in gone:
            self.mngr.delete(s)
        return gone

    def _error(self, step: int, err: Exception) -> CheckpointError:
        self._failed = True
        with self._lock:
            self._unhashed = []
        if self._main:  # orbax gave up; writes it had started may still land: let them
            calm, deadline = time.monotonic(), time.monotonic() + 10
            while time.monotonic() - calm < 1 and time.monotonic() < deadline:
                calm = calm if not _remove_unfinished(self.dir) else time.monotonic()
                time.sleep(SETTLE_INTERVAL)
        good = [s for s in list_checkpoints(self.workdir) if s != step]
        prev = f"checkpoint {max(good)} is intact" if good else "no earlier checkpoint exists"
        cause = _save_cause(err)
        todo = (
            "fix that" if cause is None else _FREE_SPACE if "space" in cause else "make it writable"
        )
        again = "resume" if good else "start again"  # a new run without one removes its files
        fix = f"{todo} and run the same command to {again}, or use another --workdir"
        return CheckpointError(
            f"could not save checkpoint {step} in {self.dir}: {cause or error_summary(err)}; "
            f"{prev}; {fix}"
        )

    def close(self) -> None:
        """Waits for the last save, records its checksum and closes the manager.

        After a failed save it only closes the manager: the error was already raised.

        Raises:
          CheckpointError: the last save failed.
        """
        try:
            if not self._failed:
                self._finish()
        finally:
            if self._recorder is not None:
                self._recorder.join(timeout=60)
            try:
                self.mngr.close()
            except Exception:
                if not self._failed:
                    raise
            finally:
                _quiet_orbax(False)


_SAVE_CAUSES = {
    errno.ENOSPC: "no space left on device",
    errno.EDQUOT: "disk quota exceeded (no space left for this user)",
    errno.EROFS: "read-only file system",
    errno.EACCES: "permission denied",
    errno.ENOTDIR: "not a directory (a file is in the way)",
}
_FREE_SPACE = "free space there (or keep fewer checkpoints: --keep)"
_WRITABLE = "make it writable, or use another --workdir"


def _save_cause(err: BaseException) -> str | None:
    """The cause of a failed write in a few words (from its errno or message), or None."""
    low = str(err).lower()
    found = [c for c in _SAVE_CAUSES.values() if c.split(" (")[0] in low]
    return _SAVE_CAUSES.get(getattr(err, "errno", None)) or (found[0] if found else None)


_UNFINISHED = ".orbax-checkpoint-tmp"


def _remove_unfinished(directory: str) -> list[str]:
    """Deletes orbax's unfinished saves: ``*.orbax-checkpoint-tmp*`` (a local folder), or
    a step folder without orbax's commit file (a bucket); the names removed."""
    try:
        names = storage.listdir(directory)
    except OSError:
        return []
    steps = [] if storage.is_local(directory) else [n for n in names if n.isdigit()]
    done = {str(s) for s in _finished(directory, steps)}
    names = [n for n in names if _UNFINISHED in n or (n in steps and n not in done)]
    for name in names:
        path = storage.join(directory, name)
        storage.rmtree(path) if storage.isdir(path) else storage.remove(path)
    return names


def _drop_orbax_errors(record: logging.LogRecord) -> bool:
    """Logging filter: orbax's error logs of failed background saves go to DEBUG (the
    Checkpointer raises them as one line)."""
    if record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname:
        log.debug("orbax: %s", record.getMessage())
        return False
    return True


_QUIET = [0]  # open Checkpointers


def _quiet_orbax(on: bool) -> None:
    """Drops orbax's error logs while a Checkpointer is open."""
    _QUIET[0] = max(0, _QUIET[0] + (1 if on else -1))
    absl = logging.getLogger("absl")
    absl.addFilter(_drop_orbax_errors) if _QUIET[0] else absl.removeFilter(_drop_orbax_errors)


def list_checkpoints(workdir: str) -> list[int]:
    """Steps of the finished checkpoints in ``workdir/checkpoints``, oldest first.

    Finished: a step folder (locally orbax renames it into place when complete), holding
    orbax's commit file on a bucket (where orbax writes in place and the file comes last).

    Example:
      >>> list_checkpoints("runs/tiny")
      [2, 4]
    """
    path = storage.join(workdir, CHECKPOINT_DIR)
    try:
        names = [n for n in storage.listdir(path) if n.isdigit()]
    except (FileNotFoundError, NotADirectoryError):
        return []
    return _finished(path, names)


def _finished(directory: str, names: list[str]) -> list[int]:
    """The steps of the step folders ``names`` of ``directory`` that orbax finished."""
    commit = ocp.path.atomicity.COMMIT_SUCCESS_FILE
    done = (
        storage.isdir
        if storage.is_local(directory)
        else (lambda p: storage.isfile(storage.join(p, commit)))
    )
    return sorted(int(n) for n in names if done(storage.join(directory, n)))


def restore_checkpoint(
    workdir: str,
    ens: Any,
    sample: Any,
    step: int | None = None,
    echo: Callable[[str], None] | None = None,
    *,
    move_damaged: bool = True,
) -> tuple[EnsembleState, dict[str, Any], int]:
    """Restores a checkpoint of ``workdir`` onto ``ens``'s mesh (any mesh shape).

    The newest checkpoint whose recorded checksum matches (and that orbax can read) is
    used; a damaged one is reported through ``echo``, moved to
    ``workdir/checkpoints_damaged/<step>`` with ``move_damaged`` (kept for inspection; the
    run saves that step again when it gets there), else left in place, and skipped. A
    checkpoint whose folder disappears while it is read (a training job's ``--keep``
    clean-up) is reported as deleted, not damaged, and skipped. Naming ``step`` restores
    exactly that one or fails, moving nothing. The checksums come from
    ``checksums.json`` or its copy (:func:`load_checksums`).

    Args:
      workdir: the run's folder.
      ens: the :class:`meshensemble.Ensemble` to restore into; its mesh may differ from
        the one the checkpoint was written with (e.g. ``(8, 1)`` onto ``(4, 1)``).
      sample: an input batch for the state's structure, e.g. ``images[:1]``.
      step: which checkpoint; default the newest good one.
      echo: where reports of damaged checkpoints go (default: logging).
      move_damaged: move damaged checkpoints to :data:`DAMAGED_DIR` (only process 0
        moves; a read-only workdir leaves them in place).

    Returns:
      ``(state, loop, step)``.

    Raises:
      FileNotFoundError: no checkpoint (or not that step) in ``workdir``.
      CheckpointError: ``step`` is damaged or was deleted (one line naming it and the
        steps available); both checksum files are unreadable; every candidate
        checkpoint is damaged; or ``ens`` does not fit
        the checkpoint (member count, model, optimizer: the message names both sides);
        or reading failed for a reason other than damage (out of memory, permission,
        I/O), which stops here instead of falling back to an older checkpoint.

    Example:
      >>> ckpt = Checkpointer("runs/demo"); ckpt.save(20, state, {"step": 20}); ckpt.close()
      >>> restored, loop, step = me.restore_checkpoint("runs/demo", ens, images[:1])  # step 20
    """
    say = echo or log.warning
    steps = list_checkpoints(workdir)
    directory = storage.absolute(storage.join(workdir, CHECKPOINT_DIR))
    if not steps:
        raise FileNotFoundError(
            f"no checkpoint in {directory}; run `meshensemble train --workdir {workdir}` first"
        )
    if step is not None and step not in steps:
        raise FileNotFoundError(
            f"no checkpoint {step} in {directory}; available: {', '.join(map(str, steps))}"
        )
    candidates = [step] if step is not None else sorted(steps, reverse=True)
    sums, note = load_checksums(directory, len(steps))
    if note:
        say(note)
    target = abstract_state(ens, sample)
    args = ocp.args.Composite(state=ocp.args.StandardRestore(target), loop=ocp.args.JsonRestore())
    absl = logging.getLogger("absl")
    absl.addFilter(_drop_missing_metadata)
    mngr = checkpoint_manager(workdir, create=False)
    problems: list[str] = []
    tried: set[int] = set()
    relisted = False
    try:
        while (s := next((c for c in candidates if c not in tried), None)) is not None:
            tried.add(s)
            found = _restore_one(mngr, args, target, directory, s, sums.get(str(s)), problems)
            if found is not None:
                if sums.get(str(s)) is None:
                    say(
                        f"checkpoint {s} has no recorded checksum (the run stopped before "
                        "recording it): unverified, but it reads back; using it"
                    )
                return found["state"], dict(found["loop"]), int(s)
            if step is not None:
                raise CheckpointError(
                    f"checkpoint {step} in {directory} {problems[-1].split(' ', 2)[2]}; pick "
                    f"another with --checkpoint (available: {', '.join(map(str, steps))}), or "
                    "omit it to use the newest checkpoint that verifies"
                )
            gone = problems[-1].endswith(_VANISHED)
            moved = _move_aside(workdir, s) if move_damaged and not gone else None
            where = f"; moved it to {moved}" if moved else "" if gone else "; left it in place"
            if gone and not relisted:  # a clean-up ran beside us: look again, once
                relisted, steps = True, list_checkpoints(workdir)
                candidates = sorted(steps, reverse=True)
                sums = load_checksums(directory, len(steps))[0]
                say(f"{problems[-1]}; trying the newest remaining one")
            else:
                say(f"{problems[-1]}{where}; trying the previous one")
    finally:
        mngr.close()
        absl.removeFilter(_drop_missing_metadata)
    raise CheckpointError(f"no good checkpoint in {directory}: {'; '.join(problems)}")


def _drop_missing_metadata(record: logging.LogRecord) -> bool:
    """Logging filter: orbax's "Metadata file does not exist" warning on every restore of
    a checkpoint saved without its optional metadata file is noise, not a problem."""
    return not str(record.msg).startswith("Metadata file does not exist")


_VANISHED = "was deleted while being read (another job's clean-up, e.g. training with --keep)"


def _restore_one(
    mngr: Any, args: Any, target: Any, directory: str, s: int, want: str | None, problems: list
) -> Any:
    """Checkpoint ``s`` restored, or None with the reason appended to ``problems``.

    A checkpoint deleted while it is read (a training job's ``--keep`` clean-up) is told
    apart from a damaged one: its folder is gone afterwards.
    """
    path, gone = storage.join(directory, str(s)), f"checkpoint {s} {_VANISHED}"
    vanished = lambda: not storage.isdir(path)
    if vanished():
        problems.append(gone)
        return None
    try:
        got = checkpoint_digest(path) if want is not None else None
    except FileNotFoundError:
        problems.append(gone)
        return None
    except OSError as err:  # permission, I/O: the files may well be fine
        raise _restore_error(s, directory, err, verified=False) from None
    if got != want:
        problems.append(gone if vanished() else f"checkpoint {s} is damaged (checksum mismatch)")
        return None
    try:
        check_structure(storage.join(path, "state"), target, f"checkpoint {s} in {directory}")
        return mngr.restore(s, args=args)
    except CheckpointError:
        if not vanished():
            raise
        problems.append(gone)
        return None
    except Exception as err:
        lost = vanished()
        # a verified checkpoint holds the bytes that were written: not damaged
        if not lost and (want is not None or _outside_cause(err)):
            raise _restore_error(s, directory, err, verified=want is not None) from None
        problems.append(gone if lost else f"checkpoint {s} is unreadable ({error_summary(err)})")
        gc.collect()  # orbax's abandoned reads
        return None


def _outside_cause(err: BaseException) -> tuple[str, str] | None:
    """``(cause, fix)`` of a failed read that is not the checkpoint's fault, else None."""
    low = f"{type(err).__name__}: {err}".lower()
    if isinstance(err, MemoryError) or "resource_exhausted" in low or "out of memory" in low:
        return "out of memory", "free memory, or restore onto a mesh with more devices"
    if isinstance(err, PermissionError) or "permission_denied" in low or "permission denied" in low:
        return "permission denied", "make the folder readable by this user"
    io = isinstance(err, OSError) and not isinstance(err, FileNotFoundError | IsADirectoryError)
    words = ("input/output error", "unavailable", "deadline_exceeded")
    io = io or any(w in low for w in words)
    return ("I/O error", "check the disk, then run again") if io else None


def _restore_error(step: int, directory: str, err: BaseException, verified: bool):
    cause, fix = _outside_cause(err) or (
        "error",
        "restore it with the meshensemble and orbax-checkpoint versions that wrote it",
    )
    fine = "fine (its checksum matches)" if verified else "not known to be damaged (no checksum)"
    return CheckpointError(
        f"could not restore checkpoint {step} from {directory}: {cause} "
        f"({error_summary(err)}); the checkpoint itself is {fine}; {fix}"
    )


def _move_aside(workdir: str, step: int) -> str | None:
    """Moves damaged checkpoint ``step`` to :data:`DAMAGED_DIR`; its new path, or None."""
    if jax.process_index() != 0:
        return None
    directory = storage.absolute(storage.join(workdir, CHECKPOINT_DIR))
    root = storage.absolute(storage.join(workdir, DAMAGED_DIR))
    dest, n = storage.join(root, str(step)), 1
    while storage.exists(dest):
        dest, n = storage.join(root, f"{step}.{n}"), n + 1
    try:  # on a bucket a copy, then a delete (storage.move): never neither
        storage.makedirs(root)
        storage.move(storage.join(directory, str(step)), dest)
        sums = read_checksums(directory)
        if sums.pop(str(step), None) is not None:
            write_checksums(directory, sums)
    except OSError as err:
        log.warning("could not move damaged checkpoint %s to %s: %s", step, dest, err)
        return None
    return dest
