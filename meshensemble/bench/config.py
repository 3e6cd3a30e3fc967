"""What the benchmark runs: its config, the case groups, and the cases' specs (data only).

:class:`BenchConfig`'s fields are the single source of the ``meshensemble bench`` flags:
a field whose metadata has a ``help`` is a flag (``batch_size`` -> ``--batch-size``).
:func:`resolve` turns given values into a checked config; :func:`plan` turns a config
into the named :class:`Case` list, each with the :class:`Spec` of what it computes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

from meshensemble.bench.suite import SUITES, suite_defaults
from meshensemble.core.ensemble import default_strategy
from meshensemble.models.conv import default_conv
from meshensemble.models.zoo import REGISTRY
from meshensemble.runtime import storage
from meshensemble.training import default_chunk_steps, default_mesh_shape

GROUPS: dict[str, tuple[str, ...]] = {
    "matmul": ("matmul_fp32", "matmul_bf16"),
    "howto": ("howto",),
    "backends": ("ens_pmap", "ens_shard_map"),
    "user": ("ens_user",),
    "chunk": ("chunk_default", "chunk_k1", "chunk_k8", "chunk_epoch"),
    "sequential": ("sequential",),
    "stream": ("stream",),
    "members": ("mpd_1", "mpd_2", "mpd_4", "mpd_8", "mpd_16", "mpd_32"),
    "mesh": ("mesh_1", "mesh_2", "mesh_4", "mesh_8"),
    "strategy": ("strategy_vmap", "strategy_loop"),
    "reform": (
        "reform_base_loop",
        "reform_im2col_vmap",
        "reform_im2col_loop",
        "reform_im2col_sequential",
    ),
    "scan": ("scan_base_k1", "scan_base_k8", "scan_canonical_k1", "scan_canonical_k8"),
    "precision": ("precision_fp32", "precision_bf16"),
    "time_to_accuracy": ("time_to_accuracy",),
}
"""Case groups of ``--cases``, in the order the cases run and print.

``time_to_accuracy`` is not timed round-robin: it trains in two fresh processes before
the other cases start (see :mod:`meshensemble.bench.accuracy`)."""

TIME_TO_ACCURACY = "time_to_accuracy"
"""The case (and group) name of the time-to-accuracy measurement."""

MATMUL_SIZES = {"cpu": 2048}
"""Side of the yardstick matmuls per platform when ``--matmul-size`` is not given;
other platforms (GPU, TPU): :data:`MATMUL_SIZE_ACCELERATOR`."""

MATMUL_SIZE_ACCELERATOR = 8192
"""Side of the yardstick matmuls on an accelerator: large enough to reach its peak."""

MODELS = ("cnn", "mlp")
"""The main models a user picks (the tiny configuration runs ``"mlp32"``)."""


def _flag(default: Any, help: str, **extra: Any) -> Any:
    """A flag's field: its default, and its ``help`` (and argparse extras) as metadata."""
    return dataclasses.field(default=default, metadata={"help": help, **extra})


