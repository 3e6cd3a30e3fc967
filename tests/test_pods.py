"""Pods (issue 41): checkpoints on a bucket, checksums from orbax's own completion, the
stop decision without a collective per step, and a library that neither hooks nor exits.

The bucket is a local GCS server (tests/gcs.py, the ``gcs`` fixture of conftest.py)."""

from __future__ import annotations

import asyncio
import json
import pathlib
import subprocess
import sys
import time

import jax
import numpy as np
import optax
import pytest
from conftest import need_devices, small_config
from orbax.checkpoint.path import atomicity

import meshensemble as me
from meshensemble.runtime import storage
from meshensemble.training import checkpoint, guards
from meshensemble.training.checkpoint import list_checkpoints, read_checksums

DATA = me.data.synthetic(num_train=256, num_test=40, seed=0)


def small_state(members=4):
    ens = me.Ensemble(me.models.MLP((16,)), optax.sgd(0.1), members, me.make_mesh(4, 1))
    return ens, ens.init(jax.random.PRNGKey(0), DATA.test_images[:1])


@pytest.fixture(params=["local", "gs"])
def workdir(request, tmp_path) -> str:
    """A run folder: local, or ``gs://bucket/<test>`` on the local GCS server."""
    if request.param == "local":
        return str(tmp_path / "run")
    return request.getfixturevalue("gcs").path(request.node.name.replace("[", "-")[:-1])


