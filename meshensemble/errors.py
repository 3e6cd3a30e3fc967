"""The package's errors as types: one base class and the kinds the CLI maps to exit codes.

Every error the library raises on purpose is a :class:`MeshEnsembleError`, of one kind:

* :class:`UsageError` (exit 2): a bad value from the user (a flag, a config field, an
  argument); also a ``ValueError``.
* :class:`DataError` (exit 2): data that cannot be used as given (a missing or damaged
  file, a wrong shape); also a ``ValueError``.
* :class:`RunFailedError` (exit 1): a run that failed on the way (a checkpoint that could
  not be written, a member's loss that became NaN, an output file); also a
  ``RuntimeError``.
* :class:`Interrupted` (exit 130): the user stopped the command (Ctrl-C).

The errors of the other rooms subclass one kind and keep their names where they are
(``meshensemble.CheckpointError``, ``meshensemble.training.NonFiniteError``,
``meshensemble.data.DataError`` ...), so ``except ValueError`` / ``except RuntimeError``
still catch what they caught. The command line picks the exit status with
``isinstance`` (:func:`exit_code`), never by a class's name. This module imports nothing
of the package: it sits below every room.

Example:
  >>> try:
  ...     me.make_mesh(ensemble=0)
  ... except ValueError as err:
  ...     print(me.errors.exit_code(err))
  2
"""

from __future__ import annotations

__all__ = [
    "EXIT_FAILED",
    "EXIT_INTERRUPTED",
    "EXIT_USAGE",
    "DataError",
    "Interrupted",
    "MeshEnsembleError",
    "RunFailedError",
    "UsageError",
    "exit_code",
]

EXIT_USAGE = 2
"""Exit status for bad input: a :class:`UsageError` or a :class:`DataError`."""
EXIT_FAILED = 1
"""Exit status for a run that failed (:class:`RunFailedError`, or anything unexpected)."""
EXIT_INTERRUPTED = 130
"""Exit status when the user interrupted the command (Ctrl-C: 128 + SIGINT)."""


class MeshEnsembleError(Exception):
    """The base of every error meshensemble raises on purpose.

    Attributes:
      exit_code: the command line's exit status for this kind (a class attribute).

    Example:
      >>> isinstance(me.CheckpointError("disk full"), me.errors.MeshEnsembleError)
      True
    """

    exit_code: int = EXIT_FAILED


class UsageError(MeshEnsembleError, ValueError):
    """A bad value from the user: one line naming it and the fix (exit 2).

    Example:
      >>> raise UsageError("--members 0 must be a positive integer")
      Traceback (most recent call last):
      ...
      meshensemble.errors.UsageError: --members 0 must be a positive integer
    """

    exit_code = EXIT_USAGE


class DataError(MeshEnsembleError, ValueError):
    """A problem with the data: a missing, corrupt or malformed file or dataset (exit 2).

    The message is always one line: where (the file or dataset), what is wrong, and the
    fix. ``reason`` is a shorter form without the fix, used in log lines. The same class
    as ``meshensemble.data.DataError``.

    Args:
      message: the full one-line message (newlines are folded into spaces).
      reason: a short description of the problem; defaults to ``message``.

    Example:
      >>> raise DataError("/tmp/x.npz: file not found (pass the path of mnist.npz)")
      Traceback (most recent call last):
      ...
      meshensemble.errors.DataError: /tmp/x.npz: file not found (pass the path of mnist.npz)
    """

    exit_code = EXIT_USAGE

    def __init__(self, message: str, reason: str | None = None) -> None:
        message = _one_line(message)
        super().__init__(message)
        self.reason = _one_line(reason) if reason is not None else message


def _one_line(text: str) -> str:
    return " ".join(part.strip() for part in str(text).splitlines() if part.strip())


class RunFailedError(MeshEnsembleError, RuntimeError):
    """A run that started and then failed: a checkpoint, an output, a NaN loss (exit 1).

    Example:
      >>> raise RunFailedError("could not write metrics.jsonl: disk full")
      Traceback (most recent call last):
      ...
      meshensemble.errors.RunFailedError: could not write metrics.jsonl: disk full
    """

    exit_code = EXIT_FAILED


class Interrupted(MeshEnsembleError):
    """The user interrupted the command (Ctrl-C), after whatever was saved (exit 130).

    Example:
      >>> raise Interrupted("interrupted at step 40: saved checkpoint 40")
      Traceback (most recent call last):
      ...
      meshensemble.errors.Interrupted: interrupted at step 40: saved checkpoint 40
    """

    exit_code = EXIT_INTERRUPTED


def exit_code(err: BaseException) -> int:
    """The command line's exit status for an exception, by its type.

    Args:
      err: any exception.

    Returns:
      The kind's ``exit_code`` for a :class:`MeshEnsembleError`; 130 for a
      ``KeyboardInterrupt``; 2 for another ``ValueError`` or a ``FileNotFoundError``
      (bad input); 1 for anything else.

    Example:
      >>> exit_code(UsageError("bad")), exit_code(RuntimeError("boom"))
      (2, 1)
      >>> exit_code(KeyboardInterrupt())
      130
    """
    if isinstance(err, MeshEnsembleError):
        return err.exit_code
    if isinstance(err, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    if isinstance(err, ValueError | FileNotFoundError):
        return EXIT_USAGE
    return EXIT_FAILED
