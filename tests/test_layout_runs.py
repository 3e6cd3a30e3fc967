"""Member layouts through runs: ``--model be_mlp``, ``--backbone RUN_OR_FILE --rank R``, the
backbone loader, resume and the one-line refusals (issue 40)."""

from __future__ import annotations

import json
import os

import chex
import flax.serialization
import jax
import numpy as np
import pytest
from conftest import need_devices, small_config
from flax import traverse_util

import meshensemble as me
from meshensemble.training import train
from meshensemble.training.backbone import load_backbone, save_backbone

DATA = me.data.synthetic(num_train=128, num_test=40, seed=3)


@pytest.fixture(scope="module")
def backbone_run(tmp_path_factory):
    """A one-member MLP run: the backbone of the adapter runs."""
    need_devices(8)
    workdir = tmp_path_factory.mktemp("backbone")
    cfg = small_config(workdir, members=1, mesh="ensemble=1,data=2", max_steps=4)
    result = train(cfg, dataset=DATA)
    return str(workdir), jax.tree.map(
        lambda v: np.asarray(v)[0], jax.device_get(result.state.params)
    )


@pytest.mark.slow
def test_a_backbone_reads_from_its_run_an_npz_and_a_msgpack(backbone_run, tmp_path):
    workdir, params = backbone_run
    chex.assert_trees_all_equal(load_backbone(workdir), params)
    save_backbone(str(tmp_path / "b.npz"), params)
    chex.assert_trees_all_equal(load_backbone(str(tmp_path / "b.npz")), params)
    (tmp_path / "b.msgpack").write_bytes(flax.serialization.to_bytes({"params": params}))
    chex.assert_trees_all_equal(load_backbone(str(tmp_path / "b.msgpack")), params)


@pytest.mark.slow
def test_a_damaged_backbone_checkpoint_and_other_inputs_are_refused(backbone_run, tmp_path):
    need_devices(8)
    import shutil

    workdir, _ = backbone_run
    copy = tmp_path / "copy"
    shutil.copytree(workdir, copy)
    step = max(me.checkpoint.list_checkpoints(str(copy)))
    files = [
        os.path.join(r, f) for r, _, fs in os.walk(copy / "checkpoints" / str(step)) for f in fs
    ]
    target = max(files, key=os.path.getsize)
    with open(target, "r+b") as f:  # one flipped bit
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    with pytest.raises(me.UsageError, match="does not match its recorded checksum"):
        load_backbone(str(copy))
    with pytest.raises(me.UsageError, match="no such run folder or file"):
        load_backbone(str(tmp_path / "nothing"))
    (tmp_path / "b.txt").write_text("x")
    with pytest.raises(me.UsageError, match=r"not a run folder, \.npz or \.msgpack"):
        load_backbone(str(tmp_path / "b.txt"))
    many = train(
        small_config(tmp_path / "many", members=2, mesh="ensemble=2,data=1", max_steps=1),
        dataset=DATA,
    )
    assert many.state.num_members == 2
    with pytest.raises(me.UsageError, match="the run has 2 members"):
        load_backbone(str(tmp_path / "many"))


@pytest.mark.slow
def test_an_adapter_run_keeps_the_backbone_frozen_and_records_it(backbone_run, tmp_path):
    """--backbone: every member starts at the backbone (bitwise), which stays frozen and
    shared; the run's config names the backbone and rank; its evaluation restores it."""
    need_devices(8)
    workdir, params = backbone_run
    cfg = small_config(tmp_path / "lora", backbone=workdir, rank=2, max_steps=6)
    result = train(cfg, dataset=DATA)
    state = result.state
    assert isinstance(state, me.SharedState)
    present = lambda t: {k: v for k, v in traverse_util.flatten_dict(t).items() if v is not None}
    chex.assert_trees_all_equal(present(jax.device_get(state.shared)), present(params))
    assert not jax.tree.leaves(state.shared_opt_state)
    assert state.params["Dense_0"]["lora_a"].shape == (4, 784, 2)
    moved = np.asarray(state.params["Dense_0"]["lora_b"])
    assert np.abs(moved).max() > 0  # the adapters trained (B starts at zero)
    recorded = json.loads((tmp_path / "lora" / "config.json").read_text())
    assert recorded["backbone"] == workdir and recorded["rank"] == 2
    scores = me.evaluation.evaluate_run(
        str(tmp_path / "lora"), ood=(), dataset=DATA, echo=lambda *_: None
    )
    assert scores["test_ensemble_accuracy"] == pytest.approx(
        result.history[-1]["test_ensemble_accuracy"]
    )


@pytest.mark.slow
def test_a_batchensemble_run_resumes_exactly(tmp_path):
    """be_mlp trains its layout (one shared kernel per layer); 3 steps then 3 more equal 6."""
    need_devices(8)
    straight = train(small_config(tmp_path / "a", model="be_mlp", max_steps=6), dataset=DATA)
    train(small_config(tmp_path / "b", model="be_mlp", max_steps=3), dataset=DATA)
    resumed = train(small_config(tmp_path / "b", model="be_mlp", max_steps=6), dataset=DATA)
    assert isinstance(straight.state, me.SharedState)
    assert straight.state.shared["BEDense_0"]["shared_kernel"].shape == (784, 128)
    chex.assert_trees_all_equal(jax.device_get(resumed.state), jax.device_get(straight.state))


