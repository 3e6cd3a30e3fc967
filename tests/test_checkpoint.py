"""Checkpoints and faults: exact resume, resharding, kill -9, SIGTERM, full and read-only
disks, damaged checkpoints, non-finite losses and bad input. Real processes, not mocks."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from conftest import need_devices
from conftest import small_config as cfg

import meshensemble as me
from meshensemble import cli
from meshensemble.cli import main

CHECKSUMS = me.checkpoint.CHECKSUMS
CHECKSUMS_COPY = me.checkpoint.CHECKSUMS_COPY
JSON_FILES = (CHECKSUMS, CHECKSUMS_COPY, "manifest.json", "config.json", "compile.json")
list_checkpoints = me.checkpoint.list_checkpoints
read_checksums = me.checkpoint.read_checksums
train = me.training.train

REPO = Path(__file__).resolve().parents[1]
DATA = me.data.synthetic(num_train=192, num_test=40, seed=0)
TX = optax.sgd(0.05, 0.9)  # the structure of the runs' optimizer state (SGD with momentum)


@pytest.fixture(scope="module")
def npz(tmp_path_factory) -> str:
    """The synthetic set as a Keras-layout npz, so subprocesses can load it."""
    path = tmp_path_factory.mktemp("data") / "synthetic.npz"
    return me.data.save_npz(DATA, path)


def final_params(workdir, mesh=(4, 2)) -> dict:
    ens = me.Ensemble(
        me.models.MLP(), TX, 4, me.make_mesh(*mesh), input_transform=me.data.normalize
    )
    state, _, _ = me.restore_checkpoint(str(workdir), ens, DATA.test_images[:1])
    return jax.device_get(state)


def records(workdir) -> list[dict]:
    return [json.loads(x) for x in Path(workdir, "metrics.jsonl").read_text().splitlines()]


# ------------------------------------------------------------------ in process
@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("first", [3])
def test_split_run_resumes_bitwise(tmp_path, first):
    need_devices(8)
    whole = train(cfg(tmp_path / "whole", max_steps=6), dataset=DATA)
    part = train(cfg(tmp_path / "split", max_steps=first), dataset=DATA)
    assert part.history[-1]["step"] == first
    rest = train(cfg(tmp_path / "split", max_steps=6), dataset=DATA)
    chex.assert_trees_all_equal(jax.device_get(rest.state), jax.device_get(whole.state))
    a, b = whole.history[-1], rest.history[-1]
    assert {k: v for k, v in a.items() if k.startswith("test_")} == {
        k: v for k, v in b.items() if k.startswith("test_")
    }
    steps = [r["step"] for r in records(tmp_path / "split")]
    assert steps == [first, 6]  # no evaluation twice


@pytest.mark.slow  # among the heaviest default tests, measured
def test_restore_onto_other_meshes_predicts_the_same(tmp_path):
    need_devices(8)
    result = train(cfg(tmp_path / "r", mesh="ensemble=4,data=1", epochs=1), dataset=DATA)
    expected = np.asarray(result.ensemble.predict(result.state, DATA.test_images))
    for shape in [(2, 1), (4, 2), (1, 1)]:  # a device subset, members x data, one device
        ens = me.Ensemble(
            me.models.MLP(),
            TX,
            4,
            me.make_mesh(*shape),
            input_transform=me.data.normalize,
        )
        state, loop, step = me.restore_checkpoint(str(tmp_path / "r"), ens, DATA.test_images[:1])
        assert step == 6 and loop["epoch"] == 1
        for leaf in jax.tree.leaves(state):
            assert leaf.sharding.is_equivalent_to(me.member_sharding(ens.mesh), leaf.ndim)
        got = np.asarray(ens.predict(state, DATA.test_images))
        np.testing.assert_allclose(got, expected, atol=1e-5, err_msg=str(shape))
    # one member as a plain single-model tree, and a subset
    p3 = me.extract_members(result.state, 3)
    logits = me.models.MLP().apply({"params": p3}, me.data.normalize(DATA.test_images))
    member = np.asarray(result.ensemble.predict_members(result.state, DATA.test_images))[3]
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(logits)), member, atol=1e-5)
    assert jax.tree.leaves(me.extract_members(result.state, [0, 2]))[0].shape[0] == 2
    with pytest.raises(ValueError, match="member index .* out of range; the ensemble has 4"):
        me.extract_members(result.state, 4)
    # an inference-only ensemble: no optimizer state on disk, same predictions
    me.save_inference(str(tmp_path / "inference"), result.state)
    ens = me.Ensemble(me.models.MLP(), TX, 4, me.make_mesh(1, 1), input_transform=me.data.normalize)
    loaded = me.load_inference(str(tmp_path / "inference"), ens, DATA.test_images[:1])
    np.testing.assert_allclose(
        np.asarray(ens.predict(loaded, DATA.test_images)), expected, atol=1e-5
    )


def biggest_file(workdir, step) -> Path:
    files = [p for p in (Path(workdir) / "checkpoints" / str(step)).rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_size)


def flip_a_bit(path: Path) -> bytes:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    return bytes(raw)


def assert_same_members(a, b, members=4):
    for i in range(members):
        got, want = me.extract_members(a, i), me.extract_members(b, i)
        jax.tree.map(np.testing.assert_array_equal, got, want)


EVERY_2 = dict(checkpoint_every=2, keep=4, epochs=1)
"""A run saving checkpoints 2, 4 and 6, which the damage tests break (in copies)."""


@pytest.fixture(scope="module")
def every_2(tmp_path_factory):
    """``(workdir, result)`` of the :data:`EVERY_2` run, trained once for the module: a test
    that damages it copies the folder first (:func:`copy_of`)."""
    need_devices(8)
    workdir = tmp_path_factory.mktemp("every_2") / "run"
    return workdir, train(cfg(workdir, **EVERY_2), dataset=DATA)


def copy_of(run: Path, workdir: Path) -> Path:
    shutil.copytree(run, workdir)
    return workdir


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_damaged_newest_checkpoint_is_moved_aside_and_the_resumed_run_finishes(tmp_path, every_2):
    workdir = copy_of(every_2[0], tmp_path / "d")
    config = cfg(workdir, **EVERY_2)
    whole = every_2[1]  # the uninterrupted run
    assert list_checkpoints(workdir) == [2, 4, 6]
    assert set(read_checksums(str(workdir / "checkpoints"))) == {"2", "4", "6"}
    # bit-flip the newest: orbax would read it silently; the checksum catches it
    victim = biggest_file(workdir, 6)
    flipped = flip_a_bit(victim)
    messages: list[str] = []
    resumed = train(config, dataset=DATA, echo=messages.append)
    aside = workdir / "checkpoints_damaged" / "6"
    said = (
        f"checkpoint 6 is damaged (checksum mismatch); moved it to {aside}; trying the previous one"
    )
    assert said in messages, messages
    assert any(m.startswith("resumed from checkpoint 4 ") for m in messages), messages
    assert resumed.history[-1]["step"] == 6
    # kept for inspection, byte for byte; step 6 saved again, good, with its checksum
    assert (aside / victim.relative_to(workdir / "checkpoints" / "6")).read_bytes() == flipped
    assert list_checkpoints(workdir) == [2, 4, 6]
    sums = read_checksums(str(workdir / "checkpoints"))
    assert sums["6"] == me.checkpoint.checkpoint_digest(str(workdir / "checkpoints" / "6"))
    # the resumed run is exact: members equal to the uninterrupted run's, in memory and on disk
    assert_same_members(resumed.state, whole.state)
    assert_same_members(final_params(workdir), jax.device_get(whole.state))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_an_unverified_truncated_checkpoint_is_unreadable_and_the_previous_one_used(
    tmp_path, every_2
):
    workdir = copy_of(every_2[0], tmp_path / "t")
    good = final_params(workdir)
    # truncate the newest and drop its checksum: orbax itself must notice
    victim = biggest_file(workdir, 6)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 3])
    sums = read_checksums(str(workdir / "checkpoints"))
    del sums["6"]
    (workdir / "checkpoints" / CHECKSUMS).write_text(json.dumps(sums))
    messages: list[str] = []
    ens = me.Ensemble(me.models.MLP(), TX, 4, me.make_mesh(4, 2), input_transform=me.data.normalize)
    state, _, step = me.restore_checkpoint(
        str(workdir), ens, DATA.test_images[:1], echo=messages.append
    )
    assert step == 4, messages
    assert any(m.startswith("checkpoint 6 is unreadable (") for m in messages), messages
    assert not np.array_equal(
        jax.device_get(state.params)["Dense_0"]["kernel"], good.params["Dense_0"]["kernel"]
    )  # an older, good state
    chex.assert_tree_all_finite(state)


def small_state(members=4):
    ens = me.Ensemble(me.models.MLP(), TX, members, me.make_mesh(4, 1))
    return ens, ens.init(jax.random.PRNGKey(0), DATA.test_images[:1])


def test_the_checksum_is_recorded_when_the_save_finalises_not_at_the_next_save(tmp_path):
    need_devices(8)
    _, state = small_state()
    folder = tmp_path / "w" / "checkpoints"
    ckpt = me.Checkpointer(str(tmp_path / "w"), keep=2)
    try:
        ckpt.save(1, state, {"step": 1})
        deadline = time.monotonic() + 120  # guards against a hang only
        while "1" not in read_checksums(str(folder)) and time.monotonic() < deadline:
            time.sleep(0.02)
        sums = read_checksums(str(folder))
        # neither a next save nor close() came: the save's own finalisation recorded it,
        # over the finished folder's final contents
        assert list_checkpoints(tmp_path / "w") == [1]
        assert sums == {"1": me.checkpoint.checkpoint_digest(str(folder / "1"))}
    finally:
        ckpt.close()
    assert read_checksums(str(folder)) == sums


def test_a_checkpoint_without_a_checksum_is_unverified_but_used_when_it_reads_back(tmp_path):
    need_devices(8)
    ens, state = small_state()
    ckpt = me.Checkpointer(str(tmp_path / "w"))
    ckpt.save(1, state, {"step": 1})
    ckpt.save(2, state, {"step": 2})
    ckpt.close()
    folder = tmp_path / "w" / "checkpoints"
    (folder / CHECKSUMS).write_text(json.dumps({"1": read_checksums(str(folder))["1"]}))
    messages: list[str] = []
    _, loop, step = me.restore_checkpoint(
        str(tmp_path / "w"), ens, DATA.test_images[:1], echo=messages.append
    )
    assert (step, loop) == (2, {"step": 2})
    assert messages == [
        "checkpoint 2 has no recorded checksum (the run stopped before recording it): "
        "unverified, but it reads back; using it"
    ]


@pytest.fixture(scope="module")
def run8(tmp_path_factory) -> Path:
    """Checkpoints 1 and 2 (and an inference save) of 8 MLP members with SGD + momentum."""
    need_devices(8)
    workdir = tmp_path_factory.mktemp("run8")
    ens = me.Ensemble(me.models.MLP(), TX, 8, me.make_mesh(8, 1))
    state = ens.init(jax.random.PRNGKey(0), DATA.test_images[:1])
    ckpt = me.Checkpointer(str(workdir))
    ckpt.save(1, state, {"step": 1})
    ckpt.save(2, state, {"step": 2})
    ckpt.close()
    me.save_inference(str(workdir / "inference"), state)
    return workdir


MISMATCHES = [
    (4, TX, me.models.MLP, "holds 8 members; this ensemble has 4 members:"),
    (
        8,
        optax.adam(1e-3),
        me.models.MLP,
        "holds 8 members with optimizer state (trace) of 101,770 numbers in float32; this "
        "ensemble has 8 members with optimizer state (count, mu, nu) of",
    ),
    (
        8,
        TX,
        me.models.CNN,
        "holds 8 members with params {Dense_0, Dense_1} of 101,770 numbers in float32; this "
        "ensemble has 8 members with params {Conv_0, Conv_1, Dense_0, Dense_1} of",
    ),
]


@pytest.mark.parametrize("members,tx,model,message", MISMATCHES, ids=["members", "adam", "cnn"])
def test_a_mismatched_ensemble_is_told_what_differs_and_nothing_falls_back(
    run8, tmp_path, members, tx, model, message
):
    run8 = shutil.copytree(run8, tmp_path / "run8")
    ens = me.Ensemble(model(), tx, members, me.make_mesh(4, 1))
    messages: list[str] = []
    with pytest.raises(me.CheckpointError) as caught:
        me.restore_checkpoint(str(run8), ens, DATA.test_images[:1], echo=messages.append)
    text = str(caught.value)
    assert text.startswith(f"checkpoint 2 in {run8 / 'checkpoints'} {message}"), text
    assert text.endswith(
        ": the checkpoint itself is fine; build the ensemble with the run's config (its "
        "config.json), or use --overwrite to start the run over"
    ), text
    assert "\n" not in text and "unreadable" not in text and "do not match" not in text
    assert messages == [] and list_checkpoints(run8) == [1, 2]  # no fallback, nothing moved
    assert not (run8 / "checkpoints_damaged").exists()
    if tx is not TX:  # an inference save holds no optimizer state: any optimizer loads it
        me.load_inference(str(run8 / "inference"), ens, DATA.test_images[:1])
        return
    with pytest.raises(me.CheckpointError) as caught:
        me.load_inference(str(run8 / "inference"), ens, DATA.test_images[:1])
    text = str(caught.value)
    assert text.startswith(f"inference checkpoint {run8 / 'inference'} {message}"), text
    assert text.endswith(
        ": the checkpoint itself is fine; build the ensemble with the model and member count "
        "it was saved from"
    ), text
    assert "\n" not in text and "strict" not in text


READ_FAILURES = [
    (MemoryError(), True, "out of memory (MemoryError)", "fine (its checksum matches)"),
    (
        ValueError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB"),
        False,
        "out of memory (ValueError: RESOURCE_EXHAUSTED: Out of memory",
        "not known to be damaged (no checksum)",
    ),
    (
        PermissionError(errno.EACCES, "Permission denied", "state/_METADATA"),
        False,
        "permission denied (PermissionError: [Errno 13] Permission denied",
        "not known to be damaged (no checksum)",
    ),
    (
        OSError(errno.EIO, "Input/output error"),
        True,
        "I/O error (OSError: [Errno 5] Input/output error)",
        "fine (its checksum matches)",
    ),
]


@pytest.mark.parametrize(
    "error,verified,cause,fine", READ_FAILURES, ids=["oom", "xla-oom", "permission", "eio"]
)
def test_a_read_failure_that_is_not_damage_stops_instead_of_rolling_back(
    run8, tmp_path, monkeypatch, error, verified, cause, fine
):
    workdir = tmp_path / "w"
    shutil.copytree(run8, workdir)
    if not verified:
        (workdir / "checkpoints" / CHECKSUMS).write_text("{}")
    real = ocp.CheckpointManager.restore

    def restore(self, step, *args, **kwargs):
        if step == 2:
            raise error
        return real(self, step, *args, **kwargs)

    monkeypatch.setattr(ocp.CheckpointManager, "restore", restore)
    ens = me.Ensemble(me.models.MLP(), TX, 8, me.make_mesh(8, 1))
    messages: list[str] = []
    with pytest.raises(me.CheckpointError) as caught:
        me.restore_checkpoint(str(workdir), ens, DATA.test_images[:1], echo=messages.append)
    text = str(caught.value)
    assert text.startswith(
        f"could not restore checkpoint 2 from {workdir / 'checkpoints'}: {cause}"
    ), text
    assert f"; the checkpoint itself is {fine}; " in text and "\n" not in text, text
    assert messages == [] and list_checkpoints(workdir) == [1, 2]  # no rollback, nothing moved


@pytest.mark.slow  # among the heaviest default tests, measured
def test_extract_members_gives_each_members_batchnorm_statistics():
    need_devices(8)
    model = me.models.MLP(batch_norm=True)
    ens = me.Ensemble(model, TX, 4, me.make_mesh(4, 1), input_transform=me.data.normalize)
    state = ens.init(jax.random.PRNGKey(0), DATA.test_images[:1])
    for i in range(2):  # running statistics that differ between members
        batch = slice(32 * i, 32 * (i + 1))
        state, _ = ens.train_step(state, DATA.train_images[batch], DATA.train_labels[batch])
    rows = jax.device_get(state.model_state)
    params, extra = me.extract_members(state, 3, with_model_state=True)
    assert set(extra) == {"batch_stats"}
    jax.tree.map(lambda got, all_: np.testing.assert_array_equal(got, all_[3]), extra, rows)
    jax.tree.map(np.testing.assert_array_equal, params, me.extract_members(state, 3))
    mean = extra["batch_stats"]["BatchNorm_0"]["mean"]
    assert not np.array_equal(mean, rows["batch_stats"]["BatchNorm_0"]["mean"][0])
    # member 3 as a plain model, with its own statistics, predicts what the ensemble's does
    logits = model.apply(
        {"params": params, **extra}, me.data.normalize(DATA.test_images), train=False
    )
    member = np.asarray(ens.predict_members(state, DATA.test_images))[3]
    np.testing.assert_allclose(np.asarray(jax.nn.softmax(logits)), member, atol=1e-5)
    _, subset = me.extract_members(state, [1, 3], with_model_state=True)
    jax.tree.map(lambda got, all_: np.testing.assert_array_equal(got, all_[[1, 3]]), subset, rows)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_nonfinite_loss_stops_naming_members_or_reinitialises_them(tmp_path, npz, capsys):
    need_devices(8)
    workdir = tmp_path / "nan"
    argv = [
        "train",
        "--source",
        "npz",
        "--data-file",
        npz,
        "--model",
        "mlp",
        "--members",
        "4",
        "--mesh",
        "ensemble=4,data=1",
        "--batch-size",
        "32",
        "--epochs",
        "2",
        "--optimizer",
        "sgd",
        "--learning-rate",
        "1e30",
        "--momentum",
        "0.9",
        "--workdir",
        str(workdir),
        "--quiet",
    ]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert "non-finite loss in member(s) [" in err and " at step " in err and "\n" not in err
    for step in list_checkpoints(workdir):  # nothing non-finite was saved
        ens = me.Ensemble(me.models.MLP(), TX, 4, me.make_mesh(4, 1))
        state, _, _ = me.restore_checkpoint(str(workdir), ens, DATA.test_images[:1], step=step)
        chex.assert_tree_all_finite(state.params)
    result = train(
        cfg(
            tmp_path / "re",
            learning_rate=1e4,
            on_nonfinite="reinit",
            epochs=1,
            checkpoint=False,
            quiet=False,
        ),
        dataset=DATA,
        echo=lambda s: None,
    )
    assert result.history[-1]["step"] == 6


@pytest.mark.slow  # among the heaviest default tests, measured
def test_sigterm_in_process_saves_at_the_next_boundary_and_resumes_bitwise(tmp_path):
    """SIGTERM (raised in this process at the run's first line, so no timer decides when):
    the run saves at the end of the running call, says so in one line naming the step and
    the checkpoint, and returns ``preempted``; the same run again resumes and ends bitwise
    where an uninterrupted one does. A signal from another process, and the CLI's exit 0,
    are checked by the real-process test below (``-m slow``)."""
    need_devices(8)
    lines: list[str] = []

    def echo(line: str) -> None:
        if not lines:
            signal.raise_signal(signal.SIGTERM)
        lines.append(line)

    stopped = train(cfg(tmp_path / "term", quiet=False), dataset=DATA, echo=echo)
    assert stopped.preempted
    said = [s for s in lines if s.startswith("stopped by SIGTERM at step ")]
    assert len(said) == 1, lines
    step = int(said[0].split("at step ")[1].split(":")[0])
    assert 0 < step < 12 and f"saved checkpoint {step} in " in said[0], said[0]
    assert list_checkpoints(tmp_path / "term")[-1] == step
    resumed = train(cfg(tmp_path / "term"), dataset=DATA, echo=lines.append)
    assert not resumed.preempted and resumed.history[-1]["step"] == 12
    whole = train(cfg(tmp_path / "whole"), dataset=DATA)
    chex.assert_trees_all_equal(jax.device_get(resumed.state), jax.device_get(whole.state))


# ------------------------------------------------------------------ real processes
def cli_cmd(npz, workdir, *extra) -> list[str]:
    return [
        sys.executable,
        "-m",
        "meshensemble.cli",
        "train",
        "--fake-devices",
        "2",
        "--source",
        "npz",
        "--data-file",
        npz,
        "--model",
        "mlp",
        "--members",
        "2",
        "--batch-size",
        "32",
        "--epochs",
        "2",
        "--checkpoint-every",
        "1",
        "--keep",
        "2",
        "--workdir",
        str(workdir),
        "--quiet",
        *extra,
    ]


def run_cli(cmd, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def uninterrupted(npz, tmp_path_factory):
    workdir = tmp_path_factory.mktemp("whole")
    done = run_cli(cli_cmd(npz, workdir))
    assert done.returncode == 0, done.stderr
    return workdir


def _params(workdir):
    ens = me.Ensemble(me.models.MLP(), TX, 2, me.make_mesh(2, 1), input_transform=me.data.normalize)
    state, loop, step = me.restore_checkpoint(str(workdir), ens, DATA.test_images[:1])
    return jax.device_get(state), step


SIGNAL_AT_CALL = """
import os, sys
from meshensemble.cli import main
from meshensemble.training.feeder import Feeder

call, signum, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
run, calls = Feeder.run, []

def run_then_signal(self, *args):
    out = run(self, *args)
    calls.append(1)
    if len(calls) == call:  # progress, not a timer: after this call's steps, before its save
        print(f"signal {signum} after call {call}", flush=True)
        os.kill(os.getpid(), signum)
    return out

Feeder.run = run_then_signal
sys.exit(main(argv))
"""


def signalled_at(cmd: list[str], call: int, signum: int) -> list[str]:
    """``cmd`` (a ``cli_cmd``) run so that the process sends itself ``signum`` right after
    its ``call``-th training call: a signal at a known point of the run on any machine."""
    assert cmd[1:3] == ["-m", "meshensemble.cli"]
    return [cmd[0], "-c", SIGNAL_AT_CALL, str(call), str(int(signum)), *cmd[3:]]


@pytest.mark.slow  # real processes; in process: the split run, unfinished saves
@pytest.mark.parametrize("seed", [0, 1])
def test_kill_9_mid_run_then_resume_matches_uninterrupted(npz, tmp_path, uninterrupted, seed):
    """SIGKILL after step 3 or 8 of 12 (one step a call: a checkpoint every step), while
    the previous step's checkpoint may still be written; the resume says where it
    restarts and ends equal to the uninterrupted run."""
    workdir = tmp_path / "killed"
    at = (3, 8)[seed]
    killed = run_cli(signalled_at(cli_cmd(npz, workdir), at, signal.SIGKILL))
    assert killed.returncode == -signal.SIGKILL, killed.stdout + killed.stderr  # really killed
    assert f"signal {int(signal.SIGKILL)} after call {at}" in killed.stdout
    left = list_checkpoints(workdir)
    assert left and max(left) < at < 12, left  # mid-run: step `at` itself was never saved
    resumed = run_cli(cli_cmd(npz, workdir))
    assert resumed.returncode == 0, resumed.stderr
    said = [s for s in resumed.stdout.splitlines() if s.startswith("resumed from checkpoint")]
    assert len(said) == 1 and int(said[0].split()[3]) <= max(left), said
    got, step = _params(workdir)
    want, want_step = _params(uninterrupted)
    assert step == want_step == 12
    chex.assert_trees_all_equal(got, want)
    assert records(workdir) == records(uninterrupted)


@pytest.mark.slow  # a real process; in process: the SIGTERM test above
def test_sigterm_saves_at_the_next_boundary_and_exits_0(npz, tmp_path, uninterrupted):
    """SIGTERM during the run's first call (triggered by progress, not a timer): the
    loop saves at the end of that call, says so and exits 0; the resume ends equal."""
    workdir = tmp_path / "term"
    cmd = signalled_at(cli_cmd(npz, workdir, "--checkpoint-every", "100"), 1, signal.SIGTERM)
    done = run_cli(cmd)
    out, err = done.stdout, done.stderr
    assert done.returncode == 0, err
    line = [s for s in (out + err).splitlines() if "stopped by SIGTERM" in s]
    assert len(line) == 1, out + err
    step = int(line[0].split("at step ")[1].split(":")[0])
    assert 1 <= step < 12 and f"saved checkpoint {step}" in line[0]
    assert list_checkpoints(workdir) == [step]
    resumed = run_cli(cli_cmd(npz, workdir))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from checkpoint {step}" in resumed.stdout + resumed.stderr
    chex.assert_trees_all_equal(_params(workdir)[0], _params(uninterrupted)[0])


def _mount(*args) -> bool:
    if shutil.which("mount") is None or os.geteuid() != 0:
        return False
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


@pytest.mark.slow  # a real disk in a real process; in process: the simulated full disk below
def test_full_disk_gives_a_clear_error_and_the_previous_checkpoint_restores(npz, tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    if not _mount("-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)):
        pytest.skip("cannot mount a tmpfs here (needs root and mount privileges)")
    try:
        workdir = mnt / "run"
        done = run_cli(cli_cmd(npz, workdir, "--keep", "5"))
        assert done.returncode == 1, done.stdout + done.stderr
        lines = done.stderr.splitlines()
        assert len(lines) == 1, done.stderr
        assert lines[0].startswith("error: could not save checkpoint"), done.stderr
        assert ": no space left on device; checkpoint " in lines[0] and "intact" in lines[0]
        assert not list((workdir / "checkpoints").glob("*orbax-checkpoint-tmp*"))
        steps = list_checkpoints(workdir)
        assert steps, "the first checkpoints fit"
        state, step = _params(workdir)
        chex.assert_tree_all_finite(state)
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def in_process_argv(npz, workdir, *extra) -> list[str]:
    """The real-process runs' ``train`` arguments, for ``main`` here (2 of the 8 devices)."""
    argv = cli_cmd(npz, workdir, "--mesh", "ensemble=2,data=1", *extra)[3:]
    i = argv.index("--fake-devices")
    return argv[:i] + argv[i + 2 :]


@pytest.fixture(scope="module")
def uninterrupted_here(npz, tmp_path_factory):
    """An uninterrupted run of :func:`in_process_argv`, run by ``main`` in this process."""
    workdir = tmp_path_factory.mktemp("whole_here")
    assert main(in_process_argv(npz, workdir)) == 0
    return workdir


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_simulated_full_disk_gives_one_line_and_no_unfinished_save(
    npz, tmp_path, capsys, monkeypatch, uninterrupted_here
):
    """The disk fills at checkpoint 2 (every write of orbax's metadata fails with ENOSPC, in
    this process): one line, nothing unfinished left, and the same command resumes once space
    is freed. (The real-disk version, a 3 MB tmpfs in real processes, is ``-m slow``.)"""
    from etils import epath

    cls = type(epath.Path("/"))
    real = cls.write_text

    def write_text(self, *args, **kwargs):  # orbax writes its metadata and JSON items with it
        found = re.search(r"/checkpoints/(\d+)", str(self))
        if found and int(found.group(1)) >= 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, *args, **kwargs)

    def hard_exit(code: int, message: str) -> None:  # the CLI's os._exit, as an exception
        print(message, file=sys.stderr)
        raise SystemExit(code)

    workdir = tmp_path / "full"
    argv = in_process_argv(npz, workdir)
    capsys.readouterr()
    monkeypatch.setattr(cls, "write_text", write_text)
    monkeypatch.setattr(cli, "hard_exit", hard_exit)
    with pytest.raises(SystemExit) as left:
        main(argv)
    assert left.value.code == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"error: could not save checkpoint 2 in {workdir / 'checkpoints'}: no space left on "
        "device; checkpoint 1 is intact; free space there (or keep fewer checkpoints: --keep) "
        "and run the same command to resume, or use another --workdir"
    ], err
    assert not list((workdir / "checkpoints").glob("*orbax-checkpoint-tmp*"))
    assert list_checkpoints(workdir) == [1]
    monkeypatch.setattr(cls, "write_text", real)  # space freed: the same command resumes
    assert main(argv) == 0
    chex.assert_trees_all_equal(_params(workdir), _params(uninterrupted_here))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_new_run_whose_first_save_fails_leaves_nothing_and_says_start_again(
    npz, tmp_path, capsys, monkeypatch
):
    """The disk is full at the first checkpoint of a new run: nothing to resume, so the
    run's files go and the line says the same command starts again (which it does)."""
    from etils import epath

    cls = type(epath.Path("/"))
    real = cls.write_text

    def write_text(self, *args, **kwargs):
        if re.search(r"/checkpoints/\d+", str(self)):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        return real(self, *args, **kwargs)

    def hard_exit(code: int, message: str) -> None:  # the CLI's os._exit, as an exception
        print(message, file=sys.stderr)
        raise SystemExit(code)

    workdir = tmp_path / "full"
    argv = in_process_argv(npz, workdir, "--max-steps", "1")
    monkeypatch.setattr(cls, "write_text", write_text)
    monkeypatch.setattr(cli, "hard_exit", hard_exit)
    with pytest.raises(SystemExit) as left:
        main(argv)
    assert left.value.code == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no earlier checkpoint exists" in err[0], err
    assert err[0].endswith("run the same command to start again, or use another --workdir")
    assert not workdir.exists()
    monkeypatch.setattr(cls, "write_text", real)
    assert main(argv) == 0 and list_checkpoints(workdir) == [1]


