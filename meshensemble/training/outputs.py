"""A run's outputs: the workdir checks, its files, and what a person reads while it runs.

:class:`RunWriter` writes ``config.json``, ``metrics.jsonl``, TensorBoard events and the
task's figures (process 0 only); a failed write raises :class:`OutputError`, one line
naming the file. :class:`Progress` shows the live loss (the task formats the records).

Example:
  >>> check_writable("runs/mnist")            # None: the folder can be made
  >>> writer = RunWriter("runs/mnist")
  >>> writer.write_metrics({"step": 469, "epoch": 1, "test_ensemble_nll": float("nan")})
  >>> line = open("runs/mnist/metrics.jsonl").readline()   # strict JSON: NaN is null
  >>> json.loads(line)["test_ensemble_nll"], json.loads(line)["nonfinite"]
  (None, {'test_ensemble_nll': 'NaN'})
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import numpy as np

from meshensemble.errors import RunFailedError
from meshensemble.runtime import storage
from meshensemble.training.checkpoint import CHECKPOINT_DIR, list_checkpoints
from meshensemble.training.config import CONFIG_FILE, METRICS_FILE

TENSORBOARD_DIR = "tensorboard"
COMPILE_FILE = "compile.json"
"""The run's compile report in its workdir: the summary of a
:class:`meshensemble.runtime.compilation.CompileLog` (``programs``, ``seconds``,
``cache_hits``, ``cache_misses``, ``by_program``: the run's own programs; ``tuning``: the
candidates the auto-tuner compiled, at its first use only) of this command."""
"""Folder of the TensorBoard event files under the workdir."""


EVALUATION_FILE = "evaluation.json"
"""What ``meshensemble evaluate`` writes into a run's folder (its scores and calibration)."""
OUTPUTS_FILE = "outputs.json"
"""The list of every other file the run's commands wrote into its folder (figures, a
``predict --out`` or ``export --out`` inside it): what ``train --overwrite`` removes."""
OLDER_OUTPUTS = (
    "learning_curves.png", "members.png", "regression.png", "reliability_diagram.png",
    "ood_histogram.png", "calibration.png",
)  # fmt: skip
"""Figures runs wrote before :data:`OUTPUTS_FILE` listed them (removed with them)."""


NONFINITE_NOTE = "nonfinite"
"""Key of the note a strict JSON object carries when values were NaN/inf: ``{path:
"NaN" | "Infinity" | "-Infinity"}`` for each value written as ``null`` (a path is the keys
and list indices down to it, joined by ``/``, e.g. ``"test_member_nll/2"``)."""


class OutputError(RunFailedError):
    """An output file could not be written (disk full, read-only, a folder in the way)."""


def strict_json(value: Any) -> Any:
    """``value`` with every NaN/inf float written as None and noted: strict JSON.

    Python's ``json`` writes bare ``NaN``/``Infinity`` tokens that strict parsers (and
    ``json.loads(s, parse_constant=...)`` raising) reject. Each non-finite float in
    ``value`` (python or numpy floats, in dicts, lists and tuples) becomes None; a dict at
    the top gets the note :data:`NONFINITE_NOTE` naming them, so a reader can tell
    "not a number" from "missing" and :func:`restore_nonfinite` can undo it.

    Args:
      value: a JSON-able value (numpy scalars and arrays are converted).

    Returns:
      A JSON-able value with no non-finite float, to dump with ``allow_nan=False``.

    Example:
      >>> strict_json({"nll": float("nan"), "acc": [0.5, float("inf")]})
      {'nll': None, 'acc': [0.5, None], 'nonfinite': {'nll': 'NaN', 'acc/1': 'Infinity'}}
    """
    found: dict[str, str] = {}

    def walk(v: Any, path: str) -> Any:
        if isinstance(v, dict):
            return {k: walk(x, f"{path}/{k}" if path else str(k)) for k, x in v.items()}
        if isinstance(v, list | tuple | np.ndarray):
            return [walk(x, f"{path}/{i}" if path else str(i)) for i, x in enumerate(v)]
        if isinstance(v, np.generic):
            v = v.item()
        if isinstance(v, float) and not np.isfinite(v):
            found[path] = "NaN" if np.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
            return None
        return v

    out = walk(value, "")
    if found and isinstance(out, dict):
        out[NONFINITE_NOTE] = found
    return out


