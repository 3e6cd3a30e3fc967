"""Non-finite training is bounded and never saved; every JSON a run writes is strict.

Issue 25, case 8: ``--on-nonfinite reinit --learning-rate 1e30`` re-initialised every 3
steps forever, exited 0 with NaN metrics and a NaN checkpoint, and wrote bare ``NaN``
tokens to ``metrics.jsonl``.
"""

from __future__ import annotations

import dataclasses
import json

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import need_devices, small_config

import meshensemble as me
from meshensemble.cli import main
from meshensemble.training import NonFiniteError, train
from meshensemble.training.checkpoint import list_checkpoints
from meshensemble.training.guards import MAX_REINITS, NonFiniteGuard, finite_members
from meshensemble.training.loop import LoopPosition
from meshensemble.training.outputs import RunWriter, dumps_strict, restore_nonfinite

DATA = me.data.synthetic(num_train=192, num_test=40, seed=0)


def _refuse(token: str):
    raise ValueError(f"bare {token} token: not strict JSON")


def strict_load(text: str):
    """``json.loads`` that rejects NaN/Infinity tokens, as strict parsers do."""
    return json.loads(text, parse_constant=_refuse)


def _ensemble():
    need_devices(4)
    ens = me.Ensemble(me.models.MLP(), optax.sgd(0.1), 4, me.make_mesh(4, 1))
    return ens, ens.init(jax.random.key(5), DATA.train_images[:1])


def test_reinit_gives_up_after_the_documented_number_per_member():
    ens, state = _ensemble()
    guard = NonFiniteGuard(ens, "reinit", jax.random.key(0), DATA.train_images[:1])
    said: list[str] = []
    bad = {"loss": jnp.asarray([[np.nan, 1, 1, 1]], jnp.float32)}
    good = {"loss": jnp.asarray([[1, 1, 1, 1]], jnp.float32)}
    step = 0
    for _ in range(MAX_REINITS):  # member 0 diverges, is re-initialised, diverges again
        state = guard.check(state, bad, step, said.append)
        state = guard.check(state, good, step + 1, said.append)  # ran on the bad member
        step += 2
    assert len(said) == MAX_REINITS and list(guard.reinits) == [MAX_REINITS, 0, 0, 0]
    state = guard.check(state, bad, step, said.append)
    with pytest.raises(NonFiniteError, match=f"after {MAX_REINITS} re-initialisations") as e:
        guard.check(state, good, step + 1, said.append)
    assert "\n" not in str(e.value) and "member(s) [0]" in str(e.value)


def test_flush_checks_the_state_itself_not_only_the_losses():
    """A step with a finite loss can leave NaN weights: flush (before every checkpoint and
    evaluation) repairs them with reinit and refuses them with stop."""
    ens, state = _ensemble()

    def spoil(v):  # member 2's weights NaN, written on the host, sharded as before
        host = np.array(v)
        host[2] = np.nan
        return jax.device_put(host, v.sharding)

    poison = jax.tree.map(spoil, state.params)
    sick = state.replace(params=poison)
    assert list(np.asarray(finite_members(sick))) == [True, True, False, True]
    with pytest.raises(NonFiniteError, match=r"non-finite state in member\(s\) \[2\]"):
        NonFiniteGuard(ens, "stop", jax.random.key(0), DATA.train_images[:1]).flush(sick, print)
    said: list[str] = []
    guard = NonFiniteGuard(ens, "reinit", jax.random.key(0), DATA.train_images[:1])
    fixed = guard.flush(sick, said.append)
    assert np.asarray(finite_members(fixed)).all() and len(said) == 1
    chex.assert_tree_all_finite(fixed.params)


