"""Multi-host: start JAX's multi-controller runtime, report the topology, fetch global values.

Every process runs the same program and sees the global mesh; each feeds only its own
devices. On TPU pods, GPU clusters under SLURM and other detected clusters,
``jax.distributed.initialize()`` finds the coordinator by itself; elsewhere (and for the
local launcher) pass the coordinator, the process count and this process's id, as flags
or through ``MESHENSEMBLE_COORDINATOR``, ``MESHENSEMBLE_NUM_PROCESSES`` and
``MESHENSEMBLE_PROCESS_ID``.

What the public API expects from each process: :meth:`meshensemble.Ensemble.train_step`,
``predict`` and ``evaluate`` take the **global** batch, the same value in every process
(each process copies only the shards its devices hold). To feed only a process's own
part, build the global array first with :meth:`meshensemble.Ensemble.place` and
``local=True``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from meshensemble.errors import RunFailedError, UsageError

log = logging.getLogger("meshensemble")

ENV_COORDINATOR = "MESHENSEMBLE_COORDINATOR"
ENV_NUM_PROCESSES = "MESHENSEMBLE_NUM_PROCESSES"
ENV_PROCESS_ID = "MESHENSEMBLE_PROCESS_ID"
ENV_INIT_TIMEOUT = "MESHENSEMBLE_INIT_TIMEOUT"
"""Environment variable: seconds a process waits for all processes to join at start-up
(``--init-timeout`` overrides it)."""
DEFAULT_INIT_TIMEOUT = 300
"""Seconds a process waits at start-up for every process to reach the coordinator.