def test_opening_a_checkpoint_folder_removes_unfinished_saves(tmp_path):
    unfinished = tmp_path / "w" / "checkpoints" / "7.orbax-checkpoint-tmp" / "state"
    unfinished.mkdir(parents=True)
    (unfinished / "_METADATA").write_text("{")
    messages: list[str] = []
    ckpt = me.Checkpointer(str(tmp_path / "w"), echo=messages.append)
    ckpt.close()
    assert messages == [
        f"removed 7.orbax-checkpoint-tmp in {tmp_path / 'w' / 'checkpoints'}: an unfinished "
        "save of a stopped run"
    ]
    assert os.listdir(tmp_path / "w" / "checkpoints") == []


@pytest.mark.slow  # among the heaviest default tests, measured
def test_read_only_workdir_is_refused_and_its_run_still_restores(
    npz, tmp_path, capsys, uninterrupted_here
):
    workdir = tmp_path / "ro"
    shutil.copytree(uninterrupted_here, workdir)
    if not (_mount("--bind", str(workdir), str(workdir))):
        pytest.skip("cannot bind-mount here (needs root and mount privileges)")
    try:
        if not _mount("-o", "remount,ro,bind", str(workdir)):
            pytest.skip("cannot remount read-only here")
        before = records(workdir)
        capsys.readouterr()
        assert main(in_process_argv(npz, workdir, "--epochs", "3")) == 2
        err = capsys.readouterr().err
        assert "is not writable" in err and str(workdir) in err
        assert records(workdir) == before
        assert _params(workdir)[1] == 12
    finally:
        subprocess.run(["umount", str(workdir)], check=False)