@dataclasses.dataclass
class BenchConfig:
    """What ``meshensemble bench`` runs; fields with a ``help`` in their metadata are flags.

    Attributes:
      members: ensemble size of the main cases.
      suite: a suite of :data:`meshensemble.bench.suite.SUITES` (it sets ``cases``,
        ``members_per_device``, ``repeats`` and ``case_budget``; ``out`` is then a folder),
        or None.
      conv_members: ensemble size of the ``reform`` and ``scan`` cases (None: ``members``).
      batch_size: examples per member per step.
      repeats: timed rounds (each case's time is the median over them).
      warmup: untimed rounds after compilation (each case also makes one untimed first
        call, compiling, unless it runs an ahead-of-time compiled program).
      cases: case and group names to run; empty for all.
      tiny: the CI configuration (see :func:`resolve`).
      data_file: a Keras-layout MNIST ``.npz``; else the embedded sample, else synthetic.
      model: ``"cnn"`` or ``"mlp"`` (the tiny configuration's default: ``MLP((32,))``).
      out: the JSON file to write (with ``suite``: the folder of the suite's files).
      plot: a PNG of time per step against members per device, or None.
      epoch_cap: the most steps ``chunk_epoch`` runs per call (None: a whole epoch).
      case_budget: stop timing a case once its timed calls add up to this many seconds
        (it keeps at least one sample); None for no limit.
      matmul_size: side of the square matmuls of the ``matmul`` cases (None: per
        platform, :func:`matmul_size`).
      members_per_device: the ``mpd_*`` sizes.
      seed: seeds initialisation and batch order.
      target_accuracy: the test ensemble accuracy ``time_to_accuracy`` trains to.
      accuracy_epochs: the most epochs ``time_to_accuracy`` trains before giving up.

    Example:
      >>> cfg = BenchConfig(members=4, cases=("backends",))
      >>> cfg.members, cfg.batch_size, cfg.tiny
      (4, 128, False)
    """

    members: int = _flag(8, "ensemble size (default 8)")
    suite: str | None = _flag(
        None,
        "run a suite: accelerator = every accelerator target (matmuls, HOWTO, epoch, members "
        "per device, time to accuracy) into --out DIR/accelerator.json and accelerator.md "
        "(see meshensemble.bench.suite)",
        choices=tuple(SUITES),
    )
    conv_members: int | None = None
    batch_size: int = _flag(128, "examples per member per step (default 128; tiny 32)")
    repeats: int = _flag(5, "timed rounds (default 5; tiny 2)")
    warmup: int = _flag(1, "untimed rounds after compiling (default 1)")
    cases: tuple[str, ...] = _flag(
        (), f"comma list of cases or groups ({', '.join(GROUPS)}); default all"
    )
    tiny: bool = _flag(False, "tiny configuration for CI (< 60 s)")
    data_file: str | None = _flag(None, "a Keras-layout MNIST .npz (default: embedded sample)")
    model: str = _flag("cnn", "model (default cnn; tiny: MLP((32,)))", choices=MODELS)
    out: str = _flag("bench.json", "JSON results file (default bench.json); with --suite: a folder")
    plot: str | None = _flag(
        None, "PNG of time per step against members per device", metavar="FILE"
    )
    epoch_cap: int | None = _flag(None, "most steps per call of chunk_epoch (default: an epoch)")
    case_budget: float | None = _flag(None, "stop timing a case after S seconds", metavar="S")
    matmul_size: int | None = _flag(
        None,
        "side of the fp32 and bf16 yardstick matmuls (default 8192 on GPU/TPU, 2048 on CPU; "
        "tiny 256)",
    )
    layouts: tuple[str, ...] = _flag(
        (),
        "comma list of zoo models (e.g. cnn,vit) whose 8-member ensemble is also measured on "
        "E x D x P layouts: state bytes per device, compile and step time (8 devices; default "
        "none)",
        metavar="MODELS",
    )
    members_per_device: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    seed: int = _flag(0, "seed of initialisation and batch order (default 0)")
    target_accuracy: float = _flag(
        0.993, "test ensemble accuracy time_to_accuracy trains to (default 0.993; tiny 0.5)"
    )
    accuracy_epochs: int = _flag(
        10, "most epochs time_to_accuracy trains (default 10; tiny 2)", metavar="N"
    )


TINY = {
    "model": "mlp32",
    "members": 4,
    "conv_members": 2,
    "batch_size": 32,
    "repeats": 2,
    "epoch_cap": 8,
    "matmul_size": 256,
    "members_per_device": (1, 2, 4),
    "target_accuracy": 0.5,
    "accuracy_epochs": 2,
}
"""The defaults that ``tiny=True`` changes (given values still override them)."""

_POSITIVE = (
    "members",
    "conv_members",
    "batch_size",
    "repeats",
    "epoch_cap",
    "matmul_size",
    "accuracy_epochs",
)
_CHECKS = (
    *((name, lambda v: v < 1, "must be a positive integer") for name in _POSITIVE),
    ("warmup", lambda v: v < 0, "must be 0 or more"),
    ("target_accuracy", lambda v: not 0 < v <= 1, "must be in (0, 1]"),
    ("case_budget", lambda v: not v > 0, "must be a positive number"),
)
"""The checked fields: name, whether a given value is bad, what it must be."""