# --- checksums: computed once orbax has finished the save, never before ----------------
@pytest.mark.slow  # among the heaviest default tests, measured
def test_checksums_are_computed_only_after_orbax_finalises_each_save(workdir, monkeypatch):
    """Orbax's last step of a save (the rename of its temporary folder locally, the commit
    file on a bucket) is made half a second late: each checkpoint is still hashed only after
    it, and its checksum is that of the finished folder."""
    need_devices(8)
    finished: set[str] = set()
    for cls in (atomicity.AtomicRenameTemporaryPath, atomicity.CommitFileTemporaryPath):

        async def late(self, *args, _real=cls.finalize, **kwargs):
            await asyncio.sleep(0.5)
            await _real(self, *args, **kwargs)
            finished.add(self.get_final().name)

        monkeypatch.setattr(cls, "finalize", late)
    hashed, real_digest = [], checkpoint.checkpoint_digest

    def digest(path):
        name = str(path).rstrip("/").rsplit("/", 1)[-1]
        hashed.append((name, name in finished))
        return real_digest(path)

    monkeypatch.setattr(checkpoint, "checkpoint_digest", digest)
    ens, state = small_state()
    ckpt = me.Checkpointer(workdir, keep=3)
    ckpt.save(1, state, {"step": 1})
    deadline = time.monotonic() + 120  # a hang guard only
    while ("1", True) not in hashed and time.monotonic() < deadline:
        time.sleep(0.02)  # recorded by the save's own completion: no next save, no close
    ckpt.save(2, state, {"step": 2})
    ckpt.close()
    assert hashed == [("1", True), ("2", True)]
    folder = storage.join(workdir, "checkpoints")
    assert read_checksums(folder) == {s: real_digest(storage.join(folder, s)) for s in ("1", "2")}


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_checkpointer_saves_verifies_and_restores_on_a_bucket(gcs):
    """gs://bucket/run/checkpoints: saved, checksummed, restored; a flipped byte there is
    caught by its checksum, the checkpoint moved aside (a copy, then a delete) and the
    previous one used."""
    need_devices(8)
    workdir = gcs.path("run")
    ens, first = small_state()
    second = ens.init(jax.random.PRNGKey(1), DATA.test_images[:1])
    ckpt = me.Checkpointer(workdir, keep=3)
    ckpt.save(1, first, {"step": 1})
    ckpt.save(2, second, {"step": 2})
    ckpt.close()
    folder = f"{workdir}/checkpoints"
    assert list_checkpoints(workdir) == [1, 2]
    sums = read_checksums(folder)
    assert sums == {s: checkpoint.checkpoint_digest(f"{folder}/{s}") for s in ("1", "2")}
    state, loop, step = me.restore_checkpoint(workdir, ens, DATA.test_images[:1])
    assert (step, loop) == (2, {"step": 2})
    np.testing.assert_array_equal(
        jax.device_get(state.params)["Dense_0"]["kernel"],
        jax.device_get(second.params)["Dense_0"]["kernel"],
    )
    data = max(
        (f for f in storage.walk_files(f"{folder}/2") if "/d/" in f),
        key=lambda f: storage.file_size(f"{folder}/2/{f}"),
    )
    blob = bytearray(storage.read_bytes(f"{folder}/2/{data}"))
    blob[len(blob) // 2] ^= 0xFF
    storage.atomic_write(f"{folder}/2/{data}", bytes(blob))
    said: list[str] = []
    state, _, step = me.restore_checkpoint(workdir, ens, DATA.test_images[:1], echo=said.append)
    assert step == 1, said
    assert said == [
        f"checkpoint 2 is damaged (checksum mismatch); moved it to "
        f"{workdir}/checkpoints_damaged/2; trying the previous one"
    ]
    assert list_checkpoints(workdir) == [1] and storage.isdir(f"{workdir}/checkpoints_damaged/2")
    assert read_checksums(folder) == {"1": sums["1"]}


# --- the stop decision: JAX's preemption sync point, once per chunk ---------------------
@pytest.fixture
def counted(monkeypatch):
    """Counts the stop decision's calls into JAX's multi-process API (and answers them as
    one process would: no preemption, every flag False)."""
    from jax.experimental import multihost_utils

    calls = {"sync": [], "gather": 0}

    def sync(step_id):
        calls["sync"].append(step_id)
        return False

    def gather(x, *args, **kwargs):
        calls["gather"] += 1
        return np.asarray(x)[None]

    monkeypatch.setattr(multihost_utils, "reached_preemption_sync_point", sync)
    monkeypatch.setattr(multihost_utils, "process_allgather", gather)
    return calls


def test_the_stop_signal_of_several_processes_asks_the_sync_point_not_a_collective(counted):
    stop = guards.StopSignal.install(processes=2)
    try:
        assert not any(stop.requested(step) for step in range(5))
    finally:
        stop.uninstall()
    first = counted["sync"][0]
    assert counted["sync"] == list(range(first, first + 5))  # one call each, in sequence
    assert counted["gather"] == 0


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_run_of_several_processes_decides_to_stop_once_per_chunk(tmp_path, monkeypatch, counted):
    """The run's loop asks the stop signal once per chunk (12 steps, chunks of 4: 3 calls),
    and the answer costs no cross-process collective (a per-step check would make 12)."""
    need_devices(8)
    real = guards.StopSignal.install
    monkeypatch.setattr(guards.StopSignal, "install", lambda: real(processes=2))
    cfg = small_config(tmp_path / "run", max_steps=12, chunk_steps=4, stop_within=0)
    me.training.train(cfg, dataset=DATA)
    assert len(counted["sync"]) == 3, counted
    assert counted["gather"] == 0


def test_with_jax_s_preemption_service_off_the_processes_gather_their_flags(counted):
    jax.config.update("jax_enable_preemption_service", False)
    try:
        stop = guards.StopSignal(processes=2)
    finally:
        jax.config.update("jax_enable_preemption_service", True)
    assert not stop.requested(0)
    stop.signal = "SIGTERM"
    assert stop.requested(1) and counted["gather"] == 2 and not counted["sync"]


# --- a library that raises, and installs nothing ----------------------------------------
HOOKS = """
import json, signal, sys, threading
def hooks():
    return [repr(signal.getsignal(signal.SIGINT)), repr(signal.getsignal(signal.SIGTERM)),
            repr(sys.unraisablehook), repr(sys.excepthook), repr(threading.excepthook)]
before = hooks()
import meshensemble as me
after_import = hooks()
me.use_fake_cpu_devices(8)
cfg = me.TrainConfig(model="mlp", members=2, mesh="ensemble=2,data=1", epochs=1, max_steps=2,
                     batch_size=32, eval_batch_size=40, workdir=sys.argv[1], quiet=True)
me.training.train(cfg, dataset=me.data.synthetic(num_train=64, num_test=40, seed=0))
print(json.dumps([before, after_import, hooks()]))
"""


@pytest.mark.slow  # among the heaviest default tests, measured
def test_importing_and_training_through_the_api_installs_no_handler_or_hook(tmp_path):
    """In a fresh process: SIGINT/SIGTERM's handlers, ``sys.unraisablehook`` and the except
    hooks are the same before ``import meshensemble``, after it, and after a run through
    the Python API (which saves checkpoints through a Checkpointer)."""
    cmd = [sys.executable, "-c", HOOKS, str(tmp_path / "run")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    before, after_import, after_run = json.loads(done.stdout.strip().splitlines()[-1])
    assert after_import == before
    assert after_run == before
    assert list_checkpoints(tmp_path / "run") == [2]


def test_the_package_never_ends_the_process_outside_the_command_line():
    """Only the command line (cli/) and the program entry points (``__main__``) exit."""
    package = pathlib.Path(me.__file__).parent
    found = [
        f"{path.relative_to(package)}: {call}"
        for path in sorted(package.rglob("*.py"))
        if path.relative_to(package).parts[0] != "cli" and path.stem != "__main__"
        for call in ("os._exit(", "sys.exit(", "os.abort(")
        if call in path.read_text()
    ]
    assert found == []
