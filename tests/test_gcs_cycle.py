"""The command-line cycle on a bucket and on a local folder, with the same command lines.

``train`` into ``ROOT/run`` killed with SIGKILL mid-epoch, resumed to the end equal bitwise
to a run never interrupted; ``evaluate --calibrate``; ``predict --input ROOT/x.npy --out
ROOT/preds.npz``; ``export --out ROOT/exported``; ``convert --data-file ROOT/data.npz``;
and a run of 2 processes whose only shared folder is ROOT. ROOT is ``gs://bucket/<test>``
on the local GCS server (tests/gcs.py: started for the session, stopped after it), or a
local folder. Slow: real processes, each a few seconds of JAX start-up.
"""

from __future__ import annotations

import dataclasses
import io
import json
import signal
import subprocess
import sys

import chex
import jax
import numpy as np
import pytest
from conftest import need_devices
from test_checkpoint import REPO, TX, signalled_at

import meshensemble as me
from meshensemble.runtime import storage
from meshensemble.training.checkpoint import list_checkpoints

CLEAN = me.data.synthetic(num_train=192, num_test=40, seed=0)
DATA = dataclasses.replace(
    CLEAN, y_train=np.where(np.arange(192) % 4 == 0, (CLEAN.y_train + 1) % 10, CLEAN.y_train)
)
"""A quarter of the train labels wrong: the validation split has mistakes to calibrate on."""
STEPS = 10
"""Steps of the trained run: 2 epochs of 5 (160 examples, batch 32; 32 for validation)."""

pytestmark = pytest.mark.slow


@pytest.fixture(params=["local", "gs"])
def root(request, tmp_path) -> str:
    """The one folder a test's commands share: local, or ``gs://bucket/<test>``."""
    if request.param == "local":
        return str(tmp_path)
    return request.getfixturevalue("gcs").path(request.node.name.replace("[", "-")[:-1])


def cli(*argv: str, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "meshensemble.cli", *argv]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def train_cmd(npz: str, workdir: str) -> list[str]:
    cmd = [sys.executable, "-m", "meshensemble.cli", "train", "--fake-devices", "2"]
    cmd += ["--source", "npz", "--data-file", npz, "--model", "mlp", "--members", "2"]
    cmd += ["--batch-size", "32", "--epochs", "2", "--checkpoint-every", "1", "--keep", "2"]
    cmd += ["--validation", "32"]  # for evaluate --calibrate
    return [*cmd, "--workdir", workdir, "--quiet"]


def restored(workdir: str):
    ens = me.Ensemble(me.models.MLP(), TX, 2, me.make_mesh(2, 1), input_transform=me.data.normalize)
    state, _, step = me.restore_checkpoint(workdir, ens, DATA.test_images[:1])
    return jax.device_get(state), step


def records(workdir: str) -> list[dict]:
    return [json.loads(x) for x in storage.read_text(f"{workdir}/metrics.jsonl").splitlines()]


def test_the_command_line_cycle(root):
    need_devices(2)
    npz = me.data.save_npz(DATA, f"{root}/data.npz")
    run, whole = f"{root}/run", f"{root}/whole"
    killed = subprocess.run(
        signalled_at(train_cmd(npz, run), 3, signal.SIGKILL),
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr
    left = list_checkpoints(run)
    assert left and max(left) < 3, left  # mid-epoch 1: step 3 itself never saved
    for workdir in (run, whole):  # the resume, and a run never interrupted
        done = subprocess.run(train_cmd(npz, workdir), capture_output=True, text=True, cwd=REPO)
        assert done.returncode == 0, done.stderr[-2000:]
    (got, step), (want, _) = restored(run), restored(whole)
    assert step == STEPS
    chex.assert_trees_all_equal(got, want)
    assert records(run) == records(whole)

    cli("evaluate", "--workdir", run, "--calibrate", "--fake-devices", "2")
    assert storage.read_json(f"{run}/evaluation.json")["calibration"]

    x = DATA.test_images[:7]
    storage.atomic_write(f"{root}/x.npy", lambda f: np.save(f, x))
    cli("predict", "--workdir", run, "--input", f"{root}/x.npy", "--out", f"{root}/preds.npz")
    want_probs = me.load_predictor(run).outputs(x)["probs"]
    preds = np.load(io.BytesIO(storage.read_bytes(f"{root}/preds.npz")))
    np.testing.assert_allclose(preds["probs"], want_probs, atol=1e-6)

    cli("export", "--workdir", run, "--out", f"{root}/exported")
    blob = storage.read_bytes(f"{root}/exported/ensemble.jax")
    exported = jax.export.deserialize(bytearray(blob))
    np.testing.assert_allclose(np.asarray(exported.call(x)["probs"]), want_probs, atol=1e-5)
    assert storage.read_json(f"{root}/exported/export.json")["members"] == 2

    cli("convert", "--data-file", npz, "--out", f"{root}/ar")
    held = storage.listdir(f"{root}/ar")
    assert held == ["labels.npz", "manifest.json", "test.array_record", "train.array_record"]
    listed = storage.read_json(f"{root}/ar/manifest.json")["files"]
    assert sorted(listed) == [n for n in held if n != "manifest.json"]


def test_two_processes_share_only_the_folder(root, tmp_path):
    """2 processes (2 fake devices each, data split across them): the checkpoints, metrics
    and data are in ROOT only; the run equals the same command's on a local folder."""
    from meshensemble.runtime.distributed import launch_local

    npz = me.data.save_npz(DATA, f"{root}/data.npz")
    argv = ["train", "--source", "npz", "--data-file", npz, "--model", "mlp"]
    argv += ["--members", "2", "--mesh", "ensemble=2,data=2", "--batch-size", "32"]
    argv += ["--max-steps", "4", "--workdir", f"{root}/multi", "--quiet"]
    assert launch_local(argv, 2, 2, timeout=300, prefix_output=False) == 0
    state, step = restored(f"{root}/multi")
    assert step == 4 and len(records(f"{root}/multi")) >= 1
    one = argv[:-3] + ["--workdir", str(tmp_path / "one"), "--quiet", "--fake-devices", "4"]
    cli(*one)
    chex.assert_trees_all_close(state, restored(str(tmp_path / "one"))[0], atol=1e-5)
