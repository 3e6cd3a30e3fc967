"""Classification's evaluation beyond the test scores: OOD detection and reliability.

What :meth:`meshensemble.tasks.Classification.evaluate_more` computes on the mesh (moved
here from the engine, which asks the task):

* per-example OOD scores (every kind of :data:`OOD_SCORE_KINDS`: max-prob, entropy and
  mutual information from the members' softmax, max-logit and energy from their logits)
  for the test inputs and for each OOD set (:func:`ood_images`: a synthetic shift of the
  test inputs, MNIST's Fashion-MNIST, or another dataset of the same input shape: a TFDS
  name, an image folder or an npz), then AUROC and AUPR with OOD as the positive class
  (:func:`ood_metrics`);
* the per-bin sums of a reliability diagram, for the ensemble and the mean member;
* the ensemble's accuracy and confidence per class, named by the data's ``class_names``
  (:func:`per_class`).

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
from meshensemble.data.ood import SHIFTS
from meshensemble.numerics import statmath

OOD_SETS = ("noise", "inverted", "fashion_mnist")
"""MNIST's named OOD sets (:func:`ood_images` also takes the other shifts of
:data:`meshensemble.data.ood.SHIFTS` and another dataset by TFDS name or path)."""
OOD_KINDS = (
    "an OOD set is a shift of the test inputs (noise, inverted, contrast, hflip, vflip), "
    "fashion_mnist, or another dataset of the same input shape: a TFDS name, an image "
    "folder or an npz"
)
"""What ``--ood`` takes, as its one-line errors say."""
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

    A name is a synthetic shift (:data:`meshensemble.data.ood.SHIFTS`: noise, inverted,
    contrast, hflip, vflip), ``fashion_mnist`` (from ``ood_file`` or TFDS), or another
    dataset: a TFDS name, an image folder or an npz (loaded by :func:`ood_images`).

    Raises:
      ValueError: an empty name, the run's own dataset, or ``ood_file`` without
        ``fashion_mnist``.

    Example:
      >>> check_ood(["noise", "noise", "inverted"], "mnist", None)
      ['noise', 'inverted']
    """
    names = [names] if isinstance(names, str) else [str(n) for n in names]
    if any(not n.strip() for n in names):
        raise ValueError(f"--ood: an empty OOD set name; {OOD_KINDS}")
    names = list(dict.fromkeys(names))
    if dataset_name in names and dataset_name not in SHIFTS:
        raise ValueError(
            f"OOD set {dataset_name} is the run's own dataset; choose another (e.g. noise or "
            "inverted)"
        )
    if ood_file is not None and "fashion_mnist" not in names:
        raise ValueError(f"--ood-file {ood_file} is only read for --ood fashion_mnist")
    return names




def ood_images(
    name: str,
    test_images: np.ndarray,
    ood_file: str | None = None,
    data_dir: str | None = None,
    log: Callable[[str], Any] | None = None,
    like: Any = None,
) -> np.ndarray:
    """The inputs of an out-of-distribution set, of the test inputs' shape and dtype.

    * a shift of :data:`meshensemble.data.ood.SHIFTS` (:func:`meshensemble.data.shift_inputs`
      of ``test_images``, noise seeded by :data:`NOISE_SEED`): for MNIST's uint8 images
      ``"noise"`` is uniform random pixels ``0..255`` and ``"inverted"`` is
      ``255 - test_images``, as always;
    * ``"fashion_mnist"``: the Fashion-MNIST test split, from ``ood_file`` (a Keras-layout
      npz) if given, else from TFDS's prepared data in ``data_dir`` (never downloaded);
    * any other name: another dataset's test inputs (:func:`meshensemble.data.load_ood`: a
      TFDS name, an image folder or an npz), which must have ``like``'s input shape and
      dtype.

    Args:
      name: a shift, ``fashion_mnist``, a TFDS name or a path.
      test_images: the in-distribution test inputs ``[N, ...]``.
      ood_file: a Keras-layout ``fashion_mnist.npz`` for ``"fashion_mnist"``.
      data_dir: TFDS's data directory (default ``$TFDS_DATA_DIR`` or
        ``~/tensorflow_datasets``).
      log: gets one line saying where another dataset came from.
      like: the in-distribution :class:`~meshensemble.data.Dataset` (needed for another
        dataset; default: the MNIST-shaped test inputs).

    Returns:
      Inputs ``[N_ood, ...]`` of the test inputs' example shape and dtype.

    Raises:
      meshensemble.data.DataError: (one line) a shift the inputs cannot take, another
        dataset that cannot be loaded or has another input shape, or Fashion-MNIST
        neither in ``ood_file`` nor prepared in TFDS.

    Example:
      >>> bool((ood_images("inverted", images) == 255 - images).all())
      True
      >>> ood_images("noise", images).shape
      (32, 28, 28, 1)
    """
    log = log or (lambda s: None)
    test_images = np.asarray(test_images)
    if name in SHIFTS:
        return data_lib.shift_inputs(test_images, name, NOISE_SEED)
    if name == "fashion_mnist":
        x = _fashion_mnist(ood_file, data_dir, log)
    else:
        like = like if like is not None else _like(test_images)
        try:
            x, note = data_lib.load_ood(name, like, data_dir)
        except data_lib.DataError as err:
            raise data_lib.DataError(f"--ood {name}: {err}; {OOD_KINDS}") from None
        log(f"OOD data: {note}")
    if x.shape[1:] != test_images.shape[1:] or x.dtype != test_images.dtype:
        raise data_lib.DataError(
            f"--ood {name}: inputs of shape {x.shape[1:]} {x.dtype}; expected "
            f"{test_images.shape[1:]} {test_images.dtype} like the run's (pick a dataset of "
            "the same input shape, or a shift)"
        )
    return x


