"""``time_to_accuracy``: a training run's wall time to a test accuracy, cold and warm.

Each run is a fresh Python process (``python -c``) that imports JAX and the library and
calls :func:`meshensemble.training.train` with a fixed config (the bench's model,
members, batch size and data; checkpoints off), timing from the start of ``train()`` to
the end of the first epoch whose test ensemble accuracy reaches ``--target-accuracy``
(the evaluation included; training stops there). Compilation is included: the run
enables JAX's persistent compilation cache in a folder of its own
(:func:`meshensemble.runtime.compilation.enable_compilation_cache`) and wraps ``train()``
in a :class:`meshensemble.runtime.compilation.CompileLog`. The first run (**cold**) starts
from an empty cache folder; the second (**warm**) is the same command on the same
folder, so it loads its programs instead of compiling them.

The process-start overhead is reported apart, from time stamps taken inside the child:
interpreter start (from the parent's launch to the child's first line), ``import jax``,
device initialisation (``jax.devices()``), ``import meshensemble``.

The runs go before every other case, while the parent process has not started its own
accelerator backend (on a GPU it would take most of the memory the child needs).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import jax

from meshensemble import data
from meshensemble.bench.config import BenchConfig
from meshensemble.runtime import storage
from meshensemble.runtime.compilation import CompileLog, enable_compilation_cache
from meshensemble.training import METRICS_FILE, TrainConfig, train

MARKER = "MESHENSEMBLE_TIME_TO_ACCURACY "
"""Prefix of the child's one line of JSON on stdout."""

TIMEOUT_S = 3600.0
"""The most seconds one child run may take."""

CHILD_CODE = """\
import time; t0 = time.time()
import json, sys
args = json.loads(sys.argv[1])
import jax; t1 = time.time()
if args["platforms"]: jax.config.update("jax_platforms", args["platforms"])
if args["num_cpu_devices"] > 0: jax.config.update("jax_num_cpu_devices", args["num_cpu_devices"])
jax.devices(); t2 = time.time()
import meshensemble; t3 = time.time()
from meshensemble.bench.accuracy import run_child
run_child(args, [t0, t1, t2, t3])
"""
"""What ``python -c`` runs: time stamps around the imports and device start, then
:func:`run_child`."""

_MODELS = {"cnn": "cnn", "mlp": "mlp", "mlp32": "mlp"}


class _Reached(Exception):
    """Raised from ``train()``'s echo to stop at the first epoch end on target."""


def train_config(cfg: BenchConfig, data_file: str, dataset: str, workdir: str) -> dict[str, Any]:
    """The :class:`meshensemble.TrainConfig` fields of a time-to-accuracy run.

    Args:
      cfg: the bench config (model, members, batch size, seed, ``accuracy_epochs``).
      data_file: the Keras-layout ``.npz`` to train on.
      dataset: its dataset name (``"mnist"``).
      workdir: the run's (fresh) workdir.

    Returns:
      The fields: the bench's model (``MLP((128,))`` for the tiny configuration's
      ``MLP((32,))``, which the registry lacks), members and batch size, the library's
      defaults otherwise (SGD 0.1 with momentum 0.9, the platform's chunk size), no
      checkpoints, quiet.

    Example:
      >>> run = TrainConfig(**train_config(cfg, "mnist.npz", "mnist", "runs/tta"))
      >>> run.model, run.members, run.epochs, run.checkpoint
      ('mlp', 4, 2, False)
    """
    return {
        "dataset": dataset,
        "source": "npz",
        "data_file": data_file,
        "model": _MODELS[cfg.model],
        "members": cfg.members,
        "batch_size": cfg.batch_size,
        "epochs": cfg.accuracy_epochs,
        "seed": cfg.seed,
        "workdir": workdir,
        "checkpoint": False,
        "overwrite": True,
        "quiet": True,
    }


def time_to_accuracy(
    cfg: BenchConfig, dataset: data.Dataset, say: Callable[[str], None]
) -> dict[str, Any]:
    """Runs the cold and the warm time-to-accuracy processes and summarises them.

    Args:
      cfg: the bench config (``target_accuracy``, ``accuracy_epochs``, model, members,
        batch size, ``data_file``).
      dataset: the bench's data (written to a temporary ``.npz`` for the children unless
        it is ``cfg.data_file`` as given).
      say: where progress lines go.

    Returns:
      ``target_accuracy``, ``train_config`` (without the temporary paths), ``data``,
      ``cold`` and ``warm`` (see :func:`summarise`), and ``warm_over_cold_compile`` (warm
      compile seconds over cold; None when either is missing).

    Example:
      >>> time_to_accuracy(cfg, load_data(cfg, print), print)["cold"]  # doctest: +SKIP
    """
    root = tempfile.mkdtemp(prefix="meshensemble-bench-tta-")
    try:
        if cfg.data_file and not cfg.tiny:
            data_file = storage.absolute(cfg.data_file)
        else:
            data_file = os.path.join(root, "data.npz")
            data.save_npz(dataset, data_file)
        name = dataset.name if dataset.name in data.DATASETS else "mnist"
        cache = os.path.join(root, "compilation_cache")
        runs = {}
        for run in ("cold", "warm"):
            fields = train_config(cfg, data_file, name, os.path.join(root, f"workdir_{run}"))
            runs[run] = launch(fields, cfg.target_accuracy, cache)
            say(f"  time_to_accuracy {run}: {describe(runs[run])}")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    shown = {k: v for k, v in fields.items() if k not in ("data_file", "workdir")}
    cold, warm = runs["cold"].get("compile_s"), runs["warm"].get("compile_s")
    return {
        "target_accuracy": cfg.target_accuracy,
        "train_config": shown,
        "data": {"note": dataset.note, "num_train": dataset.num_train},
        "cold": runs["cold"],
        "warm": runs["warm"],
        "warm_over_cold_compile": warm / cold if cold and warm is not None else None,
    }


