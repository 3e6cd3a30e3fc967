"""The training side of compilation and measured defaults: the persistent cache's settings,
the compile report, the run's program count, and the member strategy chosen by measurement
(never asserting speed: the clock or the measurement is injected)."""

from __future__ import annotations

import collections
import functools
import itertools
import json
import math
import os
import re
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import need_devices, shared_compile_cache
from jax.experimental.compilation_cache import compilation_cache

import meshensemble as me
from meshensemble import cli
from meshensemble.cli import train as cli_train
from meshensemble.runtime import autotune
from meshensemble.runtime.compilation import ENV_CACHE_DIR, CompileLog
from meshensemble.training import Feeder, TrainConfig, build_ensemble, loop, setup, train, tuning
from meshensemble.training.loop import run_keys, use_compilation_cache
from meshensemble.training.tuning import resolve_choices, step_candidate

DATA = me.data.synthetic(num_train=192, num_test=40, seed=0)
RUN_PROGRAMS = {
    "jit(_split_seed)",
    "jit(init)",
    "jit(_draw)",
    "jit(train_chunk)",
    "jit(eval_stats)",
    "jit(finite_members)",  # the guard's check of the state before every save (no NaN saved)
}
"""What a run compiles once its member strategy is decided (5 programs)."""


@pytest.fixture(autouse=True)
def jax_cache_options():
    """Puts JAX's global cache options back after each test."""
    names = ("jax_enable_compilation_cache", "jax_compilation_cache_dir")
    before = {n: getattr(jax.config, n) for n in names}
    yield
    for n, v in before.items():
        jax.config.update(n, v)
    compilation_cache.reset_cache()


TWO_PER_DEVICE = "ensemble=2,data=4"
"""A mesh with two of tiny's 4 members per device: the member strategies differ there."""


def tiny(tmp_path, name="run", **kw) -> TrainConfig:
    base = dict(
        model="mlp",
        members=4,
        mesh="ensemble=4,data=2",
        epochs=1,
        batch_size=32,
        learning_rate=0.05,
        workdir=str(tmp_path / name),
        quiet=True,
        checkpoint=False,
        eval_batch_size=40,  # one evaluation batch: no partial sums to add
        compile_cache_dir=shared_compile_cache(tmp_path / "cache"),  # own choices file
    )
    return TrainConfig(**(base | kw))


def no_measuring(*args, **kwargs):
    raise AssertionError("measured, but the choice was given, recorded or turned off")


def fake_measure(times, seen=None):
    """A stand-in for ``autotune.measure``: builds every candidate (as measuring does),
    times none, and reports ``times`` (no budget)."""

    def measure(candidates, default, *args, **kwargs):
        if seen is not None:
            seen.append((list(candidates), default))
        for make in candidates.values():
            make()
        return autotune.Measurement({n: times[n] for n in candidates})

    return measure


def roomy_budget(monkeypatch) -> None:
    """Runs whose tuner measures every candidate: a clock that ticks 1 s per reading (every
    step looks alike, so the platform default is kept) and 10,000 planned steps."""
    ticks = itertools.count()
    monkeypatch.setattr(tuning, "planned_steps", lambda cfg, dataset: 10_000)
    timed = functools.partial(tuning.resolve_choices, timer=lambda: float(next(ticks)))
    monkeypatch.setattr(setup, "resolve_choices", timed)


