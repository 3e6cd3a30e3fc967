"""Tasks: what a member's output means, its loss, and how the members' outputs combine.

A task is the one seam between the ensemble on the mesh and what it is trained for. It
says (1) the per-member, per-example loss, (2) which metrics a train step returns and
how they are laid out, and (3) how targets are checked at the boundary. How the members'
outputs combine over the ``ensemble`` axis, and which statistics an evaluation streams,
is in :mod:`meshensemble.core.steps` (the only home of collectives), chosen by the task's
``kind``:

* :class:`Classification` (the default): logits ``[B, C]``, softmax cross-entropy on
  integer labels, the ensemble is the mean of the members' softmax.
* :class:`Regression`: outputs ``[B, 2T]``, the means and unconstrained scales of ``T``
  Gaussians, the Gaussian NLL; the ensemble is the uniform mixture of the members'
  Gaussians (its density is the ``pmean`` of the members' densities over ``ensemble``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import optax

from meshensemble.core.mesh import MEMBERS, REPLICATED
from meshensemble.numerics import gaussian

__all__ = ["Classification", "Regression", "check_task"]


def softmax_cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Default per-example loss: softmax cross-entropy with integer labels.

    Computed as the Flax HOWTO computes it, against one-hot labels
    (``optax.softmax_cross_entropy``): the same value as
    ``optax.softmax_cross_entropy_with_integer_labels`` up to float rounding, without
    its gather and scatter, which XLA:CPU runs slowly (2-3% of the user CNN's step on 8
    CPU devices).

    Args:
      logits: ``[B, classes]``.
      labels: ``[B]`` integer class indices.

    Returns:
      ``[B]`` losses.

    Example:
      >>> me.softmax_cross_entropy(jnp.zeros((2, 10)), jnp.array([1, 2]))  # log 10 each
      Array([2.3025851, 2.3025851], dtype=float32)
    """
    return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, logits.shape[-1]))


@dataclasses.dataclass(frozen=True)
class Classification:
    """Classification with integer labels (the default task of :class:`meshensemble.Ensemble`).

    The model outputs logits ``[B, classes]``; each member's loss is the softmax
    cross-entropy (or the Ensemble's ``loss_fn``); the ensemble's prediction is the mean
    of the members' softmax (``pmean`` over ``ensemble``).

    Example:
      >>> model, tx = me.models.MLP((8,)), optax.sgd(0.1)
      >>> ens = me.Ensemble(model, tx, 2, mesh, task=me.tasks.Classification())
      >>> ens.task.kind
      'classification'
    """

    kind: ClassVar[str] = "classification"

    def loss(self, logits: jax.Array, labels: jax.Array) -> jax.Array:
        """Softmax cross-entropy of ``logits [B, C]`` with integer ``labels [B]``: ``[B]``."""
        return softmax_cross_entropy(logits, labels)

    def train_metric_specs(self) -> dict[str, Any]:
        """The train step's metrics and their layout (per member or replicated)."""
        return {
            "loss": MEMBERS,
            "accuracy": MEMBERS,
            "ensemble_accuracy": REPLICATED,
            "ensemble_nll": REPLICATED,
        }