@pytest.mark.parametrize(
    "kw,match",
    [
        pytest.param(  # builds the CNN's ensemble before it checks: slow
            dict(model="cnn"),
            r"--backbone .*: Dense_0/bias has shape \(128,\); the model's is \(256,\)",
            marks=pytest.mark.slow,
        ),
        (dict(model="be_mlp"), "has a member layout of its own"),
        (dict(rank=0), "rank=0"),
    ],
)
def test_a_backbone_that_does_not_fit_is_one_line_and_writes_nothing(request, tmp_path, kw, match):
    need_devices(8)
    # the options' refusals come before the backbone is read: no backbone run needed
    cnn = kw.get("model") == "cnn"
    workdir = request.getfixturevalue("backbone_run")[0] if cnn else str(tmp_path / "none")
    with pytest.raises((me.UsageError, ValueError), match=match) as err:
        train(small_config(tmp_path / "bad", backbone=workdir, max_steps=1, **kw), dataset=DATA)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "bad").exists()


@pytest.mark.slow
def test_a_resume_with_another_rank_or_backbone_is_refused(backbone_run, tmp_path):
    need_devices(8)
    workdir, params = backbone_run
    train(small_config(tmp_path / "r", backbone=workdir, rank=2, max_steps=2), dataset=DATA)
    with pytest.raises(ValueError, match="rank=2, this run has rank=3"):
        train(small_config(tmp_path / "r", backbone=workdir, rank=3, max_steps=4), dataset=DATA)
    save_backbone(str(tmp_path / "b.npz"), params)
    with pytest.raises(ValueError, match="backbone="):
        train(small_config(tmp_path / "r", backbone=str(tmp_path / "b.npz"), rank=2), dataset=DATA)


@pytest.mark.slow
def test_predict_and_the_exported_artifact_carry_the_backbone_once(backbone_run, tmp_path):
    """An adapter run predicts on another mesh, and its artifact embeds the backbone once
    (not once per member) and gives the predictor's probabilities."""
    need_devices(8)
    workdir, params = backbone_run
    run = tmp_path / "lora"
    train(small_config(run, backbone=workdir, rank=2, max_steps=3), dataset=DATA)
    predictor = me.load_predictor(str(run), mesh="ensemble=2,data=2")
    x = DATA.x_test[:8]
    probs = np.asarray(predictor.predict(x))
    me.serving.export_ensemble(predictor, str(tmp_path / "out"), platforms=("cpu",))
    blob = (tmp_path / "out" / "ensemble.jax").read_bytes()
    backbone = sum(np.asarray(v).nbytes for v in jax.tree.leaves(params))
    flat = traverse_util.flatten_dict(jax.device_get(predictor.state.params))
    adapters = sum(np.asarray(v).nbytes for k, v in flat.items() if k[-1].startswith("lora_"))
    assert len(blob) < backbone + adapters + backbone // 2  # 4 copies would be 4x the backbone
    exp = jax.export.deserialize(bytearray(blob))
    np.testing.assert_allclose(np.asarray(exp.call(x)["probs"]), probs, atol=1e-5)


def bn_mlp():
    """An MLP with BatchNorm: a backbone whose model is its parameters and its statistics."""
    return me.models.MLP((16,), batch_norm=True)


@pytest.mark.slow
def test_a_batchnorm_backbone_brings_its_statistics(tmp_path):
    """--backbone of a BatchNorm model: the members start at the backbone's running
    statistics (not fresh ones), so in evaluation they predict what the backbone does; a
    file of parameters alone is refused for such a model, before anything is written."""
    need_devices(8)
    from meshensemble.training.backbone import backbone_model_state, with_model_state

    model = f"{__name__}:bn_mlp"
    # 64 steps: BatchNorm's running statistics (momentum 0.99) are half way from fresh ones
    one = dict(model=model, members=1, mesh="ensemble=1,data=2", epochs=4, batch_size=8)
    base = train(small_config(tmp_path / "bn", **one), dataset=DATA)
    stats = jax.tree.map(lambda v: np.asarray(v)[0], jax.device_get(base.state.model_state))
    lora = train(
        small_config(tmp_path / "lora", model=model, backbone=str(tmp_path / "bn"), max_steps=1),
        dataset=DATA,
    )
    after = jax.device_get(lora.state.model_state)["batch_stats"]["BatchNorm_0"]["var"]
    want, fresh = stats["batch_stats"]["BatchNorm_0"]["var"], np.ones_like(after[0])
    # one step of the running average away from the backbone's statistics, not fresh ones
    assert np.abs(after - want).sum() < 0.1 * len(after) * np.abs(fresh - want).sum()
    ens = lora.ensemble
    got = backbone_model_state(
        str(tmp_path / "bn"), ens.model, ens.input_transform, DATA.x_train[:1]
    )
    chex.assert_trees_all_equal(got, stats)
    params = load_backbone(str(tmp_path / "bn"))
    save_backbone(str(tmp_path / "b.npz"), params)
    with pytest.raises(me.UsageError, match="keeps batch_stats .* give the backbone's run folder"):
        train(
            small_config(tmp_path / "bad", model=model, backbone=str(tmp_path / "b.npz")),
            dataset=DATA,
        )
    assert not (tmp_path / "bad").exists()
    assert with_model_state(lora.state, None) is lora.state
