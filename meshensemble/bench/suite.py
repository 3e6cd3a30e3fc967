"""``--suite accelerator``: every accelerator target in one command, as JSON and a table.

The suite runs the bench cases the targets need (the bf16 and fp32 matmul yardsticks,
the Flax HOWTO, the training loop's on-device chunk over a whole epoch, the members on
one device at ``members`` and 32 per device, and ``time_to_accuracy`` cold and warm) and
reduces them to one row per target of the accelerator issue (set for one H100): the
target, its threshold, the measured value, pass or fail. :func:`write_suite` writes
``DIR/accelerator.json`` (the rows, then every bench result) and ``DIR/accelerator.md``
(a markdown table ready for docs/benchmarks.md: the rows under a line with the date,
the device and the jax/jaxlib/flax versions).

What the rows measure:

* **epoch**: the loop's chunk of a whole epoch (``chunk_epoch``), median seconds per step
  times the steps of an epoch (60,000 MNIST examples / batch 128 = 468 steps);
* **speed-up over the HOWTO**: the HOWTO's seconds per member-example over the epoch
  chunk's (the HOWTO runs ``members / devices`` pmap runs one after another);
* **time to accuracy, cold / warm**: run-timed (from the start of ``train()`` to the end
  of the first epoch on target), in a fresh process with an empty compilation cache
  folder (cold) and again on the same folder (warm); the process start (interpreter,
  ``import jax``, device start, ``import meshensemble``) is reported apart;
* **32-member throughput**: FLOP/s of 32 members on one device (analytic FLOPs, see
  :mod:`meshensemble.bench.flops`) over the bf16 matmul's measured on the same device;
* **memory**: the ``members``-member step on one device: its compiled program's
  ``memory_analysis()`` per member (arguments + outputs + temporaries - aliased), over
  one member's state (parameters + optimizer state) + activations (the residuals
  ``jax.vjp`` keeps for the backward pass of one batch, from ``jax.eval_shape``); the
  device's own ``memory_stats()`` peak is reported beside it where the device has one
  (the suite prepares that case first, so no earlier case's peak hides it);
* **programs**: what the cold time-to-accuracy run compiled (its own programs; the
  auto-tuner's reported apart).

Example:
  $ meshensemble bench --suite accelerator --data-file mnist.npz --out results/
  $ meshensemble bench --suite accelerator --tiny --out /tmp/acc   # CPU, seconds
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from meshensemble.runtime import storage
from meshensemble.training.outputs import strict_json

SUITES: dict[str, dict[str, Any]] = {
    "accelerator": {
        "cases": ("matmul", "howto", "chunk_epoch", "members", "time_to_accuracy"),
        "members_per_device": None,  # (members, 32): see suite_defaults
        "repeats": 5,
        "case_budget": 20.0,
    }
}
"""The suites of ``--suite``: the config values each sets (given flags still win)."""

SUITE_MEMBERS = 32
"""The members per device of the throughput target."""


@dataclasses.dataclass(frozen=True)
class Target:
    """One target of the suite.

    Attributes:
      name: the row's key in ``accelerator.json``.
      label: the row's text (``{m}``: the members).
      op: ``"<="`` or ``">="``.
      bound: the threshold (for one H100).
      unit: how the value prints (``"s"``, ``"x"``, ``"%"``, ``""``).
    """

    name: str
    label: str
    op: str
    bound: float
    unit: str


ACCELERATOR_TARGETS = (
    Target("epoch_s", "{m}-member MNIST epoch", "<=", 0.25, "s"),
    Target("speedup_over_howto", "speed-up over the Flax HOWTO", ">=", 20.0, "x"),
    Target(
        "time_to_accuracy_cold_s", "time to {acc} test accuracy, cold (run-timed)", "<=", 4.0, "s"
    ),
    Target(
        "time_to_accuracy_warm_s", "time to {acc} test accuracy, warm (run-timed)", "<=", 2.0, "s"
    ),
    Target(
        "flops_over_bf16_matmul",
        "{big} members/device: FLOP/s over the bf16 matmul",
        ">=",
        0.25,
        "%",
    ),
    Target(
        "memory_over_state_activations",
        "{m}-member step memory / (state + activations)",
        "<=",
        1.3,
        "x",
    ),
    Target("programs", "programs compiled (cold run)", "<=", 8, ""),
)
"""The accelerator issue's targets, set for one H100 (on other devices only reported)."""


