"""Test setup: 8 fake CPU devices, set once before JAX initialises its backends."""

import atexit
import functools
import os
import shutil
import tempfile

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import meshensemble as me
from meshensemble.runtime import compilation
from meshensemble.testing import need_devices as need_devices  # the test modules import it here
from meshensemble.testing import set_fake_cpu_devices

set_fake_cpu_devices(8)  # JAX_PLATFORMS=cpu and jax_num_cpu_devices, before any computation
jax.config.update("jax_numpy_rank_promotion", "raise")
# One persistent compilation cache per test run, shared by all its processes: the process
# that imports this first (pytest itself, or xdist's controller) makes the folder, hands it
# to the workers it starts through the environment, and removes it when it exits (after its
# workers). A program compiled once, by any worker or test, e.g. the same model on the same
# mesh, is then loaded instead of compiled again, as in a user's second run. The env
# variable points the runs the tests start (the CLI in-process, subprocesses) there too,
# never to ~/.cache. The tuner's measured choices go beside the cache folder (written
# atomically). JAX writes cache entries in place, so a worker may read an entry another one
# is still writing: zlib's checksum rejects it, JAX warns and compiles (the warning is
# ignored in pyproject's filterwarnings); the result is never a wrong program.
_SHARED = "MESHENSEMBLE_TEST_TMP"
if os.environ.get(_SHARED) and os.path.isdir(os.environ[_SHARED]):
    _TMP = os.environ[_SHARED]  # an xdist worker, or a process a test started
else:
    _TMP = tempfile.mkdtemp(prefix="meshensemble-test-")
    os.environ[_SHARED] = _TMP
    atexit.register(shutil.rmtree, _TMP, True)
_CACHE = os.path.join(_TMP, "jax")
# MESHENSEMBLE_TEST_COMPILE_CACHE=<folder> keeps the compiled programs across test runs (a
# developer's repeated runs; the key is the whole program, so a changed one compiles again).
# The tuner's choices stay in the run's own folder either way.
_KEPT = os.environ.get("MESHENSEMBLE_TEST_COMPILE_CACHE")
if _KEPT and not os.path.exists(_CACHE):
    os.makedirs(_KEPT, exist_ok=True)
    os.symlink(os.path.abspath(_KEPT), _CACHE)
os.environ[compilation.ENV_CACHE_DIR] = _CACHE
compilation.enable_compilation_cache(_CACHE)
# Random numbers: JAX's default mode (partitionable threefry), the one users' code, the CLI
# and the library all run in; nothing here changes it.


@pytest.fixture(autouse=True)
def shared_compilation_cache():
    """After each test, JAX's persistent cache is on and in the test run's folder again.

    A run with ``compile_cache=False`` (``--no-compile-cache``) or its own
    ``compile_cache_dir`` sets JAX's global options for the whole process
    (``training.loop.use_compilation_cache``); without this, every later test in the same
    worker would compile without the shared cache, or into a folder that is removed.
    """
    yield
    if not jax.config.jax_enable_compilation_cache or jax.config.jax_compilation_cache_dir != (
        _CACHE
    ):
        jax.config.update("jax_enable_compilation_cache", True)
        compilation.enable_compilation_cache(_CACHE)
        from jax.experimental.compilation_cache import compilation_cache

        compilation_cache.reset_cache()  # JAX reads its options once: make it read them again


USER_XLA_FLAGS = "MESHENSEMBLE_TEST_USER_XLA_FLAGS"
"""The environment variable that keeps ``XLA_FLAGS`` as the user set it, before
:func:`pytest_configure` added the default set's flags (for a test whose subject is the
code a user's run compiles: ``user_xla_env``)."""

LOW_OPT_FLAG = "--xla_backend_optimization_level=0"
"""What the default set compiles with (:func:`pytest_configure`): every XLA knows it."""
EMITTER_FLAG = "--xla_cpu_use_fusion_emitters=false"
"""And this, where the installed XLA knows it (:func:`_flags_known`)."""