Generous on purpose: on a loaded machine a peer can take minutes to import JAX and start
(2 processes on 2 busy cores); a run whose peers never come fails after this long, with
one line naming the coordinator and the timeout."""
INIT_GRACE = 30
"""Seconds the runtime's own start-up deadline is set past ours, so ours fires first (the
runtime aborts the process, SIGABRT and a C++ stack, when its deadline passes)."""
DEFAULT_HEARTBEAT_TIMEOUT = 10
"""Seconds without heartbeats before a peer counts as dead (JAX's own default is 100)."""
SHUTDOWN_TIMEOUT = 300
"""Seconds a process that finished waits at exit for the others to finish too.

A busy machine can put processes tens of seconds apart at the end of a run (process 0
writes the outputs); the command line does not wait for a peer that died (it leaves with
one line at once)."""


@dataclasses.dataclass(frozen=True)
class Topology:
    """Where this process sits among all processes.

    Attributes:
      process_index: this process's id.
      process_count: number of processes.
      local_devices: devices this process drives.
      global_devices: devices of all processes.
      platform: ``"cpu"``, ``"gpu"`` or ``"tpu"``.
    """

    process_index: int
    process_count: int
    local_devices: int
    global_devices: int
    platform: str

    def __str__(self) -> str:
        return (
            f"process {self.process_index}/{self.process_count}: {self.local_devices} local "
            f"of {self.global_devices} {self.platform} devices"
        )


def topology() -> Topology:
    """The process topology as JAX sees it now.

    Returns:
      A :class:`Topology`.

    Example:
      >>> print(me.distributed.topology())
      process 0/1: 8 local of 8 cpu devices
    """
    return Topology(
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        local_devices=jax.local_device_count(),
        global_devices=jax.device_count(),
        platform=jax.devices()[0].platform,
    )


def initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    heartbeat_timeout: int = DEFAULT_HEARTBEAT_TIMEOUT,
    auto: bool = False,
    init_timeout: int | None = None,
) -> Topology:
    """Starts the multi-controller runtime; a no-op for a single process.

    Values come from the arguments, else from the ``MESHENSEMBLE_*`` environment
    variables; with ``auto=True`` and none given, JAX detects the cluster (TPU pod,
    SLURM, ...). On CPU, collectives across processes go over gloo.

    Args:
      coordinator: ``HOST:PORT`` of process 0's coordinator service.
      num_processes: number of processes.
      process_id: this process's id, ``0 <= process_id < num_processes``.
      heartbeat_timeout: seconds before a silent peer counts as dead, so that survivors
        fail promptly instead of waiting JAX's default 100 s.
      auto: let JAX detect the cluster when nothing is given.
      init_timeout: seconds to wait at start-up for every process to join; default
        ``$MESHENSEMBLE_INIT_TIMEOUT``, else :data:`DEFAULT_INIT_TIMEOUT` (300).

    Returns:
      The :class:`Topology` after initialisation.

    Raises:
      ValueError: an incomplete or inconsistent set of values (a
        :class:`~meshensemble.errors.UsageError`).
      StartupTimeoutError: the processes did not all join within ``init_timeout`` (a
        :class:`~meshensemble.errors.RunFailedError`; one line naming this process, the
        coordinator and the timeout). The runtime's attempt goes on in the background and
        JAX ends the process if it expires (:class:`StartupTimeoutError`): exit on it.
      meshensemble.errors.RunFailedError: the runtime refused to start (its first line).

    Example:
      >>> me.distributed.initialize()   # no coordinator given or in the environment: one process
      Topology(process_index=0, process_count=1, local_devices=8, global_devices=8, platform='cpu')
      >>> me.distributed.initialize("10.0.0.1:1234", 2, process_id=0)  # doctest: +SKIP
    """
    coordinator = coordinator or os.environ.get(ENV_COORDINATOR)
    num_processes = _int_or_none(num_processes, ENV_NUM_PROCESSES)
    process_id = _int_or_none(process_id, ENV_PROCESS_ID)
    given = [v is not None for v in (coordinator, num_processes, process_id)]
    if not any(given) and not auto:
        return topology()
    if any(given) and not all(given):
        raise ValueError(
            "multi-process needs --coordinator HOST:PORT, --num-processes N and --process-id I "
            f"together (got coordinator={coordinator!r}, num_processes={num_processes!r}, "
            f"process_id={process_id!r})"
        )
    if num_processes is not None:
        if num_processes < 1 or not 0 <= process_id < num_processes:
            raise ValueError(
                f"process_id={process_id} must be in [0, num_processes={num_processes})"
            )
        if ":" not in coordinator:
            raise ValueError(f"coordinator={coordinator!r} must be HOST:PORT")
    if heartbeat_timeout < 1:
        raise UsageError(f"heartbeat_timeout={heartbeat_timeout} must be >= 1 second")
    timeout = init_timeout_seconds(init_timeout)
    if jax.config.jax_platforms in (None, "", "cpu") or "cpu" in str(jax.config.jax_platforms):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    where = (coordinator, num_processes, process_id, timeout)
    failed: list[BaseException] = []

    def join() -> None:  # in a thread: it blocks until every process joins
        try:
            jax.distributed.initialize(
                coordinator_address=coordinator,
                num_processes=num_processes,
                process_id=process_id,
                heartbeat_timeout_seconds=heartbeat_timeout,
                shutdown_timeout_seconds=max(heartbeat_timeout, SHUTDOWN_TIMEOUT),
                initialization_timeout=timeout + INIT_GRACE,
            )
        except Exception as err:  # noqa: BLE001 (the runtime's errors have no common type)
            failed.append(err)

    joining = threading.Thread(target=join, name="meshensemble-join", daemon=True)
    joining.start()
    joining.join(timeout)
    if joining.is_alive():
        raise StartupTimeoutError(startup_failure("no answer from every process", *where))
    if failed:
        text = str(failed[0]).strip()
        reason = f"{type(failed[0]).__name__}: {text.splitlines()[0][:200] if text else ''}"
        raise RunFailedError(startup_failure(reason, *where)) from None
    topo = topology()
    log.info("%s", topo)
    return topo


class StartupTimeoutError(RunFailedError):
    """The processes did not all join the coordinator within the start-up timeout.

    The runtime's own attempt cannot be cancelled: it goes on in a background thread, and
    if the peers never come, JAX's runtime ends the process :data:`INIT_GRACE` seconds
    after this error (JAX's behaviour, which this library cannot change). A program that
    catches it should exit (the command line does, with one line and exit status 1).
    """


