"""Using a trained run: ``me.load_predictor``, ``meshensemble predict``, ``meshensemble export``,
the streaming engine they share, and the docs' plain-JAX loader."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import shutil
import subprocess
import sys
import types

import jax
import numpy as np
import pytest
from conftest import need_devices, small_config

import meshensemble as me
from meshensemble import calibration, cli, data, metrics
from meshensemble.core import streaming
from meshensemble.serving import inputs, predictor
from meshensemble.training import build_ensemble, train

NUM_TRAIN, NUM_TEST = 256, 45
T, Q = 1.7, 0.75  # the calibration written into the run's evaluation.json
DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "using.md")


def _reference(workdir: str, mesh: str, temperature=None):
    """``Ensemble.predict`` / ``predict_members`` on the run's state, restored independently."""
    cfg = me.training.TrainConfig(
        **{
            k: v
            for k, v in json.loads(pathlib.Path(workdir, "config.json").read_text()).items()
            if k != "resolved"
        }
    )
    ens = build_ensemble(cfg, predictor.predictor_mesh(mesh, cfg.members), NUM_TRAIN)
    x = np.zeros((1, 28, 28, 1), np.uint8)
    state, _, step = me.restore_checkpoint(workdir, ens, x, move_damaged=False)
    return types.SimpleNamespace(ens=ens, state=state, step=step)


def _identity(workdir: str, step: int) -> dict:
    """The run identity a calibration of ``workdir``'s checkpoint ``step`` is fitted for."""
    cfg = me.training.restore.load_run_config(workdir)
    return me.training.restore.run_identity(workdir, cfg, step)


