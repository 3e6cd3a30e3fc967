"""``meshensemble bench --tiny`` runs every case and writes complete JSON; FLOP counts.

No assertions on speed: the machine is shared, the tiny configuration measures noise.
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshensemble import bench, models
from meshensemble.bench import config as bench_config
from meshensemble.bench.workloads import CNN_TRAIN_FLOPS_PER_EXAMPLE, member_loss
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
    "stream_over_device_steps_per_s",
    "user_step_over_howto",
    "memory_over_state_activations_by_case",
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Runs the tiny bench once for the module; returns (exit code, results, plot path)."""
    out = tmp_path_factory.mktemp("bench")
    path, png = out / "bench.json", out / "members.png"
    code = main(["bench", "--tiny", "--layouts", "mlp", "--out", str(path), "--plot", str(png)])
    results = json.loads(path.read_text()) if path.exists() else None
    return code, results, png


@pytest.mark.slow
def test_tiny_bench_writes_every_case(tiny):
    code, results, png = tiny
    assert code == 0
    expected = [c for cases in bench.GROUPS.values() for c in cases]
    # mpd_8 .. mpd_32 are beyond the tiny configuration's 4 members per device;
    # time_to_accuracy has its own section.
    skip = ("mpd_8", "mpd_16", "mpd_32", bench_config.TIME_TO_ACCURACY)
    expected = [c for c in expected if c not in skip]
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# ---------------------------------------------------------------------------------------
# Analytic FLOPs


def _cnn_train_flops(conv: str, batch: int = 2) -> dict[str, float]:
    module = models.CNN(conv=conv)
    images = np.zeros((batch, 28, 28, 1), np.uint8)
    labels = np.zeros((batch,), np.int32)
    params = jax.eval_shape(
        lambda k: module.init(k, jnp.zeros((1, 28, 28, 1)))["params"], jax.random.key(0)
    )
    counted = bench.train_flops(member_loss(module), params, images, labels)
    return {k: v / batch for k, v in counted.items()}


def test_analytic_flops_of_the_cnn_are_the_documented_27_4_mflop_for_any_convolution():
    xla, im2col = _cnn_train_flops("xla"), _cnn_train_flops("im2col")
    # The hand count (workloads.CNN_TRAIN_FLOPS_PER_EXAMPLE): 13,705,728 multiply-adds of
    # the forward pass, every kernel gradient and every input gradient but the image's.
    assert xla["total"] == 2 * 13_705_728
    assert xla["total"] == pytest.approx(CNN_TRAIN_FLOPS_PER_EXAMPLE, rel=0.01)
    # im2col is the same arithmetic as matmuls: same total, nothing left as convolution.
    assert im2col["total"] == xla["total"]
    assert im2col["conv_general_dilated"] == 0 and xla["conv_general_dilated"] > 0
    # The dense layers are matmuls in both: 3136x256 and 256x10, forward and 2 gradients
    # (the first dense layer's input gradient feeds the convolutions).
    assert xla["dot_general"] == 2 * 3 * (3136 * 256 + 256 * 10)


def test_analytic_flops_count_what_the_jaxpr_states_for_a_custom_vjp():
    # conv_canonical's backward rule also returns the image's gradient (3x3x1->32 on
    # 28x28: 225,792 multiply-adds) that JAX then drops; the jaxpr states it, so it counts.
    canonical, xla = _cnn_train_flops("canonical"), _cnn_train_flops("xla")
    assert canonical["total"] - xla["total"] == 2 * 28 * 28 * 32 * 9


