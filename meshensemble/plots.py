"""PNG plots of a run: learning curves and member vs ensemble accuracy (matplotlib, Agg)."""

from __future__ import annotations

from typing import Any

import numpy as np

from meshensemble.runtime import storage


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the non-interactive Agg backend, imported on first use.

    Every figure of the package is drawn through it, so that plotting never needs a
    display and matplotlib is imported only when a plot is made.

    Returns:
      The ``matplotlib.pyplot`` module.

    Example:
      >>> plt = pyplot()
      >>> fig, ax = pyplot().subplots()
      >>> plt.close(fig)
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def train_curve(history: list[dict[str, Any]]) -> tuple[np.ndarray, np.ndarray]:
    """The learning curve's train-loss points: ``(steps [P], losses [P, members])``.

    A record's ``train_curve`` (the mean loss over the steps since the previous point, at
    most ten points an epoch) where present; else its ``train_loss`` at its step.

    Args:
      history: ``metrics.jsonl`` records, one per evaluation.

    Returns:
      The steps and the per-member losses (both empty without any loss).

    Example:
      >>> steps, losses = train_curve([
      ...     {"step": 4, "train_curve": {"step": [2, 4], "loss": [[1.0], [0.5]]}},
      ...     {"step": 6, "train_loss": [0.25]}])
      >>> steps.tolist(), losses[:, 0].tolist()
      ([2, 4, 6], [1.0, 0.5, 0.25])
    """
    steps: list[int] = []
    losses: list[list[float]] = []
    for r in history:
        if "train_curve" in r:
            steps += list(r["train_curve"]["step"])
            losses += list(r["train_curve"]["loss"])
        elif "train_loss" in r:
            steps.append(r["step"])
            losses.append(r["train_loss"])
    return np.asarray(steps, int), np.asarray(losses, float)


def _save(fig: Any, path: str, dpi: int = 100) -> None:
    """Renders ``fig`` into memory, writes ``path`` whole (a bucket takes no seeks), closes it."""
    kind = path.rsplit(".", 1)[-1].lower() if "." in path.rsplit("/", 1)[-1] else "png"
    storage.atomic_write(path, lambda f: fig.savefig(f, format=kind, dpi=dpi))
    pyplot().close(fig)


def _reliability(ax: Any, curves: dict[str, dict[str, Any]], colors: list[str]) -> list[str]:
    """Draws the diagonal and each curve's accuracy against confidence on ``ax`` (empty bins
    skipped); returns the curves' colors, in order."""
    ax.plot([0, 1], [0, 1], color="black", ls="--", lw=1, label="perfect calibration")
    drawn = [colors[i % len(colors)] for i in range(len(curves))]
    for color, (label, d) in zip(drawn, curves.items(), strict=True):
        acc, conf = np.asarray(d["accuracy"], float), np.asarray(d["confidence"], float)
        keep = np.isfinite(acc) & np.isfinite(conf)
        ax.plot(conf[keep], acc[keep], color=color, marker="o", ms=4, lw=1.5, label=label)
    return drawn


def learning_curves(history: list[dict[str, Any]], path: str) -> None:
    """Plots the learning curves: train loss per logged step, test accuracy, NLL and ECE.

    Four panels: each member's train loss (and their mean) at every logged step (at most
    ten points an epoch, :func:`train_curve`); the test accuracy, NLL and ECE of each
    evaluation, per member (thin) and of the ensemble. Accuracy and ECE axes start at 0.

    Args:
      history: ``metrics.jsonl`` records, one per evaluation.
      path: the PNG to write.

    Example:
      >>> import json
      >>> history = [json.loads(line) for line in open("runs/tiny/metrics.jsonl")]
      >>> learning_curves(history, "learning_curves.png")   # a trained run's records
    """
    steps = [r["step"] for r in history]
    fig, axes = pyplot().subplots(2, 2, figsize=(10, 7))
    (ax1, ax2), (ax3, ax4) = axes
    at, losses = train_curve(history)
    if len(at):
        for i in range(losses.shape[1]):
            ax1.plot(at, losses[:, i], color="tab:blue", alpha=0.35, lw=1)
        ax1.plot(at, losses.mean(1), color="tab:blue", lw=2, label="mean member")
        ax1.legend()
    ax1.set(xlabel="step", ylabel="train loss", title="training loss (members)")
    panels = ((ax2, "accuracy", 100.0, "test accuracy (%)"), (ax3, "nll", 1.0, "test NLL"),
              (ax4, "ece", 1.0, "test ECE"))  # fmt: skip
    for ax, key, scale, label in panels:
        member = np.array([r.get(f"test_member_{key}", []) for r in history], float)
        if member.ndim == 2 and member.shape[1]:
            for i in range(member.shape[1]):
                ax.plot(steps, scale * member[:, i], color="tab:gray", alpha=0.4, lw=1)
            ax.plot(steps, scale * member.mean(1), color="tab:gray", lw=2, label="mean member")
        ens = [scale * r.get(f"test_ensemble_{key}", np.nan) for r in history]
        ax.plot(steps, ens, color="tab:red", lw=2, marker="o", label="ensemble")
        ax.set(xlabel="step", ylabel=label, title=label)
        if key != "nll":  # a rate: its axis from 0, so gaps are seen at their size
            ax.set_ylim(bottom=0)
        ax.legend()
    fig.tight_layout()
    _save(fig, path)


