"""Training: the run's configuration, the on-device loop, checkpoints and outputs.

Example:
  >>> result = me.training.train(me.TrainConfig(epochs=1, workdir="runs/x"))
"""

from meshensemble.training import checkpoint as checkpoint
from meshensemble.training.loop import *  # noqa: F401,F403  (split into modules next)
from meshensemble.training.loop import (
    CONFIG_FILE as CONFIG_FILE,
)
from meshensemble.training.loop import (
    METRICS_FILE as METRICS_FILE,
)
from meshensemble.training.loop import (
    OPTIMIZERS as OPTIMIZERS,
)
from meshensemble.training.loop import (
    PRECISIONS as PRECISIONS,
)
from meshensemble.training.loop import (
    SCHEDULES as SCHEDULES,
)
from meshensemble.training.loop import (
    SHUFFLES as SHUFFLES,
)
from meshensemble.training.loop import (
    NonFiniteError as NonFiniteError,
)
from meshensemble.training.loop import (
    RunWriter as RunWriter,
)
from meshensemble.training.loop import (
    TrainConfig as TrainConfig,
)
from meshensemble.training.loop import (
    TrainResult as TrainResult,
)
from meshensemble.training.loop import (
    build_ensemble as build_ensemble,
)
from meshensemble.training.loop import (
    default_chunk_steps as default_chunk_steps,
)
from meshensemble.training.loop import (
    default_mesh_shape as default_mesh_shape,
)
from meshensemble.training.loop import (
    final_table as final_table,
)
from meshensemble.training.loop import (
    make_optimizer as make_optimizer,
)
from meshensemble.training.loop import (
    train as train,
)
