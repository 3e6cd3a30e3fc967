"""The state's structure and the inference bundle: what a checkpoint must fit, and members
taken out of a state for predicting.

:func:`abstract_state` gives the shapes a restore targets; :func:`check_structure` compares
a saved tree with it and raises :class:`CheckpointError` in one line naming both sides
(member count, model, optimizer). :func:`extract_members`, :func:`save_inference` and
:func:`load_inference` are the inference bundle (also importable from
:mod:`meshensemble.training.checkpoint` and as ``me.<name>``).

Example:
  >>> me.save_inference("runs/mnist/inference", state, temperature=1.31)
  >>> state = me.load_inference("runs/mnist/inference", ens, images[:1])
  >>> state.num_members, np.asarray(state.step).tolist()  # the parameters; a fresh step count
  (2, [0, 0])
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from meshensemble.core.sharding import abstract_layout
from meshensemble.core.state import EnsembleState, SharedState, whole_params
from meshensemble.errors import RunFailedError
from meshensemble.runtime import storage
from meshensemble.runtime.distributed import fetch
from meshensemble.training.inference import check_temperature, read_temperature, write_temperature


class CheckpointError(RunFailedError):
    """A checkpoint could not be written or no good checkpoint could be read."""


def abstract_state(ens: Any, sample: Any) -> EnsembleState:
    """The state's shapes, dtypes and member sharding on ``ens``'s mesh, for restoring.

    Args:
      ens: the :class:`meshensemble.Ensemble`.
      sample: an input batch, e.g. ``images[:1]``.

    Returns:
      An :class:`EnsembleState` of ``jax.ShapeDtypeStruct`` leaves.

    Example:
      >>> target = abstract_state(ens, images[:1])
      >>> jax.tree.leaves(target.params)[0].sharding.spec   # laid out as ens lays them
      P('ensemble',)
    """
    shapes = jax.eval_shape(lambda: ens.init(jax.random.PRNGKey(0), sample))
    return abstract_layout(ens.state_specs(sample), ens.mesh, shapes)  # as ens lays them out


def _flat(tree: Any) -> dict[tuple[str, ...], tuple[tuple[int, ...], str]]:
    """``path -> (shape, dtype)`` of a state tree or of orbax's metadata of one."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        key = tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)
        out[key] = (tuple(getattr(leaf, "shape", ())), str(getattr(leaf, "dtype", "?")))
    return out


def _summary(part: str, flat: dict, sizes: bool = True) -> str:
    """A few words on one part of a state (``params``, ``opt_state``...), per member."""
    sub = {p[1:]: v for p, v in flat.items() if p[0] == part}
    if part == "opt_state":  # the optimizer's names, without the params' own paths
        params = {p[1:] for p in flat if p[0] == "params"}
        cut = lambda p: next((i for i in range(len(p)) if p[i:] in params), len(p))
        names = {".".join(c for c in p[: cut(p)] if not c.isdigit()) or "-" for p in sub}
        what = f"optimizer state ({', '.join(sorted(names)) or 'empty'})"
    else:
        tops = ", ".join(sorted({p[0] for p in sub if p}))
        what = part.replace("_", " ") + (f" {{{tops}}}" if tops else " (empty)")
    if sub and sizes:  # per member; a layout's shared leaves have no member axis
        cut = 0 if part.startswith("shared") else 1
        size = sum(int(np.prod(shape[cut:], dtype=np.int64)) for shape, _ in sub.values())
        what += f" of {size:,} numbers in {'/'.join(sorted({d for _, d in sub.values()}))}"
    return what


def check_structure(path: str, target: Any, what: str, fix: str | None = None) -> None:
    """Checks that the tree saved in the orbax folder ``path`` fits ``target``.

    Args:
      path: an orbax item folder (a checkpoint's ``state``, or an inference bundle).
      target: the tree to restore into, e.g. from :func:`abstract_state`.
      what: how the error names the saved side, e.g. ``"checkpoint 469 in runs/x"``.
      fix: the error's advice (default: build the ensemble from the run's config).

    Returns:
      None when the shapes and dtypes match leaf for leaf.

    Raises:
      CheckpointError: one line naming both sides (member count, model, optimizer state)
        when they differ; orbax's own error when the metadata cannot be read.

    Example:
      >>> me.save_inference("bundle", state)
      >>> saved = {"params": state.params, "model_state": state.model_state}
      >>> check_structure(storage.absolute("bundle"), saved, "bundle")   # None: they agree
    """
    with ocp.StandardCheckpointer() as reader:
        meta = reader.metadata(path)
    meta = getattr(meta, "item_metadata", meta)  # orbax >= 0.12 wraps it in StepMetadata
    saved, want = _flat(getattr(meta, "tree", meta)), _flat(target)
    if saved == want:
        return

    members = lambda f: next((s[0] for p, (s, _) in sorted(f.items()) if p[0] == "params"), "?")
    strip = lambda f, part: {p: (s[1:], d) for p, (s, d) in f.items() if p[0] == part}
    parts = ["params", "model_state", "opt_state", "step", "rng", "shared", "shared_opt_state"]
    differ = [part for part in parts if strip(saved, part) != strip(want, part)]
    same_optimizer = _summary("opt_state", saved, False) == _summary("opt_state", want, False)
    if "params" in differ and same_optimizer:  # the same optimizer over other params: once
        differ = [part for part in differ if part != "opt_state"]
    ours = ", ".join(_summary(part, saved) for part in differ)
    theirs = ", ".join(_summary(part, want) for part in differ)
    fix = fix or (
        "build the ensemble with the run's config (its config.json), or use --overwrite "
        "to start the run over"
    )
    raise CheckpointError(
        f"{what} holds {members(saved)} members{' with ' + ours if ours else ''}; this "
        f"ensemble has {members(want)} members{' with ' + theirs if theirs else ''}: "
        f"the checkpoint itself is fine; {fix}"
    )