def restore_nonfinite(record: dict[str, Any]) -> dict[str, Any]:
    """Undoes :func:`strict_json` on a dict read back: the noted None become NaN/inf again.

    Args:
      record: a dict parsed from strict JSON (it is not changed).

    Returns:
      The dict without the note, its noted values as floats.

    Example:
      >>> restore_nonfinite({"nll": None, "nonfinite": {"nll": "NaN"}})
      {'nll': nan}
    """
    record = dict(record)
    note = record.pop(NONFINITE_NOTE, None) or {}
    for path, text in note.items():
        *parents, last = path.split("/")
        node: Any = record
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[int(last) if isinstance(node, list) else last] = float(text)
    return record


def dumps_strict(value: Any, **kwargs: Any) -> str:
    """``json.dumps`` of :func:`strict_json` ``(value)``: never a bare NaN/Infinity token.

    Example:
      >>> dumps_strict({"nll": float("nan")})
      '{"nll": null, "nonfinite": {"nll": "NaN"}}'
    """
    return json.dumps(strict_json(value), allow_nan=False, **kwargs)


@contextlib.contextmanager
def writing(path: str, after: str = "") -> Iterator[None]:
    """Turns an ``OSError`` while writing ``path`` into one line naming it.

    Args:
      path: the file being written.
      after: what is still fine, appended to the message (e.g. the checkpoint is saved).

    Raises:
      OutputError: ``could not write PATH: REASON; ...``.

    Example:
      >>> with writing("runs/mnist/evaluation.json"):   # no such folder: one clear error
      ...     open("runs/mnist/evaluation.json", "w").write("{}")
      Traceback (most recent call last):
      ...
      meshensemble.training.outputs.OutputError: could not write runs/mnist/evaluation.json: ...
    """
    try:
        yield
    except OSError as err:
        reason = err.strerror or str(err) or type(err).__name__
        raise OutputError(
            f"could not write {path}: {reason}; free the disk or fix the permissions"
            f"{after}, then run the command again"
        ) from None


def check_writable(
    workdir: str, what: str = "pass a writable --workdir", name: str = "workdir"
) -> None:
    """Checks that ``workdir`` can be written, without creating it.

    An existing folder gets a probe file written and removed; for a folder that does not
    exist yet, its nearest existing parent is probed.

    Args:
      workdir: the run's folder (or any folder to write in).
      what: the fix to name in the message.
      name: what the folder is, first in the message (e.g. ``"--out"``).

    Raises:
      ValueError: ``NAME W is not writable (REASON); FIX``.

    Example:
      >>> check_writable("runs/mnist")   # None: it can be made here
    """
    if not storage.is_local(workdir):  # a bucket: no folder to probe; a failed write names it
        return
    target = os.path.abspath(workdir)
    while not os.path.exists(target):
        parent = os.path.dirname(target)
        if parent == target:
            break
        target = parent
    try:
        if not os.path.isdir(target):
            raise NotADirectoryError(20, "Not a directory", target)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=target)
        os.close(fd)
        os.remove(probe)
    except OSError as err:
        reason = err.strerror or str(err)
        where = "" if target == os.path.abspath(workdir) else f": {target}"
        raise ValueError(f"{name} {workdir} is not writable ({reason}{where}); {what}") from None


@contextlib.contextmanager
def replacing(path: str) -> Iterator[Any]:
    """A text file to write that replaces ``path`` atomically when the block ends.

    The block writes into memory; when it ends the text is written with
    :func:`meshensemble.runtime.storage.atomic_write` (a temporary file renamed into place
    locally, one object on a bucket), and not at all if the block fails, so a reader or a
    crash never sees half a file.

    Args:
      path: the file to replace (local, or ``gs://...``).

    Yields:
      A text buffer to write into.

    Example:
      >>> os.makedirs("runs/mnist")
      >>> with replacing("runs/mnist/config.json") as f:
      ...     json.dump({"epochs": 1}, f)
      >>> os.listdir("runs/mnist")         # written whole, then renamed into place
      ['config.json']
    """
    buffer = io.StringIO()
    yield buffer
    storage.atomic_write(path, buffer.getvalue())


