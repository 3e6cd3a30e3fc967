"""One random-number mode: the CLI, the Python API and these tests all run JAX's default.

The CLI used to switch ``jax_threefry_partitionable`` off for the whole process, so the
same seed gave other members from ``meshensemble train`` than from ``me.training.train``,
and the tests pinned that mode, so the mode users run was never tested.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import meshensemble as me
from meshensemble.cli import main

JAX_DEFAULT = True  # jax_threefry_partitionable's default since JAX 0.5


def test_the_tests_run_in_the_mode_users_get():
    assert jax.config.jax_threefry_partitionable is JAX_DEFAULT


@pytest.mark.slow  # among the heaviest default tests, measured
def test_cli_and_api_train_the_same_members_for_the_same_seed(tmp_path):
    data_file = me.data.save_npz(me.data.synthetic(64, 16, seed=3), tmp_path / "d.npz")
    flags = dict(model="mlp", members=2, epochs=1, batch_size=16, seed=5, max_steps=2)
    argv = ["train", "--source", "npz", "--data-file", str(data_file), "--quiet"]
    for name, value in flags.items():
        argv += [f"--{name.replace('_', '-')}", str(value)]
    assert main([*argv, "--workdir", str(tmp_path / "cli")]) == 0
    assert jax.config.jax_threefry_partitionable is JAX_DEFAULT  # the CLI changed nothing

    api = me.training.train(
        me.TrainConfig(
            source="npz",
            data_file=str(data_file),
            workdir=str(tmp_path / "api"),
            quiet=True,
            **flags,
        )
    )
    sample = api.dataset.train_images[:1]
    cli_state, _, step = me.restore_checkpoint(str(tmp_path / "cli"), api.ensemble, sample)
    assert step == 2
    for i in range(2):
        for a, b in zip(
            jax.tree.leaves(me.extract_members(cli_state, i)),
            jax.tree.leaves(me.extract_members(api.state, i)),
        ):
            np.testing.assert_array_equal(a, b)
