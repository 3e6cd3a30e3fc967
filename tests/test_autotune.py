"""Measured defaults (issue "Accelerator speed"): timing, choosing, caching the choice.

The clock is injected, so nothing here depends on the machine's speed.
"""

from __future__ import annotations

import itertools

import pytest

from meshensemble.core import autotune


class FakeClock:
    """Each candidate call takes the seconds its name says; the clock advances by them."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def candidate(clock: FakeClock, seconds: float, calls: list[str], name: str):
    def make():
        calls.append(f"build {name}")

        def step():
            calls.append(name)
            clock.now += seconds
            return seconds

        return step

    return make


def test_the_fastest_candidate_wins_and_is_remembered(tmp_path):
    clock, calls = FakeClock(), []
    path = str(tmp_path / "choices.json")
    candidates = {
        "vmap": candidate(clock, 0.012, calls, "vmap"),
        "loop": candidate(clock, 0.009, calls, "loop"),
    }
    key = autotune.tuning_key(what="member_strategy", model="CNN()", batch=128)
    name, why = autotune.choose(key, candidates, path, rounds=3, timer=clock)
    assert name == "loop" and "measured now" in why and "vmap 12.0 ms" in why
    # warm-up once each (untimed), then 3 interleaved rounds
    assert calls == ["build vmap", "build loop", "vmap", "loop"] + ["vmap", "loop"] * 3
    calls.clear()
    again, why = autotune.choose(key, candidates, path, timer=clock)
    assert again == "loop" and "cached" in why and calls == []  # nothing built or run
    other = autotune.tuning_key(what="member_strategy", model="CNN()", batch=64)
    assert other != key
    assert autotune.choose(other, candidates, path, timer=clock)[0] == "loop"
    assert calls  # a new key is measured


def test_medians_resist_one_slow_round():
    clock = FakeClock()
    durations = {"a": itertools.chain([0.0], [0.010, 0.500, 0.010]), "b": itertools.repeat(0.02)}

    def make(name):
        def step():
            clock.now += next(durations[name])

        return step

    seconds = autotune.time_candidates({"a": make("a"), "b": make("b")}, rounds=3, timer=clock)
    assert seconds["a"] == pytest.approx(0.010) and seconds["b"] == pytest.approx(0.02)


def test_a_damaged_or_unwritable_choices_file_only_means_measuring(tmp_path):
    clock, calls = FakeClock(), []
    bad = tmp_path / "choices.json"
    bad.write_text("{not json")
    candidates = {"x": candidate(clock, 1.0, calls, "x"), "y": candidate(clock, 2.0, calls, "y")}
    assert autotune.choose("k", candidates, str(bad), rounds=1, timer=clock)[0] == "x"
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert (
        autotune.choose("k", candidates, str(blocked / "c.json"), rounds=1, timer=clock)[0] == "x"
    )


def test_bad_arguments():
    with pytest.raises(ValueError):
        autotune.choose("k", {}, None)
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