# ------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, npz) -> Path:
    workdir = tmp_path_factory.mktemp("finished")
    train(cfg(workdir, epochs=1, mesh="ensemble=4,data=1", source="npz", data_file=npz))
    return workdir


BAD = [
    (["--members", "0"], "members=0 must be a positive integer"),
    (["--members", "3", "--mesh", "ensemble=2"], "num_members=3 is not a positive multiple"),
    (["--mesh", "ensemble=4,modl=2"], "bad part 'modl=2'"),
    (["--mesh", "ensemble=16"], "needs 16 devices but only 8 exist"),
    (["--optimizer", "rmsprop"], "invalid choice: 'rmsprop'"),
    (["--batch-size", "30", "--mesh", "ensemble=2,data=4"], "batch_size=30 is not divisible"),
    (["--batch-size", "100000"], "batch_size=100000 is larger than"),
    (["--learning-rate", "-1"], "learning_rate=-1.0 must be a positive number"),
    (["--momentum", "1.5"], "momentum=1.5 must be in [0, 1)"),
    (["--keep", "0"], "keep=0 must be a positive integer"),
    (["--checkpoint-every", "0"], "checkpoint_every=0 must be a positive integer"),
    (["--on-nonfinite", "ignore"], "invalid choice: 'ignore'"),
    (["--epochs", "x"], "invalid int value: 'x'"),
    (["--source", "npz"], "npz"),
    (["--data-file", "/nonexistent.npz"], "/nonexistent.npz"),
    (["--backend", "pmap", "--mesh", "ensemble=4,data=2"], "backend='pmap' maps one axis"),
    (["--chunk-steps", "7"], "chunk_steps=7 does not divide"),
    (["--config", "/nonexistent.json"], "--config /nonexistent.json: cannot read JSON"),
    (["--dataset", "cifar10"], "unknown dataset 'cifar10' (use one of mnist, fashion_mnist, or"),
    (["--fake-devices", "0"], "--fake-devices 0 must be a positive integer"),
    (["--model", "mlp", "--conv", "im2col"], "conv='im2col' applies to the models cnn, howto_cnn"),
    (["--conv", "fft"], "invalid choice: 'fft'"),
    (["--precision", "fp8"], "invalid choice: 'fp8'"),
]


