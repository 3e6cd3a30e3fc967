"""Evaluating a trained run: test metrics, calibration and OOD detection.

:func:`evaluate_run` reloads a run from its workdir (``config.json`` and a checkpoint),
on any mesh, and computes on the mesh:

* the test metrics of :meth:`meshensemble.Ensemble.evaluate` (ensemble, each member and
  the mean member; keys as in ``metrics.jsonl``, see
  :func:`meshensemble.metrics.prefix_metrics`);
* per-example OOD scores (every kind of :data:`OOD_SCORE_KINDS`: max-prob, entropy and
  mutual information from the members' softmax, max-logit and energy from their logits)
  for the test images and for each OOD set, then AUROC and AUPR with OOD as the positive class;
* the per-bin sums of a reliability diagram, for the ensemble and the mean member.

Only ``[N]`` scores and ``[num_bins]`` sums leave the devices, never the members'
``[members, N, classes]`` probabilities. Process 0 writes ``evaluation.json``,
``reliability_diagram.png`` and ``ood_histogram.png`` to the workdir.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from meshensemble import data as data_lib
from meshensemble import metrics
from meshensemble.calibration.run import (
    CALIBRATION_PLOT,
    calibrate_ensemble,
    calibration_line,
    check_calibrate,
    check_split,
    write_calibration_plot,
)
from meshensemble.calibration.run import (
    TEMPERATURE_BOUNDS as TEMPERATURE_BOUNDS,
)
from meshensemble.calibration.run import (
    stream_ensemble_logits as stream_ensemble_logits,
)
from meshensemble.core import evaluating, inputs, streaming
from meshensemble.core.mesh import make_mesh, parse_mesh
from meshensemble.data.split import split_validation
from meshensemble.evaluation.regression import EVALUATION_FILE as EVALUATION_FILE
from meshensemble.evaluation.regression import (
    check_checkpoint,
    evaluate_regression,
    previous_calibration,
)
from meshensemble.numerics import statmath
from meshensemble.training import CONFIG_FILE, TrainConfig, build_ensemble, final_table
from meshensemble.training.checkpoint import (
    list_checkpoints,
    restore_checkpoint,
)
from meshensemble.training.config import default_mesh_shape
from meshensemble.training.identity import check_run_data, load_run_data
from meshensemble.training.outputs import check_writable, dumps_strict, replacing, writing

OOD_SETS = ("noise", "inverted", "fashion_mnist")
"""OOD sets :func:`evaluate_run` knows (see :func:`ood_images`)."""
DEFAULT_OOD = ("noise", "inverted")
"""The OOD sets used when none are named (both need no data beyond the test set)."""
NOISE_SEED = 0
"""Seed of ``np.random.default_rng`` for the ``noise`` OOD set."""
OOD_SCORE_KINDS = statmath.OOD_SCORE_KINDS
"""The ensemble's OOD scores: max_prob, entropy, mutual information from the members'
softmax, and max_logit and energy from their logits (``ens.predict_members(...,
logits=True)``): each member's max logit / free energy, averaged over members
(:func:`meshensemble.metrics.ood_score_from_logits`). Not from ``log(mean_m p^m)``: its
logsumexp is 0 (the energy would be constant) and its max is ``log max_prob``."""
MEMBER_OOD_KINDS = statmath.MEMBER_OOD_KINDS
"""OOD scores of a single member (its mutual information is 0)."""
RELIABILITY_PLOT = "reliability_diagram.png"
OOD_PLOT = "ood_histogram.png"
HISTOGRAM_SCORE = "entropy"
"""The OOD score drawn in ``ood_histogram.png``."""
_BIN_KEYS = statmath.OOD_BIN_KEYS


def load_run_config(workdir: str) -> Any:
    """Reads a run's ``config.json`` back into a :class:`meshensemble.training.TrainConfig`.

    The ``"resolved"`` entry (what training resolved: mesh, devices...) and keys that
    ``TrainConfig`` does not know are ignored.

    Args:
      workdir: the run's folder.

    Returns:
      The validated ``TrainConfig`` the run was trained with.

    Raises:
      FileNotFoundError: ``workdir`` or its ``config.json`` does not exist.
      ValueError: ``config.json`` is not valid JSON, not an object, or holds bad values
        (one line naming the file).

    Example:
      >>> load_run_config("runs/tiny").members
      4
    """
    if not os.path.isdir(workdir):
        raise FileNotFoundError(
            f"{workdir}: no such run folder; train one with `meshensemble train --workdir "
            f"{workdir}` or pass the folder of a trained run"
        )
    path = os.path.join(workdir, CONFIG_FILE)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path}: not found; --workdir must be a folder written by `meshensemble train`"
        )
    try:
        with open(path) as f:
            loaded = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        msg = " ".join(str(err).split())
        raise ValueError(f"{path}: corrupt run config, cannot read JSON ({msg})") from None
    if not isinstance(loaded, dict):
        raise ValueError(
            f"{path}: corrupt run config, expected a JSON object of TrainConfig fields"
        )
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    try:
        return TrainConfig(**{k: v for k, v in loaded.items() if k in fields}).validate()
    except (TypeError, ValueError) as err:
        msg = " ".join(str(err).split())
        raise ValueError(f"{path}: corrupt run config ({msg})") from None


def ood_images(
    name: str,
    test_images: np.ndarray,
    ood_file: str | None = None,
    data_dir: str | None = None,
    log: Callable[[str], Any] | None = None,
) -> np.ndarray:
    """The images of an out-of-distribution set, uint8 ``[N, 28, 28, 1]``.

    * ``"noise"``: uniform random pixels ``0..255`` in the shape of ``test_images``
      (``np.random.default_rng(NOISE_SEED)``, so the same every time);
    * ``"inverted"``: ``255 - test_images``;
    * ``"fashion_mnist"``: the Fashion-MNIST test split, from ``ood_file`` (a Keras-layout
      npz) if given, else from TFDS's prepared data in ``data_dir`` (never downloaded).

    Args:
      name: one of :data:`OOD_SETS`.
      test_images: the in-distribution test images, uint8 ``[N, 28, 28, 1]``.
      ood_file: a Keras-layout ``fashion_mnist.npz`` for ``"fashion_mnist"``.
      data_dir: TFDS's data directory (default ``$TFDS_DATA_DIR`` or
        ``~/tensorflow_datasets``).
      log: gets one line saying where Fashion-MNIST came from.

    Returns:
      uint8 images ``[N_ood, 28, 28, 1]``.

    Raises:
      ValueError: ``name`` is unknown, or ``ood_file`` is given for another set.
      meshensemble.data.DataError: Fashion-MNIST is neither in ``ood_file`` nor prepared
        in TFDS (one line saying how to provide it).

    Example:
      >>> bool((ood_images("inverted", images) == 255 - images).all())
      True
      >>> ood_images("noise", images).shape
      (32, 28, 28, 1)
    """
    if name not in OOD_SETS:
        raise ValueError(f"unknown OOD set {name!r}; choose from {', '.join(OOD_SETS)}")
    test_images = np.asarray(test_images)
    if name == "noise":
        rng = np.random.default_rng(NOISE_SEED)
        return rng.integers(0, 256, size=test_images.shape, dtype=np.uint8)
    if name == "inverted":
        return (255 - test_images.astype(np.int32)).astype(np.uint8)
    log = log or (lambda s: None)
    if ood_file is not None:
        return data_lib.load_dataset("fashion_mnist", "npz", ood_file, log=log).test_images
    try:
        ds = data_lib.load_tfds("fashion_mnist", data_dir, download=False)
    except data_lib.DataError as err:
        raise data_lib.DataError(
            f"OOD set fashion_mnist is unavailable offline: {err.reason}; pass a Keras-layout "
            "Fashion-MNIST npz with --ood-file PATH/fashion_mnist.npz, or prepare it with "
            "`meshensemble train --dataset fashion_mnist --source tfds` (needs the network)"
        ) from None
    log(f"OOD data: {ds.note}")
    return ds.test_images


def stream_scores(
    ens: Any,
    state: Any,
    images: Any,
    labels: Any | None = None,
    batch_size: int = 1000,
    num_bins: int = 15,
) -> dict[str, Any]:
    """Per-example OOD scores and reliability-diagram sums, computed on the mesh.

    Streams over ``images`` in batches of ``batch_size`` (rounded up to a multiple of the
    ``data`` axis; the last batch is padded and masked) by the host streaming engine
    (:func:`meshensemble.core.streaming.stream`). For each batch the mesh program of
    :func:`meshensemble.core.steps.ood_stats` turns the members' logits into ``[kinds, b]``
    scores and ``[num_bins]`` bin sums on device (members averaged by ``pmean`` over
    ``ensemble``); only those reach the host.

    Args:
      ens: the :class:`meshensemble.Ensemble`.
      state: its state.
      images: ``[N, ...]`` images (any ``N``).
      labels: ``[N]`` integer labels for the bin sums; None (e.g. OOD data) skips them.
      batch_size: examples per call.
      num_bins: equal-width confidence bins.

    Returns:
      ``{"scores": {kind: [N] float64 numpy}}`` for every kind in
      :data:`OOD_SCORE_KINDS`, ``{"member_scores": {kind: [members, N]}}``
      for every kind in :data:`MEMBER_OOD_KINDS` (each member scored as a single model);
      with ``labels`` also ``"ensemble"`` and
      ``"mean_member"``: dicts in the layout of
      :func:`meshensemble.metrics.reliability_diagram_data` (``accuracy``,
      ``confidence``, ``count``, ``bin_edges``). The mean member's curve pools the bin
      sums of all members, i.e. each bin is the count-weighted average of the members'
      bins (a member with no example in a bin does not drag it to ``nan``).

    Raises:
      ValueError: no images, labels of another length, a state of another ensemble, or
        a regression ensemble.

    Example:
      >>> out = stream_scores(ens, state, test_images, test_labels, batch_size=8)
      >>> out["scores"]["entropy"].shape, out["ensemble"]["accuracy"].shape
      ((16,), (15,))
      >>> out["member_scores"]["max_prob"].shape  # [members, N]
      (2, 16)
    """
    n = int(np.shape(images)[0])
    if n == 0:
        raise ValueError("stream_scores: no images; give at least one")
    if labels is not None and np.shape(labels) != (n,):
        raise ValueError(
            f"stream_scores: labels of shape {np.shape(labels)} for {n} images; give [N] labels"
        )
    inputs.check_state(state, ens.num_members)
    y_all = np.zeros(n, np.int32) if labels is None else np.asarray(labels, np.int32)
    fn = evaluating.ood_fn(ens, int(num_bins), images[:1])
    scores: list[np.ndarray] = []
    member_scores: list[np.ndarray] = []
    sums: dict[str, dict[str, np.ndarray]] = {}

    def sink(start: int, out: Mapping[str, Any]) -> None:
        scores.append(np.asarray(out["scores"], np.float64).T)
        member_scores.append(np.moveaxis(np.asarray(out["member_scores"], np.float64), -1, 0))
        for part in ("ensemble", "member"):
            acc = sums.setdefault(part, dict.fromkeys(_BIN_KEYS, 0.0))
            for key in _BIN_KEYS:
                acc[key] = acc[key] + np.asarray(out[part][key], np.float64)

    axes = {"scores": 0, "member_scores": 1, "ensemble": None, "member": None}

    def run(x: Any, y: Any, mask: Any) -> dict[str, Any]:
        out = fn(state, x, y, mask)
        return {"scores": out.examples["scores"],
                "member_scores": out.member_examples["scores"], **out.totals}  # fmt: skip

    streaming.stream(run, (images, y_all), batch_size, ens.data_size, sink, axes=axes)
    all_scores = np.concatenate(scores, axis=1)
    all_members = np.concatenate(member_scores, axis=-1)
    result: dict[str, Any] = {
        "scores": {kind: all_scores[i] for i, kind in enumerate(OOD_SCORE_KINDS)},
        "member_scores": {kind: all_members[i] for i, kind in enumerate(MEMBER_OOD_KINDS)},
    }
    if labels is not None:
        result["ensemble"] = _reliability(sums["ensemble"], num_bins)
        result["mean_member"] = _reliability(sums["member"], num_bins)
    return result


def _reliability(sums: Mapping[str, np.ndarray], num_bins: int) -> dict[str, np.ndarray]:
    """Bin sums to the layout of :func:`meshensemble.metrics.reliability_diagram_data`."""
    return metrics.reliability_from_bins(sums, num_bins)


def _mesh_shape(mesh: Any, members: int) -> dict[str, int]:
    if mesh is None or mesh == "":
        return default_mesh_shape(members, jax.device_count())
    if isinstance(mesh, Mesh):
        return {k: int(v) for k, v in mesh.shape.items()}
    if isinstance(mesh, str):
        return parse_mesh(mesh)
    return {k: int(v) for k, v in dict(mesh).items()}


def _restore_read_only(
    workdir: str, ens: Any, sample: Any, checkpoint: int | None, say: Callable[[str], Any]
) -> tuple[Any, int]:
    """Restores without touching the run's checkpoints; one line when not the newest."""
    newest = max(list_checkpoints(workdir), default=None)
    lines: list[str] = []
    state, _, step = restore_checkpoint(
        workdir, ens, sample, checkpoint, echo=lines.append, move_damaged=False
    )
    if checkpoint is None and newest is not None and step != newest:
        tails = ("; trying the previous one", "; trying the newest remaining one")
        why = "; ".join(functools.reduce(lambda t, x: t.replace(x, ""), tails, ln) for ln in lines)
        which = f"not the newest ({newest})" if step < newest else "saved meanwhile"
        say(f"evaluating checkpoint {step}, {which}: {why}")
    else:
        for line in lines:
            say(line)
    return state, int(step)