def known_cases() -> tuple[str, ...]:
    """Every case name, in the order the cases run.

    Returns:
      The names of all groups' cases.

    Example:
      >>> known_cases()[:2]
      ('matmul_fp32', 'matmul_bf16')
    """
    return tuple(c for cases in GROUPS.values() for c in cases)


def resolve(tiny: bool = False, **given: Any) -> BenchConfig:
    """Builds a checked :class:`BenchConfig` from given values (None means "the default").

    ``tiny=True`` changes the defaults (given values still override them, see
    :data:`TINY`): model ``MLP((32,))``, 4 members (2 in the conv cases), batch 32,
    2 repeats, members per device up to 4, at most 1,024 training examples, chunks
    capped at 8 steps, 256 x 256 matmuls, and a ``time_to_accuracy`` of at most 2
    epochs of ``MLP((128,))`` to 50 % test accuracy.

    Args:
      tiny: the CI configuration.
      **given: :class:`BenchConfig` field values; ``cases`` may be a comma-separated
        string or a sequence of case and group names (empty: all cases).

    Returns:
      The config.

    Raises:
      ValueError: an unknown field, a value out of range or an unknown case name (one
        line naming the value and its flag).

    Example:
      >>> resolve(tiny=True, cases="howto,backends").members
      4
    """
    fields = {f.name for f in dataclasses.fields(BenchConfig)}
    unknown = sorted(set(given) - fields)
    if unknown:
        raise ValueError(f"bench: unknown setting(s) {', '.join(unknown)}; known: {sorted(fields)}")
    values: dict[str, Any] = dict(TINY) if tiny else {}
    if given.get("suite") is not None:  # the suite's settings, then the given flags
        members = given.get("members") or values.get("members", 8)
        values.update(suite_defaults(given["suite"], members, tiny))
        values["out"] = "bench-" + given["suite"]
    values.update({k: v for k, v in given.items() if v is not None})
    for name, bad, must in _CHECKS:
        value = values.get(name)
        if value is not None and bad(value):
            raise ValueError(f"--{name.replace('_', '-')} {value} {must}")
    if values.get("model", "cnn") not in (*MODELS, "mlp32"):
        raise ValueError(f"--model {values['model']}: choose from {', '.join(MODELS)}")
    if values.get("suite") and storage.isfile(values["out"]):
        raise ValueError(
            f"--out {values['out']} is a file; --suite writes a folder of files: name a folder"
        )
    if values.get("cases"):  # empty: all cases
        values["cases"] = _cases(values["cases"])
    if values.get("layouts"):
        values["layouts"] = _layout_models(values["layouts"])
    return BenchConfig(tiny=tiny, **values)


def _names(flag: str, given: str | Sequence[str], known: Any, what: str, choose: str):
    """The names of a comma list flag; one line naming the unknown ones and the choices."""
    text = given if isinstance(given, str) else ",".join(given)
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise ValueError(
            f"{flag} {text}: unknown {what}{', '.join(unknown) or '(empty list)'}; {choose}"
        )
    return names


def _cases(cases: str | Sequence[str]) -> tuple[str, ...]:
    known = set(GROUPS) | set(known_cases())
    choose = f"choose from the groups {', '.join(GROUPS)} or their cases {', '.join(known_cases())}"
    return _names("--cases", cases, known, "", choose)