def test_cache_flags_and_env(tmp_path, monkeypatch):
    parse = lambda *argv: cli_train.config_from_args(
        cli.build_parser().parse_args(["train", "--workdir", str(tmp_path / "w"), *argv])
    )
    cfg = parse()
    assert cfg.compile_cache and cfg.compile_cache_dir is None and cfg.autotune
    cfg = parse("--no-compile-cache", "--no-autotune", "--compile-cache-dir", "/x/y")
    assert not cfg.compile_cache and cfg.compile_cache_dir == "/x/y" and not cfg.autotune

    assert use_compilation_cache(TrainConfig(compile_cache=False)) is None
    jax.jit(lambda x: x * 3)(1.0)  # JAX reads its cache options now: off
    given = str(tmp_path / "given")
    assert use_compilation_cache(TrainConfig(compile_cache_dir=given)) == given
    with CompileLog() as log:  # turned on in the same process: it takes effect at once
        jax.jit(lambda x: x * 5 + 1)(2.0)
    assert [p.cache for p in log.programs] == ["miss"]
    assert jax.config.jax_compilation_cache_dir == given and os.path.isdir(given)
    assert jax.config.jax_enable_compilation_cache
    monkeypatch.setenv(ENV_CACHE_DIR, str(tmp_path / "env"))
    assert use_compilation_cache(TrainConfig()) == str(tmp_path / "env")
    assert use_compilation_cache(TrainConfig(compile_cache=False)) is None
    assert not jax.config.jax_enable_compilation_cache
    # an unwritable folder: the run compiles as usual, never fails
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert use_compilation_cache(TrainConfig(compile_cache_dir=str(blocker / "jax"))) is None


@pytest.mark.slow  # among the heaviest default tests, measured
def test_compile_summary_written_and_printed(tmp_path, capsys):
    need_devices(8)
    lines: list[str] = []
    cfg = tiny(tmp_path, quiet=False, max_steps=2, member_strategy="loop")
    result = train(cfg, dataset=DATA, echo=lines.append)
    report = [line for line in lines if line.startswith("compiled ")]
    assert len(report) == 1 and "persistent cache:" in report[0]
    saved = json.loads((tmp_path / "run" / "compile.json").read_text())
    assert set(saved) == {
        "programs",
        "seconds",
        "cache_hits",
        "cache_misses",
        "by_program",
        "tuning",
    }
    assert saved["tuning"] == {"programs": 0, "seconds": 0.0}  # the strategy was given
    assert saved == result.compile
    assert saved["programs"] == len(saved["by_program"])
    assert {p["cache"] for p in saved["by_program"]} <= {"hit", "miss"}  # the cache is on
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["resolved"]["compile_cache"] == str(tmp_path / "cache" / "jax")

    capsys.readouterr()
    train(tiny(tmp_path, "quiet", max_steps=2, member_strategy="loop"), DATA)  # quiet=True
    assert "compiled " not in capsys.readouterr().out


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_run_compiles_few_programs(tmp_path):
    need_devices(8)
    with CompileLog() as log:
        result = train(tiny(tmp_path, max_steps=4, chunk_steps=2, member_strategy="vmap"), DATA)
    names = [p.name for p in log.programs]
    assert set(names) <= RUN_PROGRAMS, names
    assert len(names) <= len(RUN_PROGRAMS) and result.compile["programs"] == len(names)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_the_tuners_programs_are_reported_apart_and_only_at_first_use(tmp_path, monkeypatch):
    """A first run measures the member strategies: their programs are the tuner's, not the
    run's; a second run (new workdir, same cache) reads the choice and compiles none; a
    damaged entry costs one line; without a cache no line claims one (those two runs
    build the candidates but time them with a fake, to compile less)."""
    need_devices(8)
    lines: list[str] = []
    kw = dict(max_steps=2, mesh=TWO_PER_DEVICE)
    with monkeypatch.context() as patch:
        roomy_budget(patch)  # vmap is measured too
        first = train(tiny(tmp_path, quiet=False, **kw), DATA, echo=lines.append)
    tuned = first.compile["tuning"]
    assert tuned["programs"] >= 2 and tuned["seconds"] > 0  # vmap's initialisation and chunk
    assert {p["name"] for p in first.compile["by_program"]} <= RUN_PROGRAMS
    report = [line for line in lines if line.startswith("compiled ")]
    assert f"the auto-tuner compiled {tuned['programs']} more" in report[0]
    said = [line for line in lines if line.startswith("member strategy: ")]
    path = autotune.choices_path(str(tmp_path / "cache" / "jax"))
    assert len(said) == 1 and len(said[0]) <= 120, said  # the whole reason in config.json
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["resolved"]["tuning"]
    assert f"stored in {path}" in saved["reason"] and "resolved.tuning" in said[0]
    # measured with room to spare, but on CPU: bf16 is not timed (on a GPU it would be,
    # test_the_tuner_says_whether_bf16_would_be_faster)
    assert not any(line.startswith("bf16 would") for line in lines), lines
    second = train(tiny(tmp_path, "again", **kw), DATA)
    assert second.compile["tuning"] == {"programs": 0, "seconds": 0.0}
    assert second.compile["programs"] <= len(RUN_PROGRAMS)
    choices = json.loads(Path(path).read_text())  # a damaged entry: a line, the run goes on
    Path(path).write_text(json.dumps({k: {**v, "seconds": "abc"} for k, v in choices.items()}))
    lines.clear()
    monkeypatch.setattr(autotune, "measure", fake_measure({"vmap": 1.0, "loop": 1.0}))
    damaged = train(tiny(tmp_path, "damaged", quiet=False, **kw), DATA, lines.append)
    assert damaged.history[-1]["step"] == 2
    assert [line for line in lines if path in line and "ignored" in line], lines
    assert autotune.valid_record(next(iter(json.loads(Path(path).read_text()).values())))
    lines.clear()  # no compilation cache: measured, and the lines never claim a cache
    off = tiny(tmp_path, "off", quiet=False, compile_cache=False, **kw)
    train(off, DATA, lines.append)
    said = [line for line in lines if "member strategy: " in line or "auto-tuner" in line]
    assert any("not stored" in line for line in said), said
    assert not any("cached" in line for line in said), said


