"""What every ``meshensemble`` subcommand shares: the one-line errors, devices, processes.

Every bad value gets one line on stderr naming it and the fix. :func:`exit_code` maps an
exception to the command's exit status by its type (:mod:`meshensemble.errors`: 2 for
bad input, 1 for a run that failed, 130 when interrupted); tracebacks are shown only
with ``--debug`` or ``MESHENSEMBLE_DEBUG=1``.

Example:
  >>> parser = Parser(prog="meshensemble")
  >>> add_debug_flag(parser)
  >>> parser.parse_args(["--debug"]).debug
  True
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import re
import sys
import typing
import weakref
from typing import Any

from meshensemble import errors
from meshensemble.errors import Interrupted, MeshEnsembleError, UsageError
from meshensemble.training.config import (
    TrainConfig,
    config_field,
    field_choices,
    field_group,
    field_help,
)

DEBUG_ENV = "MESHENSEMBLE_DEBUG"
"""Environment variable: ``1`` shows tracebacks (as ``--debug`` does)."""
FAILED_RUN_ERRORS = (errors.RunFailedError,)
"""Exception types of a run that failed (exit 1), reported in one line: the kind
:class:`meshensemble.errors.RunFailedError` (``CheckpointError``, ``NonFiniteError``,
``OutputError`` ...); compared with ``isinstance``."""


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are a :class:`UsageError` (one line, exit 2)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        """Raises :class:`UsageError` instead of printing the usage and exiting."""
        raise UsageError(f"{self.prog}: {message}")


def format_default(value: Any) -> str:
    """How a default appears in ``--help``: ``(default: X)``.

    Example:
      >>> format_default(None), format_default(""), format_default(0.1)
      ('none', "''", '0.1')
    """
    if value is None:
        return "none"
    if value == "":
        return "''"
    return str(value)


_GROUPS: weakref.WeakKeyDictionary[argparse.ArgumentParser, dict[str, Any]] = (
    weakref.WeakKeyDictionary()
)


def argument_group(p: argparse.ArgumentParser, title: str) -> Any:
    """The ``--help`` group ``title`` of ``p``, made (after those made before) if missing.

    Args:
      p: a subcommand's parser.
      title: the group's title, e.g. ``"data"``.

    Returns:
      The ``argparse`` argument group: flags added to it are listed under its title.

    Example:
      >>> parser = Parser(prog="meshensemble train")
      >>> argument_group(parser, "data") is argument_group(parser, "data")
      True
    """
    groups = _GROUPS.setdefault(p, {})
    if title not in groups:
        groups[title] = p.add_argument_group(title)
    return groups[title]


def add_field_flag(
    p: argparse.ArgumentParser,
    name: str,
    *,
    flag: str | None = None,
    help: str | None = None,
    default: Any = dataclasses.MISSING,
    required: bool = False,
    group: str | None = None,
) -> None:
    """Adds the flag of the :class:`~meshensemble.TrainConfig` field ``name``, in its group.

    Type, choices, metavar, help and the ``--help`` group come from the field's metadata;
    booleans become ``--flag/--no-flag``. The parser's default is None (so a flag left out
    is told apart from one given) unless ``default`` is passed; the help shows the
    field's default.

    Args:
      p: the subcommand's parser.
      name: the field.
      flag: the flag (default ``--`` + the name with ``-`` for ``_``).
      help: text to use instead of the field's help (for a flag whose meaning differs).
      default: the parser's default (and the one shown); default: the field's, shown only.
      required: the flag must be given.
      group: the ``--help`` group to list it in instead of the field's (another command's
        grouping, e.g. ``evaluate``'s).

    Raises:
      ValueError: the field names no group (every ``TrainConfig`` field must).

    Example:
      >>> parser = Parser(prog="meshensemble train")
      >>> add_field_flag(parser, "mesh")
      >>> add_field_flag(parser, "checkpoint")   # a bool: --checkpoint/--no-checkpoint
      >>> args = parser.parse_args(["--mesh", "ensemble=4,data=2", "--no-checkpoint"])
      >>> args.mesh, args.checkpoint
      ('ensemble=4,data=2', False)
      >>> parser.parse_args([]).mesh is None   # left out: told apart from given
      True
    """
    f = config_field(name)
    title = group or field_group(f)
    if not title:
        raise ValueError(f"TrainConfig.{name} names no --help group; give its field group=...")
    hint = typing.get_type_hints(TrainConfig)[name]
    types = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    typ = count_or_share if types == [int, float] else types[0]
    shown = f.default if default is dataclasses.MISSING else default
    text = (help if help is not None else field_help(f)).replace("%", "%%")
    if not required:
        text += f" (default: {format_default(shown)})".replace("%", "%%")
    kwargs: dict[str, Any] = {"help": text, "dest": name, "required": required}
    kwargs["default"] = None if default is dataclasses.MISSING else default
    if typ is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = typ
        choices = field_choices(f)
        if choices is not None:
            kwargs["choices"] = choices
        elif f.metadata.get("metavar"):
            kwargs["metavar"] = f.metadata["metavar"]
    argument_group(p, title).add_argument(flag or "--" + name.replace("_", "-"), **kwargs)


def checkpoint_arg(text: str) -> int | str:
    """``--checkpoint``'s value: a step number, or ``best`` (the run's ``--keep-best`` one).

    Raises:
      argparse.ArgumentTypeError: anything else.

    Example:
      >>> checkpoint_arg("40"), checkpoint_arg("best")
      (40, 'best')
    """
    if text == "best":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a step number or best") from None


def add_checkpoint_flag(p: Any) -> None:
    """Adds ``--checkpoint STEP|best`` to a parser (or one of its argument groups).

    Example:
      >>> parser = Parser(prog="meshensemble evaluate")
      >>> add_checkpoint_flag(parser)
      >>> parser.parse_args(["--checkpoint", "best"]).checkpoint
      'best'
    """
    p.add_argument(
        "--checkpoint",
        type=checkpoint_arg,
        metavar="STEP|best",
        help="checkpoint step, or best: the one train --keep-best kept (default: the latest)",
    )


def add_run_flags(p: argparse.ArgumentParser, workdir_help: str) -> Any:
    """Adds ``--workdir DIR`` (required) and ``--checkpoint STEP|best`` in the group "the run".

    Args:
      p: the parser of a command that reads a trained run.
      workdir_help: the help of ``--workdir``.

    Returns:
      The group "the run", for the command's other flags about the run.

    Example:
      >>> parser = Parser(prog="meshensemble predict")
      >>> group = add_run_flags(parser, "the trained run's folder")
      >>> parser.parse_args(["--workdir", "runs/tiny", "--checkpoint", "4"]).checkpoint
      4
    """
    add_field_flag(p, "workdir", required=True, help=workdir_help, group="the run")
    add_checkpoint_flag(argument_group(p, "the run"))
    return argument_group(p, "the run")


def add_device_flags(p: argparse.ArgumentParser, debug_group: Any) -> None:
    """Adds ``--fake-devices``, ``--mesh``, ``--batch-size`` and ``--debug`` (to ``debug_group``).

    The flags of a command that runs a trained ensemble on this machine's devices.

    Args:
      p: the command's parser.
      debug_group: where ``--debug`` is listed (e.g. :func:`add_run_flags`'s group).

    Example:
      >>> parser = Parser(prog="meshensemble predict")
      >>> add_device_flags(parser, parser)
      >>> parser.parse_args(["--batch-size", "64"]).eval_batch_size
      64
    """
    add_fake_devices_flag(p, "ensemble and mesh")
    add_field_flag(p, "mesh", help=field_help(config_field("mesh")) + " (may differ from training)")
    add_field_flag(p, "eval_batch_size", flag="--batch-size", default=1000)
    add_debug_flag(debug_group)


def resolve_checkpoint(workdir: str, checkpoint: int | str | None) -> int | None:
    """``--checkpoint``'s step: ``best`` read from the run (one line if it kept none).

    Raises:
      ValueError: ``best`` for a run that kept no best checkpoint.

    Example:
      >>> resolve_checkpoint("runs/tiny", 4), resolve_checkpoint("runs/tiny", None)
      (4, None)
    """
    if checkpoint != "best":
        return checkpoint  # type: ignore[return-value]
    from meshensemble.training.restore import best_checkpoint

    return best_checkpoint(workdir)


def count_or_share(text: str) -> int | float:
    """A flag's ``N`` (an integer) or share (a float, e.g. ``0.2``), as ``--validation`` takes.

    Raises:
      argparse.ArgumentTypeError: neither (argparse prints one line, exit 2).

    Example:
      >>> count_or_share("50"), count_or_share("0.2")
      (50, 0.2)
    """
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    raise argparse.ArgumentTypeError(f"{text!r} is neither a count nor a share, e.g. 50 or 0.2")


def add_debug_flag(p: Any) -> None:
    """Adds ``--debug`` (tracebacks for errors) unless ``p`` has it already.

    Args:
      p: a parser, or one of its argument groups (:func:`argument_group`).

    Example:
      >>> parser = Parser(prog="meshensemble train")
      >>> add_debug_flag(parser); add_debug_flag(parser)   # the second adds nothing
      >>> parser.parse_args([]).debug is None
      True
    """
    with contextlib.suppress(argparse.ArgumentError):  # already there: keep that one
        p.add_argument(
            "--debug",
            action="store_true",
            default=None,
            help=f"show the traceback of an error (as {DEBUG_ENV}=1 does)",
        )


def debug_requested(args: argparse.Namespace | None = None) -> bool:
    """Whether ``--debug`` was given or ``MESHENSEMBLE_DEBUG`` is set to ``1``.

    Example:
      >>> debug_requested(argparse.Namespace(debug=True))
      True
    """
    env = os.environ.get(DEBUG_ENV, "").strip().lower() in ("1", "true", "yes")
    return env or bool(getattr(args, "debug", False))


def exit_code(err: BaseException) -> int:
    """The exit status for an exception, by its type (:func:`meshensemble.errors.exit_code`).

    2 for bad input (a :class:`~meshensemble.errors.UsageError`,
    :class:`~meshensemble.errors.DataError`, another ``ValueError``, a missing file), 1 for
    a failed run, 130 for an interruption (``KeyboardInterrupt``,
    :class:`~meshensemble.errors.Interrupted`).

    Example:
      >>> exit_code(UsageError("bad")), exit_code(RuntimeError("boom"))
      (2, 1)
    """
    return errors.exit_code(err)


def error_line(err: BaseException) -> str:
    """The one line printed for an exception (``error: ...``).

    Expected errors (every :class:`~meshensemble.errors.MeshEnsembleError`, and bad input)
    print their message; an interruption says so; anything else its type too, and a hint
    to rerun with ``--debug``.

    Example:
      >>> error_line(ValueError("members=0 must be a positive integer"))
      'error: members=0 must be a positive integer'
    """
    text = " ".join(str(err).split())
    if isinstance(err, KeyboardInterrupt | Interrupted):
        return f"interrupted: {text}" if text else "interrupted (Ctrl-C)"
    text = text or type(err).__name__
    if isinstance(err, MeshEnsembleError) or exit_code(err) == errors.EXIT_USAGE:
        return f"error: {text}"
    return f"error: {type(err).__name__}: {text[:300]} (rerun with --debug for the traceback)"


ABSL_NOISE = ("Metadata file does not exist",)
"""Starts of absl log messages the CLI drops: orbax's warning on every restore of a
checkpoint saved without its optional ``_CHECKPOINT_METADATA`` file."""


class PipeSafeStdout:
    """``sys.stdout`` for a command whose reader may close early (``train ... | head``).

    The first write or flush that meets a closed pipe points file descriptor 1 at
    ``os.devnull`` and drops the rest of the output, so the run goes on (and saves)
    instead of dying of a ``BrokenPipeError``. Everything else is the wrapped stream's.

    Example:
      >>> import io
      >>> out = PipeSafeStdout(io.StringIO())
      >>> out.write("epoch 1")
      7
    """

    def __init__(self, stream: Any) -> None:
        self.stream = stream
        self.closed_pipe = False

    def write(self, text: str) -> int:
        if not self.closed_pipe:
            try:
                return self.stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self.closed_pipe:
            try:
                self.stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self.closed_pipe = True
        with contextlib.suppress(OSError, ValueError, AttributeError):
            null = os.open(os.devnull, os.O_WRONLY)  # the exit's flush must not fail either
            os.dup2(null, self.stream.fileno())
            os.close(null)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def _not_noise(record: Any) -> bool:
    return not str(record.getMessage()).startswith(ABSL_NOISE)


def silence_absl_noise() -> None:
    """Drops the absl warnings of :data:`ABSL_NOISE` (idempotent; other absl lines stay).

    Example:
      >>> silence_absl_noise()
    """
    logger = logging.getLogger("absl")
    if _not_noise not in logger.filters:
        logger.addFilter(_not_noise)


@contextlib.contextmanager
def leftovers_dropped() -> typing.Iterator[None]:
    """While the command runs, drops the stray reports a failed orbax save or read leaves.

    The library raises such a failure as one line (:class:`meshensemble.CheckpointError`);
    tensorstore writes still in flight land afterwards and each reports "Event loop is
    closed" as an unraisable exception (the save's event loop has ended), and orbax's
    abandoned read coroutines report theirs when collected. The command promises one line
    on stderr, so the command (not the library) sets a ``sys.unraisablehook`` that drops
    those two kinds while it runs, and puts the previous hook back after; other
    unraisable exceptions go to that hook.

    Example:
      >>> import sys
      >>> before = sys.unraisablehook
      >>> with leftovers_dropped():
      ...     pass
      >>> sys.unraisablehook is before
      True
    """
    import traceback

    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        names = {f.name for f in traceback.extract_tb(unraisable.exc_traceback)}
        late = "call_soon_threadsafe" in names and str(unraisable.exc_value) == (
            "Event loop is closed"
        )
        code = getattr(unraisable.object, "cr_code", None)
        if not late and not (code and f"{os.sep}orbax{os.sep}" in code.co_filename):
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def hard_exit(code: int, message: str) -> None:
    """Prints ``message`` and ends the process now, skipping the runtime's shutdown barrier.

    Only the command line ends its process (the library raises). After a peer dies, the
    runtime's shutdown waits for it until the heartbeat timeout and then aborts with a
    long trace; and after a failed save, orbax's background threads still hold the write
    and would print their teardown. A failed command should instead say what happened in
    one line and exit promptly.

    Args:
      code: the exit status.
      message: the one line (stderr).

    Example:
      >>> hard_exit(1, "error: lost contact with process 1")  # doctest: +SKIP
    """
    print(message, file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def setup_devices(fake_devices: int | None) -> None:
    """Applies ``--fake-devices N`` (N simulated CPU devices) before JAX starts.

    Args:
      fake_devices: the flag's value, or None to leave the platform alone.

    Raises:
      UsageError: ``fake_devices`` is not positive.

    Example:
      >>> setup_devices(None)   # no --fake-devices: the platform is left alone
      >>> setup_devices(0)
      Traceback (most recent call last):
      meshensemble.errors.UsageError: --fake-devices 0 must be a positive integer
    """
    if fake_devices is None:
        return
    if fake_devices < 1:
        raise UsageError(f"--fake-devices {fake_devices} must be a positive integer")
    from meshensemble.core.mesh import use_fake_cpu_devices

    use_fake_cpu_devices(fake_devices)


def add_fake_devices_flag(p: argparse.ArgumentParser, group: str | None = None) -> None:
    """Adds ``--fake-devices N`` (in the ``--help`` group ``group``, when given).

    Example:
      >>> parser = Parser(prog="meshensemble bench")
      >>> add_fake_devices_flag(parser)
      >>> parser.parse_args(["--fake-devices", "8"]).fake_devices
      8
    """
    (argument_group(p, group) if group else p).add_argument(
        "--fake-devices", type=int, metavar="N", help="N simulated CPU devices (CPU platform)"
    )


def add_distributed_flags(p: argparse.ArgumentParser, group: str | None = None) -> None:
    """Adds the flags that run a command as one process of many.

    Args:
      p: a subcommand's parser.
      group: the ``--help`` group to list them in (default: the parser's own list).

    Example:
      >>> parser = Parser(prog="meshensemble train")
      >>> add_distributed_flags(parser)
      >>> parser.parse_args(["--coordinator", "10.0.0.1:1234"]).coordinator
      '10.0.0.1:1234'
    """
    add = (argument_group(p, group) if group else p).add_argument
    add("--coordinator", metavar="HOST:PORT", help="process 0's coordinator (multi-process)")
    add("--num-processes", type=int, metavar="N", help="number of processes")
    add("--process-id", type=int, metavar="I", help="this process's id in [0, N)")
    add(
        "--heartbeat-timeout",
        type=int,
        default=None,
        metavar="S",
        help="seconds before a silent peer counts as dead (default 10)",
    )
    add(
        "--init-timeout",
        type=int,
        default=None,
        metavar="S",
        help=(
            "seconds to wait at start-up for every process to join (default "
            "$MESHENSEMBLE_INIT_TIMEOUT, else 300)"
        ),
    )
    add(
        "--distributed-auto",
        action="store_true",
        help="let JAX detect the cluster (TPU pod, SLURM) and initialise from it",
    )


DISTRIBUTED_FLAGS = (
    "--coordinator",
    "--num-processes",
    "--process-id",
    "--heartbeat-timeout",
    "--init-timeout",
    "--distributed-auto",
)
"""The flags :func:`add_distributed_flags` adds."""


def setup_distributed(args: argparse.Namespace) -> None:
    """Starts the multi-process runtime from ``--coordinator`` etc. or the environment.

    Args:
      args: parsed arguments with the flags of :func:`add_distributed_flags`.

    Raises:
      UsageError: an incomplete or inconsistent set of values.

    Example:
      >>> parser = Parser(prog="meshensemble train")
      >>> add_distributed_flags(parser)
      >>> setup_distributed(parser.parse_args([]))   # no coordinator: one process, no-op
    """
    from meshensemble.runtime import distributed

    try:
        distributed.initialize(
            args.coordinator,
            args.num_processes,
            args.process_id,
            args.heartbeat_timeout or distributed.DEFAULT_HEARTBEAT_TIMEOUT,
            auto=args.distributed_auto,
            init_timeout=getattr(args, "init_timeout", None),
        )
    except ValueError as err:
        raise UsageError(str(err)) from None


def lost_peer(err: BaseException) -> str:
    """One line about a failed multi-process collective, naming the lost process if known.

    Args:
      err: the exception raised in the survivor.

    Returns:
      A one-line description.

    Example:
      >>> lost_peer(RuntimeError("... /job:jax_worker/replica:0/task:1 ..."))
      'lost contact with process 1 (RuntimeError: ...); the run stopped, resume it ...'
    """
    text = str(err)
    found = sorted({int(m) for m in re.findall(r"task[:_ ]\s*(\d+)", text, re.IGNORECASE)})
    who = f"process {', '.join(map(str, found))}" if found else "a peer process"
    first = text.strip().splitlines()[0][:160] if text.strip() else type(err).__name__
    if "GetKeyValue() timed out" in text or "Gloo context initialization failed" in text:
        return (
            f"{who} did not reach a collective in time ({type(err).__name__}: {first}); "
            "gloo waits about a minute for its peers' keys: on a loaded machine start the "
            "processes when it is quieter, or use fewer of them"
        )
    return (
        f"lost contact with {who} ({type(err).__name__}: {first}); the run stopped, "
        "resume it from the last checkpoint once all processes are back"
    )