def init_timeout_seconds(value: int | None = None) -> int:
    """The start-up timeout: ``value``, else ``$MESHENSEMBLE_INIT_TIMEOUT``, else 300.

    Args:
      value: seconds (the ``--init-timeout`` flag), or None.

    Returns:
      A whole number of seconds >= 1.

    Raises:
      meshensemble.errors.UsageError: not a positive whole number (naming where it came
        from).

    Example:
      >>> me.distributed.init_timeout_seconds(None)  # MESHENSEMBLE_INIT_TIMEOUT unset
      300
    """
    where = "--init-timeout" if value is not None else ENV_INIT_TIMEOUT
    raw = value if value is not None else os.environ.get(ENV_INIT_TIMEOUT)
    if raw is None or raw == "":
        return DEFAULT_INIT_TIMEOUT
    try:
        seconds = int(raw)
    except (TypeError, ValueError):
        seconds = 0
    if seconds < 1 or isinstance(raw, bool):
        raise UsageError(
            f"{where}={raw!r} is not a positive whole number of seconds; give e.g. "
            f"{DEFAULT_INIT_TIMEOUT}"
        )
    return seconds


def startup_failure(
    reason: str, coordinator: Any, num_processes: Any, process_id: Any, timeout: int
) -> str:
    """The one line for a multi-process start-up that failed or timed out.

    Args:
      reason: what went wrong, short (the runtime's first line, or that time ran out).
      coordinator: the coordinator's ``HOST:PORT``.
      num_processes: how many processes were to join.
      process_id: this process.
      timeout: the start-up timeout in seconds.

    Returns:
      The line, naming this process, the coordinator, the timeout and the fixes.

    Example:
      >>> startup_failure("no answer from every process", "localhost:1234", 2, 1, 300)
      'process 1 of 2 could not join the coordinator localhost:1234 within 300 s ...'
    """
    return (
        f"process {process_id} of {num_processes} could not join the coordinator "
        f"{coordinator} within {timeout} s ({reason}); start all "
        f"{num_processes} processes (process 0 serves the coordinator at that address), or "
        f"give a loaded machine more time: --init-timeout S or {ENV_INIT_TIMEOUT}=S"
    )


def _int_or_none(value: int | None, env: str) -> int | None:
    if value is not None:
        return int(value)
    raw = os.environ.get(env)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{env}={raw!r} is not an integer") from None


def fetch(tree: Any) -> Any:
    """Brings (possibly multi-process) global arrays to the host as numpy, in every process.

    Fully addressable arrays are copied as they are; arrays spread over other processes'
    devices are gathered with ``process_allgather``.

    Args:
      tree: a pytree of ``jax.Array``.

    Returns:
      The same tree of numpy arrays with the global shapes.

    Example:
      >>> state, metrics = ens.train_step(state, images, labels)
      >>> losses = me.distributed.fetch(metrics["loss"])  # numpy [members]
      >>> type(losses).__name__, losses.shape
      ('ndarray', (2,))
    """

    def one(x: Any) -> Any:
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return np.asarray(jax.device_get(x))

    return jax.tree.map(one, tree)


class DisagreementError(UsageError):
    """Processes resolved something that must be the same everywhere to different values."""


def _gather_bytes(blob: bytes) -> list[bytes]:
    """Every process's ``blob``, in process order (two ``process_allgather`` calls)."""
    sizes = np.asarray(multihost_utils.process_allgather(np.int32(len(blob)))).reshape(-1)
    padded = np.zeros((int(sizes.max()),), np.uint8)
    padded[: len(blob)] = np.frombuffer(blob, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(sizes), -1)
    return [row[: int(n)].tobytes() for row, n in zip(rows, sizes, strict=True)]


def _side(j: int, side: dict[str, Any], keys: list[str]) -> str:
    """Process ``j``'s gathered value in a disagreement: its host, ``keys``, its label."""
    shown = ", ".join(f"{k}={side['value'].get(k)!r}" for k in keys)
    note = f" ({side['label']})" if side["label"] else ""
    return f"process {j} ({side['host']}) has {shown}{note}"