def test_count_flops_of_matmuls_convolutions_and_loops():
    n = 256
    a = jax.ShapeDtypeStruct((n, n), jnp.float32)
    assert bench.count_flops(jnp.matmul, a, a)["total"] == 2 * n**3
    ab = jax.ShapeDtypeStruct((3, 8, 16), jnp.bfloat16)
    b = jax.ShapeDtypeStruct((3, 16, 4), jnp.bfloat16)
    assert bench.count_flops(jnp.matmul, ab, b)["dot_general"] == 2 * 3 * 8 * 16 * 4

    def grouped(x, k):  # 8 input channels in 2 groups -> 6 outputs, 3x3, SAME
        return jax.lax.conv_general_dilated(
            x,
            k,
            (1, 1),
            "SAME",
            dimension_numbers=("NHWC", "HWIO", "NHWC"),
            feature_group_count=2,
        )

    x = jax.ShapeDtypeStruct((5, 10, 10, 8), jnp.float32)
    k = jax.ShapeDtypeStruct((3, 3, 4, 6), jnp.float32)
    assert bench.count_flops(grouped, x, k)["conv_general_dilated"] == 2 * 5 * 100 * 6 * 9 * 4

    def scanned(c):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ c), None), c, None, length=7)[0]

    assert bench.count_flops(scanned, a)["total"] == 7 * 2 * n**3

    def branches(p, c):
        return jax.lax.cond(p, lambda c: c @ c @ c, lambda c: c @ c, c)

    assert bench.count_flops(branches, True, a)["total"] == 2 * 2 * n**3  # the costlier one


# ---------------------------------------------------------------------------------------
# New cases and fields of the tiny bench


@pytest.mark.slow
def test_tiny_bench_flops_are_analytic_and_the_matmuls_are_fp32_and_bf16(tiny):
    _, results, _ = tiny
    meta, cases = results["meta"], results["cases"]
    assert meta["flops_source"] == "analytic"
    # MLP((32,)): forward 784*32 + 32*10 multiply-adds, both kernels' gradients, and the
    # hidden layer's input gradient (the image's is never computed).
    assert meta["flops_per_example"]["mlp32"] == 2 * (2 * (784 * 32 + 32 * 10) + 32 * 10)
    assert set(meta["flops_per_example_cost_analysis"]) == set(meta["flops_per_example"])
    for name, case in cases.items():
        if case["kind"] != "matmul":
            base = bench.plain_model(case["model"])
            assert case["flops_per_example"] == meta["flops_per_example"][base], name
            assert case["flops_source"] == "analytic", name
            assert case["fraction_of_bf16_matmul_flops"] > 0, name
    n = meta["matmul_size"]
    assert n == bench.TINY["matmul_size"]
    for precision in ("fp32", "bf16"):
        mm = cases[f"matmul_{precision}"]
        assert (mm["kind"], mm["precision"], mm["flops_per_call"]) == (
            "matmul",
            precision,
            2 * n**3,
        )
        assert mm["flops_per_s"] > 0
    assert cases["matmul_bf16"]["fraction_of_bf16_matmul_flops"] == pytest.approx(1.0)
    assert meta["matmul_bf16_flops_per_s"] > 0
    for key in ("device_kind", "jax_version", "jaxlib_version", "flax_version", "date"):
        assert meta[key], key
    ratios = results["ratios"]
    assert ratios["members_per_device_flops_case"] == "mpd_4"  # the most the tiny run has
    assert ratios["members_per_device_flops_over_bf16_matmul"] == pytest.approx(
        cases["mpd_4"]["flops_per_s"] / meta["matmul_bf16_flops_per_s"]
    )


