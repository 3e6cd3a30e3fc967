"""PNG plots of a run: learning curves and member vs ensemble accuracy (matplotlib, Agg)."""

from __future__ import annotations

from typing import Any

import numpy as np


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def learning_curves(history: list[dict[str, Any]], path: str) -> None:
    """Plots train loss per member and test accuracy per member and of the ensemble.

    Args:
      history: ``metrics.jsonl`` records, one per evaluation.
      path: the PNG to write.

    Example:
      >>> learning_curves(result.history, "runs/mnist/learning_curves.png")
    """
    plt = _pyplot()
    steps = [r["step"] for r in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    if all("train_loss" in r for r in history):
        losses = np.array([r["train_loss"] for r in history])
        for i in range(losses.shape[1]):
            ax1.plot(steps, losses[:, i], color="tab:blue", alpha=0.35, lw=1)
        ax1.plot(steps, losses.mean(1), color="tab:blue", lw=2, label="mean member")
    ax1.set(xlabel="step", ylabel="train loss", title="training loss (members)")
    ax1.legend()
    member = np.array([r["test_member_accuracy"] for r in history])
    for i in range(member.shape[1]):
        ax2.plot(steps, 100 * member[:, i], color="tab:gray", alpha=0.4, lw=1)
    ax2.plot(steps, 100 * member.mean(1), color="tab:gray", lw=2, label="mean member")
    ens = [100 * r["test_ensemble_accuracy"] for r in history]
    ax2.plot(steps, ens, color="tab:red", lw=2, marker="o", label="ensemble")
    ax2.set(xlabel="step", ylabel="test accuracy (%)", title="test accuracy")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def member_vs_ensemble(record: dict[str, Any], path: str) -> None:
    """Bar chart of each member's test accuracy and NLL against the ensemble's.

    Args:
      record: one ``metrics.jsonl`` record.
      path: the PNG to write.

    Example:
      >>> member_vs_ensemble(result.history[-1], "runs/mnist/members.png")
    """
    plt = _pyplot()
    acc = list(record["test_member_accuracy"]) + [record["test_ensemble_accuracy"]]
    nll = list(record["test_member_nll"]) + [record["test_ensemble_nll"]]
    names = [str(i) for i in range(len(acc) - 1)] + ["ens."]
    colors = ["tab:gray"] * (len(acc) - 1) + ["tab:red"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    ax1.bar(names, 100 * np.array(acc), color=colors)
    lo = 100 * min(acc)
    ax1.set_ylim(max(0.0, lo - (100 - lo) * 0.5 - 0.5), 100)
    ax1.set(xlabel="member", ylabel="test accuracy (%)", title="members vs ensemble: accuracy")
    ax2.bar(names, nll, color=colors)
    ax2.set(xlabel="member", ylabel="test NLL", title="members vs ensemble: NLL")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