def evaluate_run(
    workdir: str,
    checkpoint: int | None = None,
    ood: Sequence[str] = DEFAULT_OOD,
    mesh: str | Mapping[str, int] | Mesh | None = None,
    batch_size: int = 1000,
    num_bins: int = 15,
    source: str | None = None,
    data_file: str | None = None,
    *,
    ood_file: str | None = None,
    echo: Callable[[str], Any] | None = None,
    calibrate: bool = False,
    alpha: float = 0.1,
    conformal: str = "thr",
    data_dir: str | None = None,
    dataset: data_lib.Dataset | None = None,
) -> dict[str, Any]:
    """Evaluates a trained run: test metrics, OOD detection and calibration plots.

    A regression run (``task="regression"``) is scored by
    :func:`meshensemble.evaluation.regression.evaluate_regression` instead (proper scores,
    and with ``calibrate`` a variance scale and conformal intervals; no OOD sets).

    Rebuilds the run's ensemble from ``workdir/config.json`` (as ``meshensemble train``
    built it) on ``mesh``, restores a checkpoint onto it, loads the test split with the
    run's data settings and computes everything on the mesh. Process 0 writes
    ``evaluation.json`` (the returned dict), ``reliability_diagram.png`` (ensemble and
    mean member; the mean member's curve pools all members' bin sums, see
    :func:`stream_scores`) and ``ood_histogram.png`` (the ``entropy`` score of the test
    set and of each OOD set), and a summary table goes to ``echo``.

    Args:
      workdir: the run's folder (``config.json`` and ``checkpoints/``).
      checkpoint: the step to restore; default the latest.
      ood: OOD sets from :data:`OOD_SETS` (see :func:`ood_images`); may be empty.
      mesh: ``"ensemble=E,data=D"``, a dict of axis sizes or a ``Mesh``; default all
        devices with ``ensemble = gcd(members, devices)`` (it may differ from training).
      batch_size: examples per compiled call.
      num_bins: equal-width confidence bins for the ECE and the reliability diagram.
      source: overrides the run's data source (``auto``, ``tfds``, ``npz``, ``sample``,
        ``arrayrecord``). Without ``source``, ``data_file``, ``data_dir`` and ``dataset``
        the run's recorded source and file are used (see
        :func:`meshensemble.training.identity.load_run_data`).
      data_file: overrides the run's Keras-layout npz.
      ood_file: a Keras-layout Fashion-MNIST npz for the ``fashion_mnist`` OOD set.
      echo: where the summary lines go (default ``print``).
      calibrate: also fit a temperature and a conformal threshold on the run's validation
        split (see :func:`calibrate_ensemble`); adds the ``calibration`` section and
        writes ``calibration.png``.
      alpha: the conformal miscoverage rate in ``(0, 1)``.
      conformal: the conformal score, one of :data:`meshensemble.calibration.METHODS`.
      data_dir: overrides the run's TFDS folder or ArrayRecord folder.
      dataset: the data to evaluate on, for a run trained on a Python ``dataset=`` object
        (e.g. ``me.data.synthetic(256, 64)``); checked against the run's identity.

    Every split's fingerprint is compared with the run's ``resolved.data_identity``
    before any checkpoint is read; a difference is refused with one line naming the
    split. The run's checkpoints are only read: a damaged one is reported and skipped,
    never moved, and a line says which step was evaluated and why when it is not the
    newest.

    Returns:
      A flat dict: ``test_ensemble_{accuracy,nll,brier,ece,entropy,expected_entropy,
      mutual_information,disagreement}``, ``test_member_{accuracy,nll,brier,ece}`` (lists
      of length members), ``test_mean_member_{accuracy,nll,brier,ece}``,
      ``ood_{set}_auroc_{kind}`` and ``ood_{set}_aupr_{kind}`` for every OOD set and kind
      of :data:`OOD_SCORE_KINDS`; each member as a single model:
      ``ood_{set}_member_auroc_{kind}`` (a list) and ``ood_{set}_mean_member_auroc_{kind}``
      for the kinds of :data:`MEMBER_OOD_KINDS`; ``checkpoint_step``, ``num_test`` and
      ``ood_sets`` (the list of OOD set names); with ``calibrate`` a nested
      ``calibration`` dict (:func:`calibrate_ensemble`).

    Raises:
      FileNotFoundError: ``workdir``, its ``config.json`` or the checkpoint is missing
        (the message lists the available steps).
      meshensemble.training.CheckpointError: ``checkpoint`` does not verify, or no
        checkpoint does.
      ValueError: a corrupt ``config.json``, a workdir that is not writable, an unknown
        OOD set, a bad mesh, batch size or bin count; ``calibrate`` for a run without a
        validation split ("train with --validation N first"), a bad ``alpha`` or method.
      meshensemble.training.OutputError: ``evaluation.json`` or a plot could not be
        written (one line naming the file).
      meshensemble.data.DataError: the test data or an OOD set cannot be loaded.

    Example:
      >>> r = evaluate_run("runs/tiny", mesh="ensemble=4,data=1", ood=["noise"], echo=print)
      data: MNIST from ...mnist.npz ...
      checkpoint 4 of runs/tiny on mesh ensemble=4 x data=1: 32 test examples
      ...
      >>> r["checkpoint_step"], r["num_test"], r["ood_sets"]
      (4, 32, ['noise'])
      >>> 0 <= r["test_ensemble_accuracy"] <= 1, 0 <= r["ood_noise_auroc_entropy"] <= 1
      (True, True)
    """
    say = print if echo is None else echo
    cfg = load_run_config(workdir)
    if cfg.task == "regression":  # Gaussian members: proper scores, calibrated intervals
        _check_regression_arguments(workdir, ood, dataset, data_dir, ood_file, conformal)
        return evaluate_regression(
            workdir, cfg, checkpoint=checkpoint, mesh=mesh, batch_size=batch_size,
            source=source, data_file=data_file, echo=echo, calibrate=calibrate, alpha=alpha,
        )  # fmt: skip
    names = _check_arguments(cfg, ood, ood_file, batch_size, num_bins, checkpoint)
    _check_before_work(workdir, cfg, checkpoint, calibrate, alpha, conformal, say)
    device_mesh = _device_mesh(mesh, cfg.members)
    recorded = dataset is None and (source, data_file, data_dir) == (None, None, None)
    if dataset is None:
        dataset = load_run_data(
            workdir, cfg, source=source, data_file=data_file, data_dir=data_dir, log=say
        )
    check_run_data(workdir, cfg, dataset, say, recorded)  # the run's data, split by split
    ood_sets = {
        n: ood_images(n, dataset.test_images, ood_file, cfg.data_dir, log=say) for n in names
    }

    split = split_validation(dataset, cfg.validation, cfg.seed) if cfg.validation else None
    if calibrate:
        check_split(workdir, split)
    ens = build_ensemble(cfg, device_mesh, (split.train if split else dataset).num_train)
    state, step = _restore_read_only(workdir, ens, dataset.test_images[:1], checkpoint, say)

    ev = ens.evaluate(state, dataset.test_images, dataset.test_labels, batch_size, num_bins)
    result = metrics.prefix_metrics(ev, "test")
    test = stream_scores(ens, state, dataset.test_images, dataset.test_labels, batch_size, num_bins)
    score = lambda x: stream_scores(ens, state, x, None, batch_size, num_bins)
    ood_scores = {n: score(x) for n, x in ood_sets.items()}
    result.update(_ood_metrics(test, ood_scores))
    result.update(checkpoint_step=int(step), num_test=dataset.num_test, ood_sets=names)
    curves = None
    if calibrate and split is not None:
        held, test_set = (split.images, split.labels), (dataset.test_images, dataset.test_labels)
        result["calibration"], curves = calibrate_ensemble(
            ens, state, held, test_set, alpha, conformal, batch_size, num_bins
        )
    elif not calibrate and (kept := previous_calibration(workdir, int(step), say)) is not None:
        result["calibration"] = kept

    if jax.process_index() == 0:
        _write(workdir, result, test, {n: o["scores"] for n, o in ood_scores.items()})
        if curves is not None:
            write_calibration_plot(workdir, result["calibration"], curves)
    _report(say, workdir, result, step, ens, dataset.num_test, curves is not None)
    return result