def _like(test_images: np.ndarray) -> Any:
    """A stand-in dataset of the test inputs' layout, for :func:`~meshensemble.data.load_ood`."""
    y = np.zeros(len(test_images), np.int32)
    return data_lib.Dataset("data", test_images, y, test_images, y)


def _fashion_mnist(ood_file: Any, data_dir: Any, log: Callable[[str], Any]) -> np.ndarray:
    """Fashion-MNIST's test images, from ``ood_file`` or TFDS's prepared data."""
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
      :data:`OOD_SCORE_KINDS`, ``"predicted"``: the ensemble's class ``[N]`` (int32),
      ``{"member_scores": {kind: [members, N]}}`` for every
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
    predicted: list[np.ndarray] = []
    sums: dict[str, dict[str, np.ndarray]] = {}

    def run(x: Any, y: Any, mask: Any) -> dict[str, Any]:
        out = fn(state, x, y, mask)
        return {"scores": out.examples["scores"], "predicted": out.examples["predicted"],
                "member_scores": out.member_examples["scores"], **out.totals}  # fmt: skip

    def sink(start: int, out: Mapping[str, Any]) -> None:
        scores.append(np.asarray(out["scores"], np.float64).T)
        predicted.append(np.asarray(out["predicted"]))
        member_scores.append(np.moveaxis(np.asarray(out["member_scores"], np.float64), -1, 0))
        for part in ("ensemble", "member"):
            acc = sums.setdefault(part, dict.fromkeys(_BIN_KEYS, 0.0))
            for key in _BIN_KEYS:
                acc[key] = acc[key] + np.asarray(out[part][key], np.float64)

    axes = {"scores": 0, "predicted": 0, "member_scores": 1, "ensemble": None, "member": None}
    streaming.stream(run, (images, y_all), batch_size, ens.data_size, sink, axes=axes)
    all_scores = np.concatenate(scores, axis=1)
    all_members = np.concatenate(member_scores, axis=-1)
    result: dict[str, Any] = {
        "scores": {kind: all_scores[i] for i, kind in enumerate(OOD_SCORE_KINDS)},
        "member_scores": {kind: all_members[i] for i, kind in enumerate(MEMBER_OOD_KINDS)},
        "predicted": np.concatenate(predicted),
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
      OOD set             max_prob    entropy         MI  max_logit     energy
      ...
      inverted      auroc ...
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
    if sets:  # a row per set and measure, a column per score: 80 columns
        short = {"mutual_information": "MI"}
        width = max(13, *(len(s) for s in sets))
        head = f"{'OOD set':<{width}} {'':>5} " + " ".join(
            f"{short.get(k, k):>10}" for k in OOD_SCORE_KINDS
        )
        rows += [head, "-" * len(head)]
        for s in sets:
            for m in ("auroc", "aupr"):
                vals = [result[f"ood_{s}_{m}_{k}"] for k in OOD_SCORE_KINDS]
                name = s if m == "auroc" else ""
                rows.append(f"{name:<{width}} {m:>5} " + " ".join(f"{v:>10.4f}" for v in vals))
        for s in sets:
            key = f"ood_{s}_mean_member_auroc_"
            if all(key + k in result for k in MEMBER_OOD_KINDS):
                vals = ", ".join(f"{k} {result[key + k]:.4f}" for k in MEMBER_OOD_KINDS)
                rows.append(f"{s}: mean member (single model) AUROC {vals}")
    if isinstance(result.get("test_per_class"), Mapping):
        rows.append(per_class_table(result["test_per_class"]))
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
      ``(scores, figures)``: ``ood_<set>_*`` AUROC/AUPR entries, ``ood_sets`` and
      ``test_per_class`` (:func:`per_class`, named by the data's ``class_names``);
      ``{RELIABILITY_PLOT: draw, OOD_PLOT: draw}`` (``draw(path)`` writes the figure).

    Example:
      >>> ds = me.data.synthetic(64, 32, seed=0)
      >>> result = me.metrics.prefix_metrics(ens.evaluate(state, ds.test_images, ds.test_labels))
      >>> scores, figures = evaluate_ood(ens, state, ds, ["noise"], result=result, say=print)
      >>> sorted(figures)
      ['ood_histogram.png', 'reliability_diagram.png']
    """
    names = check_ood(names, data.name, ood_file)
    load = lambda n: ood_images(n, data.test_images, ood_file, data_dir, log=say, like=data)
    sets = {n: load(n) for n in names}
    test = stream_scores(ens, state, data.test_images, data.test_labels, batch_size, num_bins)
    score = lambda x: stream_scores(ens, state, x, None, batch_size, num_bins)
    ood = {n: score(x) for n, x in sets.items()}
    classes = int(getattr(data, "num_classes", None) or ens.num_classes(state, data.x_test[:1]))
    names_of = getattr(data, "class_names", None) or tuple(str(c) for c in range(classes))
    confidence = 1.0 - test["scores"]["max_prob"]  # the score is 1 - max prob
    report = per_class(np.asarray(data.test_labels), test["predicted"], confidence, names_of)
    scores = ood_metrics(test, ood) | {"ood_sets": names, "test_per_class": report}
    return scores, {RELIABILITY_PLOT: lambda path: _reliability_plot(path, result, test),
                    OOD_PLOT: lambda path: _histogram(path, test, ood)}  # fmt: skip


def per_class(
    labels: np.ndarray, predicted: np.ndarray, confidence: np.ndarray, names: Any
) -> dict[str, list[Any]]:
    """The ensemble's accuracy (recall) and mean confidence on each class's test examples.

    Args:
      labels: the true classes ``[N]``; predicted: the ensemble's ``[N]``; confidence: its
        max probability ``[N]``; names: one name per class (the data's ``class_names``).

    Returns:
      ``{"names", "count", "accuracy", "confidence"}``, a list of one entry per class each
      (NaN accuracy and confidence for a class without test examples).

    Example:
      >>> r = per_class(np.array([0, 0, 1]), np.array([0, 1, 1]), np.array([.9, .6, .8]),
      ...               ("cat", "dog"))
      >>> r["accuracy"], r["count"]
      ([0.5, 1.0], [2, 1])
    """
    out: dict[str, list[Any]] = {"names": [str(n) for n in names], "count": [],
                                 "accuracy": [], "confidence": []}  # fmt: skip
    for c in range(len(out["names"])):
        mine = labels == c
        n = int(mine.sum())
        out["count"].append(n)
        out["accuracy"].append(float((predicted[mine] == c).mean()) if n else float("nan"))
        out["confidence"].append(float(confidence[mine].mean()) if n else float("nan"))
    return out


def per_class_table(report: Mapping[str, Any]) -> str:
    """The per-class report as text: one row a class (its name, accuracy, confidence, count).

    Example:
      >>> print(per_class_table({"names": ["cat"], "count": [2], "accuracy": [0.5],
      ...                        "confidence": [0.75]}))
      class                 accuracy  confidence   count
      --------------------------------------------------
      cat                     50.00%      0.7500       2
    """
    head = f"{'class':<20} {'accuracy':>9} {'confidence':>11} {'count':>7}"
    rows = [head, "-" * len(head)]
    for name, acc, conf, n in zip(*(report[k] for k in ("names", "accuracy", "confidence",
                                                           "count")), strict=True):  # fmt: skip
        rows.append(f"{name[:20]:<20} {100 * acc:8.2f}% {conf:11.4f} {n:7d}")
    return "\n".join(rows)


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