def _flags_known(flags: str) -> bool:
    """Whether this jaxlib's XLA accepts ``flags`` (it aborts a process on an unknown one)."""
    import subprocess
    import sys

    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    try:  # a machine too busy to answer in time gets the flags it surely knows
        return subprocess.run(probe, env=env, capture_output=True, timeout=300).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def pytest_configure(config):
    """The default set (``-m 'not slow'``) compiles its programs fast: LLVM's -O0, older emitters.

    Compiling is most of that set's time (its programs are small and run for milliseconds).
    XLA:CPU's ``--xla_backend_optimization_level=0`` halves it: XLA's HLO passes are the
    same at every level (the optimized HLO the tests read, its copies and all-reduces, is
    identical), convolutions and matrix products call the same library kernels.
    ``--xla_cpu_use_fusion_emitters=false`` emits the elementwise fusions with XLA's
    elemental emitter instead of its MLIR fusion emitters: the whole default set took
    3 min 36 s instead of 5 min 23 s (2 quiet cores, 2026-11-26). Float results agree to
    the last bits the tests' tolerances allow; the runs a test compares bitwise are
    compiled alike, and the processes the tests start inherit the flags. A test whose
    subject is what a user's run computes after hundreds of chaotic steps starts its own
    process with the user's flags (``user_xla_env``). Runs that select the ``slow`` tests
    (whole runs of big models, where the elementwise code's speed counts: the CNN's step
    ran 2.2x slower at -O0) keep XLA's defaults, and so does an ``XLA_FLAGS`` that names a
    level; a jaxlib that does not know the emitter flag gets -O0 alone. Set before JAX
    starts its backend (the first computation, at collection), in pytest and in each
    xdist worker (which inherit the controller's environment).
    """
    flags = os.environ.get("XLA_FLAGS", "")
    markexpr = " ".join(str(config.getoption("markexpr", "") or "").split())
    if "not slow" not in markexpr or "xla_backend_optimization_level" in flags:
        return
    from jax._src import xla_bridge

    started = getattr(xla_bridge, "backends_are_initialized", lambda: False)  # older JAX
    if started():  # else the flags would not apply here
        return
    os.environ[USER_XLA_FLAGS] = flags
    fast = [LOW_OPT_FLAG, EMITTER_FLAG] if _flags_known(EMITTER_FLAG) else [LOW_OPT_FLAG]
    os.environ["XLA_FLAGS"] = " ".join([flags, *fast]).strip()


def user_xla_env() -> dict[str, str]:
    """The environment with ``XLA_FLAGS`` as the user set it (the default set's flags off)."""
    env = dict(os.environ)
    if USER_XLA_FLAGS in env:
        env["XLA_FLAGS"] = env.pop(USER_XLA_FLAGS)
    return env


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(autouse=True)
def figures_built_not_rendered(request, monkeypatch):
    """The package's figures are built but not rendered, except in tests marked ``plots``.

    Every run a test starts draws its PNGs (``learning_curves.png``, ``members.png``, the
    evaluation's plots); rendering them (``tight_layout`` and ``savefig``: ~90% of the
    plotting time, ~0.5 s a run on 2 cores) is the same work every time. Here every line of
    ``meshensemble/plots.py`` still runs on the test's data (figures, axes, lines, bars,
    limits, legends), and each file is written where the plot goes (a PNG signature, so a
    folder in the way or an unwritable workdir fails as it would), but no pixel is drawn.
    The tests marked ``plots`` (the run's PNGs and a failed plot in test_train, the
    evaluation's in test_evaluate, the regression figure) and the docstring examples draw
    the real figures.
    """
    if request.node.get_closest_marker("plots") or request.node.path.name == "test_doctests.py":
        return
    from meshensemble import plots

    real = plots.pyplot

    def pyplot():
        plt = real()
        from matplotlib.figure import Figure

        monkeypatch.setattr(Figure, "tight_layout", lambda self, *args, **kwargs: None)
        monkeypatch.setattr(Figure, "savefig", _png_signature)
        return plt

    monkeypatch.setattr(plots, "pyplot", pyplot)


def _png_signature(fig, fname, *args, **kwargs) -> None:
    """``Figure.savefig`` without rendering: writes a PNG signature where the file goes."""
    if hasattr(fname, "write"):
        fname.write(PNG_SIGNATURE)
    else:
        with open(fname, "wb") as f:
            f.write(PNG_SIGNATURE)


def shared_compile_cache(folder) -> str:
    """``folder/jax``, a compilation cache folder whose programs are the test run's shared ones.

    For a test that needs its own cache folder only for what lies beside it (the tuner's
    choices file, ``folder/meshensemble-choices.json``): ``folder/jax`` links to the run's
    cache, so the programs another test or worker compiled are loaded, not compiled again.

    Returns:
      The path ``folder/jax`` (a symbolic link), to pass as ``compile_cache_dir``.
    """
    link = os.path.join(str(folder), "jax")
    if not os.path.lexists(link):
        os.makedirs(str(folder), exist_ok=True)
        os.makedirs(_CACHE, exist_ok=True)
        os.symlink(_CACHE, link)
    return link


MNIST_NPZ = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data", "mnist.npz")


@pytest.fixture
def mnist_npz() -> str:
    """Path of the full MNIST npz in ../shared/data, or skip when it is absent."""
    path = os.path.abspath(MNIST_NPZ)
    if not os.path.exists(path):
        pytest.skip(f"full MNIST not found at {path} (shared data is absent on this machine)")
    return path


@pytest.fixture
def mock_tfds():
    """``tfds.testing.mock_data`` with random examples, working around a TFDS mock bug.

    TFDS 4.9.x's mock sets ``__getitems__`` on a MagicMock as a plain attribute (it is not
    one of the magic methods mock supports), so the mocked ArrayRecord source is not
    passed as ``self`` and batched reads fail. Binding it here fixes that.
    """
    tfds = pytest.importorskip("tensorflow_datasets")
    from tensorflow_datasets.testing import mocking

    class BoundDataSourceMock(mocking.PickableDataSourceMock):
        def __setattr__(self, name, value):
            if name == "__getitems__" and isinstance(value, functools.partial):
                value = functools.partial(value, self)
            super().__setattr__(name, value)

    def mock(num_examples: int = 20):
        return tfds.testing.mock_data(
            num_examples=num_examples,
            policy=tfds.testing.MockPolicy.USE_CODE,
            mock_array_record_data_source=BoundDataSourceMock(),
        )

    return mock