def _write_strict(path: str, value: Any) -> None:
    """Writes ``value`` as indented strict JSON, replacing ``path`` atomically (NaN as null,
    noted); a failed write raises :class:`OutputError` naming the file."""
    text = dumps_strict(value, indent=2)
    with writing(path), replacing(path) as f:
        f.write(text)


def _draw(workdir: str, figures: dict[str, Callable[[str], None]], after: str = "") -> None:
    """Draws each ``{file name: draw(path)}`` in ``workdir``, listed in :data:`OUTPUTS_FILE`."""
    for name, draw in figures.items():
        path = storage.join(workdir, name)
        with writing(path, after):
            draw(path)
        note_output(workdir, path)


def note_output(workdir: str, path: str) -> None:
    """Adds ``path`` to the run's :data:`OUTPUTS_FILE` when it lies inside ``workdir``.

    Args:
      workdir: the run's folder; path: a file a command wrote (process 0 calls this).

    Example:
      >>> os.makedirs("runs/x")
      >>> note_output("runs/x", "runs/x/preds.npz"); note_output("runs/x", "/tmp/elsewhere")
      >>> json.load(open("runs/x/outputs.json"))
      ['preds.npz']
    """
    top, full = storage.absolute(workdir).rstrip("/") + "/", storage.absolute(path)
    if not full.startswith(top) or not storage.isdir(workdir):
        return
    listing, held = storage.join(workdir, OUTPUTS_FILE), _listed(workdir)
    if full[len(top) :] not in held:
        with writing(listing):
            storage.atomic_write_json(listing, [*held, full[len(top) :]])


def _listed(workdir: str) -> list[str]:
    """The files :data:`OUTPUTS_FILE` lists (none when it is missing or unreadable)."""
    try:
        return [str(v) for v in storage.read_json(storage.join(workdir, OUTPUTS_FILE))]
    except (OSError, ValueError, TypeError):
        return []


def clear_run(workdir: str) -> None:
    """Deletes every output of the run in ``workdir`` (for ``overwrite``); other files stay.

    Its config, metrics, compile log, checkpoints, TensorBoard events, ``evaluation.json``,
    and every file :data:`OUTPUTS_FILE` lists (figures, predictions or exports written
    inside the folder), and the figures older runs wrote before that list existed.

    Example:
      >>> os.makedirs("runs/mnist/checkpoints/469")
      >>> clear_run("runs/mnist")
      >>> os.listdir("runs/mnist")
      []
    """
    names = (CONFIG_FILE, METRICS_FILE, COMPILE_FILE, EVALUATION_FILE, *OLDER_OUTPUTS)
    for name in (CHECKPOINT_DIR, TENSORBOARD_DIR, *names, *_listed(workdir), OUTPUTS_FILE):
        path = storage.join(workdir, name)
        if storage.isdir(path):
            storage.rmtree(path)
        elif storage.exists(path):
            storage.remove(path)


@contextlib.contextmanager
def unfinished_run(workdir: str, fresh: bool, enabled: bool = True) -> Iterator[None]:
    """Removes what a fresh run wrote when it fails before its first checkpoint.

    A run that fails after writing ``config.json`` but before any checkpoint has nothing
    to resume from, and its files would make the next ``train`` in that workdir refuse
    ("holds a run but no checkpoint"), so they go: :func:`clear_run`'s files (config,
    metrics, compile log, plots, ``checkpoints/``, ``tensorboard/``) and the workdir itself
    when the run made it and it is left empty. Files the run did not write stay. A resumed
    run (``fresh=False``) and a run that saved a checkpoint keep everything. The error is
    re-raised unchanged.

    Args:
      workdir: the run's folder.
      fresh: True for a new run (not a resume).
      enabled: False in processes other than 0 (they write nothing).

    Example:
      >>> def train_the_run():
      ...     RunWriter("runs/mnist").write_metrics({"step": 0})
      ...     raise RuntimeError("out of memory")
      >>> with unfinished_run("runs/mnist", fresh=True):
      ...     train_the_run()  # fails before its first checkpoint: no config.json is left
      Traceback (most recent call last):
      ...
      RuntimeError: out of memory
      >>> os.path.exists("runs/mnist")   # the folder it made is gone
      False
    """
    created = not storage.exists(workdir)
    try:
        yield
    except BaseException:
        if fresh and enabled and not list_checkpoints(workdir):
            clear_run(workdir)
            if created and storage.isdir(workdir) and not storage.listdir(workdir):
                storage.rmtree(workdir)
        raise