def launch(fields: Mapping[str, Any], target: float, cache_dir: str) -> dict[str, Any]:
    """One child process: trains to ``target`` and returns its summary.

    The child gets this process's device settings (``jax_platforms``,
    ``jax_num_cpu_devices``: the fake CPU devices of ``--fake-devices``), none on a GPU.

    Args:
      fields: the :class:`meshensemble.TrainConfig` fields.
      target: the test ensemble accuracy to reach.
      cache_dir: the compilation cache folder.

    Returns:
      :func:`summarise` of the child's report, or ``{"error": ...}`` (with the child's
      exit code and the last lines of its stderr) when it failed.

    Example:
      >>> launch(train_config(cfg, "mnist.npz", "mnist", "w"), 0.99, "cache")  # doctest: +SKIP
    """
    args = {
        # the run's own cache folder, whatever $JAX_COMPILATION_CACHE_DIR says
        "train": {**fields, "compile_cache_dir": cache_dir},
        "target": target,
        "cache_dir": cache_dir,
        "platforms": jax.config.jax_platforms or "",
        "num_cpu_devices": int(jax.config.jax_num_cpu_devices),
    }
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-c", CHILD_CODE, json.dumps(args)]
    launched = time.time()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {TIMEOUT_S:.0f}s", "returncode": None}
    ended = time.time()
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(MARKER)]
    if proc.returncode != 0 or not lines:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        return {"error": tail or "no result printed", "returncode": proc.returncode}
    report = json.loads(lines[-1][len(MARKER) :])
    return summarise(report, launched, ended)


def summarise(report: Mapping[str, Any], launched: float, ended: float) -> dict[str, Any]:
    """A child's report as seconds.

    Args:
      report: what :func:`run_child` printed.
      launched: ``time.time()`` just before the parent started the child.
      ended: ``time.time()`` when the child had exited.

    Returns:
      ``reached``, ``epoch``, ``step``, ``accuracy`` (at the first epoch on target, else
      the last), ``epochs`` (every evaluation: epoch, step, accuracy, seconds since
      ``train()`` started), ``time_to_accuracy_s`` (launch to that epoch end: everything),
      ``train_to_accuracy_s`` (``train()``'s start to that epoch end), ``process_start``
      (``interpreter_s``, ``import_jax_s``, ``device_init_s``,
      ``import_meshensemble_s``, ``total_s``), ``setup_s`` (from ``import meshensemble``
      to ``train()``: the bench's module and the cache), ``compile_s``, ``programs``,
      ``cache_hits``, ``cache_misses``, ``by_program`` (the run's own programs in the
      compile log until that epoch end), ``tuning_programs`` and ``tuning_compile_s``
      (the candidates the auto-tuner compiled: 0 once its choice is cached),
      ``process_wall_s``, and the child's ``platform``, ``device_kind``,
      ``device_count``, ``cache_enabled``.

    Example:
      >>> report = {"stamps": [0.5, 1.5, 2.0, 2.5], "train_start": 3.0, "reached": True,
      ...     "reached_at": 9.0, "epochs": [{"epoch": 1, "step": 32, "accuracy": 0.6,
      ...     "seconds": 6.0}], "platform": "cpu", "device_kind": "cpu", "device_count": 8,
      ...     "cache_dir": None, "compile": {"seconds": 2.0, "programs": 5, "cache_hits": 0,
      ...     "cache_misses": 5, "by_program": {}, "tuning": {"programs": 0, "seconds": 0.0}}}
      >>> run = summarise(report, launched=0.0, ended=10.0)
      >>> run["time_to_accuracy_s"], run["process_start"]["total_s"], run["setup_s"]
      (9.0, 2.5, 0.5)
    """
    t0, t_jax, t_dev, t_me = report["stamps"]
    t_train = report["train_start"]
    done = report["reached_at"] if report["reached"] else None
    last = report["epochs"][-1] if report["epochs"] else {}
    compile_log = report["compile"]
    return {
        "reached": report["reached"],
        **{key: last.get(key) for key in ("epoch", "step", "accuracy")},
        "epochs": report["epochs"],
        "time_to_accuracy_s": done - launched if done else None,
        "train_to_accuracy_s": done - t_train if done else None,
        "process_start": {
            "interpreter_s": t0 - launched,
            "import_jax_s": t_jax - t0,
            "device_init_s": t_dev - t_jax,
            "import_meshensemble_s": t_me - t_dev,
            "total_s": t_me - launched,
        },
        "setup_s": t_train - t_me,
        "compile_s": compile_log["seconds"],
        **{k: compile_log[k] for k in ("programs", "cache_hits", "cache_misses", "by_program")},
        "tuning_programs": compile_log["tuning"]["programs"],
        "tuning_compile_s": compile_log["tuning"]["seconds"],
        "process_wall_s": ended - launched,
        **{key: report[key] for key in ("platform", "device_kind", "device_count")},
        "cache_enabled": report["cache_dir"] is not None,
    }


