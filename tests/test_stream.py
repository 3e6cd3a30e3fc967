"""The streamed input (`--input stream`): Grain sources, per-process rows, resumable state."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import chex
import jax
import numpy as np
import optax
import pytest
from conftest import need_devices, small_config

import meshensemble as me
from meshensemble.data import stream
from meshensemble.training import Feeder, TrainConfig, train
from meshensemble.training.checkpoint import Checkpointer, list_checkpoints, restore_checkpoint

REPO = Path(__file__).resolve().parents[1]
DATA = me.data.synthetic(num_train=192, num_test=40, seed=0)
TX = optax.sgd(0.05, 0.9)


def tiny(tmp_path, name="run", **kw) -> TrainConfig:
    return small_config(tmp_path / name, **({"checkpoint": False} | kw))


# ------------------------------------------------------------------ sources
def test_sources_read_the_same_examples(tmp_path):
    x, y = DATA.train_images, DATA.train_labels
    paths = stream.write_array_record(tmp_path / "train.array_record", x, y, shards=3)
    idx = np.array([[5, 0, 191], [17, 100, 3]])
    for src in (stream.ArraySource(x, y), stream.ArrayRecordSource(paths)):
        assert len(src) == 192
        got_x, got_y = src.read(idx)
        np.testing.assert_array_equal(got_x, x[idx])
        np.testing.assert_array_equal(got_y, y[idx])
        assert got_x.dtype == np.uint8 and got_y.dtype == np.int32
    with pytest.raises(me.data.DataError, match="write_array_record"):
        stream.ArrayRecordSource(tmp_path / "missing.array_record")


def test_tfds_data_source_streams(tmp_path):
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=24, policy=tfds.testing.MockPolicy.USE_CODE):
        src = stream.TfdsSource(tfds.data_source("mnist", split="train"))
        x, y = src.read(np.array([3, 0, 7]))
    assert x.shape == (3, 28, 28, 1) and x.dtype == np.uint8
    assert y.shape == (3,) and ((y >= 0) & (y < 10)).all()


def test_local_block_covers_this_process():
    need_devices(8)
    assert stream.local_block(me.make_mesh(4, 2), 32) == stream.Block((0, 32))
    assert stream.local_block(me.make_mesh(4, 2), 32, members=4) == stream.Block((0, 32), (0, 4))


@pytest.mark.parametrize(
    "mesh_shape,members,blocks",
    [
        # 2 "processes" of 4 devices: data=8 splits the rows, each reads half
        ((1, 8), None, [((0, 16), None), ((16, 32), None)]),
        # ensemble=2 x data=4: process 0 holds ensemble row 0; a shared batch is whole
        # there, a per-member batch only its members
        ((2, 4), None, [((0, 32), None), ((0, 32), None)]),
        ((2, 4), 4, [((0, 32), (0, 2)), ((0, 32), (2, 4))]),
        # 4 "processes" of 2 devices on data=4 x ensemble=2: a quarter of the rows each
        ((2, 4), None, [((0, 16), None), ((16, 32), None), ((0, 16), None), ((16, 32), None)]),
    ],
)
def test_each_process_reads_only_its_block_of_the_batch(mesh_shape, members, blocks):
    """The per-process row selection without processes: the devices of process p (a
    consecutive slice of the 8, as make_mesh orders processes) give p's block."""
    need_devices(8)
    mesh = me.make_mesh(*mesh_shape)
    per = 8 // len(blocks)
    for p, want in enumerate(blocks):
        devices = jax.devices()[p * per : (p + 1) * per]
        assert stream.local_block(mesh, 32, members, devices=devices) == stream.Block(*want)
    assert stream.local_block(mesh, 32, members) == stream.Block(
        (0, 32), None if members is None else (0, members)
    )  # one process: everything


