"""``meshensemble bench --tiny`` runs every case in-process and writes complete JSON.

No assertions on speed: the machine is shared, the tiny configuration measures noise.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest

from meshensemble import bench
from meshensemble.cli import bench as cli_bench
from meshensemble.cli import main

RATIO_KEYS = (
    "shard_map_over_pmap",
    "one_device_over_sequential",
    "loop_over_sequential",
    "vmap_over_loop",
    "reform_im2col_vmap_over_base_loop",
    "reform_im2col_loop_over_im2col_sequential",
    "on_device_loop_over_howto",
    "scan_over_jit",
    "scan_canonical_k8_over_k1",
    "members_per_device_scaling",
    "members_per_device_scaling_max",
    "mesh_speedup",
    "bf16_over_fp32",
    "memory_over_state_activations",
    "memory_over_state_activations_by_case",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Runs the tiny bench once for the module; returns (exit code, results, plot path)."""
    out = tmp_path_factory.mktemp("bench")
    path, png = out / "bench.json", out / "members.png"
    code = main(["bench", "--tiny", "--out", str(path), "--plot", str(png)])
    results = json.loads(path.read_text()) if path.exists() else None
    return code, results, png


def test_tiny_bench_writes_every_case(tiny):
    code, results, png = tiny
    assert code == 0
    expected = [c for cases in bench.GROUPS.values() for c in cases]
    # mpd_8 .. mpd_32 are beyond the tiny configuration's 4 members per device.
    expected = [c for c in expected if c not in ("mpd_8", "mpd_16", "mpd_32")]
    assert sorted(results["cases"]) == sorted(expected)
    for name, case in results["cases"].items():
        t = case["time_per_step_s"]
        assert t["n"] >= 1 and math.isfinite(t["median"]) and t["median"] > 0, name
        assert math.isfinite(t["iqr"]) and t["iqr"] >= 0, name
        if case["kind"] != "matmul":
            assert case["member_examples_per_s"] > 0, name
            assert case["flops_per_s"] > 0, name
        if case["same_as"] is not None:
            assert results["cases"][case["same_as"]]["same_as"] is None, name
    assert png.stat().st_size > 0


def test_tiny_bench_memory_per_member_against_its_floor(tiny):
    _, results, _ = tiny
    mpd = results["cases"]["mpd_4"]
    floor = mpd["state_bytes_per_member"] + mpd["activation_bytes_per_member"]
    # MLP((32,)) on batch 32: parameters 784*32 + 32 + 32*10 + 10 floats, momentum alike
    params = 4 * (784 * 32 + 32 + 32 * 10 + 10)
    assert mpd["state_bytes_per_member"] == 2 * params
    assert mpd["activation_bytes_per_member"] >= 4 * 32 * (784 + 32)  # inputs, hidden layer
    assert mpd["memory_per_member_bytes"] * 4 == pytest.approx(mpd["peak_memory_bytes"])
    assert mpd["memory_over_state_activations"] == pytest.approx(
        mpd["memory_per_member_bytes"] / floor
    )
    assert mpd["memory_over_state_activations"] >= 1.0  # a step holds at least its floor
    assert results["cases"]["precision_bf16"]["precision"] == "bf16"


def test_tiny_bench_ratios_targets_and_meta(tiny):
    _, results, _ = tiny
    ratios = results["ratios"]
    for key in RATIO_KEYS:
        assert key in ratios, key
        value = ratios[key]
        values = value.values() if isinstance(value, dict) else [value]
        assert values and all(v is not None and math.isfinite(v) and v > 0 for v in values), key
    assert set(results["targets"]) == set(bench.TARGETS)
    for target in results["targets"].values():
        assert target["met"] in (True, False)
    meta = results["meta"]
    for key in ("date", "jax_version", "device_kind", "device_count", "cpu_count"):
        assert meta[key], key
    assert meta["device_count"] == 8
    assert meta["matmul_flops_per_s"] > 0


@pytest.mark.parametrize(
    "argv",
    [
        ["bench", "--cases", "nope"],
        ["bench", "--repeats", "0"],
        ["bench", "--warmup", "-1"],
        ["bench", "--case-budget", "0"],
    ],
)
def test_bad_flags_exit_2(argv, capsys, tmp_path):
    assert main([*argv, "--out", str(tmp_path / "b.json")]) == 2
    assert "error:" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()


@pytest.mark.parametrize(
    ("given", "flag"),
    [
        ({"repeats": 0}, "--repeats 0"),
        ({"members": -1}, "--members -1"),
        ({"warmup": -1}, "--warmup -1"),
        ({"case_budget": 0.0}, "--case-budget 0.0"),
        ({"cases": "backends,nope"}, "unknown nope"),
        ({"model": "resnet"}, "--model resnet"),
        ({"workers": 2}, "unknown setting(s) workers"),
    ],
)
def test_resolve_raises_one_line_value_error_naming_the_value(given, flag):
    with pytest.raises(ValueError, match=flag.replace("(", r"\(").replace(")", r"\)")) as err:
        bench.resolve(**given)
    assert "\n" not in str(err.value)


def test_resolve_tiny_defaults_yield_to_given_values():
    cfg = bench.resolve(tiny=True, batch_size=16, cases=["howto", "backends"], seed=None)
    assert (cfg.model, cfg.members, cfg.batch_size) == ("mlp32", 4, 16)
    assert cfg.cases == ("howto", "backends") and cfg.seed == 0
    assert bench.resolve().members == bench.BenchConfig().members == 8


def test_every_flagged_config_field_is_a_bench_flag():
    parser = argparse.ArgumentParser()
    cli_bench.add_parser(parser.add_subparsers())
    flags = {
        "--matmul-size": "64",
        "--seed": "3",
        "--epoch-cap": "2",
        "--case-budget": "1.5",
        "--model": "mlp",
        "--cases": "howto",
    }
    args = parser.parse_args(["bench", *(x for kv in flags.items() for x in kv)])
    given = {name: getattr(args, name) for name in cli_bench.FLAG_FIELDS if name != "tiny"}
    cfg = bench.resolve(tiny=args.tiny, **given)
    assert (cfg.matmul_size, cfg.seed, cfg.epoch_cap, cfg.case_budget) == (64, 3, 2, 1.5)
    assert (cfg.model, cfg.cases) == ("mlp", ("howto",))
    assert set(cli_bench.FLAG_FIELDS) >= {"members", "batch_size", "repeats", "out", "plot"}
