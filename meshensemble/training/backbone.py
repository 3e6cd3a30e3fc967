"""A backbone: one trained model's parameters, read from a run folder or a file.

An adapter ensemble (``meshensemble train --backbone RUN_OR_FILE --rank R``, or
``ens.init(key, x, params=load_backbone(path))``) starts every member at the same
trained model, kept frozen and shared (docs/sharing.md). The backbone comes from:

* a run folder of ``meshensemble train --members 1``: its newest checkpoint, checked
  against its recorded checksum (a mismatch is refused), member 0's parameters;
* an ``.npz`` of the parameters, one array per leaf named by its path joined with ``/``
  (``Dense_0/kernel``), as :func:`save_backbone` writes it;
* a ``.msgpack`` of the parameter tree (``flax.serialization.to_bytes(params)``, or of
  ``{"params": params}``).

A model with mutable collections (BatchNorm's ``batch_stats``) is its parameters *and*
those statistics: :func:`backbone_model_state` reads the run's statistics so that every
member starts at the backbone in evaluation mode too (a file holds parameters only, so
such a backbone must be a run folder).

Example:
  >>> params = me.extract_members(state, 0)          # one trained member, e.g.
  >>> save_backbone("backbone.npz", params)
  >>> load_backbone("backbone.npz")["Dense_0"]["kernel"].shape
  (784, 8)
"""

from __future__ import annotations

import io
import logging
from typing import Any

import flax.serialization
import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util

from meshensemble.errors import UsageError
from meshensemble.runtime import storage
from meshensemble.training.checkpoint import CHECKPOINT_DIR, list_checkpoints
from meshensemble.training.checksums import checkpoint_digest, load_checksums

PyTree = Any
SUFFIXES = (".npz", ".msgpack")
"""The file kinds :func:`load_backbone` reads (besides run folders)."""


def load_backbone(path: str) -> PyTree:
    """One trained model's parameters from a run folder or an ``.npz``/``.msgpack`` file.

    Args:
      path: a run folder of ``meshensemble train --members 1``, or a file (see the module).

    Returns:
      The parameter tree (nested dicts of numpy arrays, no member axis).

    Raises:
      UsageError: nothing there, a run without checkpoints, of more than one member or
        with a member layout, a checkpoint whose checksum does not match, or a file of
        another kind (one line naming the path and the fix).

    Example:
      >>> save_backbone("backbone.npz", {"Dense_0": {"bias": np.zeros(3)}})
      >>> load_backbone("backbone.npz")
      {'Dense_0': {'bias': array([0., 0., 0.])}}
    """
    if storage.isdir(path):
        return _from_run(path)
    if not storage.isfile(path):
        raise UsageError(
            f"--backbone {path}: no such run folder or file; give the folder of a "
            "`meshensemble train --members 1` run, or an .npz/.msgpack of its parameters"
        )
    data = storage.read_bytes(path)
    if path.endswith(".npz"):
        with np.load(io.BytesIO(data)) as found:
            flat = {tuple(k.split("/")): np.asarray(found[k]) for k in found.files}
        return traverse_util.unflatten_dict(flat)
    if path.endswith(".msgpack"):
        tree = flax.serialization.msgpack_restore(data)
        tree = tree.get("params", tree) if isinstance(tree, dict) else tree
        return jax.tree.map(np.asarray, tree)
    raise UsageError(
        f"--backbone {path}: not a run folder, .npz or .msgpack; save the parameters with "
        "me.training.backbone.save_backbone(path.npz, params)"
    )


def backbone_model_state(path: str, model: Any, transform: Any, sample: Any) -> PyTree:
    """The backbone's model state (e.g. ``batch_stats``), checked against the model's.

    Args:
      path: what :func:`load_backbone` takes.
      model: the :class:`meshensemble.Model` of one member (the adapted backbone).
      transform: the ensemble's input transform (None: none).
      sample: an input batch of the model's shape (array or ``jax.ShapeDtypeStruct``).

    Returns:
      The backbone run's member-0 model state on the model's structure (nested dicts of
      numpy arrays, no member axis), or None when the model has no mutable collections.

    Raises:
      UsageError: the model keeps state (BatchNorm statistics) but ``path`` is a file of
        parameters, or the run's state does not fit the model's (one line naming the path).

    Example:
      >>> backbone_model_state("backbone.npz", ens.model, None, images[:1]) is None  # an MLP
      True
    """
    transform = transform or (lambda v: v)
    init = lambda xx: model.init(jax.random.PRNGKey(0), transform(xx))[1]
    wanted = jax.eval_shape(init, sample)
    if not jax.tree.leaves(wanted):
        return None
    names = ", ".join(sorted(wanted))
    if not storage.isdir(path):
        raise UsageError(
            f"--backbone {path}: this model keeps {names} beside its parameters and a file "
            "holds parameters only; give the backbone's run folder (train --members 1)"
        )
    found = jax.tree.map(lambda v: np.asarray(v)[0], _restore_run(path)["model_state"])
    want = {k: (tuple(v.shape), v.dtype) for k, v in traverse_util.flatten_dict(wanted).items()}
    have = traverse_util.flatten_dict(found) if isinstance(found, dict) else {}
    for key, (shape, _) in want.items():
        if key not in have or tuple(np.shape(have[key])) != shape:
            got = np.shape(have[key]) if key in have else "nothing"
            raise UsageError(
                f"--backbone {path}: its {'/'.join(map(str, key))} is {got}; the model's is "
                f"{shape}: give a backbone of this model (the same architecture)"
            )
    return traverse_util.unflatten_dict({k: have[k].astype(d) for k, (_, d) in want.items()})