def test_iterator_yields_the_orders_rows_and_its_state_resumes():
    order = lambda e: np.random.default_rng(e).permutation(192)
    block = stream.Block((8, 24))
    it = stream.StreamIterator(DATA, order, 32, 6, block, threads=2, prefetch=3)
    for step in range(6):
        x, y = it.next_batch(1, step)
        want = order(1)[step * 32 + 8 : step * 32 + 24]
        np.testing.assert_array_equal(y, DATA.train_labels[want])
    assert it.get_state() == {"epoch": 2, "step": 0}
    it.next_batch(2, 0)
    state = json.loads(json.dumps(it.get_state()))
    again = stream.StreamIterator(DATA, order, 32, 6, block)
    again.set_state(state)
    assert again.get_state() == {"epoch": 2, "step": 1}
    np.testing.assert_array_equal(again.next_batch(2, 1)[1], it.next_batch(2, 1)[1])
    with pytest.raises(ValueError, match="iterator state"):
        again.set_state({"epoch": 1, "step": 6})


def test_auto_picks_stream_beyond_the_device_budget(monkeypatch):
    monkeypatch.setenv("MESHENSEMBLE_DEVICE_BUDGET", str(100 * stream.EXAMPLE_BYTES))
    assert stream.choose_input(100)[0] == "device"
    choice, why = stream.choose_input(101)
    assert choice == "stream" and "MESHENSEMBLE_DEVICE_BUDGET" in why
    monkeypatch.delenv("MESHENSEMBLE_DEVICE_BUDGET")
    assert stream.choose_input(60_000)[0] == "device"


def test_streaming_flag_is_a_deprecated_spelling_of_input_stream():
    with pytest.warns(FutureWarning, match="--input stream"):
        cfg = TrainConfig(streaming=True).validate()
    with pytest.raises(ValueError, match="input='disk'"):
        TrainConfig(input="disk").validate()
    assert cfg.input == "auto"  # the flag alone already means stream (resolve_input)


# ------------------------------------------------------------------ runs
@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("shuffle", ["shared", "per-member"])
def test_streamed_run_equals_on_device_run(tmp_path, shuffle):
    need_devices(8)
    device = train(tiny(tmp_path, "d", shuffle=shuffle, max_steps=9, input="device"), dataset=DATA)
    streamed = train(
        tiny(tmp_path, "s", shuffle=shuffle, max_steps=9, input="stream"), dataset=DATA
    )
    chex.assert_trees_all_close(
        jax.device_get(device.state.params), jax.device_get(streamed.state.params), atol=1e-5
    )
    for key, value in device.history[-1].items():  # train_curve: a dict of lists
        got = streamed.history[-1][key]
        assert jax.tree.structure(got) == jax.tree.structure(value), key
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(value)):
            np.testing.assert_allclose(a, b, atol=1e-5, err_msg=key)
    assert streamed.history[-1]["step"] == 9


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("first", [3, 8])
def test_split_streamed_run_resumes_bitwise(tmp_path, first):
    need_devices(8)
    kw = dict(input="stream", checkpoint=True, shuffle="per-member")
    whole = train(tiny(tmp_path, "whole", **kw), dataset=DATA)
    part = train(tiny(tmp_path, "split", max_steps=first, **kw), dataset=DATA)
    assert part.history[-1]["step"] == first
    rest = train(tiny(tmp_path, "split", **kw), dataset=DATA)
    chex.assert_trees_all_equal(jax.device_get(rest.state), jax.device_get(whole.state))
    strip = lambda r: {k: v for k, v in r.items() if k != "train_curve"}
    assert strip(rest.history[-1]) == strip(whole.history[-1])
    # the stop logs the curve's points so far; the resumed run logs the rest, the same bits
    points = lambda history: {
        s: loss for r in history for s, loss in zip(*r.get("train_curve", {}).values())
    }  # fmt: skip
    assert points(part.history + rest.history) == points(whole.history)