def member_vs_ensemble(record: dict[str, Any], path: str) -> None:
    """Bar chart of each member's test error and NLL against the ensemble's.

    Both axes start at 0 (no truncated bars): the accuracy is shown as the error rate,
    ``100 - accuracy`` in %, so a gap of one point between members is seen at its size
    rather than hidden near 100% (or magnified by an axis that starts at 92%).

    Args:
      record: one ``metrics.jsonl`` record.
      path: the PNG to write.

    Example:
      >>> import json
      >>> history = [json.loads(line) for line in open("runs/tiny/metrics.jsonl")]
      >>> member_vs_ensemble(history[-1], "members.png")
    """
    acc = list(record["test_member_accuracy"]) + [record["test_ensemble_accuracy"]]
    nll = list(record["test_member_nll"]) + [record["test_ensemble_nll"]]
    names = [str(i) for i in range(len(acc) - 1)] + ["ens."]
    colors = ["tab:gray"] * (len(acc) - 1) + ["tab:red"]
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(10, 4))
    ax1.bar(names, 100 * (1 - np.array(acc)), color=colors)
    ax1.set_ylim(bottom=0)
    ax1.set(xlabel="member", ylabel="test error (%), 100 - accuracy",
            title="members vs ensemble: error")  # fmt: skip
    ax2.bar(names, nll, color=colors)
    ax2.set_ylim(bottom=0)
    ax2.set(xlabel="member", ylabel="test NLL", title="members vs ensemble: NLL")
    fig.tight_layout()
    _save(fig, path)


def reliability_diagram(
    curves: dict[str, dict[str, Any]], path: str, title: str = "reliability diagram"
) -> None:
    """Accuracy against confidence per confidence bin, one curve per model, and bin counts.

    Each curve is a dict in the layout of
    :func:`meshensemble.metrics.reliability_diagram_data`: ``accuracy``, ``confidence``
    and ``count`` (each ``[num_bins]``, ``nan`` for empty bins, which are skipped) and
    ``bin_edges`` ``[num_bins + 1]``.

    Args:
      curves: label (e.g. ``"ensemble (ECE 0.012)"``) to per-bin data, drawn in order.
      path: the PNG to write.
      title: the plot's title.

    Example:
      >>> d = me.metrics.reliability_diagram_data(probs, labels)
      >>> reliability_diagram({"ensemble": d}, "reliability_diagram.png")
    """
    fig, (ax1, ax2) = pyplot().subplots(
        2, 1, figsize=(5.5, 6.5), sharex=True, gridspec_kw={"height_ratios": (3, 1)}
    )
    palette = ["tab:red", "tab:gray", "tab:blue", "tab:green", "tab:orange"]
    colors = _reliability(ax1, curves, palette)
    for color, (label, d) in zip(colors, curves.items(), strict=True):
        edges = np.asarray(d["bin_edges"], float)
        count = np.asarray(d["count"], float)
        frac = count / max(count.sum(), 1.0)
        ax2.stairs(frac, edges, color=color, lw=1.5, label=label)
    ax1.set(ylabel="accuracy", title=title, xlim=(0, 1), ylim=(0, 1))
    ax1.legend(loc="upper left", fontsize="small")
    ax2.set(xlabel="confidence (max probability)", ylabel="fraction of examples")
    fig.subplots_adjust(left=0.13, right=0.97, top=0.94, bottom=0.09, hspace=0.08)
    _save(fig, path)


def ood_histogram(
    in_scores: Any,
    ood_scores: dict[str, Any],
    path: str,
    score: str = "entropy",
    bins: int = 40,
) -> None:
    """Histograms of an OOD score: the in-distribution test set against each OOD set.

    All sets share the same bin edges; each histogram is normalised to a density so sets
    of different sizes compare.

    Args:
      in_scores: ``[N]`` scores of the in-distribution test images.
      ood_scores: OOD set name to its ``[N_ood]`` scores.
      path: the PNG to write.
      score: the score's name, for the axis label (e.g. ``"entropy"``).
      bins: number of bins.

    Example:
      >>> noise = np.random.default_rng(0).integers(0, 256, images.shape, np.uint8)
      >>> s_test = me.metrics.entropy(probs)                            # [N]
      >>> s_noise = me.metrics.entropy(ens.predict(state, noise))       # [N_ood]
      >>> ood_histogram(s_test, {"noise": s_noise}, "ood_histogram.png", score="entropy")
    """
    sets = {"in-distribution (test)": np.asarray(in_scores, float)}
    sets.update({f"OOD: {k}": np.asarray(v, float) for k, v in ood_scores.items()})
    edges = np.histogram_bin_edges(np.concatenate(list(sets.values())), bins=bins)
    fig, ax = pyplot().subplots(figsize=(6.5, 4))
    colors = ["tab:blue", "tab:red", "tab:orange", "tab:purple", "tab:green"]
    for i, (label, s) in enumerate(sets.items()):
        color = colors[i % len(colors)]
        ax.hist(s, bins=edges, density=True, histtype="stepfilled", alpha=0.25, color=color)
        ax.hist(s, bins=edges, density=True, histtype="step", lw=1.5, color=color, label=label)
    ax.set(xlabel=f"{score} of the ensemble prediction", ylabel="density")
    ax.set_title(f"OOD detection: {score}")
    ax.legend(fontsize="small")
    fig.subplots_adjust(left=0.11, right=0.97, top=0.92, bottom=0.12)
    _save(fig, path)