class Tiny(nn.Module):
    """A small conv + dense net on 8x8 inputs: cheap, but has a convolution."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(4, (3, 3))(x))
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(16)(x))
        return nn.Dense(10)(x)


# ------------------------------------------------------------------ dropout masks, made visible
PROBE_EXAMPLES = 16
"""Examples of the mask probe's batch (one-hot inputs ``[16, 16]``)."""
PROBE_FEATURES = 64
"""Features dropout masks per example in the mask probe."""


class MaskProbe(nn.Module):
    """Dropout whose masks a step writes into the parameters.

    Example ``e`` (the one-hot row ``e`` of ``eye(PROBE_EXAMPLES)``) reads row ``e`` of a
    kernel ``[examples, features]`` through dropout; logit 0 is the sum of what dropout
    kept. With the loss ``-logit 0`` and plain SGD, a step moves exactly the kernel entries
    the step's mask kept, so every example's mask can be read off the update.
    """

    rate: float = 0.5

    @nn.compact
    def __call__(self, x, train: bool = False):
        h = nn.Dense(PROBE_FEATURES, use_bias=False)(x)
        h = nn.Dropout(self.rate, deterministic=not train)(h)
        return probe_logits(h)


def probe_logits(h: jax.Array) -> jax.Array:
    """``[b, 2]`` logits of the mask probes: the sum of the kept features, and 0."""
    return jnp.stack([h.sum(-1), jnp.zeros_like(h[:, 0])], axis=-1)


def dropout_masks(model, mesh, num_members: int = 4, steps: int = 2) -> np.ndarray:
    """The dropout masks every member drew at every step, read off a mask probe's kernel.

    Trains ``model`` (a mask probe, Linen or NNX: one kernel ``[examples, features]`` as its
    only parameter) with SGD(1) on the loss ``-logit 0`` over the one-hot batch.

    Returns:
      bool ``[steps, members, examples, features]``: True where the step's dropout kept
      feature ``f`` of example ``e``. Examples ``d*b .. (d+1)*b - 1`` are data shard ``d``
      (``b = examples / data``).
    """
    x = np.eye(PROBE_EXAMPLES, dtype=np.float32)
    y = np.zeros(PROBE_EXAMPLES, np.int32)
    loss = lambda logits, labels: -logits[:, 0]
    ens = me.Ensemble(model, optax.sgd(1.0), num_members, mesh, loss_fn=loss)
    state = ens.init(jax.random.key(0), x[:1])
    kernel = lambda s: me.distributed.fetch(jax.tree.leaves(s.params)[0])
    kernels = [kernel(state)]
    for _ in range(steps):
        state, _ = ens.train_step(state, x, y)
        kernels.append(kernel(state))
    return np.diff(np.stack(kernels), axis=0) != 0


def assert_masks_are_independent(masks: np.ndarray, data: int, what: str) -> None:
    """Each data shard, member and step drew its own dropout mask (``masks`` as above).

    ``what`` picks the check: ``"shards"`` (the key is folded with the data shard),
    ``"members"`` (each member has its own key) or ``"steps"`` (the key is folded with the
    step). Masks of 4 x 64 draws agree by chance with probability 2**-256.
    """
    steps, members, examples, _ = masks.shape
    assert 0.35 < masks.mean() < 0.65, masks.mean()  # dropout at rate 0.5 is on
    b = examples // data
    for s in range(steps):
        for i in range(members):
            if what == "shards":
                shards = masks[s, i].reshape(data, b, -1)
                for d in range(1, data):
                    assert (shards[d] != shards[0]).any(), (
                        f"step {s}, member {i}: data shard {d} drew shard 0's dropout mask"
                    )
            elif what == "members":
                for k in range(i):
                    assert (masks[s, i] != masks[s, k]).any(), (
                        f"step {s}: members {k} and {i} drew the same dropout mask"
                    )
            elif s:
                assert (masks[s, i] != masks[s - 1, i]).any(), (
                    f"member {i}: step {s} drew step {s - 1}'s dropout mask"
                )


def small_config(workdir, **kw) -> me.TrainConfig:
    """A run of a few seconds: 4 MLP members on (ensemble=4, data=2), 2 epochs of batch 32.

    The test modules' run configs start here and override what they test (``kw``).
    """
    base = dict(
        model="mlp",
        members=4,
        mesh="ensemble=4,data=2",
        epochs=2,
        batch_size=32,
        learning_rate=0.05,
        workdir=str(workdir),
        quiet=True,
        eval_batch_size=40,
    )
    return me.TrainConfig(**(base | kw))


@pytest.fixture(scope="session")
def gcs():
    """A local GCS server for the session, with one bucket (``tests/gcs.py``): ``gcs.path(
    "run")`` is ``gs://bucket/run``; every client in this process and in the processes a test
    starts reaches it through the environment. It starts in well under a second.
    """
    from gcs import emulator

    with emulator() as server:
        yield server
