"""Multi-host on one machine: real processes with fake CPU devices and gloo collectives."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import numpy as np
import optax
import pytest
from conftest import need_devices

import meshensemble as me
from meshensemble.runtime.distributed import free_port, launch_local
from meshensemble.training import TrainConfig, train
from meshensemble.training.checkpoint import list_checkpoints

REPO = Path(__file__).resolve().parents[1]
DATA = me.data.synthetic(num_train=128, num_test=40, seed=3)
TX = optax.sgd(0.05, 0.9)


@pytest.fixture(scope="module")
def npz(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("data") / "synthetic.npz"
    return me.data.save_npz(DATA, path)


def args(npz, workdir, mesh) -> list[str]:
    return [
        "train",
        "--source",
        "npz",
        "--data-file",
        npz,
        "--model",
        "mlp",
        "--members",
        "8",
        "--mesh",
        mesh,
        "--batch-size",
        "32",
        "--max-steps",
        "3",
        "--learning-rate",
        "0.05",
        "--workdir",
        str(workdir),
        "--quiet",
        "--eval-batch-size",
        "40",
    ]


def one_process(npz, tmp_path, mesh, **kw):
    """The reference: what ``args(npz, ..., mesh)`` trains, in this one process (8 devices)."""
    base = dict(
        source="npz",
        data_file=npz,
        model="mlp",
        members=8,
        mesh=mesh,
        batch_size=32,
        max_steps=3,
        learning_rate=0.05,
        eval_batch_size=40,
        workdir=str(tmp_path / "one"),
        quiet=True,
    )
    return train(TrainConfig(**(base | kw)))


def assert_equals_one_process(workdir, one) -> None:
    """The processes' run in ``workdir`` ended where ``one`` did: state and metrics, 1e-5."""
    state, step = restored(workdir)
    assert step == 3
    chex.assert_trees_all_close(state, jax.device_get(one.state), atol=1e-5)
    record = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[-1])
    for key, value in one.history[-1].items():  # train_curve: a dict of lists
        for a, b in zip(jax.tree.leaves(record[key]), jax.tree.leaves(value), strict=True):
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=key)


def restored(workdir, mesh=(8, 1)):
    ens = me.Ensemble(
        me.models.MLP(), TX, 8, me.make_mesh(*mesh), input_transform=me.data.normalize
    )
    state, _, step = me.restore_checkpoint(str(workdir), ens, DATA.test_images[:1])
    return jax.device_get(state), step


@pytest.mark.slow
@pytest.mark.parametrize(
    "processes,devices,mesh",
    [
        (2, 4, "ensemble=4,data=2"),  # data split across processes, checked step
        pytest.param(  # members split across processes, unchecked step
            4, 2, "ensemble=8,data=1", marks=pytest.mark.slow
        ),
    ],
    ids=["2x4 procs, (4,2)", "4x2 procs, (8,1)"],
)
def test_processes_train_the_same_ensemble_as_one_process(npz, tmp_path, processes, devices, mesh):
    need_devices(8)
    workdir = tmp_path / "multi"
    code = launch_local(
        args(npz, workdir, mesh), processes, devices, timeout=240, prefix_output=False
    )
    assert code == 0
    assert_equals_one_process(workdir, one_process(npz, tmp_path, mesh))


def start_pair(npz, workdir, *extra) -> list[subprocess.Popen]:
    """Two real processes of `meshensemble train` (2 fake devices each) on a long run."""
    port = free_port()
    cmd = [sys.executable, "-m", "meshensemble.cli", "train", "--source", "npz"]
    cmd += ["--data-file", npz, "--model", "mlp", "--members", "4", "--batch-size", "32"]
    cmd += ["--mesh", "ensemble=2,data=2", "--epochs", "500", *extra]
    cmd += ["--workdir", str(workdir), "--quiet", "--heartbeat-timeout", "20"]
    cmd += ["--fake-devices", "2", "--coordinator", f"localhost:{port}", "--num-processes", "2"]
    procs = []
    for i in range(2):
        # Files, not pipes: nobody reads a pipe while the run goes on, and a process whose
        # pipe is full blocks in its write, then its peer in the next collective (a hang
        # seen at load 6, when the runtime logs more).
        logs = [workdir.parent / f"process{i}.{name}" for name in ("out", "err")]
        with open(logs[0], "w") as out, open(logs[1], "w") as err:
            proc = subprocess.Popen(
                [*cmd, "--process-id", str(i)], cwd=REPO, text=True, stdout=out, stderr=err
            )
        proc.logs = logs
        procs.append(proc)
    return procs


