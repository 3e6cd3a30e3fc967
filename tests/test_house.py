"""An ``Ensemble`` whose behaviour follows from its arguments and the state it is given.

No method but ``__init__`` assigns an attribute; the sharded layout (``state_spec``) is
the same before and after ``init``; one ensemble runs states of different key
implementations, each with its own program, in any order.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import chex
import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import meshensemble as me
from meshensemble.core import ensemble as ensemble_module
from meshensemble.core import keys
from meshensemble.testing import need_devices

TX = optax.sgd(0.1, 0.9)
RNG = np.random.default_rng(0)
IMAGES = RNG.integers(0, 256, (8, 8, 8, 1), dtype=np.uint8)
LABELS = RNG.integers(0, 10, (8,)).astype(np.int32)


def assignments_outside_init(source: str, name: str) -> list[str]:
    """``method: self.attr`` for each ``self.<attr> = ...`` in class ``name`` outside ``__init__``.

    Item assignment into a container made in ``__init__`` (``self.cache[k] = v``) is not
    an attribute assignment (the attribute is read, ``ast.Load``).
    """
    tree = ast.parse(source)
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    found = []
    for fn in node.body:
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) or fn.name == "__init__":
            continue
        for sub in ast.walk(fn):
            if isinstance(sub, ast.Call) and getattr(sub.func, "id", "") in ("setattr", "delattr"):
                found.append(f"{fn.name}: {sub.func.id}")
            if not isinstance(sub, ast.Attribute) or not isinstance(sub.ctx, ast.Store | ast.Del):
                continue
            if isinstance(sub.value, ast.Name) and sub.value.id == "self":
                found.append(f"{fn.name}: self.{sub.attr}")
    return found


def test_no_ensemble_method_but_init_assigns_an_attribute():
    source = inspect.getsource(ensemble_module)
    assert assignments_outside_init(source, "Ensemble") == []


def test_the_ast_check_finds_an_assignment():
    source = textwrap.dedent(
        """
        class Bad:
            def __init__(self):
                self.a, self.cache = 1, {}

            def later(self, v):
                self.cache[v] = v  # a cache made in __init__: allowed
                self.b: int = 2
                self.a += 1
                (self.c, _), = [(v, v)]
                setattr(self, "d", v)
        """
    )
    assert sorted(assignments_outside_init(source, "Bad")) == [
        "later: self.a", "later: self.b", "later: self.c", "later: setattr"
    ]  # fmt: skip


@pytest.mark.slow  # among the heaviest default tests, measured
def test_the_sharded_layout_is_the_same_before_and_after_init():
    need_devices(8)
    mesh = me.make_mesh(2, 4)
    ens = me.Ensemble(me.models.MLP(), TX, 2, mesh, shard_members=True, sample=IMAGES[:1])
    before = ens.state_spec
    assert before.params["Dense_0"]["kernel"] == P("ensemble", None, "data")  # (64, 128)
    state = ens.init(jax.random.key(0), IMAGES[:1])
    assert ens.state_spec == before == ens.state_specs(IMAGES)
    is_spec = lambda s: isinstance(s, P)
    for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(before, is_leaf=is_spec)):
        assert leaf.sharding.spec == spec
    # an ensemble made without a sample: the same layout from the batch, before init too
    other = me.Ensemble(me.models.MLP(), TX, 2, mesh, shard_members=True)
    assert other.state_specs(IMAGES[:3]) == before
    with pytest.raises(ValueError, match=r"sample=images\[:1\]"):
        other.state_spec  # noqa: B018
    other.train_step(other.init(jax.random.key(0), IMAGES[:1]), IMAGES, LABELS)
    with pytest.raises(ValueError, match="no sample"):
        other.state_spec  # noqa: B018  (still: nothing an earlier call did changes it)


def test_an_unsharded_state_spec_needs_nothing():
    need_devices(8)
    ens = me.Ensemble(me.models.MLP(), TX, 4, me.make_mesh(4, 2))
    assert ens.state_spec == P("ensemble") == ens.state_specs(None)


def trained(ens, key, steps: int = 2):
    state = ens.init(key, IMAGES[:1])
    for _ in range(steps):
        state, metrics = ens.train_step(state, IMAGES, LABELS)
    return jax.device_get(state), jax.device_get(metrics)


def make(**kwargs):
    augment = me.data.augment.make_augment("shift", 2)  # draws from the state's keys
    return me.Ensemble(me.models.MLP(), TX, 4, me.make_mesh(4, 2), augment=augment, **kwargs)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_one_ensemble_runs_states_of_two_key_implementations_in_any_order():
    need_devices(8)
    three, rbg = jax.random.key(0), jax.random.key(0, impl="rbg")
    want_three, want_rbg = trained(make(), three), trained(make(), rbg)  # fresh ensembles
    assert want_rbg[0].rng.shape == (4, 4) and want_three[0].rng.shape == (4, 2)
    ens = make()
    got_three = trained(ens, three)
    got_rbg = trained(ens, rbg)  # the threefry programs do not leak into the rbg state's
    again = trained(ens, three)  # nor the rbg ones back
    chex.assert_trees_all_equal(got_three, want_three)
    chex.assert_trees_all_equal(got_rbg, want_rbg)
    chex.assert_trees_all_equal(again, want_three)
    # and the implementation matters: the same seed augments differently
    assert not np.array_equal(want_three[1]["loss"], want_rbg[1]["loss"])


def test_the_steps_read_the_implementation_from_the_key_words():
    assert keys.impl_for(4) == "rbg"
    assert keys.impl_for(2) is None  # the default's words: a raw legacy key, the same bits
    assert keys.impl_for(4, "unsafe_rbg") == "unsafe_rbg"
    with pytest.raises(ValueError, match="key_impl"):
        keys.impl_for(3)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_key_its_words_do_not_name_needs_key_impl():
    need_devices(8)
    unsafe = jax.random.key(0, impl="unsafe_rbg")
    with pytest.raises(ValueError, match="key_impl='unsafe_rbg'"):
        make().init(unsafe, IMAGES[:1])
    state, _ = trained(make(key_impl="unsafe_rbg"), unsafe, steps=1)
    assert state.rng.shape == (4, 4)
    with pytest.raises(ValueError, match="key_impl='nope' is not a PRNG implementation"):
        make(key_impl="nope")


# ---------------------------------------------------------------- the run plan (no devices)
def test_the_run_plan_follows_from_the_config_and_data_size():
    from meshensemble.training.plan import TrainPlan, plan_training

    cfg = me.TrainConfig(members=8, batch_size=100, epochs=3)
    assert plan_training(cfg, 1050, 8, "cpu") == TrainPlan(
        mesh={"ensemble": 8, "data": 1}, steps_per_epoch=10, total_steps=30, chunk=1, batch=100
    )
    assert plan_training(cfg, 1050, 8, "gpu").chunk == 10  # an epoch per call
    capped = me.TrainConfig(members=4, batch_size=100, epochs=3, max_steps=7, chunk_steps=5)
    plan = plan_training(capped, 1000, 2, "cpu")
    assert plan.mesh == {"ensemble": 2, "data": 1} and plan.total_steps == 7 and plan.chunk == 5
    given = me.TrainConfig(mesh="ensemble=2,data=4", batch_size=64)
    assert plan_training(given, 640, 8, "cpu").mesh == {"ensemble": 2, "data": 4}


@pytest.mark.parametrize(
    "fields, num_train, says",
    [
        (dict(batch_size=200), 100, "batch_size=200 is larger than the 100 training"),
        (dict(batch_size=30, mesh="ensemble=2,data=4"), 300, "not divisible by the mesh's data"),
        (dict(batch_size=10, chunk_steps=3), 100, "chunk_steps=3 does not divide the 10 steps"),
    ],
)
def test_a_bad_run_plan_is_one_line_before_any_device(fields, num_train, says):
    from meshensemble.training.plan import plan_training

    with pytest.raises(ValueError, match=says):
        plan_training(me.TrainConfig(**fields), num_train, 8, "cpu")


@pytest.mark.slow  # among the heaviest default tests, measured
def test_ood_scoring_and_calibration_logits_stream_through_the_one_engine(monkeypatch):
    """Every host loop over a dataset is :func:`meshensemble.core.streaming.stream`.

    The OOD scoring of ``evaluate`` and the logits of ``evaluate --calibrate`` each call
    it once for a dataset, with an odd size (padded, masked last batch), and give the
    same numbers as whole-array calls.
    """
    from meshensemble.calibration import run as calibrate_run
    from meshensemble.core import streaming
    from meshensemble.tasks import ood as evaluation_run

    ens = me.Ensemble(me.models.MLP((16,)), TX, 2, me.make_mesh(ensemble=2, data=1))
    state = ens.init(jax.random.key(0), IMAGES[:1])
    x = np.concatenate([IMAGES, IMAGES[:3]])  # 11 examples, batches of 4: 4 + 4 + 3
    y = np.concatenate([LABELS, LABELS[:3]])
    calls = []
    real = streaming.stream
    monkeypatch.setattr(streaming, "stream", lambda *a, **k: calls.append(1) or real(*a, **k))
    logits = calibrate_run.stream_ensemble_logits(ens, state, x, batch_size=4)
    out = evaluation_run.stream_scores(ens, state, x, y, batch_size=4, num_bins=5)
    assert len(calls) == 2
    whole = me.calibration.ensemble_logits(ens.predict_members(state, x))
    np.testing.assert_allclose(logits, np.asarray(whole), rtol=1e-5, atol=1e-6)
    members = np.asarray(ens.predict_members(state, x, logits=True))
    entropy = np.asarray(me.metrics.ood_score_from_logits(members, "entropy"))
    np.testing.assert_allclose(out["scores"]["entropy"], entropy, rtol=1e-5, atol=1e-6)
    assert out["member_scores"]["max_prob"].shape == (2, 11)
    assert int(np.sum(out["ensemble"]["count"])) == 11
    right = np.argmax(np.asarray(ens.predict(state, x)), -1) == y
    counts = np.asarray(out["ensemble"]["count"])
    acc = np.asarray(out["ensemble"]["accuracy"])
    assert np.isclose(np.nansum(acc * counts), right.sum())  # each label with its image


@pytest.mark.slow  # among the heaviest default tests, measured
def test_evaluate_streams_through_the_one_engine_and_sums_every_batch(monkeypatch):
    """``Ensemble.evaluate`` is a :func:`~meshensemble.core.streaming.stream` call too.

    11 examples in batches of 4 (the last padded and masked): the streamed metrics equal
    the metrics of the whole set at once, so no batch is lost, doubled or mislabelled.
    """
    from meshensemble.core import streaming

    ens = me.Ensemble(me.models.MLP((16,)), TX, 2, me.make_mesh(ensemble=2, data=1))
    state = ens.init(jax.random.key(0), IMAGES[:1])
    x = np.concatenate([IMAGES, IMAGES[:3]])
    y = np.concatenate([LABELS, (LABELS[:3] + 1) % 10])  # the repeats with other labels
    calls = []
    real = streaming.stream
    monkeypatch.setattr(streaming, "stream", lambda *a, **k: calls.append(1) or real(*a, **k))
    streamed = ens.evaluate(state, x, y, batch_size=4)
    assert len(calls) == 1
    whole = me.metrics.ensemble_metrics(np.asarray(ens.predict_members(state, x)), y)
    for key in ("accuracy", "nll", "brier", "ece", "mutual_information", "disagreement"):
        np.testing.assert_allclose(streamed[key], float(whole[key]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(streamed["member_nll"], whole["member_nll"], rtol=1e-5)


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("shape, backend", [((2, 2), "shard_map"), ((4, 1), "pmap")])
def test_ood_scores_reduced_on_the_mesh_match_the_whole_array_scores(shape, backend):
    """:func:`meshensemble.core.steps.ood_stats`: members pooled by ``pmean``, bins by ``psum``.

    4 members, 2 per device on a 2x2 mesh (members and examples both split) and one per
    device under pmap: every ensemble score, every member's own score and both sets of
    bin sums equal what the metrics compute from the whole ``[members, N, classes]``.
    """
    need_devices(4)
    from meshensemble.tasks import ood as evaluation_run

    ens = me.Ensemble(me.models.MLP((16,)), TX, 4, me.make_mesh(*shape), backend=backend)
    state = ens.init(jax.random.key(1), IMAGES[:1])
    x, y = np.concatenate([IMAGES, IMAGES[:2]]), np.concatenate([LABELS, LABELS[:2]])
    out = evaluation_run.stream_scores(ens, state, x, y, batch_size=4, num_bins=5)
    z = np.asarray(ens.predict_members(state, x, logits=True))
    for kind in me.tasks.ood.OOD_SCORE_KINDS:
        want = np.asarray(me.metrics.ood_score_from_logits(z, kind))
        np.testing.assert_allclose(out["scores"][kind], want, rtol=1e-5, atol=1e-6)
    for kind in me.tasks.ood.MEMBER_OOD_KINDS:
        want = np.stack([me.metrics.ood_score_from_logits(z[m][None], kind) for m in range(4)])
        np.testing.assert_allclose(out["member_scores"][kind], want, rtol=1e-5, atol=1e-6)
    p = np.asarray(jax.nn.softmax(z))
    ens_bins = me.metrics.calibration_bins(p.mean(0), y, num_bins=5)
    np.testing.assert_allclose(out["ensemble"]["count"], ens_bins["count"])
    member_counts = sum(np.asarray(me.metrics.calibration_bins(pm, y, 5)["count"]) for pm in p)
    np.testing.assert_allclose(out["mean_member"]["count"], member_counts)
    right = sum((pm.argmax(-1) == y).sum() for pm in p)
    pooled = np.nansum(out["mean_member"]["accuracy"] * out["mean_member"]["count"])
    assert np.isclose(pooled, right)
