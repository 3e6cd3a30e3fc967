"""Preemption within seconds whatever K: the pacing of calls, and SIGTERM in a whole-epoch chunk."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import need_devices, small_config

import meshensemble as me
from meshensemble.training import TrainConfig, build_ensemble, train
from meshensemble.training.checkpoint import list_checkpoints
from meshensemble.training.feeder import Feeder
from meshensemble.training.guards import NonFiniteError, NonFiniteGuard
from meshensemble.training.loop import LoopPosition
from meshensemble.training.pacing import Pacer, steps_within

REPO = Path(__file__).resolve().parents[1]
DATA = me.data.synthetic(num_train=256, num_test=40, seed=3)


class FakeClock:
    """A clock the test advances by the time the fake calls take."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def paced_calls(pacer: Pacer, clock: FakeClock, step_seconds: float, total: int, first=30.0):
    """Runs ``total`` steps in calls as the loop does; returns ``[(n, seconds)]`` per call."""
    calls, done = [], 0
    while done < total:
        n = pacer.count(total - done)
        started = pacer.start()
        clock.now += (first if not calls else 0.0) + n * step_seconds  # the first compiles
        pacer.observe(n, jnp.zeros(()), started)
        calls.append((n, clock.now - started))
        done += n
    return calls


def test_steps_within_is_the_budget_over_the_step_time_clamped_to_k():
    assert steps_within(0.1, 5.0, 469) == 50
    assert steps_within(0.001, 5.0, 469) == 469  # the whole chunk fits
    assert steps_within(9.0, 5.0, 8) == 1  # a step longer than the budget: one per call
    assert steps_within(0.0, 5.0, 8) == 8


def test_the_pacer_chooses_k_from_the_measured_step_time():
    clock = FakeClock()
    pacer = Pacer(k=469, stop_within=10.0, clock=clock)
    calls = paced_calls(pacer, clock, 0.3, 469)
    counts = [n for n, _ in calls]
    # 1 compiling call; 1 step (0.3 s, too short to time: double); 2 steps (0.6 s >= 0.5 s:
    # 0.3 s/step, so floor(5 s / 0.3 s) = 16 steps a call) until the epoch's end
    assert counts[:4] == [1, 1, 2, 16], counts
    assert set(counts[3:-1]) == {16} and sum(counts) == 469
    assert pacer.seconds_per_step == pytest.approx(0.3) and pacer.measuring
    assert max(s for _, s in calls[1:]) <= 5.0  # every call after the first: half the bound

    clock = FakeClock()
    fast = Pacer(k=100, stop_within=10.0, clock=clock)
    calls = paced_calls(fast, clock, 0.001, 500)
    # doubling 1, 2, 4, ... until a call is long enough to time, then whole chunks; a
    # whole chunk (0.1 s) far inside the budget ends the measuring: no more waiting
    assert [n for n, _ in calls][:8] == [1, 1, 2, 4, 8, 16, 32, 64], calls
    assert fast.cap == 100 and not fast.measuring

    slower = Pacer(k=469, stop_within=2.0, clock=(clock := FakeClock()))
    assert [n for n, _ in paced_calls(slower, clock, 0.3, 20)][:4] == [1, 1, 3, 3]

    off = Pacer(k=469, stop_within=0.0)
    assert off.count(469) == 469 and not off.measuring
    assert Pacer(k=1, stop_within=10.0).count(5) == 1


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_paced_call_computes_the_steps_of_a_whole_chunk(tmp_path):
    need_devices(8)
    cfg = TrainConfig(model="mlp", members=4, batch_size=32, learning_rate=0.05)
    ens = build_ensemble(dataclasses.replace(cfg, member_strategy="vmap"), me.make_mesh(4, 2), 256)
    key = jax.random.key(0)
    feeder = Feeder(ens, DATA, cfg, key, 6, 8)
    assert feeder.dynamic
    init = lambda: ens.init(key, DATA.train_images[:1])
    whole, ref = feeder.chunk(6)(init(), feeder.images, feeder.labels, feeder.order(1), 0)
    state, rows = init(), []
    for first, n in ((0, 2), (2, 1), (3, 3)):
        state, metrics = feeder.run(state, 1, first, n)
        loss = np.asarray(jax.device_get(metrics["loss"]))
        assert loss.shape == (6, 4)
        np.testing.assert_array_equal(loss[: 6 - n], 0.0)  # the steps run are the last rows
        rows.append(loss[6 - n :])
    np.testing.assert_allclose(np.concatenate(rows), jax.device_get(ref["loss"]), atol=1e-6)
    chex.assert_trees_all_close(jax.device_get(state), jax.device_get(whole), atol=1e-6)


def tiny(tmp_path, name, **kw) -> TrainConfig:
    base = dict(chunk_steps=8, member_strategy="vmap")  # 8 steps: the whole epoch
    return small_config(tmp_path / name, **(base | kw))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_capped_run_equals_whole_chunks_bitwise(tmp_path):
    need_devices(8)
    # uncapped: calls of K = 8 steps, cut only at the checkpoint steps (every 3)
    whole = train(tiny(tmp_path, "whole", stop_within=0.0, checkpoint_every=3), DATA)
    capped = train(tiny(tmp_path, "capped", stop_within=1e-6), DATA)  # 1 step a call
    chex.assert_trees_all_equal(jax.device_get(capped.state), jax.device_get(whole.state))
    assert capped.history == whole.history  # train loss summed step by step: the same bits
    # a checkpoint step ends a call, so every multiple of 3 was saved (keep=3: the newest)
    assert list_checkpoints(tmp_path / "whole") == [12, 15, 16]
    assert list_checkpoints(tmp_path / "capped") == [8, 16]