class RunWriter:
    """Writes a run's config, ``metrics.jsonl``, TensorBoard events and plots (process 0).

    Args:
      workdir: the run's folder (created).
      enabled: False in processes other than 0.
      tensorboard: also write TensorBoard event files (with ``tensorboardX``).
      keep_until: when resuming, the restored step: records after it are dropped from
        ``metrics.jsonl`` so no evaluation appears twice.

    Raises:
      OutputError: a file could not be written.
      ValueError: ``tensorboard`` without ``tensorboardX`` installed.

    Example:
      >>> first = RunWriter("runs/mnist")
      >>> for step in (469, 938):
      ...     first.write_metrics({"step": step})
      >>> writer = RunWriter("runs/mnist", keep_until=469)   # resumed from checkpoint 469
      >>> writer.history[-1]["step"]
      469
    """

    def __init__(
        self,
        workdir: str,
        enabled: bool = True,
        tensorboard: bool = False,
        keep_until: int | None = None,
    ):
        self.workdir = workdir
        self.enabled = enabled
        self.tb = None
        self.history: list[dict[str, Any]] = []
        self.metrics_path = storage.join(workdir, METRICS_FILE)
        if keep_until is not None and storage.exists(self.metrics_path):
            lines = storage.read_text(self.metrics_path).splitlines()
            records = [restore_nonfinite(json.loads(line)) for line in lines if line.strip()]
            self.history = [r for r in records if r["step"] <= keep_until]
        self.lines = [dumps_strict(r) + "\n" for r in self.history]  # metrics.jsonl, whole
        if not enabled:
            return
        with writing(self.metrics_path):
            storage.makedirs(workdir)
            storage.atomic_write(self.metrics_path, "".join(self.lines))  # cut to the restored step
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError as err:
                raise ValueError(
                    "--tensorboard needs tensorboardX; pip install tensorboardX"
                ) from err
            path = storage.join(workdir, TENSORBOARD_DIR)
            with writing(path):
                self.tb = SummaryWriter(path)

    def write_config(self, cfg: Any, resolved: dict[str, Any]) -> None:
        """Writes ``config.json``: every field of ``cfg`` and the ``resolved`` entry.

        ``data_file`` and ``data_dir`` are written as absolute paths, so a resume from
        another working directory finds the data.

        Args:
          cfg: the run's :class:`~meshensemble.training.TrainConfig`.
          resolved: what the run decided (mesh, chunk steps, data identity...).
        """
        if not self.enabled:
            return
        fields = dataclasses.asdict(cfg)
        for name in ("data_file", "data_dir"):
            if isinstance(fields.get(name), str) and "://" not in fields[name]:
                fields[name] = storage.absolute(fields[name])
        _write_strict(storage.join(self.workdir, CONFIG_FILE), fields | {"resolved": resolved})

    def write_compile(self, summary: dict[str, Any]) -> None:
        """Writes :data:`COMPILE_FILE`: what this command compiled (replaced by each command).

        Args:
          summary: :meth:`meshensemble.runtime.compilation.CompileLog.summary`.
        """
        if not self.enabled:
            return
        _write_strict(storage.join(self.workdir, COMPILE_FILE), summary)

    def write_metrics(self, record: dict[str, Any]) -> None:
        """Appends one record to ``metrics.jsonl`` (and its scalars to TensorBoard).

        The line is strict JSON: a NaN/inf value is written as ``null`` and named in the
        record's :data:`NONFINITE_NOTE` (see :func:`strict_json`). An object store cannot
        append, so the whole (small) file is rewritten with
        :func:`~meshensemble.runtime.storage.atomic_write` on every store: a reader sees
        the file as one of these calls left it, every line whole, never a part of a line.
        """
        if not self.enabled:
            return
        self.lines.append(dumps_strict(record) + "\n")
        with writing(self.metrics_path):
            storage.atomic_write(self.metrics_path, "".join(self.lines))
        if self.tb is not None:
            for name, value in record.items():
                if isinstance(value, float):
                    self.tb.add_scalar(name, value, record["step"])
            self.tb.flush()

    def figures(self, drawn: dict[str, Callable[[str], None]]) -> None:
        """Draws each ``{file name: draw(path)}`` in the workdir, listed in :data:`OUTPUTS_FILE`."""
        if not self.enabled:
            return
        _draw(self.workdir, drawn, " (the trained checkpoint and metrics.jsonl are saved)")

    def close(self) -> None:
        """Closes the TensorBoard writer."""
        if self.tb is not None:
            self.tb.close()


