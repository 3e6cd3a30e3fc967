"""A training run's configuration: :class:`TrainConfig` and what is built from it.

Each field of :class:`TrainConfig` carries its help text (and, where it has them, its
choices) in ``dataclasses.field(metadata=...)``. That metadata is the one source of
truth: the class docstring's attribute list is generated from it, and so are the
``meshensemble train`` flags (see :func:`field_help`, :func:`field_choices`).

Example:
  >>> cfg = TrainConfig(members=4, epochs=1).validate()
  >>> ens = build_ensemble(cfg, me.make_mesh(ensemble=4), num_train=60000)
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from meshensemble import data as data_lib
from meshensemble.core.backends import BACKENDS
from meshensemble.core.ensemble import STRATEGIES, Ensemble
from meshensemble.core.mesh import parse_mesh
from meshensemble.core.tasks import Task, task_class
from meshensemble.data.augment import AUGMENTS, make_augment
from meshensemble.data.tabular import TARGET_KINDS
from meshensemble.models import REGISTRY as MODEL_REGISTRY
from meshensemble.models import build_model, get_model, lora
from meshensemble.models.conv import CONV_CHOICES
from meshensemble.models.user import is_spec
from meshensemble.training.fields import GROUPS as GROUPS
from meshensemble.training.fields import attribute_docs
from meshensemble.training.fields import config_field_of as _field
from meshensemble.training.fields import field_choices as field_choices
from meshensemble.training.fields import field_group as field_group
from meshensemble.training.fields import field_help as field_help
from meshensemble.training.monitor import parse_early_stopping
from meshensemble.training.recipe import default_chunk_steps as default_chunk_steps
from meshensemble.training.recipe import default_mesh_shape as default_mesh_shape
from meshensemble.training.recipe import make_optimizer as make_optimizer

OPTIMIZERS = ("sgd", "adam", "adamw")
"""Values of ``TrainConfig.optimizer``."""
SCHEDULES = ("constant", "cosine", "warmup_cosine")
"""Values of ``TrainConfig.schedule``."""
SHUFFLES = ("shared", "per-member")
"""Values of ``TrainConfig.shuffle``."""
ON_NONFINITE = ("stop", "reinit")
"""Values of ``TrainConfig.on_nonfinite``."""
PRECISIONS: dict[str, Any] = {"fp32": None, "bf16": jnp.bfloat16}
"""``TrainConfig.precision`` -> the ensemble's ``compute_dtype``."""
CONV_MODELS = ("cnn", "howto_cnn")
"""Models whose convolutions ``TrainConfig.conv`` picks."""
CONFIG_FILE = "config.json"
"""The run's config in its workdir: every field plus a ``resolved`` entry."""
METRICS_FILE = "metrics.jsonl"
"""One JSON record per evaluation in the run's workdir."""
EVALUATIONS = 20
"""About how many evaluations (and checkpoints) a run makes when ``eval_every`` is None."""


