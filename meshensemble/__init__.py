"""meshensemble: deep ensembles on a JAX device mesh.

Members' parameters and optimizer state are stacked on a leading axis and sharded over
the mesh axis ``ensemble``; batches are split over ``data``; steps run under
``jax.shard_map`` (or the legacy ``jax.pmap`` backend).
"""

import warnings as _warnings

from meshensemble import startup as startup  # first: holds a Ctrl-C while JAX imports

# isort: split
from meshensemble import calibration as calibration
from meshensemble import core as core
from meshensemble import data as data
from meshensemble import errors as errors
from meshensemble import evaluation as evaluation
from meshensemble import metrics as metrics
from meshensemble import models as models
from meshensemble import numerics as numerics
from meshensemble import runtime as runtime
from meshensemble import serving as serving
from meshensemble import tasks as tasks
from meshensemble import testing as testing
from meshensemble import training as training
from meshensemble.core.adapters import FunctionModel as FunctionModel
from meshensemble.core.adapters import LinenModel as LinenModel
from meshensemble.core.adapters import Model as Model
from meshensemble.core.adapters import NNXModel as NNXModel
from meshensemble.core.adapters import as_model as as_model
from meshensemble.core.backends import BACKENDS as BACKENDS
from meshensemble.core.ensemble import STRATEGIES as STRATEGIES
from meshensemble.core.ensemble import Ensemble as Ensemble
from meshensemble.core.ensemble import default_strategy as default_strategy
from meshensemble.core.mesh import AXES as AXES
from meshensemble.core.mesh import DATA as DATA
from meshensemble.core.mesh import ENSEMBLE as ENSEMBLE
from meshensemble.core.mesh import MODEL as MODEL
from meshensemble.core.mesh import batch_sharding as batch_sharding
from meshensemble.core.mesh import make_mesh as make_mesh
from meshensemble.core.mesh import member_sharding as member_sharding
from meshensemble.core.mesh import members_per_device as members_per_device
from meshensemble.core.mesh import parse_mesh as parse_mesh
from meshensemble.core.mesh import replicated_sharding as replicated_sharding
from meshensemble.core.mesh import use_fake_cpu_devices as use_fake_cpu_devices
from meshensemble.core.state import EnsembleState as EnsembleState
from meshensemble.core.state import SharedState as SharedState
from meshensemble.core.steps import softmax_cross_entropy as softmax_cross_entropy
from meshensemble.errors import DataError as DataError
from meshensemble.errors import Interrupted as Interrupted
from meshensemble.errors import MeshEnsembleError as MeshEnsembleError
from meshensemble.errors import RunFailedError as RunFailedError
from meshensemble.errors import UsageError as UsageError
from meshensemble.models import conv as conv
from meshensemble.runtime import distributed as distributed
from meshensemble.serving import Predictor as Predictor
from meshensemble.serving import load_predictor as load_predictor
from meshensemble.training import TrainConfig as TrainConfig
from meshensemble.training import TrainResult as TrainResult
from meshensemble.training import checkpoint as checkpoint
from meshensemble.training.checkpoint import Checkpointer as Checkpointer
from meshensemble.training.checkpoint import CheckpointError as CheckpointError
from meshensemble.training.checkpoint import checkpoint_manager as checkpoint_manager
from meshensemble.training.checkpoint import extract_members as extract_members
from meshensemble.training.checkpoint import load_inference as load_inference
from meshensemble.training.checkpoint import restore_checkpoint as restore_checkpoint
from meshensemble.training.checkpoint import save_checkpoint as save_checkpoint
from meshensemble.training.checkpoint import save_inference as save_inference

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "BACKENDS",
    "CheckpointError",
    "Checkpointer",
    "DATA",
    "DataError",
    "ENSEMBLE",
    "MODEL",
    "Ensemble",
    "EnsembleState",
    "SharedState",
    "Interrupted",
    "MeshEnsembleError",
    "RunFailedError",
    "UsageError",
    "FunctionModel",
    "LinenModel",
    "Model",
    "NNXModel",
    "Predictor",
    "STRATEGIES",
    "TrainConfig",
    "TrainResult",
    "as_model",
    "evaluation",
    "numerics",
    "runtime",
    "calibration",
    "batch_sharding",
    "checkpoint_manager",
    "conv",
    "core",
    "data",
    "default_strategy",
    "distributed",
    "errors",
    "extract_members",
    "load_inference",
    "load_predictor",
    "make_mesh",
    "member_sharding",
    "members_per_device",
    "metrics",
    "models",
    "parse_mesh",
    "replicated_sharding",
    "restore_checkpoint",
    "save_checkpoint",
    "save_inference",
    "serving",
    "softmax_cross_entropy",
    "tasks",
    "testing",
    "training",
    "checkpoint",
    "use_fake_cpu_devices",
]


def __getattr__(name: str):
    """Deprecated aliases of renamed public names (they keep working, with a warning)."""
    if name == "train":
        _warnings.warn(
            "meshensemble.train is now meshensemble.training (me.training.train, "
            "me.TrainConfig); the old name will be removed",
            DeprecationWarning,
            stacklevel=2,
        )
        return training
    raise AttributeError(f"module 'meshensemble' has no attribute {name!r}")
