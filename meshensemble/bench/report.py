"""The results: per-case entries, the ratios, the issue's targets, the table, JSON, the plot.

:func:`collect` turns the timed runners into the dict that ``--out`` holds;
:func:`format_table` prints it, :func:`write_json` writes it and :func:`plot_members`
draws time per step against members per device.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform as platform_lib
import sys
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

import jax
import numpy as np

from meshensemble import plots
from meshensemble.bench.accuracy import describe
from meshensemble.bench.cases import Runner, memory_stats
from meshensemble.bench.config import BenchConfig, Case, Spec
from meshensemble.bench.layouts import format_layouts
from meshensemble.bench.timing import stats
from meshensemble.bench.workloads import Context
from meshensemble.runtime import storage
from meshensemble.training.outputs import strict_json

TARGETS: dict[str, tuple[str, float]] = {
    "one_device_over_sequential": ("<=", 0.75),
    "shard_map_over_pmap": ("<=", 1.05),
    "user_step_over_howto": ("<=", 1.0),
    "on_device_loop_over_howto": ("<=", 0.9),
    "members_per_device_scaling_max": ("<=", 1.0),
    "memory_over_state_activations": ("<=", 1.3),
    "members_per_device_flops_over_bf16_matmul": (">=", 0.25),
    "time_to_accuracy_cold_s": ("<=", 4.0),
    "time_to_accuracy_warm_s": ("<=", 2.0),
    "time_to_accuracy_programs": ("<=", 8),
    "time_to_accuracy_warm_over_cold_compile": ("<=", 0.2),
}
"""The issues' targets: ratio name -> (comparison, bound).

The last five are the issue "Accelerator speed"'s, for one H100 (on a CPU only
reported): the FLOP/s of the most members per device against the bf16 matmul's, and
``time_to_accuracy``'s run-timed seconds (from ``train()``'s start), programs and warm
over cold compile time."""


def collect(
    cfg: BenchConfig,
    ctx: Context,
    cases: Sequence[Case],
    runners: Mapping[Spec, Runner],
    owner: Mapping[Spec, str],
    time_to_accuracy: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The results of timed runners, in the layout of ``--out``.

    Args:
      cfg: the config.
      ctx: the shared inputs (data, FLOPs, memory floors).
      cases: the planned cases, in order.
      runners: each distinct spec's timed runner.
      owner: each spec's first case (the others are reported ``same_as`` it).
      time_to_accuracy: the :func:`meshensemble.bench.accuracy.time_to_accuracy`
        results, or None when that case did not run.

    Returns:
      ``meta`` (date, versions, devices, config, data, FLOPs per example and their
      source), ``cases`` (per case: time per step, member-examples per second, FLOP/s
      and its fractions of the fp32 and bf16 matmuls', peak memory, memory per member
      ...), ``time_to_accuracy`` (None when not run), ``ratios`` and ``targets``.

    Example:
      >>> sorted(collect(cfg, ctx, cases, runners, owner))
      ['cases', 'meta', 'ratios', 'targets', 'time_to_accuracy']
    """
    refs = tuple(_matmul_flops(runners, p) for p in ("fp32", "bf16"))
    out_cases = {
        case.name: case_entry(cfg, ctx, case, runners[case.spec], owner[case.spec], refs)
        for case in cases
    }
    ratios = compute_ratios(out_cases, cfg)
    ratios.update(accuracy_ratios(time_to_accuracy))
    meta = run_meta(cfg, ctx, runners, *refs)
    return {
        "meta": meta,
        "cases": out_cases,
        "time_to_accuracy": dict(time_to_accuracy) if time_to_accuracy else None,
        "ratios": ratios,
        "targets": check_targets(ratios),
    }


FLOPS_NOTE = (
    "per member-example, forward and backward pass of the plain model (a reformulated "
    "convolution does the same multiply-adds): 2*M*N*K of every dot_general and "
    "2*out*kernel_window*kernel_in_features of every conv_general_dilated in the jaxpr of "
    "jax.value_and_grad of the loss; elementwise ops and the update are not counted. "
    "cost_analysis() is a cross-check only: it misses custom calls (cuDNN convolutions)"
)
"""``meta.flops_note`` of the results: what the FLOPs count."""