def test_iterator_state_round_trips_through_a_checkpoint(tmp_path):
    need_devices(8)
    cfg = tiny(tmp_path, "ck", input="stream", checkpoint=True, max_steps=4)
    result = train(cfg, dataset=DATA)
    _, loop, step = restore_checkpoint(cfg.workdir, result.ensemble, DATA.test_images[:1])
    assert step == 4 and loop["input"] == {"epoch": 1, "step": 4}
    feeder = Feeder(result.ensemble, DATA, cfg, jax.random.key(1), 1, 6)
    feeder.restore_input(loop)
    assert feeder.stream.get_state() == loop["input"]
    ckpt = Checkpointer(str(tmp_path / "again"))
    ckpt.save(4, result.state, {"step": 4, **feeder.input_state()})
    ckpt.close()
    _, back, _ = restore_checkpoint(str(tmp_path / "again"), result.ensemble, DATA.test_images[:1])
    assert back["input"] == loop["input"]


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("shuffle", ["shared", "per-member"])
def test_larger_than_device_budget_array_record_streams(tmp_path, monkeypatch, shuffle):
    need_devices(8)
    big = me.data.synthetic(num_train=1536, num_test=40, seed=5)
    paths = stream.write_array_record(
        tmp_path / "big.array_record", big.train_images, big.train_labels, shards=4
    )
    budget = 256 * stream.EXAMPLE_BYTES  # the set is 6x what a device may take
    monkeypatch.setenv("MESHENSEMBLE_DEVICE_BUDGET", str(budget))
    lines, before = [], {id(a) for a in jax.live_arrays()}
    cfg = tiny(tmp_path, "big", shuffle=shuffle, epochs=1, batch_size=64, quiet=False)
    result = train(cfg, dataset=big, echo=lines.append, source=stream.ArrayRecordSource(paths))
    said = [s for s in lines if s.startswith("input:")]
    assert said and said[0].startswith("input: stream (--input auto:"), lines
    assert result.history[-1]["step"] == 24
    # the images never went to the devices (only batches did; the order [N] int32 does)
    new = [a for a in jax.live_arrays() if id(a) not in before]
    assert not [a for a in new if a.shape[:1] == (1536,) and a.ndim > 1]
    with pytest.raises(ValueError, match="stream source holds 1536 examples"):
        train(
            tiny(tmp_path, "val", input="stream", batch_size=64, validation=64),
            dataset=big,
            source=stream.ArrayRecordSource(paths),
        )
    ref = train(
        tiny(tmp_path, "ref", shuffle=shuffle, epochs=1, batch_size=64, input="device"), dataset=big
    )
    chex.assert_trees_all_close(
        jax.device_get(result.state.params), jax.device_get(ref.state.params), atol=1e-5
    )


# ------------------------------------------------------------------ kill -9, then resume
def cli_cmd(npz, workdir, *extra) -> list[str]:
    cmd = [sys.executable, "-m", "meshensemble.cli", "train", "--fake-devices", "2"]
    cmd += ["--source", "npz", "--data-file", npz, "--model", "mlp", "--members", "2"]
    cmd += ["--batch-size", "32", "--epochs", "2", "--checkpoint-every", "1", "--keep", "2"]
    return [*cmd, "--input", "stream", "--workdir", str(workdir), "--quiet", *extra]


def run_cli(cmd, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.fixture(scope="module")
def npz(tmp_path_factory) -> str:
    return me.data.save_npz(DATA, tmp_path_factory.mktemp("data") / "synthetic.npz")


def _state(workdir):
    ens = me.Ensemble(me.models.MLP(), TX, 2, me.make_mesh(2, 1), input_transform=me.data.normalize)
    state, loop, step = restore_checkpoint(str(workdir), ens, DATA.test_images[:1])
    return jax.device_get(state), loop, step


def _records(workdir) -> list[dict]:
    return [json.loads(s) for s in Path(workdir, "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_kill_9_of_a_streamed_run_then_resume_is_bitwise_uninterrupted(npz, tmp_path, seed):
    whole = run_cli(cli_cmd(npz, tmp_path / "whole"))
    assert whole.returncode == 0, whole.stderr
    workdir = tmp_path / "killed"
    at = random.Random(seed).randint(2, 10)  # a random step, mid-epoch for seeds 0 and 1
    proc = subprocess.Popen(cli_cmd(npz, workdir), cwd=REPO, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while max(list_checkpoints(workdir), default=0) < at:  # a guard only: nothing timed
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() - t0 < 300, "no checkpoint appeared"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert max(list_checkpoints(workdir)) < 12  # killed before the end: resuming is needed
    resumed = run_cli(cli_cmd(npz, workdir))
    assert resumed.returncode == 0, resumed.stderr
    got, loop, step = _state(workdir)
    want, want_loop, want_step = _state(tmp_path / "whole")
    assert step == want_step == 12
    assert loop["input"] == want_loop["input"] == {"epoch": 3, "step": 0}
    chex.assert_trees_all_equal(got, want)
    assert _records(workdir) == _records(tmp_path / "whole")