@pytest.mark.slow
def test_tiny_bench_time_to_accuracy_cold_then_warm(tiny):
    _, results, _ = tiny
    tta = results["time_to_accuracy"]
    target = tta["target_accuracy"]
    assert target == bench.TINY["target_accuracy"]
    assert tta["train_config"]["model"] == "mlp" and tta["train_config"]["members"] == 4
    for run in ("cold", "warm"):
        r = tta[run]
        assert "error" not in r, r.get("error")
        assert r["reached"] and r["accuracy"] >= target, run
        assert not any(e["accuracy"] >= target for e in r["epochs"][:-1]), run  # the first
        start = r["process_start"]
        parts = ("interpreter_s", "import_jax_s", "device_init_s", "import_meshensemble_s")
        assert start["total_s"] == pytest.approx(sum(start[p] for p in parts)), run
        assert r["time_to_accuracy_s"] == pytest.approx(
            start["total_s"] + r["setup_s"] + r["train_to_accuracy_s"]
        ), run
        assert r["cache_enabled"] and r["programs"] == len(r["by_program"]) > 0, run
        assert (r["platform"], r["device_count"]) == ("cpu", 8), run  # the parent's devices
    # The warm run reuses the cold run's cache folder: its programs come from the cache.
    # cold: an empty folder; a program compiled twice in the run (e.g. the same init for each
    # measured candidate of the member strategy) is a hit the second time, never the first
    assert tta["cold"]["cache_misses"] > 0 and tta["cold"]["cache_hits"] < tta["cold"]["programs"]
    assert tta["warm"]["cache_hits"] > 0 and tta["warm"]["cache_misses"] == 0
    assert tta["warm_over_cold_compile"] == pytest.approx(
        tta["warm"]["compile_s"] / tta["cold"]["compile_s"]
    )
    ratios = results["ratios"]
    assert ratios["time_to_accuracy_programs"] == tta["cold"]["programs"]
    assert ratios["time_to_accuracy_warm_compile_s"] == tta["warm"]["compile_s"]
    # the targets' seconds are run-timed (train()'s start on), as the suite's table checks
    assert ratios["time_to_accuracy_cold_s"] == tta["cold"]["train_to_accuracy_s"]
    assert ratios["time_to_accuracy_warm_launch_s"] == tta["warm"]["time_to_accuracy_s"]
    cold = results["targets"]["time_to_accuracy_cold_s"]
    assert cold["value"] == tta["cold"]["train_to_accuracy_s"] and cold["target"] == "<= 4.0"


def test_matmul_size_per_platform_and_time_to_accuracy_is_no_timed_case():
    def sizes(cfg, platform):
        return {c.name: c.spec.model for c in bench.plan(cfg, 1, platform, 10)}

    cfg = bench.resolve(cases="matmul")
    assert sizes(cfg, "gpu") == {"matmul_fp32": "8192", "matmul_bf16": "8192"}
    assert sizes(cfg, "tpu")["matmul_bf16"] == "8192"
    assert sizes(cfg, "cpu")["matmul_fp32"] == "2048"
    assert sizes(bench.resolve(cases="matmul", matmul_size=512), "gpu")["matmul_bf16"] == "512"
    only = bench.resolve(cases="time_to_accuracy")
    assert bench.plan(only, 8, "cpu", 10) == [] and bench_config.runs_time_to_accuracy(only)
    assert bench_config.runs_time_to_accuracy(bench.resolve())
    assert not bench_config.runs_time_to_accuracy(bench.resolve(cases="matmul"))


def test_target_accuracy_flags():
    parser = argparse.ArgumentParser()
    cli_bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", "--target-accuracy", "0.98", "--accuracy-epochs", "3"])
    given = {name: getattr(args, name) for name in cli_bench.FLAG_FIELDS if name != "tiny"}
    cfg = bench.resolve(**given)
    assert (cfg.target_accuracy, cfg.accuracy_epochs) == (0.98, 3)
    assert bench.resolve().target_accuracy == 0.993
    for bad, flag in ((1.5, "--target-accuracy 1.5"), (0.0, "--target-accuracy 0.0")):
        with pytest.raises(ValueError, match=flag):
            bench.resolve(target_accuracy=bad)
    with pytest.raises(ValueError, match="--accuracy-epochs 0"):
        bench.resolve(accuracy_epochs=0)