PEAK_MEMORY_NOTE = (
    "per device: device.memory_stats() peak_bytes_in_use where the device reports it "
    "(a process-wide running peak), else the compiled program's memory_analysis() "
    "(arguments + outputs + temporaries - aliased)"
)
"""``meta.peak_memory_note`` of the results."""

MEMORY_PER_MEMBER_NOTE = (
    "the compiled step's memory_analysis() per device divided by the members on the "
    "device, against one member's parameters + optimizer state + the residuals jax.vjp "
    "keeps for the backward pass of one batch"
)
"""``meta.memory_per_member_note`` of the results."""


def case_entry(
    cfg: BenchConfig,
    ctx: Context,
    case: Case,
    r: Runner,
    owner: str,
    refs: tuple[float | None, float | None],
) -> dict[str, Any]:
    """One case's results (``cases[name]`` of :func:`collect`).

    Args:
      cfg: the config.
      ctx: the shared inputs (FLOPs, memory floors).
      case: the case.
      r: its spec's timed runner.
      owner: the first case of its spec (another name: reported ``same_as`` it).
      refs: the fp32 and bf16 matmuls' FLOP/s (None when not measured).

    Returns:
      The case's dict: time per step, member-examples per second, FLOP/s and its
      fractions of the matmuls', memory ...

    Example:
      >>> case = cases[0]
      >>> case_entry(cfg, ctx, case, runners[case.spec], owner[case.spec], (None, None))["kind"]
      'matmul'
    """
    spec = case.spec
    entry: dict[str, Any] = {
        "group": case.group,
        "description": case.description,
        "same_as": None if owner == case.name else owner,
        **dataclasses.asdict(spec),
        "members_per_device": spec.members // max(spec.ensemble, 1),
        "time_per_step_s": stats(r.samples),
        "compile_s": r.compile_s,
        "first_call_s": r.first_call_s,
        "peak_memory_bytes": r.peak_bytes,
        "memory_source": r.memory_source,
    }
    t = entry["time_per_step_s"]["median"]
    if spec.kind == "matmul":
        entry["members_per_device"] = None
        entry["flops_per_s"] = r.flops_per_call / t
        entry["flops_per_call"] = r.flops_per_call
        entry["member_examples_per_s"] = None
    else:
        _model_entry(entry, cfg, ctx, spec, r, t)
    for key, ref in zip(("", "bf16_"), refs):
        value = entry["flops_per_s"] / ref if ref and entry["flops_per_s"] else None
        entry[f"fraction_of_{key}matmul_flops"] = value
    return entry


def _model_entry(
    entry: dict[str, Any], cfg: BenchConfig, ctx: Context, spec: Spec, r: Runner, t: float
) -> None:
    """Adds a training case's FLOPs, memory per member and throughput to ``entry``."""
    if spec.kind == "howto":
        entry["members_per_device"] = 1
        entry["howto_runs"] = spec.members // spec.devices
    flops = ctx.flops_per_example(spec.model)
    entry["flops_per_example"] = flops
    entry["flops_source"] = "analytic"
    if spec.kind in ("ensemble", "sequential") and r.program_bytes:
        on_device = 1 if spec.kind == "sequential" else entry["members_per_device"]
        floor = ctx.footprint(spec.model)
        per_member = r.program_bytes / on_device
        entry["memory_per_member_bytes"] = per_member
        entry["state_bytes_per_member"] = floor["state"]
        entry["activation_bytes_per_member"] = floor["activations"]
        entry["memory_over_state_activations"] = per_member / sum(floor.values())
    entry["member_examples_per_s"] = spec.members * cfg.batch_size / t
    entry["flops_per_s"] = entry["member_examples_per_s"] * flops


