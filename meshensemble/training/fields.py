"""The metadata a :class:`~meshensemble.TrainConfig` field carries: help, choices, group.

Each field is made by :func:`config_field_of` (``dataclasses.field`` with metadata); the
``meshensemble train`` flags, their ``--help`` groups and the class docstring's attribute
list are all generated from that metadata, so they cannot drift apart.

Example:
  >>> f = next(f for f in dataclasses.fields(me.TrainConfig) if f.name == "members")
  >>> field_group(f), field_help(f)
  ('ensemble and mesh', 'ensemble size')
"""

from __future__ import annotations

import dataclasses
import inspect
import textwrap
from collections.abc import Callable, Sequence
from typing import Any

GROUPS = (
    "data",
    "model",
    "ensemble and mesh",
    "optimisation",
    "run control",
    "multi-host",
    "performance",
)
"""The ``--help`` groups of ``meshensemble train``, in order; every field names one."""


def config_field_of(
    default: Any,
    help: str | Callable[[], str],
    *,
    group: str,
    choices: Sequence[str] | Callable[[], Sequence[str]] | None = None,
    metavar: str | None = None,
    inherit: bool = True,
) -> Any:
    """A ``dataclasses.field`` carrying its documentation (what ``TrainConfig`` is made of).

    Args:
      default: the default value.
      help: one sentence (no trailing period) for the docstring and the flag, or a
        function returning it (read when used, e.g. to list a registry extended later).
      group: the ``--help`` group, one of :data:`GROUPS`.
      choices: the allowed values, or a function returning them (read when used, so a
        registry extended later is seen).
      metavar: the flag's placeholder.
      inherit: whether a command resuming a run takes the value from the workdir's
        ``config.json`` when the command does not give it (False: per invocation).

    Returns:
      The ``dataclasses.field``.

    Raises:
      ValueError: ``group`` is not one of :data:`GROUPS`.

    Example:
      >>> config_field_of(3, "how many", group="run control").metadata["group"]
      'run control'
    """
    if group not in GROUPS:
        raise ValueError(f"group={group!r} is not one of {', '.join(GROUPS)}")
    meta = {"help": help, "choices": choices, "metavar": metavar, "inherit": inherit,
            "group": group}  # fmt: skip
    return dataclasses.field(default=default, metadata=meta)


def field_help(f: dataclasses.Field) -> str:
    """A :class:`~meshensemble.TrainConfig` field's help text (one sentence, no default).

    Args:
      f: one of ``dataclasses.fields(TrainConfig)``.

    Returns:
      The text from the field's metadata.

    Example:
      >>> field_help(next(f for f in dataclasses.fields(me.TrainConfig) if f.name == "members"))
      'ensemble size'
    """
    return str(_resolved(f.metadata.get("help", "")))


def field_group(f: dataclasses.Field) -> str | None:
    """The ``--help`` group of a :class:`~meshensemble.TrainConfig` field (None: none given).

    Example:
      >>> field_group(next(f for f in dataclasses.fields(me.TrainConfig) if f.name == "seed"))
      'run control'
    """
    return f.metadata.get("group")


def field_choices(f: dataclasses.Field) -> tuple[str, ...] | None:
    """A field's allowed values, or None when any value of its type goes.

    Example:
      >>> field_choices(next(f for f in dataclasses.fields(me.TrainConfig)
      ...                    if f.name == "shuffle"))
      ('shared', 'per-member')
    """
    choices = _resolved(f.metadata.get("choices"))
    return None if choices is None else tuple(choices)


def _resolved(value: Any) -> Any:
    """A metadata value, or what it returns when it is a callable (built when asked)."""
    return value() if callable(value) else value


def attribute_docs(cls: type) -> str:
    """``cls``'s docstring with an ``Attributes:`` list generated from its fields' metadata.

    Args:
      cls: a dataclass made of :func:`config_field_of` fields.

    Returns:
      The docstring.

    Example:
      >>> "Attributes:" in attribute_docs(me.TrainConfig)
      True
    """
    lines = [inspect.cleandoc(cls.__doc__ or "").split("\n\nAttributes:")[0], "", "Attributes:"]
    for f in dataclasses.fields(cls):
        text = field_help(f)
        choices = field_choices(f)
        if choices is not None:
            text += f"; one of {', '.join(repr(c) for c in choices)}"
        text += f" (default ``{f.default!r}``)."
        wrapped = textwrap.wrap(f"{f.name}: {text}", 88, subsequent_indent="    ")
        lines += ["  " + w for w in wrapped]
    return "\n".join(lines) + "\n"
