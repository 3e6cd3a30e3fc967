"""Tasks: the open :class:`Task` protocol and its two implementations.

``me.tasks.Task`` (defined in :mod:`meshensemble.core.tasks`) is what the one engine asks
about everything it trains; :class:`Classification` (integer labels, the members' mean
softmax) and :class:`Regression` (Gaussian members, their mixture) implement it, and so
can a user's subclass written anywhere (docs/tasks.md): register it with
:func:`register` to name it ``--task NAME``, or give ``--task module:Class``.

Example:
  >>> me.tasks.task_names()[:2]
  ('classification', 'regression')
  >>> isinstance(me.tasks.Regression(targets=1), me.tasks.Task)
  True
"""

from meshensemble.core.tasks import EvalSums as EvalSums
from meshensemble.core.tasks import Reducer as Reducer
from meshensemble.core.tasks import Task as Task
from meshensemble.core.tasks import check_task as check_task
from meshensemble.core.tasks import metric_specs as metric_specs
from meshensemble.core.tasks import register as register
from meshensemble.core.tasks import task_class as task_class
from meshensemble.core.tasks import task_names as task_names
from meshensemble.tasks.classification import Classification as Classification
from meshensemble.tasks.regression import Regression as Regression

__all__ = [
    "Classification",
    "EvalSums",
    "Reducer",
    "Regression",
    "Task",
    "check_task",
    "metric_specs",
    "register",
    "task_class",
    "task_names",
]