def finished(proc: subprocess.Popen) -> tuple[str, str]:
    """``(stdout, stderr)`` of a ``start_pair`` process once it ends (a hang guard only)."""
    proc.wait(timeout=HANG)
    return proc.logs[0].read_text(), proc.logs[1].read_text()


HANG = 600
"""Seconds after which a wait counts as a hang (a guard only: nothing here is timed)."""


def restored4(workdir):
    """The newest good checkpoint of a ``start_pair`` run (4 members), on one process."""
    ens = me.Ensemble(me.models.MLP(), TX, 4, me.make_mesh(4, 1), input_transform=me.data.normalize)
    state, _, step = me.restore_checkpoint(str(workdir), ens, DATA.test_images[:1])
    return jax.device_get(state), step


def wait_for(condition, procs, what: str) -> None:
    """Waits until ``condition()``; fails if a process ends first or after :data:`HANG`."""
    t0 = time.monotonic()
    while not condition():
        if any(p.poll() is not None for p in procs):
            pytest.fail(f"a process ended before {what}: {procs[0].logs[1].read_text()[-2000:]}")
        if time.monotonic() - t0 > HANG:
            pytest.fail(f"no {what} after {HANG}s")
        time.sleep(0.1)


@pytest.mark.slow
def test_a_dead_process_makes_the_others_fail_on_their_own(npz, tmp_path):
    need_devices(8)
    workdir = tmp_path / "dead"
    procs = start_pair(npz, workdir, "--checkpoint-every", "1")
    try:
        wait_for(lambda: list_checkpoints(workdir), procs, "a checkpoint")
        procs[1].send_signal(signal.SIGKILL)
        # the survivor leaves by itself (its heartbeat notices the lost peer): only a hang
        # guard here, never a speed bound
        _, err = finished(procs[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    if procs[0].returncode == 1:
        lines = [s for s in err.splitlines() if s.startswith("error:")]
        # the survivor's next collective fails: a train step (lost contact) or the
        # checkpoint save the peer died in (orbax's barrier names the lost task)
        assert lines, err[-2000:]
        assert "lost contact with" in lines[-1] or "could not save checkpoint" in lines[-1], lines
    else:
        # a survivor waiting in a runtime barrier (a loaded machine makes it likely) is
        # ended by JAX's coordination service once the peer misses its heartbeats: SIGABRT,
        # and the runtime's log names the dead task
        assert procs[0].returncode == -signal.SIGABRT, err[-2000:]
        assert "stopped sending heartbeats" in err, err[-2000:]
    state, step = restored4(workdir)  # the run is left resumable: a good checkpoint remains
    assert step in list_checkpoints(workdir)
    chex.assert_tree_all_finite(state)


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [[], ["--chunk-steps", "4", "--stop-within", "0.02"]],
    ids=["K=1", "K=epoch, calls capped from the agreed step time"],
)
def test_sigterm_to_one_process_stops_all_at_the_same_step(npz, tmp_path, extra):
    need_devices(8)
    workdir = tmp_path / "term"
    procs = start_pair(npz, workdir, "--checkpoint-every", "1000", *extra)
    try:
        wait_for(lambda: (workdir / "config.json").exists(), procs, "config.json")
        procs[1].send_signal(signal.SIGTERM)  # only one process is told
        outs = [finished(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-1500:] for o in outs]
    line = [s for s in outs[0][0].splitlines() if s.startswith("stopped by")]
    assert line, outs[0]
    step = int(line[0].split("at step ")[1].split(":")[0])
    assert f"saved checkpoint {step}" in line[0]
    # one agreed step, saved by both processes: the newest checkpoint, and it restores
    assert list_checkpoints(workdir)[-1] == step
    assert restored4(workdir)[1] == step


@pytest.mark.slow
def test_two_processes_stop_early_together_and_keep_the_same_best(tmp_path):
    """Early stopping and keep-best decide from replicated scores: both processes stop
    at the same evaluation, exit 0, and the best checkpoint they kept restores."""
    need_devices(8)
    rng = np.random.default_rng(0)  # random labels: the validation NLL rises after a while
    noise = me.data.Dataset(name="noise", x_train=DATA.x_train,
                            y_train=rng.integers(0, 10, len(DATA.y_train)).astype(np.int32),
                            x_test=DATA.x_test, y_test=DATA.y_test, num_classes=10)  # fmt: skip
    npz = me.data.save_npz(noise, tmp_path / "noise.npz")
    workdir = tmp_path / "early"
    watch = ["--validation", "32", "--eval-every", "1", "--early-stopping", "val_nll:2",
             "--keep-best", "val_nll", "--keep", "1", "--learning-rate", "0.2"]  # fmt: skip
    procs = start_pair(npz, workdir, *watch)
    try:
        outs = [finished(p) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0, 0], [o[1][-1500:] for o in outs]
    records = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["early_stopping"]["since"] == 2 and records[-1]["epoch"] < 500
    assert any(s.startswith("early stopping at step") for s in outs[0][0].splitlines())
    with open(workdir / "config.json") as f:
        best = json.load(f)["resolved"]["keep_best"]
    assert best["step"] == records[-1]["early_stopping"]["step"]
    assert best["step"] in list_checkpoints(workdir)  # pinned past --keep 1
    assert restored4_at(workdir, best["step"]) == best["step"]


def restored4_at(workdir, step: int) -> int:
    ens = me.Ensemble(me.models.MLP(), TX, 4, me.make_mesh(4, 1), input_transform=me.data.normalize)
    return me.restore_checkpoint(str(workdir), ens, DATA.test_images[:1], step=step)[2]


OTHER = {
    "same size, other content": me.data.synthetic(num_train=128, num_test=40, seed=4),
    "other size": me.data.synthetic(num_train=96, num_test=40, seed=3),
}


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("case", list(OTHER))
def test_processes_with_different_data_all_stop_naming_the_host(npz, tmp_path, case):
    need_devices(8)
    other = me.data.save_npz(OTHER[case], tmp_path / "other.npz")
    port = free_port()
    procs = []
    for i, data_file in enumerate((npz, other)):
        cmd = args(data_file, tmp_path / "run", "ensemble=2,data=2")
        cmd += ["--members", "4", "--heartbeat-timeout", "5", "--fake-devices", "2"]
        cmd += ["--coordinator", f"localhost:{port}", "--num-processes", "2"]
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "meshensemble.cli", *cmd, "--process-id", str(i)],
                cwd=REPO,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    try:
        outs = [p.communicate(timeout=HANG) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    host = socket.gethostname()
    differs = "content=" if case == "same size, other content" else "num_train=96"
    for p, (_, err) in zip(procs, outs, strict=True):
        assert p.returncode == 2, err[-2000:]
        last = err.strip().splitlines()[-1]
        assert last.startswith("error: the data differs between processes: "), last
        assert f"process 1 ({host}) has " in last and f"process 0 ({host}) has " in last, last
        assert differs in last and "on every host" in last, last
    assert not (tmp_path / "run" / "config.json").exists()  # stopped before writing anything


# ------------------------------------------------------------------ streamed input (--input stream)
TRACE = """
import os, threading
import numpy as np
from meshensemble.data import stream
_read, _lock = stream.ArraySource.read, threading.Lock()
def read(self, indices):
    import jax
    name = os.path.join(os.environ["STREAM_TRACE"], f"p{jax.process_index()}.txt")
    with _lock, open(name, "a") as f:
        f.write(" ".join(map(str, np.asarray(indices).reshape(-1))) + "\\n")
    return _read(self, indices)
stream.ArraySource.read = read
"""
"""A ``sitecustomize`` that makes every process log the example indices it reads."""


@pytest.mark.slow
@pytest.mark.parametrize(
    "shuffle,mesh", [("shared", "ensemble=1,data=8"), ("per-member", "ensemble=2,data=4")]
)
def test_streamed_processes_read_half_of_each_batch_and_equal_one_process(
    npz, tmp_path, monkeypatch, shuffle, mesh
):
    need_devices(8)
    trace, hook = tmp_path / "trace", tmp_path / "hook"
    trace.mkdir(), hook.mkdir()
    (hook / "sitecustomize.py").write_text(TRACE)
    env = {"STREAM_TRACE": str(trace), "PYTHONPATH": f"{hook}{os.pathsep}{REPO}"}
    workdir = tmp_path / "multi"
    argv = [*args(npz, workdir, mesh), "--input", "stream", "--shuffle", shuffle]
    assert launch_local(argv, 2, 4, timeout=300, env=env, prefix_output=False) == 0
    one_reads = []
    read = me.data.stream.ArraySource.read
    monkeypatch.setattr(
        me.data.stream.ArraySource,
        "read",
        lambda self, idx: one_reads.append(np.asarray(idx).reshape(-1)) or read(self, idx),
    )
    one = one_process(npz, tmp_path, mesh, input="stream", shuffle=shuffle)
    per_step = 32 * (8 if shuffle == "per-member" else 1)  # examples of one global batch
    reads = [
        [np.array(s.split(), int) for s in (trace / f"p{i}.txt").read_text().splitlines()]
        for i in range(2)
    ]
    for mine in reads:  # each process: exactly half of each global batch, nothing more
        assert len(mine) >= 3 and all(len(r) == per_step // 2 for r in mine)
    # each global batch one process read is the two processes' halves together (Grain's
    # threads may log the steps out of order: matched by content, at least the 3 steps run)
    whole = {tuple(np.sort(r)) for r in one_reads}
    pairs = {tuple(np.sort(np.concatenate([a, b]))) for a in reads[0] for b in reads[1]}
    assert len(whole & pairs) >= 3
    assert_equals_one_process(workdir, one)


# --- start-up on a loaded machine: a configurable timeout, one line when it runs out ---
def test_the_init_timeout_comes_from_the_flag_the_environment_or_the_default(monkeypatch):
    from meshensemble.cli import build_parser
    from meshensemble.runtime import distributed

    monkeypatch.delenv(distributed.ENV_INIT_TIMEOUT, raising=False)
    assert distributed.init_timeout_seconds(None) == distributed.DEFAULT_INIT_TIMEOUT == 300
    monkeypatch.setenv(distributed.ENV_INIT_TIMEOUT, "900")
    assert distributed.init_timeout_seconds(None) == 900
    assert distributed.init_timeout_seconds(45) == 45  # the flag wins
    for bad, where in [(0, "--init-timeout=0"), (None, "MESHENSEMBLE_INIT_TIMEOUT='soon'")]:
        monkeypatch.setenv(distributed.ENV_INIT_TIMEOUT, "soon")
        with pytest.raises(me.UsageError, match=f"^{where} is not a positive whole number"):
            distributed.init_timeout_seconds(bad)
    assert build_parser().parse_args(["train", "--init-timeout", "600"]).init_timeout == 600


def test_a_start_up_that_times_out_is_one_line_naming_the_coordinator(monkeypatch):
    """What jax.distributed.initialize is given, and the line when it fails (no process
    is started: the runtime's call is replaced)."""
    from meshensemble.runtime import distributed

    seen = {}

    def initialize(**kwargs):
        seen.update(kwargs)
        raise RuntimeError("DEADLINE_EXCEEDED: Barrier timed out.\nid: PjRT_Client_Connect")

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    monkeypatch.setattr(jax.config, "update", lambda *a: None)  # keep this process's config
    monkeypatch.setenv(distributed.ENV_INIT_TIMEOUT, "120")
    with pytest.raises(me.RunFailedError) as err:
        distributed.initialize("localhost:1234", 2, 1)
    assert seen["initialization_timeout"] > 120  # the runtime's deadline comes after ours
    assert str(err.value) == (
        "process 1 of 2 could not join the coordinator localhost:1234 within 120 s "
        "(RuntimeError: DEADLINE_EXCEEDED: Barrier timed out.); start all 2 processes "
        "(process 0 serves the coordinator at that address), or give a loaded machine more "
        "time: --init-timeout S or MESHENSEMBLE_INIT_TIMEOUT=S"
    )
    assert me.errors.exit_code(err.value) == 1


def test_when_the_peers_never_come_the_start_raises_naming_the_coordinator(monkeypatch):
    """The runtime would abort the process (SIGABRT and a C++ stack) at its own deadline;
    ours comes first and the library raises (it never ends its user's process). The
    runtime's call waits here until the error was raised."""
    import threading

    from meshensemble.runtime import distributed

    raised, seen = threading.Event(), {}

    def initialize(**kwargs):
        seen.update(kwargs)
        assert raised.wait(60), "initialize never raised"

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    monkeypatch.setattr(jax.config, "update", lambda *a: None)
    try:
        with pytest.raises(distributed.StartupTimeoutError) as err:
            distributed.initialize("localhost:1234", 2, 0, init_timeout=1)
    finally:
        raised.set()
    assert seen["initialization_timeout"] == 1 + distributed.INIT_GRACE
    assert isinstance(err.value, me.RunFailedError) and me.errors.exit_code(err.value) == 1
    assert str(err.value) == (
        "process 0 of 2 could not join the coordinator localhost:1234 within 1 s "
        "(no answer from every process); start all 2 processes (process 0 serves the "
        "coordinator at that address), or give a loaded machine more time: "
        "--init-timeout S or MESHENSEMBLE_INIT_TIMEOUT=S"
    )


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("process", [0, 1], ids=["the coordinator", "a peer"])
def test_a_command_whose_peers_never_come_exits_1_with_one_line(tmp_path, process):
    """A real process alone: the coordinator's peers never come, or a peer's coordinator
    never answers. The command's one line, exit 1, soon after --init-timeout (not JAX's
    abort at the runtime's own deadline)."""
    coordinator = f"localhost:{free_port()}"
    cmd = [sys.executable, "-m", "meshensemble.cli", "train", "--quiet", "--workdir"]
    cmd += [str(tmp_path / "run"), "--coordinator", coordinator]
    cmd += ["--num-processes", "2", "--process-id", str(process), "--init-timeout", "2"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=HANG, cwd=REPO)
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stderr.splitlines() == [
        f"error: process {process} of 2 could not join the coordinator {coordinator} within 2 s "
        "(no "
        "answer from every process); start all 2 processes (process 0 serves the "
        "coordinator at that address), or give a loaded machine more time: --init-timeout S "
        "or MESHENSEMBLE_INIT_TIMEOUT=S"
    ], done.stderr[-2000:]
    assert not (tmp_path / "run").exists()


def test_a_gloo_key_value_timeout_is_one_line():
    from meshensemble.cli.common import lost_peer

    err = RuntimeError(
        "Gloo context initialization failed: DEADLINE_EXCEEDED: GetKeyValue() timed out "
        "with key: cpu:gloo/1 and duration: 1m\nmore"
    )
    line = lost_peer(err)
    assert "\n" not in line and line.startswith("a peer process did not reach a collective")
    assert "GetKeyValue() timed out" in line and "gloo waits about a minute" in line