def test_loss_sums_do_not_depend_on_how_steps_are_split():
    losses = np.random.default_rng(0).random((9, 3)).astype(np.float32) * 3
    one, split = LoopPosition(), LoopPosition()
    one.add(9, losses)
    split.add(2, losses[:2])
    split.add(3, np.concatenate([np.zeros((5, 3)), losses[2:5]]))  # a padded chunk: 3 ran
    split.add(4, losses[5:])
    one.settle(), split.settle()
    np.testing.assert_array_equal(one.loss_sum, split.loss_sum)


def test_stop_within_is_a_flag_and_is_validated():
    from meshensemble.cli import build_parser

    args = build_parser().parse_args(["train", "--stop-within", "2.5"])
    assert args.stop_within == 2.5
    with pytest.raises(ValueError, match="stop_within=-1"):
        TrainConfig(stop_within=-1).validate()


# --- SIGTERM during a chunk that is a whole epoch of the CNN on CPU -------------------

EPOCH_STEPS = 2000
"""Steps of an epoch of the sample (4,000 train) at batch 2: one chunk of K = 2000 (about
a minute on a 2-core CPU: without the cap, the stop would come only at its end)."""


CNN_CONFIG = TrainConfig(
    model="cnn", members=2, batch_size=2, member_strategy="vmap", conv="im2col"
)
"""What :func:`cnn_command` trains (to rebuild its ensemble for restoring)."""


def cnn_command(workdir, *extra) -> list[str]:
    cmd = [sys.executable, "-m", "meshensemble.cli", "train", "--source", "sample"]
    cmd += ["--model", "cnn", "--members", "2", "--mesh", "ensemble=2,data=1"]
    cmd += ["--batch-size", "2", "--chunk-steps", str(EPOCH_STEPS), "--epochs", "1"]
    cmd += ["--member-strategy", "vmap", "--conv", "im2col", "--eval-batch-size", "500"]
    return [*cmd, "--fake-devices", "2", "--workdir", str(workdir), *extra]


@pytest.mark.slow
def test_sigterm_in_a_whole_epoch_chunk_stops_within_seconds(tmp_path):
    workdir = tmp_path / "term"
    proc = subprocess.Popen(
        cnn_command(workdir),
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, PYTHONUNBUFFERED="1"),  # each progress line as it is printed
    )
    lines: list[str] = []
    pump = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    pump.start()
    try:
        t0 = time.monotonic()
        while not any("epoch 1: step" in s for s in lines):  # a tenth of the epoch is done
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            assert time.monotonic() - t0 < 600, "no progress line after 600 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        signalled = time.monotonic()
        proc.wait(timeout=600)  # a hang guard only
        took = time.monotonic() - signalled
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    pump.join(timeout=10)
    assert proc.returncode == 0, proc.stderr.read()[-2000:]
    stopped = [s for s in lines if s.startswith("stopped by SIGTERM")]
    assert stopped, lines
    step = int(stopped[0].split("at step ")[1].split(":")[0])
    assert f"saved checkpoint {step}" in stopped[0]
    # before the chunk's end (2000), where an unpaced run could first stop (how far before
    # depends on when the signal lands, so on the machine's speed: not asserted)
    assert step < EPOCH_STEPS, (stopped, took, lines)
    assert took < 15, f"exited {took:.1f}s after SIGTERM"  # the bound

    # resumed to a few steps on, it equals a run never interrupted, bitwise
    end = ["--max-steps", str(step + 7), "--quiet"]
    for command in (cnn_command(workdir, *end), cnn_command(tmp_path / "whole", *end)):
        done = subprocess.run(command, cwd=REPO, text=True, capture_output=True, timeout=900)
        assert done.returncode == 0, done.stderr[-2000:]
    states = []
    for run in (workdir, tmp_path / "whole"):
        ens = build_ensemble(CNN_CONFIG, me.make_mesh(2, 1), 4000)
        state, _, saved = me.restore_checkpoint(str(run), ens, np.zeros((1, 28, 28, 1), np.uint8))
        assert saved == step + 7
        states.append(jax.device_get(state))
    chex.assert_trees_all_equal(*states)
    last = lambda run: json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last(workdir) == last(tmp_path / "whole")


def test_a_non_finite_loss_in_a_paced_call_names_its_step():
    need_devices(8)
    ens = build_ensemble(TrainConfig(model="mlp", members=4), me.make_mesh(4, 2), 256)
    guard = NonFiniteGuard(ens, "stop", jax.random.key(0), DATA.train_images[:1])
    loss = np.zeros((6, 4), np.float32)  # a call of 3 steps of K = 6: the last 3 rows
    loss[4, 2] = np.nan  # its second step: step 12 of the run after step 10
    guard.check(None, {"loss": jnp.asarray(loss)}, 10, print, steps=3)
    with pytest.raises(NonFiniteError, match=r"member\(s\) \[2\] at step 12;"):
        guard.flush(None, print)