@pytest.mark.parametrize("seed", [0, 7, -1, 2**31 - 1, 2**40])
def test_run_keys_equal_the_split_of_the_seed_key(seed):
    want = jax.random.split(jax.random.key(seed))
    got = run_keys(seed)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_array_equal(jax.random.key_data(g), jax.random.key_data(w))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_resumed_run_reuses_the_recorded_choice(tmp_path, monkeypatch):
    need_devices(8)
    monkeypatch.setattr(autotune, "measure", fake_measure({"vmap": 1.0, "loop": 2.0}))
    cfg = tiny(tmp_path, checkpoint=True, max_steps=2, mesh=TWO_PER_DEVICE)
    first = train(cfg, DATA)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["resolved"]["member_strategy"] == "vmap"  # not the CPU default: measured
    assert config["resolved"]["tuning"]["how"] == "measured"
    assert config["member_strategy"] == "auto"  # the fields stay as given
    assert first.ensemble.member_strategy == "vmap"
    os.remove(autotune.choices_path(cfg.compile_cache_dir))  # nothing cached to read
    monkeypatch.setattr(autotune, "measure", no_measuring)
    resumed = train(tiny(tmp_path, checkpoint=True, max_steps=4, mesh=TWO_PER_DEVICE), DATA)
    assert resumed.ensemble.member_strategy == "vmap" and resumed.history[-1]["step"] == 4
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["resolved"]["tuning"]["how"] == "recorded"