@dataclasses.dataclass(frozen=True)
class Regression:
    """Regression with ``targets`` real outputs: each member predicts a Gaussian per target.

    The model outputs ``[B, 2 * targets]``: the means ``mu`` (first ``targets`` columns)
    and unconstrained scales ``s`` (last ``targets``), with variance
    ``softplus(s) + min_variance``. With ``target_shift`` / ``target_scale`` (one value per
    target, e.g. the training targets' mean and standard deviation) the model works in
    standardised units and every prediction, loss and score is in the targets' own units:
    mean ``shift + scale * mu``, variance ``scale^2 * (softplus(s) + min_variance)``
    (the loss then differs from the standardised one by the constant ``mean(log scale)``,
    so the gradients are the same). Each member's loss is the Gaussian negative
    log-likelihood averaged over the targets; the ensemble is the uniform mixture of the
    members' Gaussians (Lakshminarayanan et al., 2017).

    Attributes:
      targets: ``T``, the number of real targets (positive).
      min_variance: the variance floor in standardised units (default ``1e-6``), which
        keeps the NLL finite when a member grows overconfident.
      target_shift: ``T`` floats added to the means, or None (0).
      target_scale: ``T`` positive floats multiplying the standard deviations, or None (1).

    Raises:
      ValueError: ``targets`` is not a positive integer, ``min_variance`` is not a
        positive finite float, or shift/scale do not have ``T`` finite values (scale > 0).

    Example:
      >>> net = me.models.MLP(features=(50,), num_classes=2)   # outputs [B, 2 * targets]
      >>> reg = me.Ensemble(net, optax.adam(1e-2), 2, mesh, task=me.tasks.Regression(targets=1))
      >>> x = np.linspace(-1, 1, 8, dtype=np.float32)[:, None]        # [N, features]
      >>> out = reg.predict(reg.init(key, x[:1]), x)
      >>> {k: v.shape for k, v in out.items()}   # mean, variance and its two parts: [N, 1]
      {'aleatoric': (8, 1), 'epistemic': (8, 1), 'mean': (8, 1), 'variance': (8, 1)}
    """

    targets: int
    min_variance: float = 1e-6
    target_shift: tuple[float, ...] | None = None
    target_scale: tuple[float, ...] | None = None
    kind: ClassVar[str] = "regression"

    def __post_init__(self) -> None:
        t = self.targets
        if not isinstance(t, int | np.integer) or isinstance(t, bool) or t < 1:
            raise ValueError(f"targets={t!r} must be a positive integer, e.g. targets=1")
        v = self.min_variance
        if not isinstance(v, int | float) or not np.isfinite(v) or v <= 0:
            raise ValueError(f"min_variance={v!r} must be a positive finite float, e.g. 1e-6")
        for name in ("target_shift", "target_scale"):
            value = getattr(self, name)
            if value is None:
                continue
            arr = np.asarray(value, np.float64).reshape(-1)
            bad = arr.size != t or not np.all(np.isfinite(arr))
            if bad or (name == "target_scale" and np.any(arr <= 0)):
                raise ValueError(
                    f"{name}={value!r} must be {t} finite values"
                    f"{' > 0' if name == 'target_scale' else ''}, one per target"
                )
            object.__setattr__(self, name, tuple(float(a) for a in arr))

    def moments(self, outputs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each member's Gaussian from the model's outputs, in the targets' units.

        Args:
          outputs: ``[..., 2T]`` float outputs.

        Returns:
          ``(mean [..., T], variance [..., T])``.

        Raises:
          ValueError: ``outputs`` is not ``2T`` wide (the model's output width is wrong).
        """
        if outputs.shape[-1] != 2 * self.targets:  # static: raised while tracing
            raise ValueError(
                f"the model outputs {outputs.shape[-1]} values per example, but "
                f"Regression(targets={self.targets}) needs 2 * targets = {2 * self.targets} "
                f"(the means, then the scales); give the model {2 * self.targets} outputs"
            )
        mean, variance = gaussian.moments(outputs.astype(jnp.float32), self.min_variance)
        row = lambda v: jnp.asarray(v, jnp.float32).reshape((1,) * (mean.ndim - 1) + (-1,))
        if self.target_scale is not None:
            scale = row(self.target_scale)
            mean, variance = mean * scale, variance * scale**2
        if self.target_shift is not None:
            mean = mean + row(self.target_shift)
        return mean, variance

    def loss(self, outputs: jax.Array, targets: jax.Array) -> jax.Array:
        """Gaussian NLL per example, averaged over targets: ``outputs [B, 2T]``, ``targets [B, T]``.

        Returns:
          ``[B]`` losses.
        """
        mean, variance = self.moments(outputs)
        return -jnp.mean(gaussian.log_density(mean, variance, targets.astype(mean.dtype)), -1)

    def train_metric_specs(self) -> dict[str, Any]:
        """The train step's metrics: per-member ``loss`` (NLL) and ``rmse``, the mixture's."""
        return {
            "loss": MEMBERS,
            "rmse": MEMBERS,
            "ensemble_nll": REPLICATED,
            "ensemble_rmse": REPLICATED,
        }

    def check_batch(self, x: Any, y: Any, num_members: int, data_size: int) -> tuple[bool, Any]:
        """Checks a training batch; returns ``(per_member, targets as [.., B, T])``.

        Args:
          x: ``[B, ...]`` or per member ``[members, B, ...]``.
          y: ``[B, T]`` (or ``[B]`` when ``T = 1``) or per member ``[members, B, T]``.
          num_members: the ensemble's size.
          data_size: the mesh's ``data`` axis, which must divide ``B``.

        Raises:
          ValueError: one line naming the shapes or dtype and the fix.
        """
        y = self.as_targets(y, np.shape(x)[0] if np.ndim(x) else 0)
        per_member = np.ndim(y) == 3
        if per_member and np.shape(y)[0] != num_members:
            raise ValueError(
                f"per-member targets of shape {np.shape(y)} have {np.shape(y)[0]} members, "
                f"the ensemble has {num_members}; give [{num_members}, B, T] or shared [B, T]"
            )
        batch = np.shape(y)[-2]
        if tuple(np.shape(x)[: np.ndim(y) - 1]) != tuple(np.shape(y)[:-1]):
            raise ValueError(
                f"inputs of shape {np.shape(x)} and targets of shape {np.shape(y)} differ in "
                "length; give one target row per input"
            )
        if batch == 0 or batch % data_size:
            raise ValueError(
                f"batch size {batch} is not a positive multiple of the mesh's data axis "
                f"({data_size}); use a batch size divisible by {data_size}"
            )
        return per_member, y

    def as_targets(self, y: Any, n: int) -> Any:
        """``y`` as float ``[..., N, T]`` (``[N]`` becomes ``[N, 1]`` when ``T = 1``).

        Raises:
          ValueError: non-float targets, a NaN or inf among host (numpy) targets (one
            would make every member's loss NaN), or a last axis other than ``T``.
        """
        if not jnp.issubdtype(np.result_type(y), jnp.floating):
            raise ValueError(
                f"regression targets have dtype {np.result_type(y)}; give float targets "
                "(e.g. y.astype('float32'))"
            )
        if isinstance(y, np.ndarray) and not np.isfinite(y).all():
            at = tuple(int(i) for i in np.argwhere(~np.isfinite(y))[0])
            raise ValueError(
                f"regression targets hold {y[at]} at index {at}; clean the data first (a NaN "
                "or inf target makes the loss NaN)"
            )
        if np.ndim(y) == 1 and self.targets == 1:
            y = y[:, None]
        if np.ndim(y) not in (2, 3) or np.shape(y)[-1] != self.targets:
            raise ValueError(
                f"targets of shape {np.shape(y)} do not end in {self.targets} targets; give "
                f"[N, {self.targets}]" + (" or [N]" if self.targets == 1 else "")
            )
        return y


def check_task(task: Any) -> Classification | Regression:
    """``task``, or :class:`Classification` for None; TypeError for anything else.

    Example:
      >>> check_task(None)
      Classification()
    """
    if task is None:
        return Classification()
    if isinstance(task, Classification | Regression):
        return task
    raise TypeError(
        f"task={task!r} is not a task; pass me.tasks.Classification() or "
        "me.tasks.Regression(targets=T)"
    )