def run_meta(
    cfg: BenchConfig,
    ctx: Context,
    runners: Mapping[Spec, Runner],
    matmul_flops: float | None,
    bf16_flops: float | None,
) -> dict[str, Any]:
    """The results' ``meta``: date, versions, devices, config, data and FLOPs.

    Args:
      cfg: the config.
      ctx: the shared inputs (data, FLOPs).
      runners: each distinct spec's timed runner (for the matmul's size).
      matmul_flops: the fp32 matmul's FLOP/s, or None.
      bf16_flops: the bf16 matmul's FLOP/s, or None.

    Returns:
      The ``meta`` dict of :func:`collect`.

    Example:
      >>> run_meta(cfg, ctx, runners, None, None)["platform"]
      'cpu'
    """
    devices = jax.devices()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "jax_version": jax.__version__,
        "jaxlib_version": _version("jaxlib"),
        "flax_version": _version("flax"),
        "python": platform_lib.python_version(),
        "platform": devices[0].platform,
        "device_kind": devices[0].device_kind,
        "device_count": len(devices),
        "cpu_count": os.cpu_count(),
        "machine": platform_lib.machine(),
        "processor": _cpu_name(),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "argv": sys.argv,
        "config": dataclasses.asdict(cfg),
        "data": {
            **{key: getattr(ctx.dataset, key) for key in ("name", "source", "note", "num_train")},
            "steps_per_epoch": ctx.steps_per_epoch,
        },
        "flops_per_example": ctx.flops,
        "flops_source": "analytic",
        "flops_by_primitive": ctx.flops_by_primitive,
        "flops_per_example_cost_analysis": ctx.cost_analysis_flops,
        "flops_note": FLOPS_NOTE,
        "matmul_flops_per_s": matmul_flops,
        "matmul_bf16_flops_per_s": bf16_flops,
        "matmul_size": next((int(s.model) for s in runners if s.kind == "matmul"), None),
        "default_matmul_precision": jax.config.jax_default_matmul_precision,
        "device_memory_bytes": _memory_limit(devices[0]),
        "accelerator_plugins": _plugins(),
        "peak_memory_note": PEAK_MEMORY_NOTE,
        "memory_per_member_note": MEMORY_PER_MEMBER_NOTE,
    }


def _matmul_flops(runners: Mapping[Spec, Runner], precision: str) -> float | None:
    mm = (r for s, r in runners.items() if s.kind == "matmul" and s.precision == precision)
    r = next(mm, None)
    if r is None or not r.samples:
        return None
    return r.flops_per_call / float(np.median(r.samples))


def _memory_limit(device: jax.Device) -> int | None:
    stats = memory_stats(device)
    return int(stats["bytes_limit"]) if "bytes_limit" in stats else None


def _plugins() -> dict[str, str]:
    """Versions of the installed JAX accelerator plugins (CUDA, ROCm, TPU)."""
    cuda = [f"jax-cuda{v}-{kind}" for v in (12, 13) for kind in ("plugin", "pjrt")]
    names = (*cuda, "jax-rocm-plugin", "libtpu")
    return {n: v for n in names if (v := _version(n))}


def accuracy_ratios(tta: Mapping[str, Any] | None) -> dict[str, Any]:
    """The ``time_to_accuracy`` numbers the targets check.

    Args:
      tta: the :func:`meshensemble.bench.accuracy.time_to_accuracy` results, or None.

    Returns:
      ``time_to_accuracy_`` + ``cold_s`` / ``warm_s`` (run-timed, from ``train()``'s
      start), ``cold_launch_s`` / ``warm_launch_s`` (from the launch), ``cold_compile_s``
      / ``warm_compile_s``, ``programs`` (the cold run's own), ``warm_over_cold_compile``
      and ``cold_tuning_programs`` / ``cold_tuning_compile_s`` (the auto-tuner's first
      use); None where not measured.

    Example:
      >>> accuracy_ratios(None)["time_to_accuracy_programs"] is None   # not run: None
      True
    """
    tta = tta or {}
    cold, warm = tta.get("cold") or {}, tta.get("warm") or {}
    return {
        "time_to_accuracy_cold_s": cold.get("train_to_accuracy_s"),
        "time_to_accuracy_warm_s": warm.get("train_to_accuracy_s"),
        "time_to_accuracy_cold_launch_s": cold.get("time_to_accuracy_s"),
        "time_to_accuracy_warm_launch_s": warm.get("time_to_accuracy_s"),
        "time_to_accuracy_cold_compile_s": cold.get("compile_s"),
        "time_to_accuracy_warm_compile_s": warm.get("compile_s"),
        "time_to_accuracy_programs": cold.get("programs"),
        "time_to_accuracy_warm_over_cold_compile": tta.get("warm_over_cold_compile"),
        "time_to_accuracy_cold_tuning_programs": cold.get("tuning_programs"),
        "time_to_accuracy_cold_tuning_compile_s": cold.get("tuning_compile_s"),
    }