@pytest.mark.slow  # among the heaviest default tests, measured
def test_measured_once_then_read_from_the_choices_file(tmp_path, monkeypatch):
    """The real measurement with a fake clock whose ticks shorten: the candidate measured
    second (vmap; the CPU default loop goes first) looks faster and wins."""
    need_devices(8)
    cfg = tiny(tmp_path, epochs=10_000, mesh=TWO_PER_DEVICE).validate()  # budget has room
    mesh = me.make_mesh(ensemble=2, data=4)
    key = jax.random.key(0)
    ticks = itertools.accumulate(1.0 / (i + 1) for i in itertools.count())
    cache = str(tmp_path / "cache" / "jax")
    feeder = run_feeder(cfg, DATA, k=1)
    choice = resolve_choices(cfg, mesh, DATA, key, cache, timer=lambda: next(ticks), feeder=feeder)
    assert choice.how == "measured" and choice.member_strategy == "vmap"
    assert choice.line().startswith("member strategy: vmap (vmap: ")
    assert "against loop" in choice.line() and "resolved.tuning" in choice.line()
    assert "stored in" in choice.resolved()["tuning"]["reason"]
    assert choice.ensemble is not None and choice.ensemble.member_strategy == "vmap"
    assert choice.feeder is not None and choice.feeder.ens is choice.ensemble
    with CompileLog() as log:  # the run trains with the winner's feeder: nothing compiles
        state = choice.ensemble.init(key, DATA.train_images[:1])
        jax.block_until_ready(choice.feeder.run(state, 1, 0, 1))
    assert log.programs == []
    monkeypatch.setattr(autotune, "measure", no_measuring)
    again = resolve_choices(cfg, mesh, DATA, key, cache)
    assert again.how == "cached" and again.member_strategy == "vmap"
    assert resolve_choices(cfg, mesh, DATA, key, None, {"member_strategy": "loop"}).how == (
        "recorded"
    )
    monkeypatch.undo()  # no cache folder: measured again, and the line pins the winner
    ticks = itertools.accumulate(1.0 / (i + 1) for i in itertools.count())
    unkept = resolve_choices(cfg, mesh, DATA, key, None, timer=lambda: next(ticks), feeder=feeder)
    assert unkept.member_strategy == "vmap" and "not stored" in unkept.line()
    assert "pin it with --member-strategy vmap" in unkept.resolved()["tuning"]["reason"]


def run_feeder(cfg: TrainConfig, dataset, k: int):
    """``feeder(ens)`` as :func:`meshensemble.training.train` gives the tuner (chunk ``k``)."""
    order_key = run_keys(cfg.seed)[1]
    steps = len(dataset.train_labels) // cfg.batch_size
    return lambda ens: Feeder(ens, dataset, cfg, order_key, k, steps)


def programs(result) -> collections.Counter:
    """The names of the programs a run compiled, its own and the tuner's, counted."""
    return collections.Counter(
        [p["name"] for p in result.compile["by_program"]]
        + ["tuning"] * result.compile["tuning"]["programs"]
    )


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_tuned_run_compiles_no_more_than_an_untuned_one_but_what_it_measured(
    tmp_path, monkeypatch
):
    """The tuner times the platform default with the run's own chunk program, on a copy of
    its initial state: a run that keeps the default compiles exactly the programs of a run
    with autotune off (K=2: a chunk of several steps, as on GPUs, called for one step),
    and trains bitwise the same members; one that also measures vmap compiles vmap's
    programs more, the tuner's (K=1, the CPU chunk). 2 planned steps can never pay for
    measuring (the budget is 0.2 steps), whatever the machine's speed."""
    need_devices(8)
    kw = dict(max_steps=2, mesh=TWO_PER_DEVICE)
    own = lambda name: shared_compile_cache(tmp_path / name)  # own choices: none read
    off = train(tiny(tmp_path, "off", autotune=False, chunk_steps=2, **kw), DATA)
    lines: list[str] = []
    kept_cfg = tiny(tmp_path, "kept", quiet=False, chunk_steps=2, compile_cache_dir=own("k"), **kw)
    kept = train(kept_cfg, DATA, lines.append)
    said = [line for line in lines if line.startswith("member strategy: ")]
    reason = json.loads((tmp_path / "kept" / "config.json").read_text())["resolved"]["tuning"]
    assert "default" in said[0] and len(said) == 1, said  # the whole reason in config.json
    assert "the platform default kept" in reason["reason"], reason
    assert "which the run reuses" in reason["reason"], reason
    assert kept.compile["tuning"]["programs"] == 0
    assert programs(kept) - programs(off) == collections.Counter(), (kept.compile, off.compile)
    chex.assert_trees_all_equal(kept.state.params, off.state.params)
    chex.assert_trees_all_equal(kept.state.opt_state, off.state.opt_state)
    roomy_budget(monkeypatch)
    measured = train(tiny(tmp_path, "m", chunk_steps=1, compile_cache_dir=own("m"), **kw), DATA)
    tuned = [p for p in measured.compile["by_program"] if p["name"] == "jit(train_chunk)"]
    assert len(tuned) == 1  # the run's chunk: the default's, timed and reused
    assert programs(measured) - programs(off) == collections.Counter(tuning=2)  # vmap's two
    assert measured.ensemble.member_strategy == "loop"