def extract_members(
    state: EnsembleState, members: int | list[int], with_model_state: bool = False
) -> Any:
    """One member's (or a subset's) parameters, and optionally model state, as plain trees.

    Args:
      state: an ensemble state.
      members: an index (returns leaves without the member axis, ready for
        ``model.apply({"params": p}, x)``) or a list of indices (leaves ``[len, ...]``).
      with_model_state: also return the members' ``model_state`` (BatchNorm's
        ``batch_stats``; ``{}`` for models without any), picked the same way.

    Returns:
      The parameters as numpy arrays on the host; with ``with_model_state``, the pair
      ``(params, model_state)``.

    Raises:
      ValueError: an index out of range.

    Example:
      >>> params = me.extract_members(state, 1)          # the namespace's MLP members
      >>> logits = me.models.MLP((8,)).apply({"params": params}, me.data.normalize(images))
      >>> logits.shape
      (32, 10)
      >>> params, extra = me.extract_members(state, [0, 1], with_model_state=True)
      >>> params["Dense_0"]["kernel"].shape, extra       # [members, ...]; no BatchNorm here
      ((2, 784, 8), {})
    """
    m = state.num_members
    idx = [members] if isinstance(members, int | np.integer) else list(members)
    bad = [i for i in idx if not 0 <= int(i) < m]
    if bad or not idx:
        raise ValueError(f"member index {bad or idx} out of range; the ensemble has {m} members")
    rows = int(members) if isinstance(members, int | np.integer) else np.asarray(idx)
    params = jax.tree.map(lambda v: np.asarray(v)[rows], fetch(state.params))
    if isinstance(state, SharedState):  # a layout's shared leaves, the same for every member
        lead = () if isinstance(rows, int) else (len(idx),)
        shared = jax.tree.map(lambda v: np.broadcast_to(v, lead + np.shape(v)), fetch(state.shared))
        params = whole_params(params, shared)
    if not with_model_state:
        return params
    return params, jax.tree.map(lambda v: np.asarray(v)[rows], fetch(state.model_state))


def _inference_part(state: Any) -> dict[str, Any]:
    """What an inference bundle keeps of a state: parameters (shared ones too), model state."""
    tree = {"params": state.params, "model_state": state.model_state}
    return tree | ({"shared": state.shared} if isinstance(state, SharedState) else {})


def save_inference(path: str, state: EnsembleState, temperature: Any = None) -> None:
    """Saves an inference-only ensemble: parameters, model state and the temperature.

    Args:
      path: a folder that does not exist yet (orbax refuses to overwrite).
      state: the ensemble state (no optimizer state is saved).
      temperature: None, ``T > 0`` or ``[members]``; kept in ``path/temperature.json``.

    Raises:
      ValueError: a bad temperature, or a list of them whose length is not the state's
        member count (checked before anything is written).

    Example:
      >>> me.save_inference("runs/mnist/inference", state, temperature=1.31)
    """
    t = check_temperature(temperature)
    if isinstance(t, list) and len(t) != state.num_members:
        raise ValueError(
            f"temperature holds {len(t)} values but the state has {state.num_members} "
            f"members; give one T for all or {state.num_members}, one per member"
        )
    tree = _inference_part(state)
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(storage.as_path(storage.absolute(path)), tree)
    write_temperature(storage.absolute(path), temperature)


def load_inference(path: str, ens: Any, sample: Any, *, with_temperature: bool = False) -> Any:
    """Loads :func:`save_inference` output onto ``ens``'s mesh as a state for predicting.

    Args:
      path: the folder written by :func:`save_inference`.
      ens: the ensemble to load into (any mesh).
      sample: an input batch for the structure.
      with_temperature: also return the bundle's temperature.

    Returns:
      An :class:`EnsembleState` (fresh optimizer state) for ``ens.predict``; with
      ``with_temperature``, ``(state, T)``: T None (none saved), a float or ``[members]``.

    Raises:
      FileNotFoundError: nothing at ``path``.
      CheckpointError: ``ens`` does not fit what was saved (model, member count).

    Example:
      >>> me.save_inference("runs/mnist/inference", state, temperature=1.31)
      >>> state, t = me.load_inference("runs/mnist/inference", ens, images[:1],
      ...                              with_temperature=True)
      >>> t
      1.31
    """
    target = abstract_state(ens, sample)
    sub = _inference_part(target)
    path = storage.absolute(path)
    if not storage.isdir(path):
        raise FileNotFoundError(
            f"no inference checkpoint in {path}; write one with me.save_inference(path, state)"
        )
    fix = "build the ensemble with the model and member count it was saved from"
    check_structure(path, sub, f"inference checkpoint {path}", fix)
    with ocp.StandardCheckpointer() as ckptr:
        tree = ckptr.restore(path, sub)
    state = ens.init(jax.random.PRNGKey(0), sample).replace(**tree)
    return (state, read_temperature(path)) if with_temperature else state
