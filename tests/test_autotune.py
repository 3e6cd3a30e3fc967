"""Measured defaults on a budget (issue 30): timing, abandoning, the budget, caching, the line.

The clock is injected (a fake that each build and step advances), so nothing here depends
on the machine's speed.
"""

from __future__ import annotations

import itertools
import json

import pytest

from meshensemble.runtime import autotune


class FakeClock:
    """The time: advanced only by the fake candidates' builds and steps."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def candidate(clock: FakeClock, seconds: float, calls: list[str], name: str, build_s=0.0):
    """A candidate whose build takes ``build_s`` and each step ``seconds`` on ``clock``."""

    def make():
        calls.append(f"build {name}")
        clock.now += build_s

        def step():
            calls.append(name)
            clock.now += seconds
            return seconds

        return step

    return make


def test_the_fastest_candidate_wins_and_is_stored_then_read(tmp_path):
    clock, calls = FakeClock(), []
    path = str(tmp_path / "choices.json")
    candidates = {
        "vmap": candidate(clock, 0.012, calls, "vmap"),
        "loop": candidate(clock, 0.009, calls, "loop"),
    }
    key = autotune.tuning_key(what="member_strategy", model="CNN()", batch=128)
    d = autotune.decide(key, candidates, path, default="vmap", rounds=3, timer=clock)
    assert (d.name, d.how, d.stored) == ("loop", "measured", path)
    assert "vmap 12.0 ms" in d.reason and f"stored in {path}" in d.reason
    # the default first: built, warmed up (untimed), 3 timed steps; then the other
    assert calls == ["build vmap"] + ["vmap"] * 4 + ["build loop"] + ["loop"] * 4
    calls.clear()
    again = autotune.decide(key, candidates, path, default="vmap", timer=clock)
    assert (again.name, again.how) == ("loop", "cached") and calls == []  # nothing built
    assert f"read from {path}" in again.reason
    other = autotune.tuning_key(what="member_strategy", model="CNN()", batch=64)
    assert other != key
    assert autotune.choose(other, candidates, path, timer=clock)[0] == "loop"
    assert calls  # a new key is measured


def test_a_clearly_slower_candidate_is_abandoned_at_its_first_step():
    clock, calls = FakeClock(), []
    candidates = {
        "a": candidate(clock, 0.010, calls, "a"),
        "slow": candidate(clock, 0.016, calls, "slow"),  # 1.6x the best: abandoned
        "b": candidate(clock, 0.014, calls, "b"),  # 1.4x: timed in full
    }
    m = autotune.measure(candidates, "a", rounds=3, timer=clock)
    assert calls.count("slow") == 2  # its warm-up and one timed step
    assert calls.count("b") == 4 and m.abandoned == ("slow",) and m.skipped == ()
    assert m.seconds["slow"] == pytest.approx(0.016) and m.winner("a") == "a"


def test_the_default_stays_unless_clearly_faster():
    clock = FakeClock()
    close = {"d": candidate(clock, 0.100, [], "d"), "x": candidate(clock, 0.097, [], "x")}
    assert autotune.measure(close, "d", timer=clock).winner("d") == "d"  # 3 % faster: kept
    clear = {"d": candidate(clock, 0.100, [], "d"), "x": candidate(clock, 0.090, [], "x")}
    assert autotune.measure(clear, "d", timer=clock).winner("d") == "x"


def test_over_budget_the_default_is_kept_said_so_and_not_remeasured(tmp_path):
    """100 planned steps of 10 ms: 1 s of training, a budget of 0.1 s; a candidate costs its
    0.5 s build, so only the default (its first timed step) is measured."""
    clock, calls = FakeClock(), []
    path = str(tmp_path / "choices.json")
    candidates = {
        "d": candidate(clock, 0.010, calls, "d", build_s=0.5),
        "x": candidate(clock, 0.001, calls, "x", build_s=0.5),
    }
    d = autotune.decide("k", candidates, path, "d", planned_steps=100, timer=clock, pin="--p d")
    assert (d.name, d.how) == ("d", "default")
    assert calls == ["build d", "d", "d"]  # warm-up and one timed step, nothing more
    assert d.measurement.skipped == ("x",) and d.measurement.budget_s == pytest.approx(0.1)
    assert d.measurement.expected_s == pytest.approx(1.0)
    assert "the platform default kept" in d.reason and "budget of 0.1 s" in d.reason
    assert f"stored in {path}" in d.reason and "\n" not in d.reason
    calls.clear()  # the same run again: read, not measured
    again = autotune.decide("k", candidates, path, "d", planned_steps=100, timer=clock)
    assert (again.name, again.how, calls) == ("d", "cached", [])
    # a run long enough to pay for measuring measures the rest
    longer = autotune.decide("k", candidates, path, "d", planned_steps=100_000, timer=clock)
    assert (longer.name, longer.how) == ("x", "measured") and "build x" in calls


def test_the_defaults_compilation_the_run_reuses_is_not_the_tuners_cost():
    """Builds take 0.5 s, steps 10 ms, 80 planned steps: a budget of 0.08 s. Another
    candidate would cost ~0.54 s (a build like the default's, a warm-up and 3 steps), so
    none fits; what the default's build counts as (the run's own or the tuner's) shows in
    what is reported spent. With the whole 0.8 s of training as the budget, the reused
    build is what makes room for the other candidate."""
    for reused in (False, True):
        clock, calls = FakeClock(), []
        candidates = {
            "d": candidate(clock, 0.010, calls, "d", build_s=0.5),
            "x": candidate(clock, 0.010, calls, "x", build_s=0.5),
        }
        d = autotune.decide("k", candidates, None, "d", 80, timer=clock, reused=reused)
        m = d.measurement
        assert calls == ["build d", "d", "d"] and m.needs_s == pytest.approx(0.54)
        assert m.spent_s == pytest.approx(0.52)
        assert m.reused_s == pytest.approx(0.5 if reused else 0.0)
        assert m.cost_s == pytest.approx(0.02 if reused else 0.52)
        if reused:  # the real cost: two steps; the compilation said apart
            assert "timing the default cost 0.0 s beyond its 0.5 s compilation" in d.reason
        else:
            assert "timing the default took 0.5 s" in d.reason
    # 0.52 s spent + 0.02 s of the default's other rounds + 0.54 s for x: over 0.8 s,
    # unless the default's 0.5 s build is the run's own
    for reused, measured in ((False, ["d"]), (True, ["d", "x"])):
        clock = FakeClock()
        candidates = {
            "d": candidate(clock, 0.010, [], "d", build_s=0.5),
            "x": candidate(clock, 0.010, [], "x", build_s=0.5),
        }
        m = autotune.measure(candidates, "d", 80, timer=clock, share=1.0, reused=reused)
        assert list(m.seconds) == measured, reused


def test_the_budget_stops_measuring_part_way():
    """Builds take 1 s, steps 0.1 s: a candidate costs 1.4 s (build, warm-up, 3 steps).
    With 500 planned steps (50 s, budget 5 s) two others fit and the third does not."""
    clock, calls = FakeClock(), []
    candidates = {n: candidate(clock, 0.1, calls, n, build_s=1.0) for n in "dabc"}
    m = autotune.measure(candidates, "d", planned_steps=500, rounds=3, timer=clock)
    assert list(m.seconds) == ["d", "a", "b"] and m.skipped == ("c",)
    assert m.spent_s <= m.budget_s == pytest.approx(5.0)
    assert m.needs_s == pytest.approx(1.4)


def test_the_line_says_whether_the_choice_is_stored(tmp_path):
    clock = FakeClock()
    candidates = {"d": candidate(clock, 0.02, [], "d"), "x": candidate(clock, 0.01, [], "x")}
    pin = {n: f"--member-strategy {n}" for n in candidates}
    d = autotune.decide("k", candidates, None, "d", timer=clock, pin=pin)
    assert d.stored is None and "cached" not in d.reason and d.name == "x"
    # the flags that reproduce the choice, not the default's
    assert "not stored" in d.reason and "pin it with --member-strategy x" in d.reason
    blocked = tmp_path / "file"
    blocked.write_text("")  # a folder that cannot be made: not stored either
    d = autotune.decide("k", candidates, str(blocked / "c.json"), "d", timer=clock)
    assert d.stored is None and "not stored" in d.reason


@pytest.mark.parametrize(
    "entry",
    [
        {"choice": "x", "seconds": "abc"},
        {"choice": "x", "seconds": {"x": "abc"}},
        {"choice": 3, "seconds": {}},
        {"choice": "x", "seconds": {"x": 0.1}, "bf16_ratio": "fast"},
        "x",
    ],
)
def test_a_damaged_entry_is_ignored_with_a_line_naming_the_file(tmp_path, entry):
    clock, calls = FakeClock(), []
    path = tmp_path / "meshensemble-choices.json"
    path.write_text(json.dumps({"k": entry}))
    candidates = {"d": candidate(clock, 0.02, calls, "d"), "x": candidate(clock, 0.01, calls, "x")}
    d = autotune.decide("k", candidates, str(path), "d", timer=clock)
    assert d.name == "x" and d.how == "measured" and calls  # measured again
    assert len(d.notes) == 1 and str(path) in d.notes[0] and "ignored" in d.notes[0]
    assert autotune.valid_record(json.loads(path.read_text())["k"])  # replaced
    assert autotune.recorded(str(path), "k")["choice"] == "x"


def test_a_damaged_or_unwritable_choices_file_only_means_measuring(tmp_path):
    clock, calls = FakeClock(), []
    bad = tmp_path / "choices.json"
    bad.write_text("{not json")
    candidates = {"x": candidate(clock, 1.0, calls, "x"), "y": candidate(clock, 2.0, calls, "y")}
    d = autotune.decide("k", candidates, str(bad), timer=clock)
    assert d.name == "x" and len(d.notes) == 1 and str(bad) in d.notes[0]
    assert autotune.read_choices(str(bad))["k"]["choice"] == "x"  # rewritten whole
    bad.write_text("[1, 2]")
    assert str(bad) in autotune.decide("k", candidates, str(bad), timer=clock).notes[0]


def test_medians_resist_one_slow_round():
    clock = FakeClock()
    durations = {"a": itertools.chain([0.0], [0.010, 0.500, 0.010]), "b": itertools.repeat(0.02)}

    def make(name):
        def step():
            clock.now += next(durations[name])

        return step

    seconds = autotune.time_candidates({"a": make("a"), "b": make("b")}, rounds=3, timer=clock)
    assert seconds["a"] == pytest.approx(0.010) and seconds["b"] == pytest.approx(0.02)


def test_bad_arguments():
    with pytest.raises(ValueError):
        autotune.choose("k", {}, None)
    with pytest.raises(ValueError, match="'z' is not a candidate"):
        autotune.decide("k", {"a": lambda: None}, None, default="z")
    with pytest.raises(ValueError):
        autotune.time_candidates({"a": lambda: None}, rounds=0)


def test_precision_ratio_is_bf16_over_fp32_measured_and_the_line_says_so():
    clock, calls = FakeClock(), []
    fp32 = candidate(clock, 0.010, calls, "fp32")()
    bf16 = candidate(clock, 0.0062, calls, "bf16")()
    ratio = autotune.precision_ratio(fp32, bf16, rounds=3, timer=clock)
    assert ratio == pytest.approx(0.62)
    assert calls == ["build fp32", "build bf16"] + ["fp32", "bf16"] * 4  # warm-up, 3 rounds
    assert autotune.bf16_line(ratio) == (
        "bf16 would run 0.62x the fp32 step time; precision stays fp32: "
        "pass --precision bf16 to use it"
    )


def test_remember_adds_to_a_recorded_choice_only(tmp_path):
    clock, calls = FakeClock(), []
    path = str(tmp_path / "choices.json")
    autotune.remember(path, "k", bf16_ratio=0.5)  # nothing recorded: nothing written
    assert autotune.recorded(path, "k") == {}
    candidates = {"x": candidate(clock, 1.0, calls, "x"), "y": candidate(clock, 2.0, calls, "y")}
    autotune.choose("k", candidates, path, rounds=1, timer=clock)
    autotune.remember(path, "k", bf16_ratio=0.5)
    assert autotune.recorded(path, "k")["bf16_ratio"] == 0.5
    assert autotune.recorded(path, "k")["choice"] == "x"