def calibration_summary(
    curves: dict[str, dict[str, Any]], set_size_counts: Any, path: str, title: str = ""
) -> None:
    """Reliability before / after calibration beside the histogram of conformal set sizes.

    Args:
      curves: label to per-bin data in the layout of
        :func:`meshensemble.metrics.reliability_diagram_data` (e.g. before and after
        temperature scaling), drawn in order.
      set_size_counts: ``[classes + 1]`` counts: ``set_size_counts[k]`` test examples got a
        prediction set of ``k`` classes.
      path: the PNG to write.
      title: what the set sizes are of, e.g. ``"thr, alpha=0.1"``.

    Example:
      >>> d0 = me.metrics.reliability_diagram_data(probs, labels)
      >>> tempered = jax.nn.softmax(jnp.log(probs) / 0.5)   # sharper: temperature 0.5
      >>> d1 = me.metrics.reliability_diagram_data(tempered, labels)
      >>> sizes = [0, 20, 12] + [0] * 8                        # [classes + 1] set sizes
      >>> calibration_summary({"before": d0, "after": d1}, sizes, "calibration.png")
    """
    fig, (ax1, ax2) = pyplot().subplots(1, 2, figsize=(10, 4.2))
    _reliability(ax1, curves, ["tab:red", "tab:blue", "tab:green", "tab:orange"])
    ax1.set(xlabel="confidence", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1))
    ax1.set_title("reliability before / after calibration")
    ax1.legend(loc="upper left", fontsize="small")
    counts = np.asarray(set_size_counts, float)
    ax2.bar(np.arange(len(counts)), counts, color="tab:blue")
    ax2.set(xlabel="prediction set size (classes)", ylabel="test examples", yscale="symlog")
    ax2.set_title(f"conformal set sizes ({title})" if title else "conformal set sizes")
    fig.tight_layout()
    _save(fig, path)


def regression_figure(
    grid: Any,
    mean: Any,
    sd: Any,
    member_means: Any,
    x_train: Any,
    y_train: Any,
    path: str,
) -> None:
    """The 1-D regression figure: mixture mean +/- 2 sd, the member means, the training data.

    Args:
      grid: ``[G]`` inputs, sorted.
      mean: ``[G]`` the mixture's mean; ``sd``: ``[G]`` its standard deviation.
      member_means: ``[members, G]`` each member's mean.
      x_train: ``[N]`` training inputs; ``y_train``: ``[N]`` their targets.
      path: the PNG to write.

    Example:
      >>> predictor, toy = me.load_predictor("runs/toy"), me.data.toy1d()
      >>> g = np.linspace(-4, 4, 50, dtype=np.float32)
      >>> out = predictor.predict(g[:, None])
      >>> members = predictor.predict_members(g[:, None])
      >>> sd = np.sqrt(out["variance"][:, 0])
      >>> x, y = toy.x_train[:, 0], toy.y_train[:, 0]
      >>> regression_figure(g, out["mean"][:, 0], sd, members["mean"][..., 0], x, y, "r.png")
    """
    grid, mean, sd = (np.asarray(v, np.float64).reshape(-1) for v in (grid, mean, sd))
    fig, ax = pyplot().subplots(figsize=(7, 4.5))
    ax.fill_between(grid, mean - 2 * sd, mean + 2 * sd, color="tab:blue", alpha=0.2,
                    label="mixture mean +/- 2 sd")  # fmt: skip
    for i, m in enumerate(np.asarray(member_means)):
        ax.plot(
            grid, m, color="tab:gray", lw=0.8, alpha=0.6, label="member means" if not i else None
        )
    ax.plot(grid, mean, color="tab:blue", lw=2, label="mixture mean")
    ax.scatter(np.ravel(x_train), np.ravel(y_train), color="tab:red", s=14, zorder=3,
               label="training data")  # fmt: skip
    ax.set(xlabel="x", ylabel="y", title="regression ensemble: the mixture")
    ax.legend(loc="upper left")
    fig.tight_layout()
    _save(fig, path)