@pytest.mark.slow  # among the heaviest default tests, measured
def test_the_budget_is_checked_before_a_candidate_is_built(tmp_path, monkeypatch):
    """A fake clock on which building the default's ensemble and compiling it take 1,000 s
    (its steps 1 ms): measuring vmap would cost as much, far over 10 % of the 60,000
    planned steps, so vmap is never built; with a cheap build it is."""
    need_devices(8)
    cfg = tiny(tmp_path, epochs=10_000, mesh=TWO_PER_DEVICE).validate()
    mesh, key = me.make_mesh(ensemble=2, data=4), jax.random.key(0)
    clock, built = [0.0], []

    def timer():
        clock[0] += 0.001
        return clock[0]

    def building(slow):
        def build(given, *args, **kwargs):
            built.append(given.member_strategy)
            clock[0] += slow
            return build_ensemble(given, *args, **kwargs)

        return build

    monkeypatch.setattr(tuning, "build_ensemble", building(1000.0))
    feeder = run_feeder(cfg, DATA, k=1)
    choice = resolve_choices(cfg, mesh, DATA, key, None, timer=timer, feeder=feeder)
    assert built == ["loop"] and (choice.member_strategy, choice.how) == ("loop", "default")
    assert "over the tuner's budget of" in choice.reason and "1000 s compilation" in choice.reason
    assert choice.feeder is not None and choice.feeder.ens is choice.ensemble
    built.clear()
    monkeypatch.setattr(tuning, "build_ensemble", building(0.0))
    resolve_choices(cfg, mesh, DATA, key, None, timer=timer, feeder=feeder)
    assert built == ["loop", "vmap"]


@pytest.mark.slow  # among the heaviest default tests, measured
def test_one_member_per_device_never_times_vmap_against_loop(tmp_path, monkeypatch):
    need_devices(8)
    mesh = me.make_mesh(ensemble=4, data=2)
    monkeypatch.setattr(autotune, "measure", no_measuring)
    mlp = tiny(tmp_path, members=4).validate()  # 4 members on ensemble=4: one per device
    choice = resolve_choices(mlp, mesh, DATA, jax.random.key(0), None)
    assert (choice.member_strategy, choice.how) == ("loop", "default")
    assert "same program" in choice.reason
    seen: list = []
    times = {"canonical": 2.0, "im2col": 1.0, "gemm_grad": 3.0}
    monkeypatch.setattr(autotune, "measure", fake_measure(times, seen))
    cnn = tiny(tmp_path, model="cnn", members=4, epochs=1000).validate()
    choice = resolve_choices(cnn, mesh, DATA, jax.random.key(0), None)
    # convolutions only; on CPU "xla" is the default's program (canonical) and not timed
    assert seen == [(["canonical", "im2col", "gemm_grad"], "canonical")]
    assert (choice.member_strategy, choice.conv) == ("loop", "im2col")


@pytest.mark.slow  # among the heaviest default tests, measured
def test_no_autotune_and_explicit_choices_skip_measuring(tmp_path, monkeypatch):
    need_devices(8)
    monkeypatch.setattr(autotune, "measure", no_measuring)
    off = train(tiny(tmp_path, "off", autotune=False, max_steps=2), DATA)
    assert off.ensemble.member_strategy == me.default_strategy("cpu")
    given = train(tiny(tmp_path, "given", member_strategy="vmap", max_steps=2), DATA)
    assert given.ensemble.member_strategy == "vmap"
    mesh = me.make_mesh(ensemble=4, data=2)
    cnn = TrainConfig(model="cnn", members=4, conv="im2col", autotune=False).validate()
    choice = resolve_choices(cnn, mesh, DATA, jax.random.key(0), None)
    assert (choice.member_strategy, choice.conv, choice.how) == ("loop", "im2col", "default")
    given = TrainConfig(model="cnn", members=4, member_strategy="vmap", conv="xla").validate()
    choice = resolve_choices(given, mesh, DATA, jax.random.key(0), None)
    assert (choice.member_strategy, choice.conv, choice.how) == ("vmap", "xla", "given")