@pytest.mark.slow
def test_tiny_bench_layouts_measure_each_mesh_of_the_model(tiny):
    """``--layouts mlp`` adds the E x D x P table: FSDP rows hold a fraction of the state."""
    _, results, _ = tiny
    assert "layouts of mlp (5 meshes" in bench.format_table(results)
    rows = {r["layout"]: r for r in results["layouts"]["mlp"]}
    assert set(rows) == {"8x1x1", "2x4x1", "2x4x1 fsdp", "2x1x4", "2x2x2 fsdp"}
    whole = rows["2x4x1"]["state_bytes"]  # 4 members whole on each device
    assert rows["8x1x1"]["state_bytes"] * 3.5 < whole  # 1 member per device
    assert rows["2x4x1 fsdp"]["state_bytes"] * 3.5 < whole  # 4 members over 4 data shards
    assert all(np.isfinite(r["loss"]) and r["step_s"] > 0 for r in rows.values())


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--layouts", "foo"], "--layouts foo: unknown model foo"),
        (["--layouts", "mlp", "--batch-size", "6"], "--batch-size 6 must be a multiple of 4"),
    ],
)
def test_bench_layouts_bad_values_exit_2_with_one_line(argv, says, tmp_path, capsys):
    path = tmp_path / "b.json"
    assert main(["bench", "--tiny", "--cases", "howto", *argv, "--out", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and says in err[0]
    assert not path.exists()


def test_the_accelerator_suite_sets_its_cases_and_given_flags_win():
    cfg = bench.resolve(suite="accelerator")
    assert "time_to_accuracy" in cfg.cases and "howto" in cfg.cases and "chunk_epoch" in cfg.cases
    assert cfg.members_per_device == (8, 32) and cfg.out == "bench-accelerator"
    tiny = bench.resolve(tiny=True, suite="accelerator", out="/x")
    assert (tiny.model, tiny.members, tiny.members_per_device, tiny.out) == (
        "mlp32",
        4,
        (4, 8),
        "/x",
    )
    assert bench.resolve(suite="accelerator", members=6, repeats=9).members_per_device == (6, 32)
    assert bench.resolve(suite="accelerator", repeats=9).repeats == 9
    with pytest.raises(ValueError, match="--suite gpu: unknown suite"):
        bench.resolve(suite="gpu")


def test_the_suite_refuses_a_file_as_its_out_folder(tmp_path, capsys):
    taken = tmp_path / "results.json"
    taken.write_text("{}")
    assert main(["bench", "--suite", "accelerator", "--tiny", "--out", str(taken)]) == 2
    err = capsys.readouterr().err
    assert f"--out {taken} is a file" in err and len(err.strip().splitlines()) == 1
    assert taken.read_text() == "{}"


def fake_suite_results(**over):
    """The parts of a bench result the accelerator rows read, as on one H100."""
    run = {
        "reached": True,
        "epoch": 3,
        "accuracy": 0.9931,
        "train_to_accuracy_s": 3.5,
        "process_start": {"total_s": 2.0},
        "compile_s": 1.5,
        "cache_hits": 0,
        "cache_misses": 6,
        "programs": 6,
        "tuning_programs": 2,
    }
    results = {
        "meta": {
            "date": "2026-11-25T21:00:00+00:00",
            "device_count": 1,
            "device_kind": "NVIDIA H100 80GB HBM3",
            "platform": "gpu",
            "jax_version": "0.10.2",
            "jaxlib_version": "0.10.2",
            "flax_version": "0.12.8",
            "wall_s": 300.0,
            "matmul_bf16_flops_per_s": 7e14,
            "data": {"steps_per_epoch": 468, "note": "MNIST from mnist.npz"},
            "config": {
                "members": 8,
                "members_per_device": [8, 32],
                "target_accuracy": 0.993,
                "model": "cnn",
                "batch_size": 128,
            },
        },
        "cases": {
            "chunk_epoch": {"time_per_step_s": {"median": 0.0005}, "k": 468},
            "mpd_8": {
                "memory_per_member_bytes": 3 * 2**20,
                "memory_source": "memory_stats",
                "peak_memory_bytes": 32 * 2**20,
                "members_per_device": 8,
            },
        },
        "ratios": {
            "on_device_loop_over_howto_by_k": {"chunk_epoch": 0.04},
            "members_per_device_flops_case": "mpd_32",
            "members_per_device_flops_over_bf16_matmul": 0.2,
            "memory_over_state_activations": 1.2,
            "one_device_case": "mpd_8",
        },
        "time_to_accuracy": {"cold": run, "warm": {**run, "train_to_accuracy_s": 2.5}},
    }
    results["time_to_accuracy"].update(over)
    return results


def test_accelerator_rows_compare_each_target_with_its_threshold(tmp_path):
    results = fake_suite_results()
    rows = {r["name"]: r for r in bench.accelerator_rows(results)}
    assert list(rows) == [t.name for t in bench.ACCELERATOR_TARGETS]
    assert rows["epoch_s"]["value"] == pytest.approx(0.234) and rows["epoch_s"]["passed"]
    assert rows["speedup_over_howto"]["value"] == pytest.approx(25.0)
    assert rows["time_to_accuracy_cold_s"]["passed"] is True  # 3.5 <= 4, run-timed
    assert "process start 2.0 s apart" in rows["time_to_accuracy_cold_s"]["note"]
    assert rows["time_to_accuracy_warm_s"]["passed"] is False  # 2.5 > 2
    assert rows["flops_over_bf16_matmul"]["passed"] is False  # 20% < 25%
    assert rows["memory_over_state_activations"]["passed"] is True
    assert "device peak 4.0 MiB/member" in rows["memory_over_state_activations"]["note"]
    assert rows["programs"]["value"] == 6 and "auto-tuner's 2 apart" in rows["programs"]["note"]
    json_path, md_path = bench.write_suite(results, str(tmp_path / "out"))
    with open(md_path) as f:
        md = f.read()
    assert "NVIDIA H100 80GB HBM3" in md and "jaxlib 0.10.2" in md and "flax 0.12.8" in md
    assert "2026-11-25" in md and md.count("\n| ") == 1 + len(rows)
    assert "| 8-member MNIST epoch | <= 0.250 s | 0.234 s | pass |" in md
    assert "| FAIL |" in md
    with open(json_path) as f:
        saved = json.load(f)
    assert [r["name"] for r in saved["targets"]] == list(rows)
    unreached = fake_suite_results(
        cold={"reached": False, "accuracy": 0.98, "process_start": {"total_s": 1.0}}
    )
    cold = bench.accelerator_rows(unreached)[2]
    assert cold["passed"] is None and "not reached (98.00%)" in cold["note"]


@pytest.mark.slow
def test_the_accelerator_suite_runs_on_cpu_without_tfds_or_mlxtend(tmp_path):
    """The command as the GPU runs it (one device, --data-file, PYTHONPATH, no
    tensorflow-datasets or mlxtend: importing either fails), at tiny sizes."""
    import os
    import subprocess
    import sys

    from meshensemble import data

    blocked = tmp_path / "blocked"
    for name in ("tensorflow_datasets", "mlxtend"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('{name} blocked')\n")
    ds = data.synthetic(num_train=512, num_test=64, seed=0)
    npz = tmp_path / "mnist.npz"
    np.savez(
        npz,
        x_train=ds.train_images,
        y_train=ds.train_labels,
        x_test=ds.test_images,
        y_test=ds.test_labels,
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": f"{blocked}{os.pathsep}{root}"}
    out = tmp_path / "acc"
    argv = ["bench", "--suite", "accelerator", "--tiny", "--data-file", str(npz), "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, "-m", "meshensemble.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = json.loads((out / "accelerator.json").read_text())
    rows = {r["name"]: r for r in saved["targets"]}
    assert all(r["value"] is not None for r in rows.values()), rows
    assert saved["results"]["meta"]["device_count"] == 1
    md = (out / "accelerator.md").read_text()
    assert md.count("\n| ") == 1 + len(rows) and "jaxlib" in md