@pytest.mark.slow
def test_a_diverging_run_exits_1_in_one_line_and_saves_no_nan(tmp_path, capsys):
    need_devices(8)
    npz = me.data.save_npz(DATA, tmp_path / "synthetic.npz")
    workdir = tmp_path / "nan"
    argv = ["train", "--source", "npz", "--data-file", npz, "--model", "mlp", "--members", "4"]
    argv += ["--mesh", "ensemble=4,data=1", "--batch-size", "32", "--epochs", "3"]
    argv += ["--learning-rate", "1e30", "--on-nonfinite", "reinit", "--workdir", str(workdir)]
    assert main([*argv, "--quiet"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"after {MAX_REINITS} re-initialisations" in err, err
    for step in list_checkpoints(workdir):
        ens = me.Ensemble(me.models.MLP(), optax.sgd(0.1, 0.9), 4, me.make_mesh(4, 1))
        restored, _, _ = me.restore_checkpoint(str(workdir), ens, DATA.test_images[:1], step=step)
        chex.assert_tree_all_finite(restored.params)
    for name in ("config.json", "metrics.jsonl", "compile.json"):
        path = workdir / name
        if path.exists():
            for line in path.read_text().splitlines() if name.endswith("l") else [None]:
                strict_load(line if line is not None else path.read_text())


class NaNGradMLP(nn.Module):
    """Finite logits whose gradient is NaN (``sqrt`` at 0): a step with a finite loss
    leaves NaN weights."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(10)(x.reshape((x.shape[0], -1)))
        return h + jnp.sqrt(jnp.abs(h) * 0.0)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_finite_loss_with_nan_weights_is_not_saved(tmp_path, monkeypatch):
    """The only step's loss is finite (computed before the update) but the weights after it
    are not: the old loop saved that checkpoint and exited 0."""
    need_devices(4)
    monkeypatch.setitem(me.models.REGISTRY, "nangrad", NaNGradMLP)
    workdir = tmp_path / "one"
    cfg = small_config(workdir, model="nangrad", mesh="ensemble=4,data=1", max_steps=1)
    cfg = dataclasses.replace(cfg, autotune=False, member_strategy="vmap")
    with pytest.raises(NonFiniteError, match=r"non-finite state in member\(s\) \[0, 1, 2, 3\]"):
        train(cfg, dataset=DATA)
    assert list_checkpoints(str(workdir)) == []


def test_metrics_records_are_strict_json_with_a_note_and_read_back(tmp_path):
    writer = RunWriter(str(tmp_path))
    record = {"epoch": 1, "step": 6, "test_ensemble_nll": float("nan")}
    record |= {"test_member_nll": [0.5, float("inf")], "test_ensemble_entropy": float("nan")}
    writer.write_metrics(record)
    line = (tmp_path / "metrics.jsonl").read_text().strip()
    got = strict_load(line)
    assert got["test_ensemble_nll"] is None and got["test_member_nll"] == [0.5, None]
    assert got["nonfinite"] == {
        "test_ensemble_nll": "NaN",
        "test_member_nll/1": "Infinity",
        "test_ensemble_entropy": "NaN",
    }
    # a resumed run reads the records back with their NaN/inf, and writes them strictly again
    again = RunWriter(str(tmp_path), keep_until=6)
    back = again.history[0]
    assert np.isnan(back["test_ensemble_nll"]) and back["test_member_nll"][1] == np.inf
    assert "nonfinite" not in back
    strict_load((tmp_path / "metrics.jsonl").read_text())
    back = restore_nonfinite(strict_load(dumps_strict({"a": [np.float32(1), -np.inf]})))
    assert back["a"] == [1.0, -np.inf]


def test_the_flag_help_states_the_limit():
    field = {f.name: f for f in dataclasses.fields(me.TrainConfig)}["on_nonfinite"]
    assert f"at most {MAX_REINITS} times each per run" in field.metadata["help"]


@pytest.mark.slow  # among the heaviest default tests, measured
def test_every_json_of_a_run_with_nan_losses_is_strict_checkpoints_included(tmp_path):
    """A re-initialised member's NaN losses sit in the epoch's ``loss_sum`` when a checkpoint
    is saved mid-epoch: its loop-position JSON once held a bare ``NaN``."""
    need_devices(8)
    workdir = tmp_path / "reinit"
    cfg = small_config(workdir, learning_rate=1e30, on_nonfinite="reinit", max_steps=3)
    result = train(dataclasses.replace(cfg, autotune=False, member_strategy="vmap"), dataset=DATA)
    assert list_checkpoints(str(workdir)) == [3]
    texts = []  # every JSON document under the workdir, whatever its name (orbax's `metadata`)
    for path in sorted(p for p in workdir.rglob("*") if p.is_file()):
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        for doc in text.splitlines() if path.suffix == ".jsonl" else [text]:
            try:
                json.loads(doc)  # lenient: takes NaN
            except ValueError:
                continue
            texts.append((path, doc))
    assert any(p.parts[-2:] == ("loop", "metadata") for p, _ in texts), texts
    for path, doc in texts:
        try:
            strict_load(doc)
        except ValueError as e:
            raise AssertionError(f"{path.relative_to(workdir)}: {e}") from None
    # the position reads back with its NaN (the resumed epoch's mean loss stays NaN)
    ens = result.ensemble
    _, loop, _ = me.restore_checkpoint(str(workdir), ens, DATA.test_images[:1])
    pos = LoopPosition.from_json(loop)
    assert pos.step == 3 and np.isnan(np.asarray(pos.loss_sum)).any(), loop


def test_save_checkpoint_refuses_a_nan_loop_and_the_bench_json_is_strict(tmp_path):
    from meshensemble.bench.report import write_json

    ens, state = _ensemble()
    mngr = me.checkpoint_manager(str(tmp_path / "run"))
    with pytest.raises(ValueError, match="holds a NaN/inf float") as e:
        me.save_checkpoint(mngr, 1, state, {"step": 1, "loss_sum": [float("nan")]})
    assert "\n" not in str(e.value)
    mngr.close()
    write_json(
        {"case": {"seconds": float("nan"), "ratio": np.float32(np.inf)}}, tmp_path / "b.json"
    )
    back = restore_nonfinite(strict_load((tmp_path / "b.json").read_text()))
    assert np.isnan(back["case"]["seconds"]) and back["case"]["ratio"] == np.inf