def test_measuring_never_consumes_the_given_state(tmp_path):
    need_devices(8)
    cfg = tiny(tmp_path).validate()
    ens = build_ensemble(cfg, me.make_mesh(ensemble=4, data=2), len(DATA.train_labels))
    state = ens.init(jax.random.key(0), DATA.train_images[:1])
    before = jax.device_get(state.params)
    step = step_candidate(ens, state, DATA.train_images[:32], DATA.train_labels[:32])
    for _ in range(3):
        jax.block_until_ready(step())
    assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(state))
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(state.params), before)
    state, _ = ens.train_step(state, DATA.train_images[:32], DATA.train_labels[:32])


def compiles_started(monkeypatch) -> list:
    """The futures of every ahead-of-time compilation a run starts (recorded, not changed)."""
    from meshensemble.runtime import precompile

    futures: list = []
    real = precompile.start_compiling
    monkeypatch.setattr(
        precompile, "start_compiling", lambda fn: futures.append(real(fn)) or futures[-1]
    )
    return futures


def assert_compiled_cleanly(futures: list) -> None:
    """At least one compilation was started and none failed (a failure falls back silently)."""
    assert futures, "nothing was compiled ahead of time"
    for future in futures:
        assert future.exception() is None, repr(future.exception())


@pytest.mark.slow  # among the heaviest default tests, measured
def test_the_chunk_compiled_ahead_of_time_gives_the_same_members(tmp_path, monkeypatch):
    need_devices(8)
    started: list[bool] = []
    original = Feeder.compile_ahead
    monkeypatch.setattr(
        Feeder, "compile_ahead", lambda self, init: started.append(original(self, init))
    )
    futures = compiles_started(monkeypatch)
    kw = dict(max_steps=4, chunk_steps=2, member_strategy="loop", shuffle="per-member")
    with CompileLog() as log:
        ahead = train(tiny(tmp_path, "ahead", **kw), DATA)
    assert started == [True]
    assert_compiled_cleanly(futures)  # a program compiled ahead, not a silent fallback
    assert [p.name for p in log.programs].count("jit(train_chunk)") == 1  # used, not redone
    monkeypatch.setattr(loop, "AHEAD_OF_TIME", False)
    lazy = train(tiny(tmp_path, "lazy", **kw), DATA)
    assert started == [True]
    chex.assert_trees_all_equal(ahead.state.params, lazy.state.params)
    chex.assert_trees_all_equal(ahead.state.opt_state, lazy.state.opt_state)
    assert ahead.history[-1]["train_loss"] == lazy.history[-1]["train_loss"]

    monkeypatch.setattr(loop, "AHEAD_OF_TIME", True)  # pmap has no lower(): compiled lazily
    pmap = train(tiny(tmp_path, "pmap", mesh="ensemble=4,data=1", backend="pmap", **kw), DATA)
    assert started == [True, False] and pmap.history[-1]["step"] == 4