def test_a_config_file_s_mesh_of_the_wrong_type_is_one_line(tmp_path, capsys):
    config = tmp_path / "c.json"
    config.write_text('{"mesh": 5}')
    assert main(["train", "--config", str(config), "--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "error: mesh=5 must be a string like 'ensemble=4,data=2' (or None: every device)"
    assert not (tmp_path / "w").exists()


@pytest.mark.parametrize("argv,message", BAD, ids=[m[:30] for _, m in BAD])
def test_bad_input_table(tmp_path, capsys, argv, message):
    need_devices(8)
    workdir = tmp_path / "bad"
    code = main(["train", "--source", "sample", "--workdir", str(workdir), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "\n" not in err, err
    assert not workdir.exists()


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--no-resume"], "holds a run (config.json, metrics.jsonl, checkpoints); --no-resume"),
        (["--members", "8"], "holds a run with members=4, this run has members=8"),
        (["--seed", "3"], "holds a run with seed=0"),
    ],
)
def test_a_run_in_the_workdir_is_never_clobbered(finished_run, capsys, argv, message):
    before = {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()}
    code = main(["train", "--workdir", str(finished_run), *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2 and message in err and "\n" not in err, err
    after = {p: p.read_bytes() for p in finished_run.rglob("*") if p.is_file()}
    assert after == before


def test_corrupt_workdir_config_is_refused(tmp_path, capsys):
    workdir = tmp_path / "c"
    workdir.mkdir()
    (workdir / "config.json").write_text("{not json")
    assert main(["train", "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err
    assert "workdir config" in err and "cannot read JSON" in err
    assert (workdir / "config.json").read_text() == "{not json"


@pytest.mark.slow  # among the heaviest default tests, measured
def test_resume_says_so_and_overwrite_starts_over(finished_run, tmp_path, capsys):
    workdir = tmp_path / "again"
    shutil.copytree(finished_run, workdir)
    assert main(["train", "--workdir", str(workdir), "--epochs", "2"]) == 0
    out = capsys.readouterr().out
    assert "resumed from checkpoint 6" in out
    assert [r["step"] for r in records(workdir)] == [6, 12]
    assert (
        main(
            [
                "train",
                "--workdir",
                str(workdir),
                "--overwrite",
                "--no-resume",
                "--source",
                "npz",
                "--data-file",
                "/nonexistent.npz",
            ]
        )
        == 2
    )
    assert [r["step"] for r in records(workdir)] == [6, 12]  # a failed start deletes nothing


def test_checkpointer_reports_unwritable_target(tmp_path):
    need_devices(8)
    _, state = small_state()
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):  # root ignores the mode: nobody creates under a file
            (tmp_path / "file").write_text("")
            target, cause = tmp_path / "file" / "w", "not a directory (a file is in the way)"
        else:
            target, cause = locked / "w", "permission denied"
        with pytest.raises(me.CheckpointError) as caught:
            ckpt = me.Checkpointer(str(target))
            ckpt.save(1, state, {"step": 1})
            ckpt.close()
        assert str(caught.value) == (
            f"cannot create {target / 'checkpoints'}: {cause}; make it writable, or use "
            "another --workdir"
        )
        assert not target.exists()
    finally:
        locked.chmod(0o700)


# ------------------------------------------------------------------ checksums and their copy
def two_checkpoints(workdir) -> tuple:
    """Checkpoints 1 and 2 of different states (other initialisations)."""
    ens, first = small_state()
    second = ens.init(jax.random.PRNGKey(1), DATA.test_images[:1])
    ckpt = me.Checkpointer(str(workdir), keep=3)
    ckpt.save(1, first, {"step": 1})
    ckpt.save(2, second, {"step": 2})
    ckpt.close()
    return ens, (first, second)


def test_restore_takes_the_newest_checkpoint_not_the_oldest(tmp_path, caplog):
    need_devices(8)
    ens, (_, second) = two_checkpoints(tmp_path / "w")
    caplog.clear()
    state, loop, step = me.restore_checkpoint(str(tmp_path / "w"), ens, DATA.test_images[:1])
    assert (step, loop) == (2, {"step": 2})
    chex.assert_trees_all_equal(jax.device_get(state.params), jax.device_get(second.params))
    assert "Metadata file does not exist" not in caplog.text  # orbax's noise, dropped


def test_a_damaged_checksums_file_never_lets_a_damaged_checkpoint_through(tmp_path):
    need_devices(8)
    workdir = tmp_path / "w"
    ens, _ = two_checkpoints(workdir)
    folder = workdir / "checkpoints"
    assert read_checksums(str(folder)) == json.loads((folder / CHECKSUMS_COPY).read_text())
    flip_a_bit(biggest_file(workdir, 2))
    (folder / CHECKSUMS).write_text('{"1": "ab')  # truncated by a crash
    messages: list[str] = []
    _, _, step = me.restore_checkpoint(
        str(workdir), ens, DATA.test_images[:1], echo=messages.append, move_damaged=False
    )
    assert step == 1, messages  # the copy's checksum caught the flipped bit
    assert (
        messages[0].startswith(f"{folder / CHECKSUMS} is damaged (")
        and "using its copy" in (messages[0])
    )
    assert messages[1].startswith("checkpoint 2 is damaged (checksum mismatch)"), messages
    # both gone bad: refused, naming the file and the fix; nothing is used unverified
    (folder / CHECKSUMS_COPY).write_text("")
    with pytest.raises(me.checkpoint.CheckpointError) as err:
        me.restore_checkpoint(str(workdir), ens, DATA.test_images[:1])
    text = str(err.value)
    assert text.startswith(f"{folder / CHECKSUMS} is damaged (") and "write {} into" in text
    assert "\n" not in text


def test_every_json_of_a_run_is_written_atomically(tmp_path, monkeypatch):
    """No JSON file of a run is ever opened for writing under its own name (a crash
    mid-write would leave half a file): each is written to a temporary name beside it,
    then renamed (meshensemble.runtime.storage.atomic_write)."""
    need_devices(8)
    import builtins

    opened, real_open, real_os_open = [], builtins.open, os.open

    def spy(file, mode="r", *args, **kw):
        if isinstance(mode, str) and any(m in mode for m in "wax"):
            opened.append(os.path.basename(str(file)))
        return real_open(file, mode, *args, **kw)

    def os_spy(file, flags, *args, **kw):
        if flags & (os.O_WRONLY | os.O_RDWR):
            opened.append(os.path.basename(str(file)))
        return real_os_open(file, flags, *args, **kw)

    monkeypatch.setattr(builtins, "open", spy)
    monkeypatch.setattr(os, "open", os_spy)
    two_checkpoints(tmp_path / "w")
    me.data.write_array_record_dataset(tmp_path / "ar", me.data.synthetic(8, 4))
    writer = me.training.outputs.RunWriter(str(tmp_path / "w"))
    writer.write_config(cfg(tmp_path / "w"), {"data_identity": None})
    writer.write_compile({})
    assert {CHECKSUMS, CHECKSUMS_COPY, "manifest.json", "config.json"} <= set(os.listdir(
        tmp_path / "w" / "checkpoints")) | set(os.listdir(tmp_path / "ar")) | set(
        os.listdir(tmp_path / "w"))  # fmt: skip
    temporary = {re.sub(r"^\.(.*)\.[0-9a-f]{12}\.tmp$", r"\1", n) for n in opened}
    assert set(JSON_FILES) <= temporary, opened  # the spies saw each one's temporary file
    assert not [name for name in opened if name in JSON_FILES], opened


def test_resume_refuses_data_with_every_odd_image_inverted_naming_the_split(tmp_path):
    """Every byte counts: more images than the old strided sample read (1,024 of them)."""
    from meshensemble.training import identity

    data = me.data.synthetic(num_train=2100, num_test=8, seed=4)
    images = data.train_images.copy()
    images[1::2] = 255 - images[1::2]  # the same labels
    odd = me.data.Dataset("mnist", images, data.train_labels, data.test_images,
                          data.test_labels, source="synthetic", note="odd")  # fmt: skip
    held = identity.data_identity(data, None)
    saved = {"resolved": {"data_identity": held, "data": "synthetic"}}
    identity.check_same_run(str(tmp_path), saved, {}, identity.data_identity(data, None))
    with pytest.raises(ValueError) as err:
        identity.check_same_run(str(tmp_path), saved, {}, identity.data_identity(odd, None))
    text = str(err.value)
    assert text.startswith(f"workdir {tmp_path} holds a run with train split fingerprint=bytes:")
    assert "(the train data differ)" in text and "\n" not in text
    # with a validation split, both parts are named
    held = identity.data_identity(data, None, validation=100, seed=0)
    saved = {"resolved": {"data_identity": held, "data": "synthetic"}}
    with pytest.raises(ValueError, match=r"\(the train and validation data differ\)"):
        identity.check_same_run(str(tmp_path), saved, {}, identity.data_identity(odd, None, 100))


def test_a_missing_checkpoint_folder_has_no_digest(tmp_path):
    """The SHA-256 of nothing must not pass for a missing checkpoint's checksum."""
    from meshensemble.training.checkpoint import checkpoint_digest

    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        checkpoint_digest(str(tmp_path / "469"))
    (tmp_path / "469").mkdir()
    (tmp_path / "469" / "a").write_bytes(b"x")
    assert len(checkpoint_digest(str(tmp_path / "469"))) == 64