def _version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform_lib.processor()


def compute_ratios(c: Mapping[str, Any], cfg: BenchConfig) -> dict[str, Any]:
    """The ratios between cases that the targets and the docs quote.

    A ratio whose cases were not run is None (an empty dict for the per-size ones).

    Args:
      c: the ``cases`` of the results.
      cfg: the config.

    Returns:
      Ratio name -> value (time ratios below 1 mean the first case is faster), and the
      names of the cases some ratios picked (``one_device_case``, ``best_one_device_case``).

    Example:
      >>> compute_ratios(results["cases"], cfg)["bf16_matmul_over_fp32_matmul"] > 0
      True
    """

    tm = _Times(c, cfg.batch_size)
    one_device = next(
        (n for n in (f"mpd_{cfg.members}", "mesh_1", "strategy_loop", "strategy_vmap") if n in c),
        None,
    )
    r = _time_ratios(tm, one_device)
    r.update(_best_one_device(tm, cfg))
    r.update(_memory_ratios(c, one_device))
    r.update(_members_per_device_ratios(tm, cfg))
    r.update(_mesh_ratios(tm))
    return r


class _Times:
    """The cases' median times per step, and the ratios of two (None where one is missing)."""

    def __init__(self, c: Mapping[str, Any], batch_size: int):
        self.c, self.batch_size = c, batch_size

    def t(self, name: str) -> float | None:
        return self.c[name]["time_per_step_s"]["median"] if name in self.c else None

    @staticmethod
    def div(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def ratio(self, a: str, b: str) -> float | None:
        return self.div(self.t(a), self.t(b))

    def per_member_example(self, name: str) -> float | None:
        t = self.t(name)
        return t / (self.c[name]["members"] * self.batch_size) if t is not None else None


def _time_ratios(tm: _Times, one_device: str | None) -> dict[str, Any]:
    """The time ratios of pairs of cases (the backends, strategies, reforms, scans ...)."""
    q, pme, c = tm.ratio, tm.per_member_example, tm.c
    return {
        "shard_map_over_pmap": q("ens_shard_map", "ens_pmap"),
        "one_device_over_sequential": q(one_device, "sequential") if one_device else None,
        "one_device_case": one_device,
        "loop_over_sequential": q("strategy_loop", "sequential"),
        "vmap_over_sequential": q("strategy_vmap", "sequential"),
        "vmap_over_loop": q("strategy_vmap", "strategy_loop"),
        "reform_im2col_vmap_over_base_loop": q("reform_im2col_vmap", "reform_base_loop"),
        "reform_im2col_loop_over_base_loop": q("reform_im2col_loop", "reform_base_loop"),
        "reform_im2col_loop_over_im2col_sequential": q(
            "reform_im2col_loop", "reform_im2col_sequential"
        ),
        "on_device_loop_over_howto": tm.div(pme("chunk_default"), pme("howto")),
        "on_device_loop_over_howto_by_k": {
            n: tm.div(pme(n), pme("howto"))
            for n in ("chunk_k1", "chunk_k8", "chunk_epoch")
            if n in c and "howto" in c
        },
        "ens_shard_map_over_howto": q("ens_shard_map", "howto"),
        "user_step_over_howto": q("ens_user", "howto"),
        "scan_over_jit": q("chunk_k8", "chunk_k1"),
        "stream_over_device_steps_per_s": q("chunk_default", "stream"),
        "scan_base_k8_over_k1": q("scan_base_k8", "scan_base_k1"),
        "scan_canonical_k8_over_k1": q("scan_canonical_k8", "scan_canonical_k1"),
        "scan_canonical_k8_over_base_k1": q("scan_canonical_k8", "scan_base_k1"),
        "bf16_over_fp32": q("precision_bf16", "precision_fp32"),
    }


def _best_one_device(tm: _Times, cfg: BenchConfig) -> dict[str, Any]:
    """The fastest way found to train the members on one device, against the sequential
    loop (for the CNN the reform cases train the same members as the main cases)."""
    same_model = cfg.model == "cnn" and (cfg.conv_members or cfg.members) == cfg.members
    options = ["strategy_loop", "strategy_vmap"]
    options += ["reform_im2col_loop", "reform_im2col_vmap"] if same_model else []
    timed = {n: tm.t(n) for n in options if tm.t(n) is not None}
    sequential = tm.t("sequential")
    if not (timed and sequential):
        return {"best_one_device_case": None, "best_one_device_over_sequential": None}
    best = min(timed, key=lambda n: timed[n])
    return {
        "best_one_device_case": best,
        "best_one_device_over_sequential": timed[best] / sequential,
    }


def _memory_ratios(c: Mapping[str, Any], one_device: str | None) -> dict[str, Any]:
    """Memory per member of the members' step on one device, against state + activations."""
    return {
        "memory_over_state_activations": c.get(one_device, {}).get("memory_over_state_activations"),
        "memory_over_state_activations_by_case": {
            n: e["memory_over_state_activations"]
            for n, e in c.items()
            if e.get("memory_over_state_activations") is not None and e["same_as"] is None
        },
    }


def _members_per_device_ratios(tm: _Times, cfg: BenchConfig) -> dict[str, Any]:
    """Time per member as members per device grow; FLOP/s against the bf16 matmul's."""
    c, r = tm.c, {}
    mpd = {n: tm.t(f"mpd_{n}") for n in cfg.members_per_device if f"mpd_{n}" in c}
    if 1 in mpd:
        r["members_per_device_scaling"] = {str(n): v / (n * mpd[1]) for n, v in mpd.items()}
        r["members_per_device_scaling_max"] = max(r["members_per_device_scaling"].values())
    else:
        r["members_per_device_scaling"], r["members_per_device_scaling_max"] = {}, None
    # Achieved FLOP/s with the most members per device against the bf16 matmul's.
    top = next((f"mpd_{n}" for n in sorted(mpd, reverse=True)), None)
    r["members_per_device_flops_case"] = top
    r["members_per_device_flops_over_bf16_matmul"] = (
        c[top]["fraction_of_bf16_matmul_flops"] if top else None
    )
    r["flops_over_bf16_matmul_by_members_per_device"] = {
        str(n): c[f"mpd_{n}"]["fraction_of_bf16_matmul_flops"]
        for n in mpd
        if c[f"mpd_{n}"]["fraction_of_bf16_matmul_flops"] is not None
    }
    r["bf16_matmul_over_fp32_matmul"] = c.get("matmul_bf16", {}).get("fraction_of_matmul_flops")
    return r


def _mesh_ratios(tm: _Times) -> dict[str, Any]:
    """Speed-up and efficiency of the members on 1, 2, 4, 8 devices."""
    mesh = {n: tm.t(f"mesh_{n}") for n in (1, 2, 4, 8) if f"mesh_{n}" in tm.c}
    if 1 not in mesh:
        return {"mesh_speedup": {}, "mesh_efficiency": {}}
    return {
        "mesh_speedup": {str(n): mesh[1] / v for n, v in mesh.items()},
        "mesh_efficiency": {str(n): mesh[1] / (n * v) for n, v in mesh.items()},
    }


def check_targets(ratios: Mapping[str, Any]) -> dict[str, Any]:
    """Each target of :data:`TARGETS` with its measured value and whether it is met.

    Args:
      ratios: from :func:`compute_ratios`.

    Returns:
      Target name -> ``{"value", "target", "met"}`` (``met`` None when not measured).

    Example:
      >>> check_targets({"shard_map_over_pmap": 0.9})["shard_map_over_pmap"]["met"]
      True
    """
    out = {}
    for name, (op, bound) in TARGETS.items():
        value = ratios.get(name)
        met = None if value is None else (value <= bound if op == "<=" else value >= bound)
        out[name] = {"value": value, "target": f"{op} {bound}", "met": met}
    return out


def format_table(results: dict[str, Any]) -> str:
    """The results as a text table, then the ratios and targets.

    Args:
      results: from :func:`meshensemble.bench.run_bench`.

    Returns:
      The text.

    Example:
      >>> print(format_table(results))
      case M dev M/dev K ms/step IQR m-ex/s GFLOP/s %mm %bf16 peak MiB notes
      ...
    """
    lines = _case_lines(results["cases"]) + _accuracy_lines(results.get("time_to_accuracy"))
    lines += [""] + _ratio_lines(results["ratios"]) + [""] + _target_lines(results["targets"])
    for name, rows in results.get("layouts", {}).items():
        lines += ["", f"layouts of {name} ({len(rows)} meshes, the same 8-member ensemble):"]
        lines.append(format_layouts(rows))
    return "\n".join(lines)


def _case_lines(cases: dict[str, Any]) -> list[str]:
    """The table of cases: its head, a rule and one line per case."""
    head = (
        f"{'case':<20} {'M':>3} {'dev':>3} {'M/dev':>5} {'K':>4} {'ms/step':>9} {'IQR':>7} "
        f"{'m-ex/s':>8} {'GFLOP/s':>8} {'%mm':>5} {'%bf16':>5} {'peak MiB':>8}  notes"
    )
    lines = [head, "-" * len(head)]
    for name, e in cases.items():
        st = e["time_per_step_s"]
        cells = (f"{'' if e.get(k) is None else show(e[k]):>{w}}" for k, show, w in _CELLS)
        note = f"= {e['same_as']}" if e["same_as"] else e["description"]
        lines.append(
            f"{name:<20} {'' if e['kind'] == 'matmul' else e['members']:>3} {e['devices']:>3} "
            f"{e['members_per_device'] or '':>5} {e['k']:>4} {1e3 * st['median']:>9.1f} "
            f"{1e3 * st['iqr']:>7.1f} {' '.join(cells)}  {note}"
        )
    return lines


_CELLS = (
    ("member_examples_per_s", lambda v: f"{v:.0f}", 8),
    ("flops_per_s", lambda v: f"{v / 1e9:.1f}", 8),
    ("fraction_of_matmul_flops", lambda v: f"{100 * v:.0f}", 5),
    ("fraction_of_bf16_matmul_flops", lambda v: f"{100 * v:.0f}", 5),
    ("peak_memory_bytes", lambda v: f"{v / 2**20:.0f}", 8),
)
"""The table's cells that a case may lack (blank then): the key, its text, its width."""


def _accuracy_lines(tta: dict[str, Any] | None) -> list[str]:
    """The time-to-accuracy runs, after a blank line (none when not run)."""
    if not tta:
        return []
    run = tta["train_config"]
    head = (
        f"time_to_accuracy (test ensemble accuracy >= {tta['target_accuracy']}, {run['model']}, "
        f"{run['members']} members, batch {run['batch_size']}, at most {run['epochs']} epochs):"
    )
    return ["", head, *(f"  {name}: {describe(tta[name])}" for name in ("cold", "warm"))]


def _ratio_lines(ratios: dict[str, Any]) -> list[str]:
    """One line per ratio (numbers, names, non-empty dicts of numbers)."""
    lines: list[str] = []
    for name, v in ratios.items():
        if isinstance(v, dict):
            if v:
                lines.append(f"{name}: " + ", ".join(f"{k}={x:.2f}" for k, x in v.items()))
        elif isinstance(v, float):
            lines.append(f"{name}: {v:.3f}")
        elif isinstance(v, int | str) and not isinstance(v, bool):
            lines.append(f"{name}: {v}")
    return lines


def _target_lines(targets: dict[str, Any]) -> list[str]:
    """One line per target: its bound, the value and whether it is met."""
    lines: list[str] = []
    for name, tgt in targets.items():
        met = {True: "MET", False: "NOT MET", None: "not measured"}[tgt["met"]]
        v = tgt["value"]
        value = "-" if v is None else str(v) if isinstance(v, int) else f"{v:.3f}"
        lines.append(f"target {name} {tgt['target']}: {value} {met}")
    return lines


def plot_members(results: dict[str, Any], path: str) -> bool:
    """Plots time per step against members per device (the ``mpd_*`` cases).

    Draws the measured median with its interquartile range, linear growth from one
    member, and the sequential baseline's time per member.

    Args:
      results: from :func:`meshensemble.bench.run_bench`.
      path: the PNG to write.

    Returns:
      Whether there was anything to plot (at least one ``mpd_*`` case).

    Example:
      >>> plot_members(results, "bench_members.png")   # these results have no mpd_* case
      False
    """
    cases = results["cases"]
    pts = sorted(
        (e["members"], e["time_per_step_s"]) for n, e in cases.items() if n.startswith("mpd_")
    )
    if not pts:
        return False
    plt = plots.pyplot()
    m = np.array([p[0] for p in pts], float)
    q1, med, q3 = (np.array([p[1][q] for p in pts]) * 1e3 for q in ("q1", "median", "q3"))
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    ax.errorbar(
        m, med, yerr=[med - q1, q3 - med], marker="o", capsize=3, label="ensemble, 1 device"
    )
    if m[0] == 1:
        ax.plot(m, med[0] * m, ls="--", color="gray", label="linear from 1 member")
    if "sequential" in cases:
        seq = cases["sequential"]
        per_member = seq["time_per_step_s"]["median"] * 1e3 / seq["members"]
        ax.plot(m, per_member * m, ls=":", color="tab:red", label="sequential (jitted step)")
    _label_axes(ax, results["meta"], m, med)
    ax.legend()
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    storage.makedirs(os.path.dirname(storage.absolute(path)))
    storage.atomic_write(path, lambda f: fig.savefig(f, format="png", dpi=110))
    plt.close(fig)
    return True


def _label_axes(ax: Any, meta: dict[str, Any], m: np.ndarray, med: np.ndarray) -> None:
    """Log axes, the title (model, batch, devices, JAX) and readable ticks."""
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="members per device",
        ylabel="time per step (ms)",
        title=(
            f"{meta['config']['model']}, batch {meta['config']['batch_size']}: "
            f"{meta['device_count']} {meta['device_kind']} device(s), "
            f"{meta['cpu_count']} CPU cores, JAX {meta['jax_version']}"
        ),
    )
    ax.set_xticks(m, [str(int(v)) for v in m])
    ticks = [
        v
        for v in (10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000)
        if med.min() / 1.5 <= v <= med.max() * 2
    ]
    if ticks:
        ax.set_yticks(ticks, [str(v) for v in ticks])
        ax.minorticks_off()


def write_json(results: Mapping[str, Any], path: str) -> None:
    """Writes the results as indented JSON, making the file's folder if needed.

    Args:
      results: from :func:`meshensemble.bench.run_bench`.
      path: the file.

    Example:
      >>> write_json(results, "bench.json")
    """
    storage.makedirs(os.path.dirname(storage.absolute(path)))
    # strict_json makes numpy scalars numbers and tuples lists; anything else: its str
    storage.atomic_write_json(path, strict_json(results), indent=1, default=str)