def _check_before_work(
    workdir: str,
    cfg: Any,
    checkpoint: int | None,
    calibrate: bool,
    alpha: float,
    conformal: str,
    say: Callable[[str], Any],
) -> None:
    """The workdir writable, the calibration arguments, the checkpoint listed: no data read."""
    if jax.process_index() == 0:  # process 0 writes the results there
        check_writable(
            workdir,
            f"{EVALUATION_FILE} and the plots go there: make it writable, or copy the run to "
            "a writable folder and evaluate the copy",
        )
    if calibrate:
        check_calibrate(workdir, cfg, alpha, conformal, note=lambda m: say(f"note: {m}"))
    check_checkpoint(workdir, checkpoint)  # before loading data: a listing, nothing opened


def _device_mesh(mesh: str | Mapping[str, int] | Mesh | None, members: int) -> Mesh:
    """The mesh to evaluate on: ``mesh`` itself, or made from its axis sizes (or the default)."""
    if isinstance(mesh, Mesh):
        return mesh
    shape = _mesh_shape(mesh, members)
    return make_mesh(shape.get("ensemble"), shape.get("data", 1), shape.get("model"))


def _check_regression_arguments(
    workdir: str, ood: Any, dataset: Any, data_dir: Any, ood_file: Any, conformal: str
) -> None:
    """Refuses the classification-only arguments for a regression run (one line)."""
    named_ood = tuple([ood] if isinstance(ood, str) else ood) != DEFAULT_OOD
    if named_ood or dataset is not None or data_dir is not None or ood_file is not None:
        raise ValueError(
            f"run {workdir} is a regression run: OOD sets, --ood-file, --data-dir and "
            "dataset= are for classification runs; drop them"
        )
    if conformal != "thr":
        raise ValueError(
            f"--conformal {conformal} is for classification sets; a regression run's "
            "intervals are normalised split conformal: drop --conformal"
        )


