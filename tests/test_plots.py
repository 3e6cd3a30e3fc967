"""The run's figures: learning curves per logged step with test NLL and ECE; honest axes."""

from __future__ import annotations

import pytest

from meshensemble import plots

pytestmark = pytest.mark.plots  # our own savefig, not conftest's

HISTORY = [
    {"step": 4, "train_loss": [0.9, 1.1], "test_member_accuracy": [0.90, 0.92],
     "test_ensemble_accuracy": 0.93, "test_member_nll": [0.40, 0.35], "test_ensemble_nll": 0.30,
     "test_member_ece": [0.05, 0.04], "test_ensemble_ece": 0.02,
     "train_curve": {"step": [2, 4], "loss": [[1.2, 1.4], [0.9, 1.1]]}},
    {"step": 8, "train_loss": [0.5, 0.7], "test_member_accuracy": [0.925, 0.93],
     "test_ensemble_accuracy": 0.94, "test_member_nll": [0.30, 0.28], "test_ensemble_nll": 0.25,
     "test_member_ece": [0.03, 0.03], "test_ensemble_ece": 0.01,
     "train_curve": {"step": [6, 8], "loss": [[0.6, 0.8], [0.5, 0.7]]}},
]  # fmt: skip


@pytest.fixture
def saved(monkeypatch):
    """The figures the plots save (not rendered)."""
    from matplotlib.figure import Figure

    figures = []
    monkeypatch.setattr(Figure, "savefig", lambda fig, *a, **k: figures.append(fig))
    monkeypatch.setattr(Figure, "tight_layout", lambda fig, *a, **k: None)
    return figures


def test_learning_curves_have_a_point_per_logged_step_and_test_nll_and_ece(saved, tmp_path):
    plots.learning_curves(HISTORY, str(tmp_path / "c.png"))
    axes = {ax.get_title(): ax for ax in saved[0].axes}
    assert {"test NLL", "test ECE", "test accuracy (%)"} <= set(axes)
    mean = axes["training loss (members)"].lines[-1]
    assert list(mean.get_xdata()) == [2, 4, 6, 8]  # every logged step, not one per evaluation
    assert list(axes["test ECE"].lines[-1].get_ydata()) == [0.02, 0.01]
    assert list(axes["test NLL"].lines[-1].get_ydata()) == [0.30, 0.25]
    assert axes["test accuracy (%)"].get_ylim()[0] == 0 and axes["test ECE"].get_ylim()[0] == 0


def test_members_chart_starts_its_axes_at_zero(saved, tmp_path):
    plots.member_vs_ensemble(HISTORY[-1], str(tmp_path / "m.png"))
    error, nll = saved[0].axes
    assert error.get_ylim()[0] == 0 and nll.get_ylim()[0] == 0
    heights = [round(b.get_height(), 6) for b in error.patches]
    assert heights == [7.5, 7.0, 6.0]  # the error rates, 100 - accuracy