def describe(run: Mapping[str, Any]) -> str:
    """One line about a run, for the progress output and the table.

    Args:
      run: a :func:`summarise` result (or an error).

    Returns:
      E.g. ``"99.31% at epoch 5 in 21.3s (train 18.0s, process start 3.3s, compile 3.1s,
      7 programs, cache 0 hits / 7 misses)"``.

    Example:
      >>> describe({"error": "Traceback ...\\nValueError: bad data", "returncode": 1})
      "failed (exit 1): ['ValueError: bad data']"
    """
    if "error" in run:
        return f"failed (exit {run.get('returncode')}): {run['error'].splitlines()[-1:]}"
    what = (
        f"{100 * run['accuracy']:.2f}% at epoch {run['epoch']} in "
        f"{run['time_to_accuracy_s']:.1f}s (train {run['train_to_accuracy_s']:.1f}s"
        if run["reached"]
        else f"target not reached: {100 * (run['accuracy'] or 0):.2f}% after epoch "
        f"{run['epoch']} (train {run['epochs'][-1]['seconds'] if run['epochs'] else 0:.1f}s"
    )
    tuned = run["tuning_programs"]
    tuning = (
        f"; the auto-tuner compiled {tuned} more in {run['tuning_compile_s']:.1f}s" if tuned else ""
    )
    return (
        f"{what}, process start {run['process_start']['total_s']:.1f}s, compile "
        f"{run['compile_s']:.1f}s, {run['programs']} programs, cache {run['cache_hits']} hits / "
        f"{run['cache_misses']} misses{tuning})"
    )


def run_child(args: Mapping[str, Any], stamps: list[float]) -> None:
    """The child's part: trains to the target and prints one line of JSON.

    Enables the compilation cache in ``args["cache_dir"]``, then runs
    :func:`meshensemble.training.train` inside a
    :class:`~meshensemble.runtime.compilation.CompileLog`. After each evaluation (read back
    from the run's ``metrics.jsonl`` when ``train()`` reports it) it notes the time; at
    the first on target it stops training.

    Args:
      args: ``train`` (the TrainConfig fields), ``target``, ``cache_dir``.
      stamps: ``time.time()`` at the child's start, after ``import jax``, after
        ``jax.devices()``, after ``import meshensemble``.

    Example (in the child process, see ``CHILD_CODE``):
      >>> run_child(args, [t0, t1, t2, t3])  # doctest: +SKIP
    """
    cache = enable_compilation_cache(args["cache_dir"])
    cfg = TrainConfig(**args["train"])
    metrics = storage.join(cfg.workdir, METRICS_FILE)
    target = float(args["target"])
    epochs: list[dict[str, Any]] = []
    result: dict[str, Any] = {"reached": False, "reached_at": None}
    log = CompileLog()

    def echo(line: str) -> None:
        del line  # the records are read from metrics.jsonl, not parsed from lines
        now = time.time()
        records = _records(metrics)
        for r in records[len(epochs) :]:
            acc = float(r["test_ensemble_accuracy"])
            epochs.append(
                {"epoch": r["epoch"], "step": r["step"], "accuracy": acc, "seconds": now - t_train}
            )
            if acc >= target and not result["reached"]:
                result.update(reached=True, reached_at=now, compile=log.summary())
                raise _Reached

    with log:
        t_train = time.time()
        with contextlib.suppress(_Reached):  # stopped at the first epoch on target
            train(cfg, echo=echo)
    devices = jax.devices()
    report = {
        "stamps": stamps,
        "train_start": t_train,
        "epochs": epochs,
        "compile": result.pop("compile", None) or log.summary(),
        **result,
        "cache_dir": cache,
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
    }
    print(MARKER + json.dumps(report), flush=True)


def _records(path: str) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in storage.read_text(path).splitlines() if line.strip()]
    except (OSError, ValueError):
        return []