def suite_defaults(name: str, members: int, tiny: bool) -> dict[str, Any]:
    """The config values ``--suite name`` sets.

    Args:
      name: a key of :data:`SUITES`.
      members: the ensemble size (the memory case runs it on one device).
      tiny: the CI configuration (the throughput case at ``2 * members`` per device).

    Returns:
      :class:`~meshensemble.bench.BenchConfig` field values.

    Raises:
      ValueError: an unknown suite.

    Example:
      >>> suite_defaults("accelerator", 8, False)["members_per_device"]
      (8, 32)
    """
    if name not in SUITES:
        raise ValueError(f"--suite {name}: unknown suite; choose from {', '.join(SUITES)}")
    values = dict(SUITES[name])
    big = 2 * members if tiny else SUITE_MEMBERS
    values["members_per_device"] = tuple(sorted({members, big}))
    if tiny:
        values.update(repeats=2, case_budget=2.0)
    return values


def _value(name: str, results: Mapping[str, Any]) -> tuple[Any, str]:
    """A target's measured value and a note (how it was measured)."""
    cases, ratios = results["cases"], results["ratios"]
    tta = results.get("time_to_accuracy") or {}
    steps = results["meta"]["data"]["steps_per_epoch"]
    if name == "epoch_s":
        c = cases.get("chunk_epoch")
        if not c:
            return None, "not run"
        return c["time_per_step_s"]["median"] * steps, f"{steps} steps x median step, K={c['k']}"
    if name == "speedup_over_howto":
        r = (ratios.get("on_device_loop_over_howto_by_k") or {}).get("chunk_epoch")
        return (1 / r if r else None), "per member-example, epoch chunk against the HOWTO"
    if name.startswith("time_to_accuracy_"):
        run = tta.get("cold" if "cold" in name else "warm") or {}
        if "error" in run or not run:
            return None, run.get("error", "not run").splitlines()[-1][:120] if run else "not run"
        start = run["process_start"]["total_s"]
        if not run["reached"]:
            return None, f"target not reached ({100 * (run['accuracy'] or 0):.2f}%)"
        return run["train_to_accuracy_s"], (
            f"epoch {run['epoch']}; process start {start:.1f} s apart; compile "
            f"{run['compile_s']:.1f} s; cache {run['cache_hits']} hits / "
            f"{run['cache_misses']} misses"
        )
    if name == "flops_over_bf16_matmul":
        case = ratios.get("members_per_device_flops_case")
        value = ratios.get("members_per_device_flops_over_bf16_matmul")
        bf16 = results["meta"].get("matmul_bf16_flops_per_s")
        note = f"{case}; bf16 matmul {bf16 / 1e12:.2f} TFLOP/s" if bf16 else f"{case}"
        return value, note
    if name == "memory_over_state_activations":
        return ratios.get("memory_over_state_activations"), _memory_note(results)
    if name == "programs":
        cold = tta.get("cold") or {}
        tuned = cold.get("tuning_programs")
        return cold.get("programs"), (f"the auto-tuner's {tuned} apart" if tuned else "")
    raise ValueError(f"unknown target {name!r}")


def _memory_note(results: Mapping[str, Any]) -> str:
    case = results["ratios"].get("one_device_case")
    c = results["cases"].get(case or "", {})
    per = c.get("memory_per_member_bytes")
    if per is None:
        return "no memory analysis on this backend"
    note = f"{case}: {per / 2**20:.1f} MiB/member (memory_analysis)"
    if c.get("memory_source") == "memory_stats" and c.get("peak_memory_bytes"):
        mpd = c["members_per_device"] or 1
        note += f", device peak {c['peak_memory_bytes'] / mpd / 2**20:.1f} MiB/member"
    return note


