"""``meshensemble bench``: how fast ensembles train, against the Flax HOWTO and a loop.

Runs every case in one process on the same model, data and machine, and times them
round-robin (one call of each case per round, after compilation and warm-up rounds), so
that load from other jobs falls on all cases alike; each case's time per step is the
median over ``--repeats`` rounds, with its interquartile range.

The library's cases run the model as the library runs it (for the CNN: ``conv="auto"``,
``canonical`` on CPU, see :mod:`meshensemble.models.conv`); the baselines (``howto``,
``sequential``) run the plain Flax CNN with XLA's convolution, as their users' code does.

Cases (``--cases`` takes these names or the group names in brackets):

* ``matmul_fp32``, ``matmul_bf16`` [matmul]: a square matmul on one device in float32
  and in bfloat16, the FLOP/s yardsticks (8192 x 8192 on a GPU or TPU, 2048 on a CPU,
  ``--matmul-size`` overrides).
* ``howto`` [howto]: the Flax "Ensembling on multiple devices" HOWTO: ``jax.pmap``
  ``apply_model`` + ``update_model`` with one member per device, host-side batch
  indexing and ``jax_utils.replicate`` of every batch. With fewer devices than members,
  a step runs ``members / devices`` such HOWTO runs one after another.
* ``ens_pmap``, ``ens_shard_map`` [backends]: :meth:`meshensemble.Ensemble.train_step`
  on host batches with ``backend="pmap"`` / ``"shard_map"``, one step per call.
* ``ens_user`` [user]: :meth:`meshensemble.Ensemble.train_step` on the model exactly as
  ``howto`` runs it (the user's Flax CNN with XLA's convolution), one member per device:
  ``user_step_over_howto`` is the library's step against the HOWTO's on the same model.
* ``chunk_default``, ``chunk_k1``, ``chunk_k8``, ``chunk_epoch`` [chunk]: the training
  loop's on-device chunk exactly as :func:`meshensemble.training.train` builds it (data on
  the devices, ``K`` steps per compiled call: with ``K > 1`` the loop's paced program, a
  ``fori_loop`` whose step count is an argument); ``default``
  is ``train.default_chunk_steps`` for the platform.
* ``stream`` [stream]: the loop's streamed input (``--input stream``, one step per call,
  Grain prefetch of this process's rows; :mod:`meshensemble.bench.stream_case`), 8 steps
  per timed call; ``ratios["stream_over_device_steps_per_s"]`` compares it with
  ``chunk_default``.
* ``sequential`` [sequential]: the members trained one after another with a jitted
  single-model step on one device (the baseline an ensemble must beat).
* ``mpd_1`` ... ``mpd_32`` [members]: 1 to 32 members on one device (cost growth).
* ``mesh_1`` ... ``mesh_8`` [mesh]: the members on meshes of 1 to 8 devices.
* ``strategy_vmap``, ``strategy_loop`` [strategy]: the member strategies, all members on
  one device.
* ``reform_base_loop``, ``reform_im2col_vmap``, ``reform_im2col_loop``,
  ``reform_im2col_sequential`` [reform]: the CNN with XLA's convolution in the unrolled
  loop (``base``), against the CNN whose convolutions are ``im2col`` matmuls, so that
  ``vmap`` batches the members into batched matmuls (and the first layer, whose input
  all members share, into one wide matmul) instead of grouped convolutions; and the
  im2col model trained member after member, which tells a faster convolution from a
  gain of batching members.
* ``scan_base_k1``, ``scan_base_k8``, ``scan_canonical_k1``, ``scan_canonical_k8``
  [scan]: the on-device chunk of the conv model with XLA's convolution and with
  :func:`meshensemble.models.conv.conv_canonical` (the same convolution with a backward pass
  in the layout XLA:CPU's fast kernels take), at ``K = 1`` and ``K = 8``.
* ``precision_fp32``, ``precision_bf16`` [precision]: the members on one device in
  float32 and with mixed precision (``compute_dtype=bfloat16``, float32 master weights).
* ``time_to_accuracy`` [time_to_accuracy]: :func:`meshensemble.training.train` in a fresh
  process, from its start to the first epoch whose test ensemble accuracy reaches
  ``--target-accuracy``, compilation included; twice: with an empty compilation cache
  (cold) and with the same cache again (warm); the process-start overhead apart
  (:mod:`meshensemble.bench.accuracy`). It runs first, in its own processes, and is not
  part of the round-robin timing.

FLOPs are counted analytically (:mod:`meshensemble.bench.flops`: the matmuls and
convolutions of the jaxpr of one member's forward and backward pass), so they hold on
any device; XLA's ``cost_analysis()``, which misses cuDNN's convolutions on a GPU, is
kept as a cross-check in ``meta``.

Cases that describe the same computation (e.g. ``mesh_8`` and ``ens_shard_map``) are
timed once and reported under each name (``same_as`` in the JSON).

Modules: :mod:`~meshensemble.bench.config` (the config, the groups, the plan of cases),
:mod:`~meshensemble.bench.workloads` (the models, data and members' states the cases
share), :mod:`~meshensemble.bench.flops` (the analytic FLOP count),
:mod:`~meshensemble.bench.cases` (the runners), :mod:`~meshensemble.bench.timing`
(the round-robin timer), :mod:`~meshensemble.bench.accuracy` (time to accuracy),
:mod:`~meshensemble.bench.report` (ratios, targets, table, JSON, plot),
:mod:`~meshensemble.bench.layouts` (one ensemble on E x D x P meshes: state bytes per
device, step time). The command
line (``meshensemble bench``) lives in :mod:`meshensemble.cli.bench`.

``--suite accelerator`` runs the cases every accelerator target needs and writes one row
per target to ``DIR/accelerator.json`` and ``DIR/accelerator.md``
(:mod:`~meshensemble.bench.suite`).

Example:
  $ meshensemble bench --suite accelerator --data-file mnist.npz --out results/
  $ meshensemble bench --fake-devices 8 --data-file mnist.npz --out bench.json
  $ meshensemble bench --tiny --out /tmp/bench.json  # CI: a tiny configuration, < 60 s
  $ meshensemble bench --tiny --cases howto,backends
  >>> from meshensemble import bench
  >>> results = bench.run_bench(bench.resolve(tiny=True, cases="matmul"))  # progress: stderr
  >>> sorted(results["cases"])
  ['matmul_bf16', 'matmul_fp32']
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

import jax

from meshensemble.bench.accuracy import time_to_accuracy
from meshensemble.bench.cases import RUNNERS, Runner
from meshensemble.bench.config import (
    GROUPS,
    TINY,
    BenchConfig,
    Case,
    Spec,
    known_cases,
    matmul_size,
    plain_model,
    plan,
    resolve,
    runs_time_to_accuracy,
)
from meshensemble.bench.flops import count_flops, jaxpr_flops, train_flops
from meshensemble.bench.layouts import (
    LAYOUT_DEVICES,
    LAYOUT_MEMBERS,
    format_layouts,
    measure_layouts,
)
from meshensemble.bench.report import TARGETS, collect, format_table, plot_members, write_json
from meshensemble.bench.stream_case import StreamSteps
from meshensemble.bench.suite import ACCELERATOR_TARGETS, SUITES, accelerator_rows, write_suite
from meshensemble.bench.timing import loadavg, round_robin, timed
from meshensemble.bench.workloads import Context, load_data, make_model
from meshensemble.models.zoo import get_model

RUNNERS["stream"] = StreamSteps  # here: bench/stream_case.py builds on bench/cases.py

__all__ = [
    "ACCELERATOR_TARGETS",
    "GROUPS",
    "SUITES",
    "TARGETS",
    "TINY",
    "BenchConfig",
    "Case",
    "Spec",
    "count_flops",
    "format_layouts",
    "format_table",
    "jaxpr_flops",
    "known_cases",
    "make_model",
    "matmul_size",
    "measure_layouts",
    "plan",
    "plot_members",
    "resolve",
    "run_bench",
    "accelerator_rows",
    "time_to_accuracy",
    "train_flops",
    "write_json",
    "write_suite",
]


def run_bench(cfg: BenchConfig, say: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Runs the benchmark and returns the results (what ``--out`` holds).

    Loads the data, runs ``time_to_accuracy`` in its own processes (first, before this
    process starts its accelerator), plans the cases, prepares (compiles) each distinct
    computation once, counts the models' FLOPs, times the cases round-robin and
    collects the results.

    Args:
      cfg: what to run (see :func:`resolve`).
      say: where progress lines go (default: stderr).

    Returns:
      A dict with ``meta`` (date, versions, devices, config, wall time, load averages,
      FLOPs per example), ``cases`` (per case: time per step, member-examples per
      second, FLOP/s, peak memory, ...), ``time_to_accuracy`` (None when not run),
      ``ratios`` and ``targets``.

    Raises:
      ValueError: the batch is larger than the training set, or the members do not fit
        the devices.

    Example:
      >>> results = run_bench(resolve(tiny=True, cases="matmul"), say=lambda line: None)
      >>> results["ratios"]["bf16_matmul_over_fp32_matmul"] > 0
      True
      >>> results["ratios"]["shard_map_over_pmap"] is None   # its cases did not run
      True
    """
    say = say or (lambda s: print(s, file=sys.stderr, flush=True))
    _check_layouts(cfg)
    t_start = time.perf_counter()
    since = lambda: time.perf_counter() - t_start
    load_start = loadavg()
    dataset, tta = _load(cfg, say)
    ctx = Context(cfg, dataset)
    devices = jax.devices()
    platform = devices[0].platform
    cases = plan(cfg, len(devices), platform, ctx.steps_per_epoch)
    if cfg.suite:  # the memory case first: no earlier case's device peak can hide its own
        cases.sort(key=lambda c: c.name != f"mpd_{cfg.members}")
    runners, owner = _runners(ctx, cases)
    say(
        f"bench: {len(cases)} cases ({len(runners)} distinct) on {len(devices)} {platform} "
        f"device(s); model {cfg.model}, {cfg.members} members, batch {cfg.batch_size}; "
        f"data: {dataset.note}"
    )
    _prepare(ctx, runners, owner, say)
    say(f"  compiled everything at {since():6.1f}s")
    round_robin(
        runners.values(),
        cfg.repeats,
        cfg.warmup,
        cfg.case_budget,
        lambda rep, n: say(f"  round {rep}/{n} done at {since():6.1f}s"),
    )
    results = collect(cfg, ctx, cases, runners, owner, tta)
    if cfg.layouts:  # the same 8-member ensemble on E x D x P meshes (bench/layouts.py)
        results["layouts"] = {}
        for name in cfg.layouts:
            say(f"  layouts of {name} at {since():6.1f}s")
            results["layouts"][name] = measure_layouts(
                get_model(name), members=LAYOUT_MEMBERS, batch_size=cfg.batch_size
            )
    results["meta"].update(wall_s=since(), loadavg_start=load_start, loadavg_end=loadavg())
    return results