def write_evaluation(
    workdir: str, result: dict[str, Any], figures: dict[str, Callable[[str], None]]
) -> None:
    """Writes :data:`EVALUATION_FILE` (strict JSON, replaced atomically) and the figures.

    What ``evaluate`` writes, and a run that calibrates itself at its end (process 0 only).

    Args:
      workdir: the run's folder; result: the scores (and ``calibration``);
      figures: ``{file name: draw(path)}``, listed in :data:`OUTPUTS_FILE`.

    Raises:
      OutputError: a file could not be written.

    Example:
      >>> os.makedirs("runs/new")
      >>> write_evaluation("runs/new", {"task": "classification"}, {})
      >>> json.load(open("runs/new/evaluation.json"))
      {'task': 'classification'}
    """
    _write_strict(storage.join(workdir, EVALUATION_FILE), result)
    _draw(workdir, figures)


class Progress:
    """Live progress: a tqdm bar with the loss on a terminal, else a plain line per tenth.

    Args:
      say: where plain lines go.
      enabled: False prints nothing (quiet runs, processes other than 0).

    Example:
      >>> progress = Progress(print, enabled=True)
      >>> progress.start(epoch=1, epochs=10, total=469)
      >>> metrics = {"loss": jnp.array([2.3, 2.2])}
      >>> progress.update(1, metrics); progress.close()
    """

    def __init__(self, say: Callable[[str], None], enabled: bool):
        self.say = say
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.bar: Any = None
        self._last: jax.Array | None = None
        self._plain: tuple[int, int, int, float] | None = None  # epoch, done, total, t0
        self._base = 0

    @property
    def started(self) -> bool:
        """Whether an epoch's progress is showing."""
        return self.bar is not None

    def start(self, epoch: int, epochs: int, total: int, initial: int = 0) -> None:
        """Starts an epoch's bar at step ``initial`` of ``total``."""
        if not self.enabled:
            return
        if self.tty:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=total, initial=initial, desc=f"epoch {epoch}/{epochs}", leave=False
            )
        else:
            self.bar = True  # started
            self._plain = (epoch, initial, total, 0.0)
            self._base = initial

    def _loss(self) -> str:
        if self._last is None:
            return "n/a"
        # the chunk's last step, taken on the host (indexing on device compiles a program)
        local = [np.asarray(s.data)[-1] for s in self._last.addressable_shards]
        return f"{float(np.mean(local)):.4f}"

    def update(self, n: int, metrics: dict[str, jax.Array]) -> None:
        """Counts ``n`` steps; shows the loss of a step that has finished (never waits)."""
        if self.bar is None:
            return
        if self._plain is not None:
            epoch, done, total, t0 = self._plain
            if not t0:  # the first chunk includes compilation: rates count from its end
                t0, self._base = time.perf_counter(), done + n
            tenth = max(1, total // 10)  # epochs of fewer than 10 steps: their lines only
            if total >= 10 and (done + n) // tenth > done // tenth and done + n < total:
                rate = (done + n - self._base) / max(time.perf_counter() - t0, 1e-9)
                self.say(
                    f"  epoch {epoch}: step {done + n}/{total}, member loss {self._loss()}, "
                    f"{rate:.1f} steps/s"
                )
            self._plain = (epoch, done + n, total, t0)
        else:
            self.bar.update(n)
            if self._last is not None and self.bar.n % 5 < n:  # a step that has finished
                self.bar.set_postfix(loss=self._loss())
        self._last = metrics["loss"]

    def close(self) -> None:
        """Ends the epoch's bar."""
        if self.bar is not None and self.bar is not True:
            self.bar.close()
        self.bar = None
        self._plain = None
