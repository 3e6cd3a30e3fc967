"""meshensemble: deep ensembles on a JAX device mesh.

Members' parameters and optimizer state are stacked on a leading axis and sharded over
the mesh axis ``ensemble``; batches are split over ``data``; steps run under
``jax.shard_map`` (or the legacy ``jax.pmap`` backend).
"""

from meshensemble import conv as conv
from meshensemble import data as data
from meshensemble import distributed as distributed
from meshensemble import metrics as metrics
from meshensemble import models as models
from meshensemble import train as train
from meshensemble.backends import BACKENDS as BACKENDS
from meshensemble.checkpoint import Checkpointer as Checkpointer
from meshensemble.checkpoint import CheckpointError as CheckpointError
from meshensemble.checkpoint import checkpoint_manager as checkpoint_manager
from meshensemble.checkpoint import extract_members as extract_members
from meshensemble.checkpoint import load_inference as load_inference
from meshensemble.checkpoint import restore_checkpoint as restore_checkpoint
from meshensemble.checkpoint import save_checkpoint as save_checkpoint
from meshensemble.checkpoint import save_inference as save_inference
from meshensemble.ensemble import STRATEGIES as STRATEGIES
from meshensemble.ensemble import Ensemble as Ensemble
from meshensemble.ensemble import default_strategy as default_strategy
from meshensemble.mesh import AXES as AXES
from meshensemble.mesh import DATA as DATA
from meshensemble.mesh import ENSEMBLE as ENSEMBLE
from meshensemble.mesh import batch_sharding as batch_sharding
from meshensemble.mesh import make_mesh as make_mesh
from meshensemble.mesh import member_sharding as member_sharding
from meshensemble.mesh import members_per_device as members_per_device
from meshensemble.mesh import parse_mesh as parse_mesh
from meshensemble.mesh import replicated_sharding as replicated_sharding
from meshensemble.mesh import use_fake_cpu_devices as use_fake_cpu_devices
from meshensemble.model import FunctionModel as FunctionModel
from meshensemble.model import LinenModel as LinenModel
from meshensemble.model import Model as Model
from meshensemble.model import NNXModel as NNXModel
from meshensemble.model import as_model as as_model
from meshensemble.steps import EnsembleState as EnsembleState
from meshensemble.steps import softmax_cross_entropy as softmax_cross_entropy
from meshensemble.train import TrainConfig as TrainConfig
from meshensemble.train import TrainResult as TrainResult

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "BACKENDS",
    "CheckpointError",
    "Checkpointer",
    "DATA",
    "ENSEMBLE",
    "Ensemble",
    "EnsembleState",
    "FunctionModel",
    "LinenModel",
    "Model",
    "NNXModel",
    "STRATEGIES",
    "TrainConfig",
    "TrainResult",
    "as_model",
    "batch_sharding",
    "checkpoint_manager",
    "conv",
    "data",
    "default_strategy",
    "distributed",
    "extract_members",
    "load_inference",
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
    "softmax_cross_entropy",
    "train",
    "use_fake_cpu_devices",
]