def _check_arguments(
    cfg: Any, ood: Any, ood_file: Any, batch_size: Any, num_bins: Any, checkpoint: Any
) -> list[str]:
    """The OOD set names, once each, after checking every argument (one-line errors)."""
    names = [ood] if isinstance(ood, str) else list(ood)
    unknown = [n for n in names if n not in OOD_SETS]
    if unknown:
        raise ValueError(
            f"unknown OOD set(s) {', '.join(map(repr, unknown))}; choose from {', '.join(OOD_SETS)}"
        )
    names = list(dict.fromkeys(names))
    if "fashion_mnist" in names and cfg.dataset == "fashion_mnist":
        raise ValueError("OOD set fashion_mnist is the run's own dataset; choose noise or inverted")
    if ood_file is not None and "fashion_mnist" not in names:
        raise ValueError(f"--ood-file {ood_file} is only read for --ood fashion_mnist")
    for name, value in (("batch_size", batch_size), ("num_bins", num_bins)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if checkpoint is not None and (not isinstance(checkpoint, int) or checkpoint < 0):
        raise ValueError(f"checkpoint={checkpoint!r} must be a step number (>= 0)")
    return names


def _ood_metrics(test: Mapping[str, Any], ood: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """AUROC and AUPR of each OOD set against the test set (OOD positive), per score kind,
    and each member's AUROC scored as a single model."""
    result: dict[str, Any] = {}
    for n, out in ood.items():
        for kind in OOD_SCORE_KINDS:
            s_in, s_out = test["scores"][kind], out["scores"][kind]
            result[f"ood_{n}_auroc_{kind}"] = metrics.auroc(s_in, s_out)
            result[f"ood_{n}_aupr_{kind}"] = metrics.aupr(s_in, s_out)
        for kind in MEMBER_OOD_KINDS:
            pairs = zip(test["member_scores"][kind], out["member_scores"][kind])
            per_member = [metrics.auroc(s_in, s_out) for s_in, s_out in pairs]
            result[f"ood_{n}_member_auroc_{kind}"] = per_member
            result[f"ood_{n}_mean_member_auroc_{kind}"] = float(np.mean(per_member))
    return result


def _report(
    say: Callable[[str], Any],
    workdir: str,
    result: dict[str, Any],
    step: int,
    ens: Any,
    num_test: int,
    calibrated: bool,
) -> None:
    """Prints what was evaluated, the tables and (process 0) the files written."""
    say(
        f"checkpoint {step} of {workdir} on mesh ensemble={ens.mesh.shape['ensemble']} x "
        f"data={ens.data_size}: {num_test} test examples"
    )
    say(final_table(result))
    say(summary_table(result))
    if calibrated:
        say(calibration_line(result["calibration"]))
    if jax.process_index() == 0:
        files = [RELIABILITY_PLOT, OOD_PLOT] + ([CALIBRATION_PLOT] if calibrated else [])
        say(f"wrote {EVALUATION_FILE}, {', '.join(files[:-1])} and {files[-1]} to {workdir}")


def _write(
    workdir: str,
    result: dict[str, Any],
    test: dict[str, Any],
    ood_scores: dict[str, dict[str, np.ndarray]],
) -> None:
    from meshensemble import plots

    path = os.path.join(workdir, EVALUATION_FILE)
    text = dumps_strict(result, indent=2)  # NaN as null, noted: strict JSON
    with writing(path), replacing(path) as f:
        f.write(text)
    members = f"members pooled (mean member ECE {result['test_mean_member_ece']:.4f})"
    curves = {
        f"ensemble (ECE {result['test_ensemble_ece']:.4f})": test["ensemble"],
        members: test["mean_member"],
    }
    path = os.path.join(workdir, RELIABILITY_PLOT)
    with writing(path):
        plots.reliability_diagram(curves, path)
    path = os.path.join(workdir, OOD_PLOT)
    with writing(path):
        plots.ood_histogram(
            test["scores"][HISTOGRAM_SCORE],
            {n: s[HISTOGRAM_SCORE] for n, s in ood_scores.items()},
            path,
            score=HISTOGRAM_SCORE,
        )


def summary_table(result: Mapping[str, Any]) -> str:
    """A text summary of an :func:`evaluate_run` result: uncertainty and OOD detection.

    Args:
      result: the dict returned by :func:`evaluate_run` (or read from ``evaluation.json``).

    Returns:
      The table as one string: the test set's mean uncertainties, then one row per OOD
      set with the AUROC and AUPR of every score kind.

    Example:
      >>> import json
      >>> print(summary_table(json.load(open("runs/tiny/evaluation.json"))))
      test uncertainty: entropy ..., expected entropy ..., mutual information ..., disagreement ...
      OOD set      auroc max_prob  auroc entropy ...
      ...
      inverted ...
    """
    rows = [
        "test uncertainty: entropy {:.4f}, expected entropy {:.4f}, mutual information "
        "{:.4f}, disagreement {:.4f}".format(
            result["test_ensemble_entropy"],
            result["test_ensemble_expected_entropy"],
            result["test_ensemble_mutual_information"],
            result["test_ensemble_disagreement"],
        )
    ]
    sets = list(result.get("ood_sets", []))
    if sets:
        short = {"mutual_information": "MI"}
        cols = [f"{m} {short.get(k, k)}" for m in ("auroc", "aupr") for k in OOD_SCORE_KINDS]
        width = max(12, *(len(s) for s in sets))
        head = f"{'OOD set':<{width}} " + " ".join(f"{c:>14}" for c in cols)
        rows += [head, "-" * len(head)]
        for s in sets:
            vals = [result[f"ood_{s}_{m}_{k}"] for m in ("auroc", "aupr") for k in OOD_SCORE_KINDS]
            rows.append(f"{s:<{width}} " + " ".join(f"{v:>14.4f}" for v in vals))
        for s in sets:
            key = f"ood_{s}_mean_member_auroc_"
            if all(key + k in result for k in MEMBER_OOD_KINDS):
                vals = ", ".join(f"{k} {result[key + k]:.4f}" for k in MEMBER_OOD_KINDS)
                rows.append(f"{s}: mean member (single model) AUROC {vals}")
    return "\n".join(rows)