def _layout_models(models: str | Sequence[str]) -> tuple[str, ...]:
    return _names("--layouts", models, REGISTRY, "model ", f"choose from {', '.join(REGISTRY)}")


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a case computes; cases with equal specs are timed once.

    Attributes:
      kind: ``"matmul"``, ``"howto"``, ``"ensemble"``, ``"chunk"``, ``"stream"`` or
        ``"sequential"``.
      model: a :func:`meshensemble.bench.workloads.make_model` id (the matmul's size for
        ``"matmul"``).
      members: members trained per step.
      devices: devices used (for ``"howto"``: per HOWTO run).
      ensemble: the mesh's ``ensemble`` axis.
      data: the mesh's ``data`` axis.
      backend: ``"shard_map"`` or ``"pmap"``.
      strategy: the resolved member strategy, ``"vmap"`` or ``"loop"``.
      k: steps per call.
      precision: ``"fp32"`` or ``"bf16"`` (mixed precision, ``compute_dtype=bfloat16``;
        for ``"matmul"``: the operands' dtype).

    Example:
      >>> spec = Spec("ensemble", "mlp32", members=4, strategy="vmap")
      >>> spec == Spec("ensemble", "mlp32", members=4, strategy="vmap")   # timed once
      True
    """

    kind: str
    model: str
    members: int = 1
    devices: int = 1
    ensemble: int = 1
    data: int = 1
    backend: str = "shard_map"
    strategy: str = "loop"
    k: int = 1
    precision: str = "fp32"


@dataclasses.dataclass
class Case:
    """A named case: its group, its spec and a one-line description.

    Attributes:
      name: e.g. ``"mpd_4"``.
      group: its group in :data:`GROUPS`.
      spec: what it computes.
      description: one line for the table.

    Example:
      >>> case = Case("matmul_fp32", "matmul", Spec("matmul", "256"), "float32 matmul 256")
      >>> case.spec.kind, case.spec.model
      ('matmul', '256')
    """

    name: str
    group: str
    spec: Spec
    description: str


def plain_model(model_id: str) -> str:
    """The model as its users' own code runs it: a conv model with XLA's convolution.

    Also the model whose FLOPs a reformulated model performs (its useful work).

    Args:
      model_id: a bench model id, e.g. ``"cnn-im2col"``.

    Returns:
      ``"cnn-xla"`` / ``"tinyconv-xla"`` for the conv models, else the base id.

    Example:
      >>> plain_model("cnn-im2col")
      'cnn-xla'
    """
    base = model_id.split("-")[0]
    return f"{base}-xla" if base in ("cnn", "tinyconv") else base


def matmul_size(cfg: BenchConfig, platform: str) -> int:
    """Side of the yardstick matmuls: ``cfg.matmul_size``, else the platform's.

    Args:
      cfg: the config.
      platform: ``"cpu"``, ``"gpu"``, ``"tpu"`` ...

    Returns:
      2048 on CPU, 8192 elsewhere (see :data:`MATMUL_SIZES`), unless given.

    Example:
      >>> matmul_size(BenchConfig(), "gpu")
      8192
    """
    return cfg.matmul_size or MATMUL_SIZES.get(platform, MATMUL_SIZE_ACCELERATOR)


def runs_time_to_accuracy(cfg: BenchConfig) -> bool:
    """Whether the config selects the ``time_to_accuracy`` case (all cases do).

    Args:
      cfg: the config.

    Returns:
      True when ``cfg.cases`` is empty or names it.

    Example:
      >>> runs_time_to_accuracy(BenchConfig(cases=("backends",)))
      False
    """
    return not cfg.cases or TIME_TO_ACCURACY in cfg.cases


def plan(cfg: BenchConfig, num_devices: int, platform: str, steps_per_epoch: int) -> list[Case]:
    """The cases a config runs, in order, with their specs.

    Args:
      cfg: the bench config.
      num_devices: devices available.
      platform: ``"cpu"``, ``"gpu"`` ...
      steps_per_epoch: full batches in the training set.

    Returns:
      The selected cases (cases that need more devices than exist are left out; so is
      ``time_to_accuracy``, which is no timed case, see :func:`runs_time_to_accuracy`).

    Example:
      >>> [c.name for c in plan(BenchConfig(cases=("mesh",)), 8, "cpu", 468)]
      ['mesh_1', 'mesh_2', 'mesh_4', 'mesh_8']
    """
    ctx = _plan_context(cfg, num_devices, platform, steps_per_epoch)
    cases = [
        *_yardstick_cases(ctx),
        *_chunk_cases(ctx),
        *_member_cases(ctx, cfg.members_per_device),
        *_reform_cases(ctx),
        *_precision_cases(ctx),
    ]
    return select_cases(cases, cfg.cases)


@dataclasses.dataclass(frozen=True)
class _Context:
    """What every case of a plan derives from: the config resolved for the machine."""

    m: int  # members
    model: str  # the bench model id the library runs
    conv: str  # the conv family of the reformulation cases
    auto: str  # the platform's member strategy
    num_devices: int
    e: int  # the whole-machine mesh's ensemble axis
    d: int  # ... and data axis
    steps_per_epoch: int
    k_epoch: int
    k_default: int
    k8: int
    n_mm: int  # the matmuls' side
    mc: int  # members of the reformulation cases


def _plan_context(
    cfg: BenchConfig, num_devices: int, platform: str, steps_per_epoch: int
) -> _Context:
    model = cfg.model
    if model == "cnn":  # as the library runs it: the platform's default convolution
        model = f"cnn-{default_conv(platform)}"
    whole = default_mesh_shape(cfg.members, num_devices)
    k_epoch = min(steps_per_epoch, cfg.epoch_cap or steps_per_epoch)
    return _Context(
        m=cfg.members,
        model=model,
        conv="cnn" if cfg.model == "cnn" else "tinyconv",
        auto=default_strategy(platform),
        num_devices=num_devices,
        e=whole["ensemble"],
        d=whole["data"],
        steps_per_epoch=steps_per_epoch,
        k_epoch=k_epoch,
        k_default=min(default_chunk_steps(platform, steps_per_epoch), k_epoch),
        k8=min(8, steps_per_epoch),
        n_mm=matmul_size(cfg, platform),
        mc=min(cfg.conv_members or cfg.members, cfg.members),
    )


def _case(name: str, spec: Spec, description: str, group: str | None = None) -> Case:
    """A case of :data:`GROUPS` (its group looked up) or, given, of ``group``."""
    found = [g for g, names in GROUPS.items() if name in names]
    return Case(name, group or found[0], spec, description)


def _yardstick_cases(ctx: _Context) -> list[Case]:
    """The matmuls, the HOWTO and the backends' and user's single steps."""
    m, e, model, n_mm = ctx.m, ctx.e, ctx.model, ctx.n_mm
    # The HOWTO's layout, which the pmap backend also needs: one member per device.
    on_line = dict(members=m, devices=e, ensemble=e, data=1, strategy=ctx.auto)
    cases = [
        _case(f"matmul_{p}", Spec("matmul", str(n_mm), precision=p), f"{t} matmul {n_mm} x {n_mm}")
        for p, t in (("fp32", "float32"), ("bf16", "bfloat16"))
    ]
    howto = f"Flax HOWTO pmap, {e} member(s)/run x {m // e} run(s)"
    user = "Ensemble.train_step on the user's Flax model (XLA convolution), as howto"
    return cases + [
        _case("howto", Spec("howto", plain_model(model), m, e), howto),
        _case(
            "ens_pmap",
            Spec("ensemble", model, backend="pmap", **on_line),
            "Ensemble(backend=pmap).train_step",
        ),
        _case(
            "ens_shard_map",
            Spec("ensemble", model, **on_line),
            "Ensemble(backend=shard_map).train_step",
        ),
        _case("ens_user", Spec("ensemble", plain_model(model), **on_line), user),
    ]


def _on_all(ctx: _Context) -> dict[str, Any]:
    """The spec fields of a case on the whole machine's default mesh."""
    return dict(
        members=ctx.m, devices=ctx.num_devices, ensemble=ctx.e, data=ctx.d, strategy=ctx.auto
    )


def _has_grain() -> bool:
    """Whether Grain imports (the ``stream`` case needs it; a GPU image may lack it)."""
    try:
        import grain  # noqa: F401
    except ImportError:
        return False
    return True


def _chunk_cases(ctx: _Context) -> list[Case]:
    """The training loop's chunks, the streamed input and the sequential members."""
    model, k8, k_default, k_epoch = ctx.model, ctx.k8, ctx.k_default, ctx.k_epoch
    cases = [
        _case(name, Spec("chunk", model, k=k, **_on_all(ctx)), what)
        for name, k, what in (
            ("chunk_default", k_default, f"train.py chunk, default K={k_default}"),
            ("chunk_k1", 1, "train.py chunk, K=1"),
            ("chunk_k8", k8, f"train.py chunk, K={k8} (paced loop)"),
            ("chunk_epoch", k_epoch, f"train.py chunk, K={k_epoch} (epoch {ctx.steps_per_epoch})"),
        )
    ]
    if _has_grain():  # else the stream ratio reads "not measured"
        what = f"train.py --input stream, {k8} steps/call (Grain prefetch)"
        cases.append(_case("stream", Spec("stream", model, k=k8, **_on_all(ctx)), what))
    what = f"{ctx.m} members one after another, jitted step"
    return cases + [_case("sequential", Spec("sequential", plain_model(model), ctx.m), what)]


def _member_cases(ctx: _Context, members_per_device: Sequence[int]) -> list[Case]:
    """Members per device, mesh sizes and member strategies."""
    m, model, auto = ctx.m, ctx.model, ctx.auto
    cases = [  # any size, not only the "members" group's names
        _case(
            f"mpd_{n}",
            Spec("ensemble", model, n, strategy=auto),
            f"{n} member(s) on 1 device ({auto})",
            "members",
        )
        for n in members_per_device
    ]
    for n in (1, 2, 4, 8):
        if n <= ctx.num_devices:
            en = math.gcd(m, n)
            spec = Spec("ensemble", model, m, n, en, n // en, strategy=auto)
            cases.append(_case(f"mesh_{n}", spec, f"{m} members on {n} device(s)"))
    on_one = dict(members=m, devices=1, ensemble=1, data=1)
    return cases + [
        _case(
            f"strategy_{s}",
            Spec("ensemble", model, strategy=s, **on_one),
            f"{m} members on 1 device, {s}",
        )
        for s in ("vmap", "loop")
    ]


def _reform_cases(ctx: _Context) -> list[Case]:
    """The conv reformulations (im2col, canonical) and their scans."""
    conv, mc = ctx.conv, ctx.mc
    ec = math.gcd(mc, ctx.num_devices)
    conv_one = dict(members=mc, devices=1, ensemble=1, data=1)
    conv_all = dict(members=mc, devices=ctx.num_devices, ensemble=ec, data=ctx.num_devices // ec)
    cases = [
        _case(
            name,
            Spec("ensemble", model_id, strategy=strategy, **conv_one),
            f"{model_id}, {mc} on 1 device, {strategy}",
        )
        for name, model_id, strategy in (
            ("reform_base_loop", f"{conv}-xla", "loop"),
            ("reform_im2col_vmap", f"{conv}-im2col", "vmap"),
            ("reform_im2col_loop", f"{conv}-im2col", "loop"),
        )
    ]
    what = f"{conv}-im2col, {mc} one after another, jitted step"
    cases.append(_case("reform_im2col_sequential", Spec("sequential", f"{conv}-im2col", mc), what))
    return cases + [
        _case(
            name,
            Spec("chunk", model_id, k=k, strategy=ctx.auto, **conv_all),
            f"{model_id} chunk, K={k}",
        )
        for name, model_id, k in (
            ("scan_base_k1", f"{conv}-xla", 1),
            ("scan_base_k8", f"{conv}-xla", ctx.k8),
            ("scan_canonical_k1", f"{conv}-canonical", 1),
            ("scan_canonical_k8", f"{conv}-canonical", ctx.k8),
        )
    ]


def _precision_cases(ctx: _Context) -> list[Case]:
    """float32 against mixed bfloat16, on one device."""
    on_one = dict(members=ctx.m, devices=1, ensemble=1, data=1, strategy=ctx.auto)
    return [
        _case(
            f"precision_{p}",
            Spec("ensemble", ctx.model, precision=p, **on_one),
            f"{ctx.m} members on 1 device, {p}",
        )
        for p in ("fp32", "bf16")
    ]


def select_cases(cases: list[Case], names: Sequence[str]) -> list[Case]:
    """The cases ``names`` (case or group names of ``--cases``) select, in plan order.

    Args:
      cases: the planned cases.
      names: case or group names; empty selects every case.

    Returns:
      The selected cases.

    Example:
      >>> [c.name for c in select_cases(plan(BenchConfig(), 8, "cpu", 468), ("user",))]
      ['ens_user']
    """
    if not names:
        return cases
    chosen = {c for n in names for c in GROUPS.get(n, (n,))}
    return [c for c in cases if c.name in chosen]