def _write_calibration(workdir: str, step: int) -> None:
    section = {"temperature": T, "conformal": {"method": "thr", "alpha": 0.1, "threshold": Q},
               "fitted_for": _identity(workdir, step)}  # fmt: skip
    with open(os.path.join(workdir, "evaluation.json"), "w") as f:
        json.dump({"checkpoint_step": step, "calibration": section}, f)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 4-member MLP run (1 epoch), calibrated (evaluation.json), and an uncalibrated copy."""
    need_devices(8)
    root = tmp_path_factory.mktemp("serving")
    ds = data.synthetic(NUM_TRAIN, NUM_TEST, seed=3)
    npz = data.save_npz(ds, root / "synthetic.npz")
    workdir = os.fspath(root / "run")
    train(small_config(workdir, epochs=1, source="npz", data_file=npz))
    plain = os.fspath(root / "plain")
    shutil.copytree(workdir, plain)
    ref = _reference(workdir, "ensemble=4,data=2")
    _write_calibration(workdir, ref.step)
    x = ds.test_images
    return types.SimpleNamespace(root=root, workdir=workdir, plain=plain, images=x, ref=ref)


def test_stream_pads_masks_keeps_order_and_bounds_the_batches_in_flight():
    rows = np.arange(47 * 2).reshape(47, 2)
    seen, pending, most = [], [0], [0]

    def fn(x, mask):
        pending[0] += 1
        most[0] = max(most[0], pending[0])
        assert x.shape == (8, 2) and mask.sum() == min(8, 47 - len(seen) * 8)
        np.testing.assert_array_equal(x[~mask], np.repeat(x[:1], (~mask).sum(), axis=0))
        seen.append(mask)
        return {"rows": x, "members": np.stack([x, -x])}

    got, done = {}, []

    def sink(start, out):
        pending[0] -= 1
        got[start] = out

    n = streaming.stream(
        fn, rows, 7, 4, sink, axes={"members": 1}, in_flight=2, progress=done.append
    )
    starts = list(range(0, 47, 8))
    assert n == 47 and sorted(got) == starts and sum(done) == 47
    assert most[0] == 3  # two in flight while a third is dispatched, never more
    np.testing.assert_array_equal(np.concatenate([got[s]["rows"] for s in starts]), rows)
    assert got[40]["members"].shape == (2, 7, 2)
    assert streaming.batch_size_for(1000, 7, 2) == 8
    with pytest.raises(ValueError, match="no examples"):
        streaming.stream(fn, rows[:0], 7, 4, sink)


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("mesh", ["ensemble=4,data=2", "ensemble=1,data=1"])
def test_predictor_equals_ensemble_predict_on_the_restored_state(run, mesh):
    ref = _reference(run.workdir, mesh)
    p = me.load_predictor(run.workdir, mesh, batch_size=16)  # 3 batches, the last padded
    assert p.calibration.temperature == T and p.step == ref.step
    out = p.outputs(run.images, members=True)
    want = np.asarray(ref.ens.predict(ref.state, run.images, temperature=T))
    np.testing.assert_allclose(out["probs"], want, atol=1e-6)
    plain = np.asarray(ref.ens.predict(ref.state, run.images))
    assert np.abs(plain - want).max() > 1e-3  # the temperature matters here
    np.testing.assert_allclose(p.predict(run.images, temperature=False), plain, atol=1e-6)
    members = np.asarray(me.distributed.fetch(ref.ens.predict_members(ref.state, run.images)))
    np.testing.assert_allclose(out["member_probs"], members, atol=1e-6)
    np.testing.assert_array_equal(out["label"], want.argmax(-1))
    np.testing.assert_allclose(out["confidence"], want.max(-1), atol=1e-6)
    np.testing.assert_allclose(out["entropy"], metrics.entropy(want), atol=1e-5)
    mi = np.asarray(metrics.mutual_information(members))
    np.testing.assert_allclose(out["mutual_information"], mi, atol=1e-5)
    sets = np.asarray(calibration.prediction_sets(want, Q, "thr"))
    np.testing.assert_array_equal(out["prediction_set"], sets)
    np.testing.assert_array_equal(p.prediction_sets(run.images), sets)
    assert 0 < sets.sum() < sets.size and (sets.sum(-1) != 1).any()  # not trivial sets
    assert set(p.uncertainty(run.images)) == set(me.tasks.classification.UNCERTAINTY_KEYS)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_outputs_and_sets_are_the_same_in_any_batch_even_on_the_threshold(run):
    """An example's outputs are the same bits in batches of the default size, 7 and 1, and
    alone; so are its APS/RAPS sets at thresholds that are exactly one row's score (the
    audit found 17 of 1,000 APS sets changed with ``predict --batch-size``)."""
    x = np.resize(run.images, (300, 28, 28, 1))  # 5 blocks a device in one batch, 2 in 7
    p = {bs: me.load_predictor(run.workdir, batch_size=bs) for bs in (1000, 7, 1)}
    out = {bs: p[bs].outputs(x, members=True) for bs in p}
    for bs in (7, 1):
        for key in out[1000]:
            np.testing.assert_array_equal(out[bs][key], out[1000][key], err_msg=key)
    for i in (0, 17, 299):
        alone = p[1000].outputs(x[i : i + 1])
        for key in alone:
            np.testing.assert_array_equal(alone[key][0], out[1000][key][i], err_msg=key)
    base, x, probs = p[1000], x[:45], out[1000]["probs"][:45]  # sets: batches of 45, 7, 1
    ranked = np.argsort(-probs, axis=-1, kind="stable")
    for method, rank in (("aps", 1), ("raps", 6)):  # RAPS: a class its penalty reaches
        scores = np.asarray(calibration.conformal_scores(probs, method))
        for row in range(0, 45, 5):  # q is exactly this row's score of that class
            c = ranked[row, rank]
            q = float(scores[row, c])
            cal = me.tasks.classification.Calibration(T, q, method, 0.1, base.step)
            sets = [
                me.Predictor(base.ensemble, base.state, step=base.step, workdir=run.workdir,
                             calibration=cal, num_classes=10, batch_size=bs).prediction_sets(x)
                for bs in (1000, 7, 1)
            ]  # fmt: skip
            assert sets[0][row, c] and sets[0][row].sum() >= rank + 1, (method, row)
            np.testing.assert_array_equal(sets[1], sets[0], err_msg=f"{method} batch 7")
            np.testing.assert_array_equal(sets[2], sets[0], err_msg=f"{method} batch 1")


def test_the_temperature_step_runs_inside_the_blocks(run, monkeypatch):
    """The calibration's temperature is applied inside the blocked program, to blocks of
    ``BLOCK_ROWS`` rows, never to a whole batch on the host (there its rounding would
    depend on the batch again)."""
    seen, real = [], me.numerics.temperature.tempered

    def spy(probs, t):
        seen.append(probs.shape[0])
        return real(probs, t)

    monkeypatch.setattr(me.numerics.temperature, "tempered", spy)
    p = me.load_predictor(run.workdir)  # a new program: traced here
    out = p.outputs(np.resize(run.images, (100, 28, 28, 1)), sets=True)  # 64 rows a device
    assert out["prediction_set"].shape == (100, 10)
    assert seen and set(seen) == {me.serving.blocks.BLOCK_ROWS}, seen


def test_calibration_of_another_checkpoint_or_none_gives_no_sets(run):
    task, ident = me.tasks.Classification(), _identity(run.workdir, run.ref.step)
    cal, why = predictor.read_calibration(run.workdir, task, 10**6, ident)
    assert cal is None and "is of checkpoint" in why
    p = me.load_predictor(run.plain)
    assert p.calibration is None and "prediction_set" not in p.outputs(run.images[:3])
    with pytest.raises(ValueError, match=r"^no prediction sets: run .* is not calibrated"):
        p.prediction_sets(run.images[:3])


@pytest.mark.slow  # among the heaviest default tests, measured
def test_the_refusal_of_another_checkpoints_sets_names_a_command_that_fixes_it(run, capsys):
    """Following the command the refusal names (complete: this checkpoint, the same score
    and alpha) calibrates that checkpoint, and the same predict then writes its sets."""
    workdir = os.fspath(run.root / "two_checkpoints")
    arrays = dict(np.load(run.root / "synthetic.npz"))
    y = arrays["y_train"]
    arrays["y_train"] = np.where(np.arange(len(y)) % 3 == 0, (y + 1) % 10, y)  # some wrong
    npz = os.fspath(run.root / "noisy.npz")
    np.savez(npz, **arrays)
    cfg = small_config(workdir, source="npz", data_file=npz, validation=64, checkpoint_every=6)
    train(cfg)  # 6 steps an epoch: checkpoints 6 and 12
    argv = ["evaluate", "--workdir", workdir, "--calibrate", "--conformal", "aps", "--alpha", "0.2"]
    assert cli.main(argv) == 0  # the newest checkpoint, 12
    np.save(run.root / "few.npy", run.images[:5])
    out = os.fspath(run.root / "sets6.npz")
    predict = ["predict", "--workdir", workdir, "--input", os.fspath(run.root / "few.npy"),
               "--out", out, "--checkpoint", "6", "--sets", "--quiet"]  # fmt: skip
    capsys.readouterr()
    assert cli.main(predict) == 2 and not os.path.exists(out)
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is of checkpoint 12, not 6" in err, err
    command = re.search(r"run `(meshensemble evaluate [^`]*)` first", err).group(1)
    assert "--checkpoint 6" in command and "--conformal aps --alpha 0.2" in command, command
    assert cli.main(shlex.split(command)[1:]) == 0  # as the user pastes it
    assert cli.main(predict) == 0
    assert np.load(out)["prediction_set"].shape == (5, 10)
    cal = me.load_predictor(workdir, checkpoint=6).calibration
    assert (cal.step, cal.method, cal.alpha) == (6, "aps", 0.2)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_cli_predict_writes_npz_csv_and_reads_a_folder_of_images(run, capsys):
    from PIL import Image

    x = run.images[:5]
    np.save(run.root / "x.npy", x[..., 0])  # [N, 28, 28]: the channel axis is added
    folder = run.root / "pngs"
    folder.mkdir()
    names = ["d.png", "a.png", "c.jpeg", "b.png", "e.png"]  # read in sorted order
    for name, img in zip(names, x):
        Image.fromarray(img[..., 0]).save(folder / name, quality=100, subsampling=0)
    out, csv_out = run.root / "p.npz", run.root / "p.csv"
    args = ["predict", "--workdir", run.workdir, "--mesh", "ensemble=4,data=2"]
    assert (
        cli.main([*args, "--input", str(run.root / "x.npy"), "--out", str(out), "--members"]) == 0
    )
    assert "wrote 5 predictions" in capsys.readouterr().out
    got = np.load(out)
    want = me.load_predictor(run.workdir).outputs(x, members=True)
    assert sorted(got.files) == sorted(want)
    for k in want:
        np.testing.assert_allclose(got[k], want[k], atol=1e-6)
    assert cli.main([*args, "--input", str(folder), "--out", str(csv_out), "--quiet"]) == 0
    lines = csv_out.read_text().splitlines()
    assert lines[0] == "name,label,confidence,entropy,mutual_information,prediction_set"
    order = [names.index(n) for n in sorted(names)]
    rows = [line.split(",") for line in lines[1:]]
    assert [r[0] for r in rows] == sorted(names)
    for row, i in zip(rows, order):  # the PNGs are lossless: the same labels and sets
        if names[i].endswith(".png"):
            assert int(row[1]) == want["label"][i]
            assert row[5] == " ".join(map(str, np.flatnonzero(want["prediction_set"][i])))
    plain_out = run.root / "plain.npz"
    flags = ["--input", str(run.root / "x.npy"), "--out", str(plain_out), "--no-temperature"]
    assert cli.main([*args, *flags]) == 0
    untempered = np.asarray(run.ref.ens.predict(run.ref.state, x))
    np.testing.assert_allclose(np.load(plain_out)["probs"], untempered, atol=1e-6)
    # the sets stay those of the calibrated probabilities (the threshold belongs to them)
    np.testing.assert_array_equal(np.load(plain_out)["prediction_set"], want["prediction_set"])


def test_npy_input_is_memory_mapped(run):
    np.save(run.root / "m.npy", run.images)
    images = inputs.open_images(str(run.root / "m.npy"), (28, 28, 1), np.uint8)
    assert isinstance(images.rows, np.memmap) and images[2:5].shape == (3, 28, 28, 1)


@pytest.fixture(scope="module")
def exported(run):
    out = os.fspath(run.root / "exported")
    assert cli.main(["export", "--workdir", run.workdir, "--out", out]) == 0
    return out


@pytest.mark.slow  # among the heaviest default tests, measured
def test_export_equals_predict_for_any_batch_size_from_one_artifact(run, exported):
    meta = json.loads(pathlib.Path(exported, "export.json").read_text())
    saved = json.loads(pathlib.Path(run.workdir, "config.json").read_text())["resolved"]
    assert meta["input"] == {"shape": ["batch", 28, 28, 1], "dtype": "uint8", "range": [0, 255]}
    assert (meta["classes"], meta["members"], meta["temperature"]) == (10, 4, T)
    assert meta["conformal"]["threshold"] == Q and meta["conformal"]["method"] == "thr"
    assert meta["data_identity"] == saved["data_identity"]
    assert {"cpu", "cuda"} <= set(meta["platforms"]) and meta["versions"]["jax"] == jax.__version__
    blob = pathlib.Path(exported, "ensemble.jax").read_bytes()
    exp = jax.export.deserialize(bytearray(blob))
    x = np.resize(run.images, (1000, 28, 28, 1))
    ens, state = run.ref.ens, run.ref.state
    for n in (1, 7, 1000):
        got = exp.call(x[:n])
        want = np.asarray(ens.predict(state, x[:n], temperature=T))
        np.testing.assert_allclose(np.asarray(got["probs"]), want, atol=1e-5)
        members = me.distributed.fetch(ens.predict_members(state, x[:n]))
        np.testing.assert_allclose(np.asarray(got["member_probs"]), members, atol=1e-5)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_the_docs_loader_runs_in_a_process_without_meshensemble(run, exported, tmp_path):
    """The loader of docs/using.md, as pasted, on a calibrated run and an uncalibrated one
    (the README's main job is uncalibrated: the loader once crashed on it)."""
    text = pathlib.Path(DOCS).read_text()
    code = re.search(r"needs JAX.*?```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 10
    check = (
        "\nimport sys\nassert 'meshensemble' not in sys.modules, 'the loader imported it'\n"
        "np.savez('result.npz', probs=probs, **({} if sets is None else {'sets': sets}))\n"
    )
    plain = os.fspath(tmp_path / "plain_artifact")
    assert cli.main(["export", "--workdir", run.plain, "--out", plain, "--platforms", "cpu"]) == 0
    for name, artifact, temperature in (("calibrated", exported, T), ("plain", plain, None)):
        where = tmp_path / name
        shutil.copytree(artifact, where / "exported")
        np.save(where / "new_images.npy", run.images)
        subprocess.run([sys.executable, "-c", code + check], cwd=where, check=True, timeout=300)
        result = np.load(where / "result.npz")
        want = np.asarray(run.ref.ens.predict(run.ref.state, run.images, temperature=temperature))
        np.testing.assert_allclose(result["probs"], want, atol=1e-5)
        if temperature is None:
            assert "sets" not in result.files
            continue
        sets = calibration.prediction_sets(result["probs"], Q, "thr")
        np.testing.assert_array_equal(result["sets"], np.asarray(sets))


@pytest.mark.slow  # among the heaviest default tests, measured
def test_fsdp_run_predicts_and_exports_like_any_other(run, tmp_path):
    workdir = os.fspath(tmp_path / "fsdp")
    npz = os.fspath(run.root / "synthetic.npz")
    train(small_config(workdir, epochs=1, source="npz", data_file=npz, shard_members=True))
    ref = _reference(workdir, "ensemble=4,data=2")
    x = run.images[:7]
    want = np.asarray(ref.ens.predict(ref.state, x))
    p = me.load_predictor(workdir, "ensemble=4,data=2")
    np.testing.assert_allclose(p.predict(x), want, atol=1e-6)
    out = os.fspath(tmp_path / "exported")
    me.serving.export_ensemble(p, out, platforms=("cpu",))
    exp = jax.export.deserialize(bytearray(pathlib.Path(out, "ensemble.jax").read_bytes()))
    np.testing.assert_allclose(np.asarray(exp.call(x)["probs"]), want, atol=1e-5)


def _palette_png(path, pixels, colour: bool) -> None:
    """A palette PNG (mode P) of ``pixels`` (uint8 [H, W]) by index: a grey palette that
    maps index i to grey 255 - i, or one whose entries are colours (red for i, blue 255 - i)."""
    from PIL import Image

    img = Image.fromarray(pixels, mode="P")
    i = np.arange(256)
    rgb = np.stack([i, np.zeros_like(i), 255 - i] if colour else [255 - i] * 3, axis=-1)
    img.putpalette(rgb.astype(np.uint8).reshape(-1).tolist())
    img.save(path)


def test_a_palette_png_is_read_through_its_palette_and_a_colour_one_refused(tmp_path):
    pixels = np.arange(28 * 28, dtype=np.uint8).reshape(28, 28) % 200
    grey = tmp_path / "grey"
    grey.mkdir()
    _palette_png(grey / "a.png", pixels, colour=False)
    got = inputs.open_images(str(grey), (28, 28, 1), np.uint8)[0:1]
    np.testing.assert_array_equal(got[0, ..., 0], 255 - pixels)  # the palette's greys
    colour = tmp_path / "colour"
    colour.mkdir()
    _palette_png(colour / "b.png", pixels, colour=True)
    with pytest.raises(ValueError, match=r"b\.png has image mode P \(colour palette\); the run "):
        inputs.open_images(str(colour), (28, 28, 1), np.uint8)
    rgb = inputs.open_images(str(colour), (28, 28, 3), np.uint8)[0:1]  # an RGB run: its colours
    np.testing.assert_array_equal(rgb[0], np.stack([pixels, 0 * pixels, 255 - pixels], -1))


def _bad_cases(run):
    root = run.root / "bad"
    root.mkdir(exist_ok=True)
    x = root / "x.npy"
    np.save(x, run.images[:3])
    for name, arr in (
        ("shape", np.zeros((3, 20, 20), np.uint8)),
        ("dtype", np.zeros((3, 28, 28), np.float32)),
        ("unit", np.full((3, 28, 28), 0.5, np.float32)),  # divided by 255 already
        ("float255", np.full((3, 28, 28), 200.0, np.float64)),
    ):
        np.save(root / f"{name}.npy", arr)
    (root / "empty.npy").write_bytes(b"")
    (root / "noimages").mkdir(exist_ok=True)
    (root / "mixed").mkdir(exist_ok=True)
    from PIL import Image

    Image.fromarray(run.images[0, ..., 0]).save(root / "mixed" / "a.png")
    (root / "mixed" / "notes.txt").write_text("not an image")
    (root / "palette").mkdir(exist_ok=True)
    _palette_png(root / "palette" / "a.png", run.images[0, ..., 0], colour=True)
    nockpt = root / "nockpt"
    nockpt.mkdir(exist_ok=True)
    shutil.copy(os.path.join(run.workdir, "config.json"), nockpt)
    damaged = root / "damaged"
    if not damaged.exists():
        shutil.copytree(run.workdir, damaged)
        for dirpath, _, files in os.walk(damaged / "checkpoints"):
            for f in files:
                if f != "checksums.json":
                    path = pathlib.Path(dirpath, f)
                    path.write_bytes(bytes(b ^ 0xFF for b in path.read_bytes()))
    w, out = run.workdir, str(root / "out" / "p.npz")
    os.makedirs(root / "out", exist_ok=True)
    same = root / "same"  # an input the output must not replace, named three ways
    same.mkdir(exist_ok=True)
    np.savez(same / "x.npz", images=run.images[:3])
    if not (same / "link.npz").exists():
        os.symlink(same / "x.npz", same / "link.npz")
    relative = os.path.relpath(same / "x.npz")
    return {
        "no checkpoint": (str(nockpt), x, out, [], 2, "no checkpoint"),
        "damaged checkpoint": (str(damaged), x, out, [], 1, "no good checkpoint"),
        "wrong shape": (w, root / "shape.npy", out, [], 2, r"shape \[3, 20, 20\]"),
        "wrong dtype": (w, root / "dtype.npy", out, [], 2, "of dtype float32: the run takes uint8"),
        "floats in [0, 1]": (w, root / "unit.npy", out, [], 2, r"\(images \* 255\).round\(\)"),
        "floats 0..255": (w, root / "float255.npy", out, [], 2, r"0..255: convert with images.as"),
        "empty file": (w, root / "empty.npy", out, [], 2, "empty file"),
        "no images": (w, root / "noimages", out, [], 2, "no PNG/JPEG"),
        "non-image file": (w, root / "mixed", out, [], 2, "'notes.txt', not a PNG/JPEG"),
        "colour palette png": (w, root / "palette", out, [], 2, r"a\.png has image mode P \(col"),
        "missing out folder": (w, x, str(root / "nowhere" / "p.npz"), [], 2, "does not exist"),
        "out is a folder": (w, x, str(root / "out.npz"), [], 2, "is a folder"),
        "out kind": (w, x, str(root / "out" / "p.txt"), [], 2, r"\.npz or \.csv"),
        "sets uncalibrated": (run.plain, x, out, ["--sets"], 2, "no prediction sets: run"),
        "members in a csv": (w, x, str(root / "out" / "m.csv"), ["--members"], 2, "FILE.npz"),
        "out is the input": (w, same / "x.npz", str(same / "x.npz"), [], 2, "is the --input"),
        "out links to the input": (w, same / "x.npz", str(same / "link.npz"), [], 2, "is the --i"),
        "out is the input, relative": (w, same / "x.npz", relative, [], 2, "is the --input file"),
    }


CASES = [
    "no checkpoint",
    "damaged checkpoint",
    "wrong shape",
    "wrong dtype",
    "floats in [0, 1]",
    "floats 0..255",
    "empty file",
    "no images",
    "non-image file",
    "colour palette png",
    "missing out folder",
    "out is a folder",
    "out kind",
    "sets uncalibrated",
    "members in a csv",
    "out is the input",
    "out links to the input",
    "out is the input, relative",
]


@pytest.mark.slow  # among the heaviest default tests, measured
@pytest.mark.parametrize("case", CASES)
def test_bad_input_gets_one_line_and_writes_nothing(run, capsys, monkeypatch, case):
    # a CheckpointError leaves the CLI through os._exit (orbax's threads): keep pytest alive
    monkeypatch.setattr(cli, "hard_exit", lambda code, line: None)
    workdir, x, out, extra, code, message = _bad_cases(run)[case]
    if case == "out is a folder":
        os.makedirs(out, exist_ok=True)
    before = sorted(os.walk(workdir))
    folder = os.path.dirname(os.path.abspath(out))
    had = sorted(os.listdir(folder)) if os.path.isdir(folder) else None
    given = pathlib.Path(x).read_bytes() if os.path.isfile(x) else None
    rc = cli.main(["predict", "--workdir", workdir, "--input", str(x), "--out", out, *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == code and len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(message, err[0]), err
    assert sorted(os.walk(workdir)) == before  # the run is read, never changed
    if had is not None:
        assert sorted(os.listdir(folder)) == had  # no output, no temporary file
    if given is not None:
        assert pathlib.Path(x).read_bytes() == given  # the input is never replaced


def test_an_unwritable_out_names_the_output_file_not_a_workdir(run, capsys):
    x = run.root / "unwritable" / "x.npy"
    x.parent.mkdir(exist_ok=True)  # its own folder: no other test's files needed
    np.save(x, run.images[:3])
    rc = cli.main(["predict", "--workdir", run.workdir, "--input", str(x), "--out", "/proc/x.npz"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: --out /proc/x.npz: its folder /proc is not writable ("), err
    assert "workdir" not in err[0]
    rc = cli.main(["export", "--workdir", run.workdir, "--out", "/proc/exported"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert err[0].startswith("error: --out /proc/exported is not writable ("), err
    assert "workdir" not in err[0]


@pytest.mark.parametrize(
    "value, what",
    [(np.nan, "nan (not finite)"), (-np.inf, "-inf (not finite)"), (1e39, "1e+39 (beyond")],
)
def test_features_with_a_nan_or_inf_are_refused_naming_the_row_and_column(tmp_path, value, what):
    x = np.zeros((70_000, 3), np.float64)  # more rows than one block of the check
    x[66_000, 2] = value
    np.save(tmp_path / "x.npy", x)
    want = f"--input {tmp_path / 'x.npy'} holds {what}"
    with pytest.raises(ValueError, match=re.escape(want) + r".* at row 66000, column 2; give"):
        inputs.open_features(str(tmp_path / "x.npy"), 3)
    with pytest.raises(ValueError, match="at row 66000, column 2"):
        inputs.as_features(x, 3)
    x[66_000, 2] = np.finfo(np.float32).max  # the largest float32 still predicts
    assert inputs.as_features(x, 3) is x


@pytest.mark.slow  # among the heaviest default tests, measured
def test_export_takes_quiet_as_predict_does(run, capsys, tmp_path):
    out = os.fspath(tmp_path / "quiet")
    argv = ["export", "--workdir", run.workdir, "--out", out, "--platforms", "cpu", "--quiet"]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == "" and sorted(os.listdir(out)) == [
        "ensemble.jax",
        "export.json",
    ]


def test_export_refuses_a_file_as_its_folder(run, capsys):
    target = run.root / "a_file"
    target.write_text("x")
    assert cli.main(["export", "--workdir", run.workdir, "--out", str(target)]) == 2
    assert "is a file" in capsys.readouterr().err and target.read_text() == "x"


@pytest.mark.slow
def test_cnn_run_of_eight_members_predicts_and_exports(tmp_path):
    need_devices(8)
    ds = data.synthetic(512, 64, seed=1)
    npz = data.save_npz(ds, tmp_path / "d.npz")
    workdir = os.fspath(tmp_path / "cnn")
    cfg = small_config(
        workdir,
        model="cnn",
        members=8,
        mesh="ensemble=8,data=1",
        epochs=1,
        source="npz",
        data_file=npz,
    )
    train(cfg)
    ens = build_ensemble(cfg, me.make_mesh(8, 1), 512)
    state, _, _ = me.restore_checkpoint(workdir, ens, ds.test_images[:1])
    want = np.asarray(ens.predict(state, ds.test_images))
    out = tmp_path / "p.npz"
    np.save(tmp_path / "x.npy", ds.test_images)
    assert (
        cli.main(
            [
                "predict",
                "--workdir",
                workdir,
                "--input",
                str(tmp_path / "x.npy"),
                "--out",
                str(out),
                "--batch-size",
                "24",
            ]
        )
        == 0
    )
    np.testing.assert_allclose(np.load(out)["probs"], want, atol=1e-6)
    assert cli.main(["export", "--workdir", workdir, "--out", str(tmp_path / "e")]) == 0
    exp = jax.export.deserialize(bytearray((tmp_path / "e" / "ensemble.jax").read_bytes()))
    for n in (1, 7, 64):
        got = np.asarray(exp.call(ds.test_images[:n])["probs"])
        np.testing.assert_allclose(got, want[:n], atol=1e-5)


def test_outputs_are_written_atomically(tmp_path, monkeypatch):
    from meshensemble.serving.outputs import write_predictions

    target = tmp_path / "p.npz"
    target.write_bytes(b"old")

    def half(f, **arrays):
        f.write(b"half of a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(np, "savez", half)
    with pytest.raises(me.training.OutputError, match=r"could not write .*p\.npz: No space left"):
        write_predictions(str(target), {"probs": np.ones((2, 3))})
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["p.npz"]
    monkeypatch.undo()
    write_predictions(str(target), {"probs": np.ones((2, 3))})
    assert np.load(target)["probs"].shape == (2, 3) and os.listdir(tmp_path) == ["p.npz"]


def test_reads_the_calibration_evaluate_calibrate_writes(run, tmp_path):
    from meshensemble.calibration.run import calibrate_ensemble

    x, y = run.images, np.asarray(data.synthetic(NUM_TRAIN, NUM_TEST, seed=3).test_labels)
    y = np.where(np.arange(len(y)) % 3 == 0, (y + 1) % 10, y)  # some wrong: T is no bound
    section, _ = calibrate_ensemble(run.ref.ens, run.ref.state, (x, y), (x, y), 0.2, "aps")
    ident = _identity(run.workdir, run.ref.step)
    result = {"checkpoint_step": run.ref.step, "calibration": section | {"fitted_for": ident}}
    (tmp_path / "evaluation.json").write_text(json.dumps(result))  # as evaluate_run writes it
    task = me.tasks.Classification()
    cal, why = predictor.read_calibration(str(tmp_path), task, run.ref.step, ident)
    assert why == "" and cal.temperature == section["temperature"]
    assert (cal.method, cal.alpha) == ("aps", 0.2)
    assert cal.threshold == section["conformal"]["threshold"]


@pytest.mark.parametrize("method", ["aps", "raps"])
def test_a_run_calibrated_with_aps_or_raps_predicts_those_sets(run, tmp_path, method):
    """The predictor's sets are the run's method at its threshold, recomputed here with
    ``me.calibration`` from the predictor's calibrated probabilities, not THR's."""
    x, y = run.images, np.asarray(data.synthetic(NUM_TRAIN, NUM_TEST, seed=3).test_labels)
    y = np.where(np.arange(len(y)) % 3 == 0, (y + 1) % 10, y)  # some wrong: T is no bound
    section, _ = me.calibration.run.calibrate_ensemble(
        run.ref.ens, run.ref.state, (x, y), (x, y), 0.2, method
    )
    workdir = tmp_path / "run"
    shutil.copytree(run.plain, workdir)
    section |= {"fitted_for": _identity(os.fspath(workdir), run.ref.step)}
    result = {"checkpoint_step": run.ref.step, "calibration": section}  # as evaluate writes
    (workdir / "evaluation.json").write_text(json.dumps(result))
    p = me.load_predictor(os.fspath(workdir))
    q = section["conformal"]["threshold"]
    assert p.calibration.method == method and p.calibration.threshold == q
    probs = p.predict(x)  # calibrated with the run's temperature
    want = np.asarray(me.calibration.prediction_sets(probs, q, method))
    got = p.prediction_sets(x)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(p.outputs(x)["prediction_set"], want)
    thr = np.asarray(me.calibration.prediction_sets(probs, q, "thr"))
    assert (thr != want).any(-1).sum() >= 5  # the method changes the sets here