def accelerator_rows(results: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The suite's rows: each target with its threshold, value and whether it passed.

    Args:
      results: from :func:`meshensemble.bench.run_bench` with the suite's config.

    Returns:
      ``[{"name", "target", "threshold", "value", "passed", "note"}, ...]`` (``passed``
      None when not measured).

    Example:
      >>> rows = accelerator_rows(results)
      >>> sorted(rows[0])
      ['name', 'note', 'passed', 'shown', 'target', 'threshold', 'value']
    """
    cfg = results["meta"]["config"]
    big = max(cfg["members_per_device"] or (SUITE_MEMBERS,))
    acc = f"{100 * cfg['target_accuracy']:.1f}%"
    rows = []
    for t in ACCELERATOR_TARGETS:
        value, note = _value(t.name, results)
        passed = None if value is None else value <= t.bound if t.op == "<=" else value >= t.bound
        rows.append(
            {
                "name": t.name,
                "target": t.label.format(m=cfg["members"], big=big, acc=acc),
                "threshold": f"{t.op} {_show(t.bound, t.unit)}",
                "value": value,
                "shown": "-" if value is None else _show(value, t.unit),
                "passed": passed,
                "note": note,
            }
        )
    return rows


def _show(v: float, unit: str) -> str:
    if unit == "s":
        return f"{v:.3f} s" if v < 10 else f"{v:.1f} s"
    return {"%": f"{100 * v:.0f}%", "x": f"{v:.2f}x"}.get(unit, f"{v:g}")


def format_markdown(results: Mapping[str, Any], rows: list[dict[str, Any]]) -> str:
    """The rows as a markdown table, under a line with date, device and versions.

    Args:
      results: the bench results (their ``meta``).
      rows: from :func:`accelerator_rows`.

    Returns:
      Markdown text.

    Example:
      >>> print(format_markdown(results, accelerator_rows(results)).splitlines()[0])
      Measured ... on 8 x cpu (cpu), jax ...; model mlp32, batch 32, data: ...
    """
    m = results["meta"]
    head = (
        f"Measured {m['date']} on {m['device_count']} x {m['device_kind']} ({m['platform']}), "
        f"jax {m['jax_version']}, jaxlib {m['jaxlib_version']}, flax {m['flax_version']}; "
        f"model {m['config']['model']}, batch {m['config']['batch_size']}, data: "
        f"{m['data']['note']}; bench wall time {m.get('wall_s', 0):.0f} s."
    )
    lines = [head, "", "| target | threshold | measured | pass | how |", "|---|---|---|---|---|"]
    for r in rows:
        verdict = {True: "pass", False: "FAIL", None: "not measured"}[r["passed"]]
        lines.append(
            f"| {r['target']} | {r['threshold']} | {r['shown']} | {verdict} | {r['note']} |"
        )
    return "\n".join(lines) + "\n"


def write_suite(results: dict[str, Any], out_dir: str) -> tuple[str, str]:
    """Writes ``out_dir/accelerator.json`` and ``out_dir/accelerator.md``.

    Args:
      results: from :func:`meshensemble.bench.run_bench` with the suite's config.
      out_dir: the folder (made if needed).

    Returns:
      The two paths.

    Example:
      >>> write_suite(results, "acc")   # results of run_bench(resolve(suite="accelerator"))
      ('acc/accelerator.json', 'acc/accelerator.md')
    """
    rows = accelerator_rows(results)
    storage.makedirs(out_dir)
    json_path = storage.join(out_dir, "accelerator.json")
    md_path = storage.join(out_dir, "accelerator.md")
    summary = {"suite": "accelerator", "targets": rows, "results": results}
    # strict_json makes numpy scalars numbers and tuples lists; what is left: item() or str
    plain = lambda v: v.item() if hasattr(v, "item") else str(v)
    storage.atomic_write_json(json_path, strict_json(summary), indent=1, default=plain)
    storage.atomic_write(md_path, format_markdown(results, rows))
    return json_path, md_path
