"""Training: the run's configuration, the on-device loop, checkpoints and outputs.

Modules: :mod:`~meshensemble.training.config` (:class:`TrainConfig` and what is built
from it), :mod:`~meshensemble.training.loop` (:func:`train`),
:mod:`~meshensemble.training.feeder` (the steps' data),
:mod:`~meshensemble.training.guards` (signals, non-finite losses),
:mod:`~meshensemble.training.pacing` (steps per call, so a stop comes within seconds),
:mod:`~meshensemble.training.identity` (what defines a run, for resuming),
:mod:`~meshensemble.training.outputs` (files and printed lines),
:mod:`~meshensemble.training.checkpoint` and :mod:`~meshensemble.training.bundle` (the
state's structure checks and the inference bundle), :mod:`~meshensemble.training.rundata`
(the run's data, checked by its task), :mod:`~meshensemble.training.restore` (a finished
run rebuilt and restored: what evaluate, predict and export take). One loop for every task.

Example:
  >>> cfg = me.TrainConfig(model="mlp", members=4, epochs=1, batch_size=32, source="npz",
  ...                      data_file="mnist.npz", workdir="runs/x", quiet=True)
  >>> result = me.training.train(cfg)   # quiet: only the final table
  accuracy nll brier ece
  ...
  >>> result.history[-1]["step"], result.ensemble.num_members
  (3, 4)
"""

from meshensemble.training import checkpoint as checkpoint
from meshensemble.training import restore as restore
from meshensemble.training import rundata as rundata
from meshensemble.training import setup as setup
from meshensemble.training import tuning as tuning
from meshensemble.training.config import CONFIG_FILE as CONFIG_FILE
from meshensemble.training.config import CONV_MODELS as CONV_MODELS
from meshensemble.training.config import METRICS_FILE as METRICS_FILE
from meshensemble.training.config import ON_NONFINITE as ON_NONFINITE
from meshensemble.training.config import OPTIMIZERS as OPTIMIZERS
from meshensemble.training.config import PRECISIONS as PRECISIONS
from meshensemble.training.config import SCHEDULES as SCHEDULES
from meshensemble.training.config import SHUFFLES as SHUFFLES
from meshensemble.training.config import TrainConfig as TrainConfig
from meshensemble.training.config import build_ensemble as build_ensemble
from meshensemble.training.config import default_chunk_steps as default_chunk_steps
from meshensemble.training.config import default_mesh_shape as default_mesh_shape
from meshensemble.training.config import make_optimizer as make_optimizer
from meshensemble.training.config import with_task_defaults as with_task_defaults
from meshensemble.training.feeder import Feeder as Feeder
from meshensemble.training.guards import NonFiniteError as NonFiniteError
from meshensemble.training.identity import RUN_FIELDS as RUN_FIELDS
from meshensemble.training.loop import LoopPosition as LoopPosition
from meshensemble.training.loop import TrainResult as TrainResult
from meshensemble.training.loop import run_keys as run_keys
from meshensemble.training.loop import train as train
from meshensemble.training.loop import use_compilation_cache as use_compilation_cache
from meshensemble.training.outputs import OutputError as OutputError
from meshensemble.training.outputs import RunWriter as RunWriter

__all__ = [
    "CONFIG_FILE",
    "CONV_MODELS",
    "METRICS_FILE",
    "ON_NONFINITE",
    "OPTIMIZERS",
    "PRECISIONS",
    "RUN_FIELDS",
    "SCHEDULES",
    "SHUFFLES",
    "Feeder",
    "LoopPosition",
    "NonFiniteError",
    "OutputError",
    "RunWriter",
    "TrainConfig",
    "TrainResult",
    "build_ensemble",
    "checkpoint",
    "default_chunk_steps",
    "default_mesh_shape",
    "make_optimizer",
    "with_task_defaults",
    "restore",
    "rundata",
    "setup",
    "run_keys",
    "train",
    "tuning",
    "use_compilation_cache",
]