def with_model_state(state: Any, model_state: PyTree) -> Any:
    """``state`` with every member's model state set to ``model_state`` (placed alike).

    Args:
      state: an :class:`~meshensemble.EnsembleState` (model-state leaves ``[members, ...]``).
      model_state: one member's model state of the same structure (no member axis), or
        None (``state`` is returned unchanged).

    Returns:
      The state with each member's model state equal to ``model_state``, every leaf with
      its old shape, dtype and sharding.

    Example:
      >>> with_model_state(state, None) is state
      True
    """
    if model_state is None:
        return state

    def put(old: jax.Array, new: Any) -> jax.Array:
        whole = np.broadcast_to(np.asarray(new, old.dtype), old.shape)
        return jax.make_array_from_callback(old.shape, old.sharding, lambda idx: whole[idx])

    return state.replace(model_state=jax.tree.map(put, state.model_state, model_state))


def save_backbone(path: str, params: PyTree) -> None:
    """Writes one model's parameters as an ``.npz`` :func:`load_backbone` reads (atomically).

    Args:
      path: the file, ending ``.npz``.
      params: a tree of nested dicts of arrays (no member axis), e.g.
        ``me.extract_members(state, 0)``.

    Raises:
      UsageError: ``path`` does not end with ``.npz``.

    Example:
      >>> save_backbone("backbone.npz", me.extract_members(state, 0))
    """
    if not path.endswith(".npz"):
        raise UsageError(f"save_backbone({path!r}): the file must end with .npz")
    flat = traverse_util.flatten_dict(jax.tree.map(np.asarray, params))
    arrays = {"/".join(map(str, k)): v for k, v in flat.items()}
    storage.atomic_write(path, lambda f: np.savez(f, **arrays))


def _from_run(workdir: str) -> PyTree:
    """Member 0's parameters of the newest checkpoint of a one-member run, verified."""
    return jax.tree.map(lambda v: np.asarray(v)[0], _restore_run(workdir)["params"])


def _restore_run(workdir: str) -> dict[str, Any]:
    """The newest checkpoint's state of a one-member run without a layout, verified."""
    steps = list_checkpoints(workdir)
    if not steps:
        raise UsageError(
            f"--backbone {workdir}: no checkpoint there; train the backbone first "
            f"(meshensemble train --members 1 --workdir {workdir})"
        )
    directory = storage.join(workdir, CHECKPOINT_DIR)
    step = max(steps)
    sums, _ = load_checksums(storage.absolute(directory), len(steps))
    folder = storage.absolute(storage.join(directory, str(step)))
    recorded = sums.get(str(step))
    if recorded is not None and recorded != checkpoint_digest(folder):
        raise UsageError(
            f"--backbone {workdir}: checkpoint {step} does not match its recorded checksum "
            f"(damaged); move {folder} aside to use the previous one, or train the backbone again"
        )
    item = storage.join(folder, "state")
    absl = logging.getLogger("absl")  # orbax's note on the optional metadata file: noise
    quiet = lambda record: not str(record.msg).startswith("Metadata file does not exist")
    absl.addFilter(quiet)
    try:
        with ocp.StandardCheckpointer() as reader:
            meta = reader.metadata(item)
            meta = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
            device = jax.sharding.SingleDeviceSharding(jax.local_devices(backend="cpu")[0])
            shape = lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device)
            state = reader.restore(item, jax.tree.map(shape, meta))
    finally:
        absl.removeFilter(quiet)
    params = state["params"]
    members = {int(np.shape(v)[0]) for v in jax.tree.leaves(params)}
    if members != {1} or state.get("shared") is not None:
        count = ", ".join(map(str, sorted(members)))
        what = "a member layout" if state.get("shared") is not None else f"{count} members"
        raise UsageError(
            f"--backbone {workdir}: the run has {what}; a backbone is one plain model "
            "(train it with --members 1)"
        )
    return state