def with_task_defaults(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` plus the task's ``cli_defaults`` for the fields it does not hold.

    Args:
      values: ``TrainConfig`` field values that were given (flags, ``--config``, a resumed
        run's ``config.json``); a missing ``task`` is the default task.

    Returns:
      A new dict: given values always win (``meshensemble train`` applies it before
      ``config.json`` is written, which records the result).

    Raises:
      ValueError: an unknown task.

    Example:
      >>> with_task_defaults({"task": "regression", "learning_rate": 0.05})["optimizer"]
      'adam'
    """
    task = task_class(values.get("task", TrainConfig.task))
    return {**task.cli_defaults, **values}


@dataclasses.dataclass
class TrainConfig:
    """Everything a training run needs; the ``meshensemble train`` flags are generated from it.

    Defaults follow the Flax MNIST example (SGD 0.1 with momentum 0.9, batch 128,
    constant rate, 10 epochs), with an 8-member ensemble.
    """

    dataset: str = _field(
        "mnist",
        "the dataset's name: any TFDS name for source tfds (mnist, fashion_mnist, cifar10, "
        "svhn_cropped ...), mnist or fashion_mnist for auto and sample; a folder, CSV, "
        "ArrayRecord folder or an npz not in MNIST's layout keeps its own name unless "
        "another is given (see docs/data.md)",
        metavar="NAME", group="data",
    )
    task: str = _field(
        "classification",
        "a registered task (classification: integer labels, the members' softmax averaged; "
        "regression: float targets, Gaussian members, their mixture, see docs/regression.md) "
        "or a Task subclass as module:Class (docs/tasks.md); a task's own defaults apply to "
        "the flags not given",
        metavar="TASK", group="model",
    )
    source: str = _field(
        "auto",
        "where the data comes from (see meshensemble.data.load_dataset and "
        "docs/data.md): auto tries data_file, TFDS's prepared data, a TFDS "
        "download, then the embedded MNIST sample (a task may name its own: --task "
        "regression's is the toy1d toy); tfds any TFDS name with an image and a label; npz "
        "a Keras-layout file of any shapes; folder an image folder in data_dir; csv a table "
        "in data_file; arrayrecord the files of `meshensemble convert` in data_dir, read a "
        "batch at a time; toy1d, diabetes and friedman1 are tables with float targets",
        choices=data_lib.SOURCES, group="data",
    )
    data_file: str | None = _field(
        None,
        "a Keras-layout .npz (x_train, y_train, x_test, y_test) for source npz or auto, or "
        "the training CSV of source csv",
        metavar="PATH", group="data",
    )
    data_dir: str | None = _field(
        None,
        "the TFDS data folder, the ArrayRecord folder of source arrayrecord, or the image "
        "folder of source folder (ROOT/train/<class>/ and ROOT/test/<class>/, PNG or JPEG files)",
        metavar="DIR", group="data",
    )
    test_file: str | None = _field(
        None, "source csv: the test CSV, with the training CSV's columns", metavar="PATH",
        group="data",
    )
    test_fraction: float | None = _field(
        None,
        "source csv without a test file: the share of the training rows held out as the test "
        "split, seeded by --seed (stratified by class)",
        metavar="F", group="data",
    )
    target_column: str | None = _field(
        None, "source csv: the column of the targets (every other column is a feature)",
        metavar="NAME", group="data",
    )
    targets: str = _field(
        "auto",
        "source csv: what the target column holds: auto (class ids unless a value has a "
        "fraction), classes, or floats (regression targets)",
        choices=TARGET_KINDS, group="data",
    )
    model: str = _field(
        "cnn",
        lambda: (
            f"the member architecture: {', '.join(MODEL_REGISTRY)} (meshensemble.models."
            "REGISTRY), or your Flax Linen module as module:Class (built with its defaults; "
            "a num_classes field gets the task's output width) or module:function (no "
            "arguments, returns one), importable on PYTHONPATH by every later command"
        ),
        metavar="NAME", group="model",
    )
    members: int = _field(8, "ensemble size", metavar="M", group="ensemble and mesh")
    backbone: str | None = _field(
        None,
        "LoRA ensemble: the frozen backbone every member shares, one trained --model (a run "
        "folder of `meshensemble train --members 1`, or an .npz/.msgpack of its parameters); "
        "each member trains rank --rank adapters on its dense and convolution layers "
        "(docs/sharing.md)",
        metavar="RUN_OR_FILE", group="model",
    )
    rank: int = _field(4, "the rank of the --backbone adapters", metavar="R", group="model")
    mesh: str = _field(
        "",
        "the mesh, e.g. ensemble=4,data=2; empty: all devices, ensemble = gcd(members, "
        "devices) and the rest on data",
        metavar="SPEC", group="ensemble and mesh",
    )
    backend: str = _field(
        "shard_map", "how steps are mapped over the mesh", choices=BACKENDS,
        group="ensemble and mesh",
    )
    shard_members: bool = _field(
        False,
        "FSDP: split each member's parameters and optimizer state over the mesh's data "
        "axis (and model axis), gathered for each step; state memory per device falls by "
        "their size (shard_map backend; see docs/sharding.md)",
        group="ensemble and mesh",
    )
    member_strategy: str = _field(
        "auto",
        "how a device computes the members it holds (vmap or a loop); auto: the faster "
        "measured on this device (see autotune)",
        choices=STRATEGIES, group="performance",
    )
    conv: str = _field(
        "auto",
        "how the CNN computes its convolutions (cnn and howto_cnn only): auto times this "
        "platform's candidates on this device (CPU: canonical, im2col, gemm_grad; see "
        "autotune; without it: canonical, XLA's convolution with its backward in XLA:CPU's "
        "fast layout, on CPU, im2col matmuls on GPU, xla on TPU); see meshensemble.models.conv",
        choices=CONV_CHOICES, group="performance",
    )
    autotune: bool = _field(
        True,
        "with member_strategy or conv at auto, time the candidates on this device and "
        "model at setup and keep the fastest (remembered beside the compilation cache); "
        "off: the platform defaults",
        group="performance",
    )
    precision: str = _field(
        "fp32",
        "fp32, or bf16 for mixed precision (bfloat16 compute, float32 weights and "
        "optimizer state; for accelerators)",
        choices=tuple(PRECISIONS), group="performance",
    )
    epochs: int = _field(
        10,
        "epochs to train (a decaying schedule spans them); --task regression: 100 unless given",
        metavar="N", group="optimisation",
    )
    batch_size: int | None = _field(
        128,
        "global batch size (every member sees this many examples a step); none: the whole "
        "training split, at most 128 (--task regression's default, for small tables)",
        metavar="B", group="optimisation",
    )
    optimizer: str = _field(
        "sgd", "the optimizer; --task regression: adam unless given", choices=OPTIMIZERS,
        group="optimisation",
    )
    learning_rate: float = _field(
        0.1, "peak learning rate; --task regression: 0.01 unless given", metavar="LR",
        group="optimisation",
    )
    momentum: float = _field(0.9, "SGD momentum in [0, 1) (0 for none)", group="optimisation")
    weight_decay: float = _field(
        0.0, "decoupled weight decay (adamw) or L2 added to the SGD/adam update (>= 0)",
        group="optimisation",
    )
    schedule: str = _field(
        "constant",
        "the learning-rate schedule (warmup_cosine warms up for warmup_epochs)",
        choices=SCHEDULES, group="optimisation",
    )
    warmup_epochs: float = _field(
        1.0, "warm-up length of warmup_cosine, in epochs (>= 0)", group="optimisation"
    )
    shuffle: str = _field(
        "shared",
        "shared: all members see the same batches (as in the Flax HOWTO); per-member: "
        "each member its own order",
        choices=SHUFFLES, group="ensemble and mesh",
    )
    seed: int = _field(
        0, "seeds the members' initialisation and the data order", group="run control"
    )
    validation: int | float = _field(
        0,
        "training examples held out for calibration (stratified by class, seeded by --seed, "
        "never trained on; recorded in config.json): a count, or a share in (0, 1) of the "
        "training rows, rounded; 0 for none; --task regression: 0.2 unless given (the run "
        "then calibrates its intervals on them at the end)",
        metavar="N", group="data",
    )
    augment: str = _field(
        "none",
        "on-device augmentation of the training images, per member and step: shift "
        "translates by up to augment_shift pixels (zero fill; MNIST-like), crop_flip pads "
        "by augment_shift, crops at random and mirrors half (CIFAR-like); see "
        "meshensemble.data.augment",
        choices=AUGMENTS, group="data",
    )
    augment_shift: int = _field(
        2, "pixels of --augment: the largest translation each way (>= 0)", metavar="PX",
        group="data",
    )
    bootstrap: bool = _field(
        False,
        "bagging: each member trains on its own resample with replacement of the training "
        "set (drawn once per run, a fresh order of it each epoch; implies per-member batches)",
        group="ensemble and mesh",
    )
    label_smoothing: float = _field(
        0.0, "label smoothing of the cross-entropy in [0, 1) (0: off; it hurts NLL)",
        group="optimisation",
    )
    max_steps: int | None = _field(
        None,
        "stop after this many steps of the whole run and evaluate; the schedule still "
        "spans epochs, so a rerun with a larger value (or none) continues exactly",
        metavar="N",
        inherit=False, group="run control",
    )
    chunk_steps: int | None = _field(
        None,
        "steps per compiled call (K); none: 1 on CPU, a whole epoch elsewhere",
        metavar="K", group="performance",
    )
    stop_within: float = _field(
        10.0,
        "seconds within which SIGTERM/SIGINT and --checkpoint-every are honoured: calls run "
        "at most about half of it (steps per call capped from the measured step time, same "
        "results); 0: whole calls of K steps",
        metavar="SECONDS", group="performance",
    )
    eval_batch_size: int = _field(
        1000, "examples per evaluation call", metavar="B", group="performance"
    )
    eval_every: int | None = _field(
        None,
        "evaluate (test split, and the validation split when held out) and save a checkpoint "
        "every N epochs, and at the end; none: about 20 times a run (every epochs // 20 "
        "epochs, at least every epoch)",
        metavar="N", group="run control",
    )
    streaming: bool = _field(
        False, "deprecated spelling of --input stream (feed host batches, one step per call)",
        group="performance",
    )
    input: str = _field(
        "auto",
        "where batches come from: device (the training set on every device, K steps per "
        "call), stream (each process reads its rows of each batch on the host, Grain "
        "prefetch) or auto (device when the set fits the device memory budget)",
        choices=data_lib.stream.INPUTS, group="performance",
    )
    compile_cache: bool = _field(
        True,
        "use JAX's persistent compilation cache (sets JAX's global cache options for the "
        "process), so a rerun loads its programs instead of compiling them",
        inherit=False, group="performance",
    )
    compile_cache_dir: str | None = _field(
        None,
        "the compilation cache's folder; none: $JAX_COMPILATION_CACHE_DIR, else "
        "~/.cache/meshensemble/jax",
        metavar="DIR",
        inherit=False, group="performance",
    )
    workdir: str = _field(
        "runs/mnist", "where config, metrics, plots and checkpoints go", metavar="DIR",
        group="run control",
    )
    tensorboard: bool = _field(
        False, "also write TensorBoard event files (needs tensorboardX)", group="run control"
    )
    checkpoint: bool = _field(
        True, "save the state at each evaluation (see eval_every) and at the end",
        group="run control",
    )
    checkpoint_every: int | None = _field(
        None,
        "also save every this many steps (a call of K steps ends at each such step)",
        metavar="N", group="run control",
    )
    keep: int = _field(
        3, "how many checkpoints to keep (the newest)", metavar="K", group="run control"
    )
    early_stopping: str | None = _field(
        None,
        "stop once the validation METRIC has not improved for PATIENCE evaluations in a row "
        "(one line says so); METRIC: what the task logs on --validation N, e.g. val_nll, "
        "val_accuracy (regression: val_nll, val_crps)",
        metavar="METRIC:PATIENCE", group="run control",
    )
    keep_best: str | None = _field(
        None,
        "also keep the checkpoint of the best validation METRIC (never deleted by --keep; "
        "named at the end, in config.json and metrics.jsonl); evaluate, predict and export "
        "take it as --checkpoint best",
        metavar="METRIC", group="run control",
    )
    resume: bool = _field(
        True,
        "resume from the workdir's newest good checkpoint when it holds the same run",
        inherit=False, group="run control",
    )
    overwrite: bool = _field(
        False, "start over in a workdir that holds a run (deletes its outputs)", inherit=False,
        group="run control",
    )
    on_nonfinite: str = _field(
        "stop",
        "what a NaN/inf loss or state does: stop raises, keeping the last good checkpoint; "
        "reinit re-initialises only the members that became non-finite, at most 3 times "
        "each per run (then it stops); no NaN/inf state is ever saved",
        choices=ON_NONFINITE, group="run control",
    )
    quiet: bool = _field(
        False, "print only the final table (and a line when resuming or stopping)",
        group="run control",
    )

    def validate(self) -> TrainConfig:
        """Checks every field.

        Returns:
          ``self``, for chaining.

        Raises:
          ValueError: one line naming the bad field, its value and what is allowed.

        Example:
          >>> TrainConfig(members=4).validate().members
          4
        """
        for f in dataclasses.fields(self):
            allowed = field_choices(f)
            value = getattr(self, f.name)
            if allowed is not None and value not in allowed:
                raise ValueError(
                    f"{f.name}={value!r} is not allowed; choose one of {', '.join(allowed)}"
                )
        if self.streaming:
            warnings.warn(
                "streaming=True (--streaming) is deprecated; use input='stream' (--input stream)",
                FutureWarning,
                stacklevel=2,
            )
        for name in ("members", "epochs", "eval_batch_size", "keep", "rank"):
            _positive_int(name, getattr(self, name))
        for name in ("batch_size", "max_steps", "chunk_steps", "checkpoint_every", "eval_every"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed={self.seed!r} must be an integer")
        v = self.validation
        count = isinstance(v, int) and v >= 0
        share = isinstance(v, float) and 0 < v < 1
        if isinstance(v, bool) or not (count or share):
            raise ValueError(
                f"validation={v!r} must be an integer >= 0 (training examples held out) or a "
                "share in (0, 1) of the training rows, e.g. 0.2; use 0 for none"
            )
        _number("learning_rate", self.learning_rate, "a positive number", lambda v: v > 0)
        _number("momentum", self.momentum, "in [0, 1)", lambda v: 0 <= v < 1)
        _number("weight_decay", self.weight_decay, ">= 0", lambda v: v >= 0)
        _number("warmup_epochs", self.warmup_epochs, ">= 0", lambda v: v >= 0)
        _number("label_smoothing", self.label_smoothing, "in [0, 1)", lambda v: 0 <= v < 1)
        make_augment(self.augment, self.augment_shift)
        _number("stop_within", self.stop_within, ">= 0 seconds (0: no cap)", lambda v: v >= 0)
        if self.mesh is not None and not isinstance(self.mesh, str):
            raise ValueError(
                f"mesh={self.mesh!r} must be a string like 'ensemble=4,data=2' (or None: every "
                "device)"
            )
        if self.mesh:
            parse_mesh(self.mesh)
        task_class(self.task)  # a registered name or module:Class, else one line
        self._check_watches()
        if self.backbone and hasattr(get_model(self.model), "member_layout"):
            raise ValueError(
                f"backbone={self.backbone!r} puts adapters on a plain model, and "
                f"model={self.model!r} has a member layout of its own; use e.g. --model mlp"
            )
        if not is_spec(self.model) and self.model not in MODEL_REGISTRY:
            raise ValueError(
                f"model={self.model!r} is unknown; choose one of {', '.join(MODEL_REGISTRY)}, "
                "or give your Flax module as module:Class"
            )
        if self.conv != "auto" and self.model not in CONV_MODELS:
            raise ValueError(
                f"conv={self.conv!r} applies to the models {', '.join(CONV_MODELS)}, not "
                f"model={self.model!r}; leave conv at 'auto'"
            )
        return self


    def _check_watches(self) -> None:
        """``early_stopping`` and ``keep_best`` need a validation split (and checkpoints)."""
        if self.early_stopping is not None:
            parse_early_stopping(self.early_stopping)
        for name in ("early_stopping", "keep_best"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name}={value!r} must name a validation metric, e.g. val_nll")
            if value is not None and not self.validation:
                raise ValueError(
                    f"{name}={value!r} watches the validation split, and validation=0 holds "
                    "none out; add --validation N (e.g. --validation 5000)"
                )
        if self.keep_best is not None and not self.checkpoint:
            raise ValueError(
                f"keep_best={self.keep_best!r} keeps a checkpoint, and --no-checkpoint saves "
                "none; drop one of them"
            )

    def validation_count(self, num_train: int) -> int:
        """The training examples the run holds out of ``num_train``: ``validation`` itself, or
        a share of them, ``floor(share * num_train + 0.5)``.

        Example:
          >>> TrainConfig(validation=0.2).validation_count(354)   # 20% of 354 rows
          71
        """
        v = self.validation
        return math.floor(v * num_train + 0.5) if isinstance(v, float) else int(v)


def _positive_int(name: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name}={value!r} must be a positive integer")


def _number(name: str, value: Any, what: str, ok: Callable[[float], bool]) -> None:
    good = isinstance(value, int | float) and not isinstance(value, bool)
    if not (good and math.isfinite(value) and ok(value)):
        raise ValueError(f"{name}={value!r} must be {what}")


def config_field(name: str) -> dataclasses.Field:
    """The :class:`TrainConfig` field called ``name`` (for flags that reuse its metadata).

    Raises:
      KeyError: no such field.

    Example:
      >>> config_field("mesh").default
      ''
    """
    for f in dataclasses.fields(TrainConfig):
        if f.name == name:
            return f
    raise KeyError(f"TrainConfig has no field {name!r}")


def inherited_fields() -> tuple[str, ...]:
    """Fields a resumed command takes from the workdir's ``config.json`` when not given.

    ``max_steps``, ``resume`` and ``overwrite`` belong to one invocation only.

    Example:
      >>> "max_steps" in inherited_fields()
      False
    """
    return tuple(f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("inherit"))


TrainConfig.__doc__ = attribute_docs(TrainConfig)


def model_name(cfg: TrainConfig, sample: Any = None) -> str:
    """The member model's name: ``cfg.model``, or ``mlp`` for the default ``cnn`` on inputs
    that are not images (``[N, F]`` features).

    Example:
      >>> model_name(TrainConfig(), np.zeros((1, 10), np.float32))
      'mlp'
    """
    flat = sample is not None and np.ndim(sample) < 4
    return "mlp" if cfg.model == TrainConfig.model and flat else cfg.model


def input_transform(sample: Any, normalization: Any = None) -> Callable[[Any], Any] | None:
    """What the members apply to their inputs on device: the run's normalisation.

    A recorded normalisation (:func:`meshensemble.data.as_normalization`: per-channel
    statistics of colour images, per-feature ones of float features) is applied as
    :meth:`~meshensemble.data.Normalization.apply`; without one, integer pixels (one-channel
    images, MNIST) are scaled to ``[0, 1]`` (:func:`meshensemble.data.normalize`), float
    features go in as they are.

    Args:
      sample: an input batch (its dtype decides), or None (images).
      normalization: a :class:`~meshensemble.data.Normalization`, its record, the older
        ``{"mean", "std"}`` feature statistics, or None.

    Returns:
      ``fn(x) -> x`` (jit-able), or None.

    Example:
      >>> fn = input_transform(np.zeros((1, 2), np.float32), {"mean": [1, 2], "std": [2, 2]})
      >>> np.asarray(fn(np.ones((1, 2), np.float32))).tolist()
      [[0.0, -0.5]]
    """
    norm = data_lib.as_normalization(normalization)
    if norm is not None:
        return norm.apply
    if sample is None or np.issubdtype(np.dtype(sample.dtype), np.integer):
        return data_lib.normalize
    return None


def build_ensemble(
    cfg: TrainConfig,
    mesh: Mesh,
    num_train: int,
    sample: Any = None,
    *,
    task: Task | None = None,
    input_stats: Any = None,
    steps_per_epoch: int | None = None,
) -> Ensemble:
    """The :class:`meshensemble.Ensemble` a run's config describes, on ``mesh``.

    The learning-rate schedule spans ``cfg.epochs`` epochs of ``num_train`` examples (not
    ``max_steps``), so a run resumed with a larger ``max_steps`` continues exactly, and
    evaluation rebuilds the same optimizer-state structure. The member model is
    :func:`meshensemble.models.build_model` of the config's model for the inputs' shape
    and the task's output width.

    Args:
      cfg: the run's config.
      mesh: the mesh to run on (it may differ from the one the run was trained on).
      num_train: training examples, for the steps per epoch.
      sample: inputs of the data's shape (``images[:1]``): the inputs' dtype chooses the
        input transform (:func:`input_transform`), their shape the model's input, and
        ``ens.state_spec`` of sharded members follows it; default None (MNIST's images).
      task: the run's task, set up for its data (default ``cfg.task``'s class with the
        config's options, e.g. ``label_smoothing``); its output width sets the model's.
      input_stats: the run's input normalisation (:func:`input_transform` takes it).
      steps_per_epoch: the run's, when recorded (default ``num_train // batch_size``).

    Returns:
      The ensemble; with the model's member layout (``member_layout()``: ``be_*``), or
      LoRA adapters on ``cfg.backbone``'s architecture with their layout (the backbone's
      values come with ``init``).

    Raises:
      meshensemble.UsageError: the model cannot take the inputs (one line).

    Example:
      >>> cfg = me.TrainConfig(model="mlp", members=8, batch_size=128)
      >>> ens = build_ensemble(cfg, me.make_mesh(ensemble=8), num_train=60000)
      >>> ens.num_members, ens.input_transform is not None
      (8, True)
    """
    steps = steps_per_epoch or max(num_train // (cfg.batch_size or num_train or 1), 1)
    if task is None:  # the config's task with its options (no data: no statistics)
        task = task_class(cfg.task)().for_data(None, dataclasses.asdict(cfg))
    name = model_name(cfg, sample)
    shape = data_lib.IMAGE_SHAPE if sample is None else tuple(np.shape(sample)[1:])
    width = task.output_width()
    width = getattr(get_model(name), "num_classes", 10) if width is None else width
    fields = {"conv": cfg.conv} if name in CONV_MODELS else {}
    model = build_model(name, shape, int(width), trace=False, **fields)
    model = lora(model, rank=cfg.rank) if cfg.backbone else model
    layout = model.member_layout() if hasattr(model, "member_layout") else {}
    return Ensemble(
        model,
        make_optimizer(cfg, cfg.epochs * steps, steps),
        cfg.members,
        mesh,
        backend=cfg.backend,
        member_strategy=cfg.member_strategy,
        input_transform=input_transform(sample, input_stats),
        compute_dtype=PRECISIONS[cfg.precision],
        augment=make_augment(cfg.augment, cfg.augment_shift),
        shard_members=cfg.shard_members,
        task=task,
        sample=sample,
        **layout,
    )
