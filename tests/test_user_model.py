"""``--model module:Class``: a user's Flax module trains, evaluates, predicts and exports."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from conftest import need_devices

import meshensemble as me
from meshensemble import cli

MODULE = '''
import flax.linen as nn
import jax.numpy as jnp


class Tiny(nn.Module):
    """Not in the zoo: one hidden layer of 8 (the zoo's MLP has 128)."""

    num_classes: int = 10

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = jnp.reshape(x, (x.shape[0], -1))
        return nn.Dense(self.num_classes)(nn.relu(nn.Dense(8, name="hidden")(x)))


class NotAModule:
    pass
'''


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    name = f"user_models_{os.getpid()}"
    (tmp_path / f"{name}.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.slow  # among the heaviest default tests, measured
def test_a_users_module_trains_evaluates_predicts_and_exports(tmp_path, user_module, capsys):
    need_devices(2)
    data = me.data.synthetic(num_train=64, num_test=32, seed=0)
    npz = me.data.save_npz(data, tmp_path / "d.npz")
    workdir = str(tmp_path / "run")
    spec = f"{user_module}:Tiny"
    argv = ["train", "--source", "npz", "--data-file", npz, "--model", spec, "--members", "2",
            "--mesh", "ensemble=2,data=1", "--batch-size", "32", "--epochs", "1",
            "--workdir", workdir, "--quiet"]  # fmt: skip
    assert cli.main(argv) == 0
    with open(os.path.join(workdir, "config.json")) as f:
        assert json.load(f)["model"] == spec  # recorded: the later commands rebuild it
    assert cli.main(["evaluate", "--workdir", workdir]) == 0
    p = me.load_predictor(workdir, echo=lambda line: None)
    hidden = [v for k, v in _flat(p.state.params).items() if "hidden" in k and "kernel" in k]
    assert [v.shape[-1] for v in hidden] == [8]  # the user's module, not the zoo's
    np.save(tmp_path / "x.npy", data.x_test[:5])
    out = str(tmp_path / "p.npz")
    assert cli.main(["predict", "--workdir", workdir, "--input", str(tmp_path / "x.npy"),
                     "--out", out, "--quiet"]) == 0  # fmt: skip
    want = np.asarray(p.ensemble.predict(p.state, data.x_test[:5]))
    np.testing.assert_allclose(np.load(out)["probs"], want, atol=1e-6)
    export = ["export", "--workdir", workdir, "--out", str(tmp_path / "e"), "--platforms", "cpu"]
    assert cli.main(export) == 0
    assert (tmp_path / "e" / "export.json").exists()
    capsys.readouterr()


def _flat(tree, prefix=""):
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict) or hasattr(v, "items"):
            out.update(_flat(v, f"{prefix}{k}/"))
        else:
            out[prefix + k] = v
    return out


@pytest.mark.parametrize(
    "attr, message",
    [
        ("NotAModule", "model='{m}:NotAModule' is the class NotAModule, not a flax.linen.Module"),
        ("Missing", "model='{m}:Missing': module '{m}' has no 'Missing'"),
    ],
)
def test_a_bad_model_spec_is_one_line_and_writes_nothing(
    tmp_path, user_module, capsys, attr, message
):
    workdir = tmp_path / "w"
    argv = ["train", "--source", "sample", "--model", f"{user_module}:{attr}"]
    assert cli.main([*argv, "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert message.format(m=user_module) in err[0], err
    assert not workdir.exists()


def test_a_module_that_does_not_import_is_one_line(tmp_path, capsys):
    workdir = tmp_path / "w"
    argv = ["train", "--source", "sample", "--model", "no_such_module_here:Net"]
    assert cli.main([*argv, "--workdir", str(workdir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not import" in err[0] and "PYTHONPATH" in err[0], err
    assert not workdir.exists()