@pytest.mark.slow  # among the heaviest default tests, measured
def test_the_evaluation_compiled_ahead_once_and_summed_on_the_host(tmp_path, monkeypatch):
    """Several evaluation batches (one padded): one eval program, compiled ahead, no adds."""
    need_devices(8)
    started: list[bool] = []
    original = Feeder.compile_eval_ahead
    monkeypatch.setattr(
        Feeder, "compile_eval_ahead", lambda self, *a: started.append(original(self, *a))
    )
    futures = compiles_started(monkeypatch)
    kw = dict(max_steps=4, chunk_steps=2, member_strategy="vmap", eval_batch_size=16)
    with CompileLog() as log:
        ahead = train(tiny(tmp_path, "ahead", **kw), DATA)  # 40 test examples: 16 + 16 + 8
    names = [p.name for p in log.programs]
    assert started == [True] and names.count("jit(eval_stats)") == 1, names
    assert_compiled_cleanly(futures)
    assert set(names) <= RUN_PROGRAMS, names  # the partial sums are added with numpy
    monkeypatch.setattr(loop, "AHEAD_OF_TIME", False)
    lazy = train(tiny(tmp_path, "lazy", **kw), DATA)
    assert started == [True]
    assert ahead.history[-1] == lazy.history[-1]
    one_batch = train(tiny(tmp_path, "one", **(kw | {"eval_batch_size": 40})), DATA)
    for key in ("test_ensemble_accuracy", "test_ensemble_nll", "test_ensemble_ece"):
        np.testing.assert_allclose(ahead.history[-1][key], one_batch.history[-1][key], rtol=1e-5)
    by_program = json.loads((tmp_path / "ahead" / "compile.json").read_text())["by_program"]
    assert {"jit(eval_stats)", "jit(train_chunk)"} <= {p["name"] for p in by_program}


def test_ahead_of_time_calls_the_compiled_program_only_for_its_signature():
    from meshensemble.runtime.precompile import AheadOfTime

    calls: list[str] = []

    class Fn:
        def __call__(self, *args):
            calls.append("lazy")
            return "lazy"

        def lower(self, *args):
            class Lowered:
                def compile(self):
                    if args[0].shape == (9,):
                        raise RuntimeError("cannot compile")
                    return lambda *a: calls.append("ahead") or "ahead"

            return Lowered()

    fn = AheadOfTime(Fn())
    assert fn(np.zeros(3)) == "lazy"  # nothing compiled ahead yet
    assert fn.compile_ahead(jax.ShapeDtypeStruct((3,), np.float32))
    assert fn(np.zeros(3, np.float32)) == "ahead"
    assert fn(np.zeros(4, np.float32)) == "lazy" and fn(np.zeros(3, np.int32)) == "lazy"
    assert fn.compile_ahead(jax.ShapeDtypeStruct((9,), np.float32))
    assert fn(np.zeros(9, np.float32)) == "lazy"  # the compile failed: compiled at the call
    assert calls == ["lazy", "ahead", "lazy", "lazy", "lazy"]
    assert not AheadOfTime(lambda *a: None).compile_ahead(np.zeros(3))  # no lower(): pmap


@pytest.mark.slow  # among the heaviest default tests, measured
def test_the_tuner_says_whether_bf16_would_be_faster(tmp_path, monkeypatch):
    need_devices(8)

    def fake_times(candidates, rounds=3, timer=None):  # the bf16 medians, faked
        assert set(candidates) == {"fp32", "bf16"}
        return {"fp32": 0.0100, "bf16": 0.0062}

    monkeypatch.setattr(autotune, "time_candidates", fake_times)
    monkeypatch.setattr(autotune, "measure", fake_measure({"vmap": 1.0, "loop": 2.0}))
    lines: list[str] = []
    # on CPU itself bf16 is not timed: test_the_tuners_programs_are_reported_apart_...
    monkeypatch.setattr(tuning, "BF16_PLATFORMS", ("cpu",))  # as on an accelerator
    cfg = tiny(tmp_path, quiet=False, max_steps=2, mesh=TWO_PER_DEVICE)
    result = train(cfg, DATA, echo=lines.append)
    want = (
        "bf16 would run 0.62x the fp32 step time; precision stays fp32: "
        "pass --precision bf16 to use it"
    )
    assert want in lines and result.ensemble.compute_dtype is None  # precision unchanged
    tuned = json.loads((tmp_path / "run" / "config.json").read_text())["resolved"]["tuning"]
    assert tuned["bf16"] == want and tuned["bf16_ratio"] == pytest.approx(0.62)
    path = autotune.choices_path(cfg.compile_cache_dir)
    assert [r["bf16_ratio"] for r in autotune.read_choices(path).values()] == [pytest.approx(0.62)]
    monkeypatch.setattr(autotune, "time_candidates", no_measuring)  # cached: read, not timed
    monkeypatch.setattr(autotune, "measure", no_measuring)
    lines.clear()
    train(
        tiny(tmp_path, "again", quiet=False, max_steps=2, mesh=TWO_PER_DEVICE),
        DATA,
        echo=lines.append,
    )
    assert want in lines
    lines.clear()
    monkeypatch.setattr(autotune, "measure", fake_measure({"vmap": 1.0, "loop": 1.0}))
    bf16_cfg = tiny(
        tmp_path, "bf16", quiet=False, max_steps=2, mesh=TWO_PER_DEVICE, precision="bf16"
    )
    bf16 = train(bf16_cfg, DATA, echo=lines.append)
    assert not any(line.startswith("bf16 would") for line in lines)  # not asked in bf16
    assert bf16.ensemble.compute_dtype is not None