def _load(cfg: BenchConfig, say: Callable[[str], None]) -> tuple[Any, dict[str, Any] | None]:
    """The data (checked against the batch), then ``time_to_accuracy`` when selected."""
    dataset = load_data(cfg, say)
    if cfg.batch_size > dataset.num_train:
        raise ValueError(
            f"--batch-size {cfg.batch_size} is larger than the {dataset.num_train} training "
            "examples"
        )
    tta = None
    if runs_time_to_accuracy(cfg):
        say(f"bench: time_to_accuracy, target {cfg.target_accuracy}, two fresh processes")
        tta = time_to_accuracy(cfg, dataset, say)
    return dataset, tta


def _check_layouts(cfg: BenchConfig) -> None:
    """ValueError when ``--layouts`` lacks its devices or a batch that ``data=4`` splits."""
    if cfg.layouts and len(jax.devices()) < LAYOUT_DEVICES:
        raise ValueError(
            f"--layouts needs {LAYOUT_DEVICES} devices, this process has {len(jax.devices())}; "
            f"pass --fake-devices {LAYOUT_DEVICES} on CPU"
        )
    if cfg.layouts and cfg.batch_size % 4:
        raise ValueError(
            f"--layouts splits the batch over data=4: --batch-size {cfg.batch_size} must be a "
            "multiple of 4"
        )


def _runners(ctx: Context, cases: list[Case]) -> tuple[dict[Spec, Runner], dict[Spec, str]]:
    """One runner per distinct spec, and each spec's first case (its owner)."""
    owner: dict[Spec, str] = {}
    for case in cases:
        owner.setdefault(case.spec, case.name)
    return {spec: RUNNERS[spec.kind](ctx, spec) for spec in owner}, owner


def _prepare(
    ctx: Context,
    runners: dict[Spec, Runner],
    owner: dict[Spec, str],
    say: Callable[[str], None],
) -> None:
    """Compiles every runner (and its first calls; nothing is timed) and counts FLOPs."""
    for spec, runner in runners.items():
        say(f"  prepared {owner[spec]:<20s} in {timed(runner.prepare):6.1f}s")
    # FLOPs per example are counted from the jaxpr; XLA's cost analysis is a cross-check
    # (from a case's one-device program, else a plain step compiled here).
    for model_id in sorted({plain_model(s.model) for s in runners if s.kind != "matmul"}):
        ctx.flops_per_example(model_id)
        ctx.cost_analysis_per_example(model_id)
