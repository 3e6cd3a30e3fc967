"""Classification's evaluation beyond the test scores: OOD detection and reliability.

What :meth:`meshensemble.tasks.Classification.evaluate_more` computes on the mesh (moved
here from the engine, which asks the task):

* per-example OOD scores (every kind of :data:`OOD_SCORE_KINDS`: max-prob, entropy and
  mutual information from the members' softmax, max-logit and energy from their logits)
  for the test images and for each OOD set (:func:`ood_images`), then AUROC and AUPR with
  OOD as the positive class (:func:`ood_metrics`);
* the per-bin sums of a reliability diagram, for the ensemble and the mean member.

Only ``[N]`` scores and ``[num_bins]`` sums leave the devices, never the members'
``[members, N, classes]`` probabilities (:func:`stream_scores`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from meshensemble import data as data_lib
from meshensemble import metrics
from meshensemble.core import evaluating, inputs, streaming
from meshensemble.numerics import statmath

OOD_SETS = ("noise", "inverted", "fashion_mnist")
"""OOD sets :func:`ood_images` knows."""
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


def check_ood(names: Any, dataset_name: str, ood_file: Any) -> list[str]:
    """The OOD set names, once each, after checking them (one-line errors).

    Raises:
      ValueError: an unknown set, the run's own dataset, or ``ood_file`` without
        ``fashion_mnist``.

    Example:
      >>> check_ood(["noise", "noise", "inverted"], "mnist", None)
      ['noise', 'inverted']
    """
    names = [names] if isinstance(names, str) else list(names)
    unknown = [n for n in names if n not in OOD_SETS]
    if unknown:
        raise ValueError(
            f"--ood: unknown OOD set(s) {', '.join(map(repr, unknown))}; choose from "
            f"{', '.join(OOD_SETS)}"
        )
    names = list(dict.fromkeys(names))
    if "fashion_mnist" in names and dataset_name == "fashion_mnist":
        raise ValueError("OOD set fashion_mnist is the run's own dataset; choose noise or inverted")
    if ood_file is not None and "fashion_mnist" not in names:
        raise ValueError(f"--ood-file {ood_file} is only read for --ood fashion_mnist")
    return names


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
      ValueError: ``name`` is unknown.
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
    :meth:`~meshensemble.tasks.Classification.ood_sums` turns the members' logits into
    scores and ``[num_bins]`` bin sums on device (members averaged by ``pmean`` over
    ``ensemble``); only those reach the host.

    Args:
      ens: the :class:`meshensemble.Ensemble` (a classification task).
      state: its state.
      images: ``[N, ...]`` images (any ``N``).
      labels: ``[N]`` integer labels for the bin sums; None (e.g. OOD data) skips them.
      batch_size: examples per call.
      num_bins: equal-width confidence bins.

    Returns:
      ``{"scores": {kind: [N] float64 numpy}}`` for every kind in
      :data:`OOD_SCORE_KINDS`, ``{"member_scores": {kind: [members, N]}}`` for every
      kind in :data:`MEMBER_OOD_KINDS` (each member scored as a single model); with
      ``labels`` also ``"ensemble"`` and ``"mean_member"``: dicts in the layout of
      :func:`meshensemble.metrics.reliability_diagram_data` (``accuracy``,
      ``confidence``, ``count``, ``bin_edges``). The mean member's curve pools the bin
      sums of all members (a member with no example in a bin does not drag it to ``nan``).

    Raises:
      ValueError: no images, labels of another length, or a state of another ensemble.

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

    def run(x: Any, y: Any, mask: Any) -> dict[str, Any]:
        out = fn(state, x, y, mask)
        return {"scores": out.examples["scores"],
                "member_scores": out.member_examples["scores"], **out.totals}  # fmt: skip

    def sink(start: int, out: Mapping[str, Any]) -> None:
        scores.append(np.asarray(out["scores"], np.float64).T)
        member_scores.append(np.moveaxis(np.asarray(out["member_scores"], np.float64), -1, 0))
        for part in ("ensemble", "member"):
            acc = sums.setdefault(part, dict.fromkeys(_BIN_KEYS, 0.0))
            for key in _BIN_KEYS:
                acc[key] = acc[key] + np.asarray(out[part][key], np.float64)

    axes = {"scores": 0, "member_scores": 1, "ensemble": None, "member": None}
    streaming.stream(run, (images, y_all), batch_size, ens.data_size, sink, axes=axes)
    all_scores = np.concatenate(scores, axis=1)
    all_members = np.concatenate(member_scores, axis=-1)
    result: dict[str, Any] = {
        "scores": {kind: all_scores[i] for i, kind in enumerate(OOD_SCORE_KINDS)},
        "member_scores": {kind: all_members[i] for i, kind in enumerate(MEMBER_OOD_KINDS)},
    }
    if labels is not None:
        result["ensemble"] = metrics.reliability_from_bins(sums["ensemble"], num_bins)
        result["mean_member"] = metrics.reliability_from_bins(sums["member"], num_bins)
    return result


def ood_metrics(test: Mapping[str, Any], ood: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """AUROC and AUPR of each OOD set against the test set (OOD positive), per score kind,
    and each member's AUROC scored as a single model.

    Example:
      >>> t, o = stream_scores(ens, state, test_images), stream_scores(ens, state, 255 - images)
      >>> 0 <= ood_metrics(t, {"inverted": o})["ood_inverted_auroc_entropy"] <= 1
      True
    """
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


def summary_table(result: Mapping[str, Any]) -> str:
    """A text summary of an evaluation result: uncertainty and OOD detection.

    Args:
      result: ``evaluate_run``'s result (or ``evaluation.json``) of a classification run.

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