def agree(
    name: str,
    value: dict[str, Any],
    fix: str,
    compare: tuple[str, ...] | None = None,
    label: str | None = None,
) -> list[dict[str, Any]]:
    """Checks that every process resolved ``value`` alike; all processes raise if not.

    Every process must call it at the same point (it is a collective). The values (JSON
    objects, with this process's hostname) are gathered with ``process_allgather``; each
    process compares them with process 0's the same way, so either all return or all
    raise the same error. In one process it returns at once.

    Args:
      name: what is compared, for the message (e.g. ``"the data"``).
      value: this process's value, a JSON-serialisable dict.
      fix: what the user should do, ending the message (e.g. ``"pass the same --source
        on every host"``).
      compare: the keys that must agree (default all); the other keys only describe.
      label: a short description of this process's value for the message (e.g. the
        dataset's note).

    Returns:
      Every process's ``value``, in process order.

    Raises:
      DisagreementError: one line naming the first process that differs from process 0,
        both hosts, and the differing keys, e.g. ``the data differs between processes:
        process 1 (host-b) has num_train=4000 (sample), process 0 (host-a) has
        num_train=60000 (tfds mnist); pass the same --source/--data-file on every host``.

    Example:
      >>> me.distributed.agree("the data", {"num_train": 60000}, "pass the same --source")
      [{'num_train': 60000}]
    """
    if jax.process_count() == 1:
        return [value]
    mine = {"host": socket.gethostname(), "label": label, "value": value}
    blob = json.dumps(mine, sort_keys=True, default=str).encode()
    every = [json.loads(b.decode()) for b in _gather_bytes(blob)]
    first = every[0]
    keys = list(compare if compare is not None else first["value"])
    for i, other in enumerate(every[1:], start=1):
        diff = [k for k in keys if other["value"].get(k) != first["value"].get(k)]
        if diff:
            sides = f"{_side(i, other, diff)}, {_side(0, first, diff)}"
            raise DisagreementError(f"{name} differs between processes: {sides}; {fix}")
    return [side["value"] for side in every]


def agree_max(value: float) -> float:
    """The largest of every process's ``value`` (a collective; ``value`` in one process).

    Used where processes must take the same decision from a measurement, e.g. the step
    time that caps the steps per call.

    Args:
      value: this process's number.

    Returns:
      The maximum over processes, the same float in every process.

    Example:
      >>> me.distributed.agree_max(0.25)
      0.25
    """
    if jax.process_count() == 1:
        return float(value)
    gathered = multihost_utils.process_allgather(np.float32(value))
    return float(np.max(np.asarray(gathered, np.float32)))


def free_port() -> int:
    """A TCP port on localhost that is free now (for a local coordinator)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return int(s.getsockname()[1])


def launch_local(
    argv: list[str],
    num_processes: int,
    devices_per_process: int,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    prefix_output: bool = True,
) -> int:
    """Runs ``meshensemble ARGV`` as ``num_processes`` local processes (fake CPU devices).

    Each process gets ``--fake-devices devices_per_process`` and the coordinator flags;
    CPU collectives go over gloo. When one process fails, the others get a bounded time
    (their heartbeat timeout) to fail too, then are killed; every process is cleaned up.

    Args:
      argv: the ``meshensemble`` arguments, e.g. ``["train", "--mesh", "ensemble=4,data=2"]``.
      num_processes: how many processes.
      devices_per_process: fake CPU devices in each.
      timeout: seconds before everything still running is killed.
      env: extra environment variables.
      prefix_output: prefix each output line with ``[i]``.

    Returns:
      0 if every process succeeded, else the first non-zero exit code.

    Example:
      >>> launch_local(["train", "--source", "sample", "--max-steps", "5"], 2, 4)  # doctest: +SKIP
      0
    """
    port = free_port()
    procs: list[subprocess.Popen] = []
    threads = []
    base_env = dict(os.environ, **(env or {}))
    for i in range(num_processes):
        cmd = [
            sys.executable,
            "-m",
            "meshensemble.cli",
            *argv,
            "--fake-devices",
            str(devices_per_process),
            "--coordinator",
            f"localhost:{port}",
            "--num-processes",
            str(num_processes),
            "--process-id",
            str(i),
        ]
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=base_env
        )
        procs.append(proc)

        def pump(p: subprocess.Popen = proc, tag: str = f"[{i}] " if prefix_output else ""):
            for line in p.stdout:
                print(tag + line, end="", flush=True)

        t = threading.Thread(target=pump, daemon=True)
        t.start()
        threads.append(t)
    deadline = time.time() + timeout
    try:
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):  # the others: a bounded grace
                deadline = min(deadline, time.time() + DEFAULT_HEARTBEAT_TIMEOUT + 20)
            if time.time() > deadline:
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        for t in threads:
            t.join(timeout=5)
    codes = [p.returncode for p in procs]
    return next((c for c in codes if c != 0), 0)
