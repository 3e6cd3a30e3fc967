"""The persistent compilation cache and the compile log (issue "Accelerator speed").

The cache is checked across two real processes: the second run of the same program loads
it from the cache instead of compiling it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from meshensemble.runtime import compilation

PROGRAM = r"""
import json, sys
import jax, jax.numpy as jnp
from meshensemble.runtime import compilation
assert compilation.enable_compilation_cache(sys.argv[1]) == sys.argv[1]
with compilation.CompileLog() as log:
    f = jax.jit(lambda x: jnp.sin(x) @ x.T)
    f(jnp.ones((32, 32))).block_until_ready()
print(json.dumps(log.summary()))
"""


def run_once(cache: str) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    out = subprocess.run(
        [sys.executable, "-c", PROGRAM, cache],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_second_process_loads_its_programs_from_the_cache(tmp_path):
    cache = str(tmp_path / "cache")
    first, second = run_once(cache), run_once(cache)
    names = lambda s: sorted(p["name"] for p in s["by_program"])
    assert "jit(<lambda>)" in names(first) and names(first) == names(second)
    assert first["cache_misses"] == first["programs"] and first["cache_hits"] == 0
    assert second["cache_hits"] == second["programs"] and second["cache_misses"] == 0
    assert os.listdir(cache)  # small programs are stored too (thresholds lowered to 0)


def test_compile_log_records_each_program_once(tmp_path):
    x7, x5 = jnp.arange(7.0), jnp.arange(5.0)  # made before: their iota is not logged
    jax.block_until_ready((x7, x5))
    with compilation.CompileLog() as outer:
        with compilation.CompileLog() as inner:
            jax.jit(lambda x: x * 3 + 1)(x7).block_until_ready()
        jax.jit(lambda x: x - 2)(x5).block_until_ready()
    assert [p.name for p in inner.programs] == ["jit(<lambda>)"]
    assert [p.name for p in outer.programs] == ["jit(<lambda>)", "jit(<lambda>)"]
    assert outer.programs[0] is inner.programs[0] and inner.programs[0].seconds >= 0
    assert outer.summary()["programs"] == len(outer.programs)
    assert "compiled" in outer.line()


def test_cache_folder_default_and_env(monkeypatch, tmp_path):
    monkeypatch.delenv(compilation.ENV_CACHE_DIR, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert compilation.default_cache_dir() == str(tmp_path / "meshensemble" / "jax")
    monkeypatch.setenv(compilation.ENV_CACHE_DIR, str(tmp_path / "mine"))
    assert compilation.default_cache_dir() == str(tmp_path / "mine")


def test_an_unwritable_cache_folder_is_no_failure(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")  # nobody can create a folder under a regular file
    assert compilation.enable_compilation_cache(str(blocker / "cache")) is None