def evaluate_ood(
    ens: Any, state: Any, data: Any, names: Any, *, result: Mapping[str, Any],
    batch_size: int = 1000, num_bins: int = 15, ood_file: Any = None, data_dir: Any = None,
    say: Callable[[str], Any] = print, **_: Any,
) -> tuple[dict[str, Any], dict[str, Callable[[str], None]]]:  # fmt: skip
    """The OOD scores and reliability of a classification run, with its two figures.

    Args:
      ens, state: the restored run; data: its dataset; names: OOD set names.
      result: the test scores so far (the figures' labels quote the ECEs).
      batch_size, num_bins, ood_file, data_dir, say: as ``evaluate_run`` takes them.

    Returns:
      ``(scores, figures)``: ``ood_<set>_*`` AUROC/AUPR entries and ``ood_sets``;
      ``{RELIABILITY_PLOT: draw, OOD_PLOT: draw}`` (``draw(path)`` writes the figure).

    Example:
      >>> ds = me.data.synthetic(64, 32, seed=0)
      >>> result = me.metrics.prefix_metrics(ens.evaluate(state, ds.test_images, ds.test_labels))
      >>> scores, figures = evaluate_ood(ens, state, ds, ["noise"], result=result, say=print)
      >>> sorted(figures)
      ['ood_histogram.png', 'reliability_diagram.png']
    """
    names = check_ood(names, data.name, ood_file)
    sets = {n: ood_images(n, data.test_images, ood_file, data_dir, log=say) for n in names}
    test = stream_scores(ens, state, data.test_images, data.test_labels, batch_size, num_bins)
    score = lambda x: stream_scores(ens, state, x, None, batch_size, num_bins)
    ood = {n: score(x) for n, x in sets.items()}
    scores = ood_metrics(test, ood) | {"ood_sets": names}
    return scores, {RELIABILITY_PLOT: lambda path: _reliability_plot(path, result, test),
                    OOD_PLOT: lambda path: _histogram(path, test, ood)}  # fmt: skip


def _reliability_plot(path: str, result: Mapping[str, Any], test: Mapping[str, Any]) -> None:
    from meshensemble import plots

    members = f"members pooled (mean member ECE {result['test_mean_member_ece']:.4f})"
    curves = {
        f"ensemble (ECE {result['test_ensemble_ece']:.4f})": test["ensemble"],
        members: test["mean_member"],
    }
    plots.reliability_diagram(curves, path)


def _histogram(path: str, test: Mapping[str, Any], ood: Mapping[str, Any]) -> None:
    from meshensemble import plots

    scores = {n: o["scores"][HISTOGRAM_SCORE] for n, o in ood.items()}
    plots.ood_histogram(test["scores"][HISTOGRAM_SCORE], scores, path, score=HISTOGRAM_SCORE)