def _nbytes(tree) -> int:
    return sum(math.prod(a.shape) * jnp.dtype(a.dtype).itemsize for a in jax.tree.leaves(tree))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_the_gpu_configurations_8_member_step_fits_its_memory_floor_and_copies_no_state():
    """CPU proxies for the GPU, from one compilation of the 8-member CNN step (batch 128,
    the members vmapped with the GPU's default convolution, on one device):

    * ``compiled.memory_analysis()`` (arguments + outputs + temporaries - aliased) stays
      within 1.3x state + activations. State: the 8 members' parameters and optimizer
      state. Activations: what the backward pass of this very formulation keeps, the
      residuals of ``jax.vjp`` of one member's loss on the batch (im2col's patches
      included: 472 MiB for 8 members, against 251 MiB for XLA's convolution), times 8.
      The gradients and the update's temporaries are what the 1.3 allows for.
    * the compiled program copies no donated state leaf (XLA writes the new state into
      the donated buffers; tests/test_ensemble.py checks the small model on meshes);
    * the compiled HLO has no grouped convolution either (tests/test_conv.py checks the
      lowered one)."""
    mesh = me.make_mesh(1, 1, devices=jax.devices()[:1])
    model = me.models.CNN(conv=me.conv.default_conv("gpu"))
    tx = optax.sgd(0.1, 0.9)
    ens = me.Ensemble(model, tx, 8, mesh, member_strategy=me.default_strategy("gpu"))
    x, y = jnp.zeros((128, 28, 28, 1)), jnp.zeros((128,), jnp.int32)
    shapes = jax.eval_shape(ens.init, jax.random.key(0), x[:1])
    state = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    compiled = ens.train_step_fn().lower(state, x, y).compile()
    m = compiled.memory_analysis()
    used = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    params = jax.eval_shape(model.init, jax.random.key(0), x[:1])  # shapes only

    def loss(p):
        logits = model.apply(p, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    residuals = jax.eval_shape(lambda p: jax.tree.leaves(jax.vjp(loss, p)[1]), params)
    floor = _nbytes((shapes.params, shapes.opt_state)) + 8 * _nbytes(residuals)
    assert used <= 1.3 * floor, (used / 2**20, floor / 2**20)
    text = compiled.as_text()
    entry = text[text.index("\nENTRY") : text.index("\n}\n", text.index("\nENTRY"))]
    leaves = {
        f"f32[{','.join(map(str, leaf.shape))}]"
        for leaf in jax.tree.leaves((shapes.params, shapes.opt_state))
    }
    copied = re.findall(r"= (f32\[[\d,]*\])\{[\d,]*\} (?:copy\(|fusion\(.*wrapped_copy)", entry)
    assert [s for s in copied if s in leaves] == []
    assert not re.findall(r"feature_group_count=([2-9]|\d\d+)", text)
