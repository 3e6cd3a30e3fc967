"""A training split that stays in its files (`--source arrayrecord`, `tfds --input stream`)."""

from __future__ import annotations

import json
import os
import shutil
import threading

import chex
import jax
import numpy as np
import pytest
import test_multiprocess as mp
from conftest import need_devices, small_config

import meshensemble as me
from meshensemble import cli
from meshensemble.data import lazy, manifest, stream
from meshensemble.training import train
from meshensemble.training.identity import data_fingerprint, data_identity, split_fingerprint

BIG = me.data.synthetic(num_train=4096, num_test=40, seed=5)  # N >> what 2 steps read


@pytest.fixture(autouse=True)
def verify_cache(tmp_path_factory, monkeypatch):
    """Each test's own cache of verified files (never the user's ~/.cache)."""
    path = tmp_path_factory.mktemp("cache") / "verified-files.json"
    monkeypatch.setenv(manifest.VERIFY_CACHE_ENV, str(path))
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """``BIG`` as ArrayRecord files (2 train shards) and as an npz."""
    root = tmp_path_factory.mktemp("lazy")
    lazy.write_array_record_dataset(root / "ar", BIG, shards=2)
    return str(root / "ar"), me.data.save_npz(BIG, root / "big.npz")


def run_args(workdir, *extra) -> list[str]:
    """A ``train`` command of 2 steps of 4 MLP members on (4, 2), as small_config's run."""
    return [
        "train", "--model", "mlp", "--members", "4", "--mesh", "ensemble=4,data=2",
        "--member-strategy", "vmap", "--batch-size", "32", "--max-steps", "2",
        "--learning-rate", "0.05", "--eval-batch-size", "40", "--workdir", str(workdir),
        "--quiet", *extra,
    ]  # fmt: skip


def count_reads(monkeypatch) -> list[np.ndarray]:
    """The indices of every read of train files (ArrayRecordSource), from any thread."""
    reads, lock, read = [], threading.Lock(), stream.ArrayRecordSource.read

    def counted(self, indices):
        if lazy.TRAIN_FILE in os.path.basename(self.paths[0]):  # not the test split's reads
            with lock:
                reads.append(np.asarray(indices).reshape(-1))
        return read(self, indices)

    monkeypatch.setattr(stream.ArrayRecordSource, "read", counted)
    return reads


# ------------------------------------------------------------------ the lazy array
def test_source_images_read_only_where_indexed_and_refuse_a_whole_load(files, monkeypatch):
    ds = me.data.load_array_record_dataset(files[0])
    x = ds.train_images
    assert me.data.is_lazy(ds) and not me.data.is_lazy(BIG) and ds.source == "arrayrecord"
    assert (len(x), x.shape, x.dtype, x.ndim) == (4096, (4096, 28, 28, 1), np.uint8, 4)
    np.testing.assert_array_equal(ds.train_labels, BIG.train_labels)
    np.testing.assert_array_equal(ds.test_images, BIG.test_images)  # read whole
    reads = count_reads(monkeypatch)
    np.testing.assert_array_equal(x[7], BIG.train_images[7])
    np.testing.assert_array_equal(x[-1], BIG.train_images[-1])
    np.testing.assert_array_equal(x[10:20:3], BIG.train_images[10:20:3])
    np.testing.assert_array_equal(x[np.array([[4095, 3], [2048, 0]])],
                                  BIG.train_images[np.array([[4095, 3], [2048, 0]])])  # fmt: skip
    assert x[:0].shape == (0, 28, 28, 1)
    assert sum(map(len, reads)) == 1 + 1 + 4 + 4  # exactly the examples indexed
    with pytest.raises(me.data.DataError, match="would load all 4,096 training images.*stream"):
        np.asarray(x)
    with pytest.raises(IndexError):
        x[4096]
    # a validation split of a lazy split: a lazy (index-remapped) train split, arrays held out
    split = me.data.split_validation(ds, 96, seed=1, batch_size=32)
    ref = me.data.split_validation(BIG, 96, seed=1, batch_size=32)
    assert me.data.is_lazy(split.train) and split.train.num_train == 4000
    np.testing.assert_array_equal(split.images, ref.images)
    np.testing.assert_array_equal(split.train.train_images[[0, 3999]],
                                  ref.train.train_images[[0, 3999]])  # fmt: skip
    # the fingerprint: the files' manifest (no image read), every label; a changed label
    # changes it
    assert split_fingerprint(x, ds.train_labels).startswith("manifest:")
    reads.clear()  # the identity with a validation split reads no image of the files
    held = data_identity(ds, None, validation=96, seed=1)["splits"]
    assert (
        not reads
        and held["validation"].startswith("manifest:")
        and held["train"] != (data_identity(ds, None)["splits"]["train"])
    )
    assert split_fingerprint(BIG.train_images, BIG.train_labels).startswith("bytes:")
    labels = BIG.train_labels.copy()
    labels[5] = (labels[5] + 1) % 10
    changed = me.data.Dataset("mnist", x, labels, ds.test_images, ds.test_labels,
                              source="arrayrecord", note="x")  # fmt: skip
    assert data_fingerprint(changed) != data_fingerprint(ds)
    labels[7] = 11  # not an image the check reads: every label is checked
    with pytest.raises(me.data.DataError, match="label 11 at index 7"):
        me.data.Dataset("mnist", x, labels, ds.test_images, ds.test_labels,
                        source="arrayrecord", note="x")  # fmt: skip


# ------------------------------------------------------------------ runs
@pytest.mark.slow  # among the heaviest default tests, measured
def test_streamed_arrayrecord_cli_run_equals_in_memory_runs_and_reads_only_its_batches(
    files, tmp_path, monkeypatch
):
    need_devices(8)
    directory, npz = files
    reads = count_reads(monkeypatch)
    workdir = tmp_path / "ar"
    argv = run_args(workdir, "--source", "arrayrecord", "--data-dir", directory)
    assert cli.main(argv) == 0  # --input auto: a lazy split streams
    config = json.loads((workdir / "config.json").read_text())
    assert config["resolved"]["data_identity"]["source"] == "arrayrecord"
    # reads: the check of 2 images, the init sample, and the batches of the 2 steps plus
    # what Grain read ahead (8 steps): never the 4096 examples (the identity reads none)
    batches = [r for r in reads if len(r) == 32]
    assert 2 <= len(batches) <= 2 + 8
    assert sum(map(len, reads)) <= 2 + 1 + 32 * len(batches) < 4096 // 2
    cfg = dict(model="mlp", member_strategy="vmap", max_steps=2, checkpoint=False)
    in_memory = dict(source="npz", data_file=npz)
    device = train(small_config(tmp_path / "d", input="device", **cfg, **in_memory))
    streamed = train(small_config(tmp_path / "s", input="stream", **cfg, **in_memory))
    ens = device.ensemble
    state, _, step = me.restore_checkpoint(str(workdir), ens, BIG.test_images[:1])
    assert step == 2
    record = json.loads((workdir / "metrics.jsonl").read_text().splitlines()[-1])
    for other in (device, streamed):
        chex.assert_trees_all_close(
            jax.device_get(state.params), jax.device_get(other.state.params), atol=1e-5
        )
        for key, value in other.history[-1].items():  # train_curve: a dict of lists
            for a, b in zip(jax.tree.leaves(record[key]), jax.tree.leaves(value), strict=True):
                np.testing.assert_allclose(a, b, atol=1e-5, err_msg=key)


@pytest.mark.slow  # among the heaviest default tests, measured
def test_tfds_input_stream_opens_a_lazy_train_split(mock_tfds, tmp_path, monkeypatch):
    need_devices(8)
    with mock_tfds(num_examples=64):
        ds = me.data.load_dataset("mnist", "tfds", stream=True, log=lambda s: None)
        assert me.data.is_lazy(ds) and ds.num_train == 64 and ds.test_images.shape[0] == 64
        assert isinstance(ds.train_images.source, stream.TfdsSource)
        x, y = ds.train_images.source.read(np.arange(64))
        np.testing.assert_array_equal(ds.train_labels, y)
        np.testing.assert_array_equal(ds.train_images[[5, 1]], x[[5, 1]])
        argv = run_args(tmp_path / "t", "--source", "tfds", "--input", "stream")
        assert cli.main(argv) == 0
    assert "train split read lazily" in json.loads((tmp_path / "t/config.json").read_text())[
        "resolved"]["data"]  # fmt: skip


class FakeTfdsSplit:
    """What ``split_files`` reads of a ``tfds.data_source`` split: TFDS's own SplitDict of
    prepared array_record shards in ``directory`` (16 records each), the split, a length."""

    def __init__(self, directory, split="train", shards=2):
        from tensorflow_datasets.core import naming
        from tensorflow_datasets.core import splits as splits_lib

        template = naming.ShardedFileTemplate(
            data_dir=str(directory), dataset_name="mnist", split="train",
            filetype_suffix="array_record",
        )  # fmt: skip
        info = splits_lib.SplitInfo(
            name="train", shard_lengths=[16] * shards, num_bytes=0, filename_template=template
        )
        splits = splits_lib.SplitDict([info])
        self.dataset_info = type(
            "Info", (), {"name": "mnist", "version": "3.0.1", "splits": splits}
        )()
        self.split = split
        self.length = sum(f.take for f in splits[split].file_instructions)

    def __len__(self):
        return self.length


def test_tfds_split_identity_covers_every_byte_of_its_files_hashed_once_per_host(
    tmp_path, monkeypatch
):
    pytest.importorskip("tensorflow_datasets")
    from meshensemble.data import tfds as tfds_lib

    hashed, digest = [], manifest.file_digest
    monkeypatch.setattr(manifest, "file_digest", lambda p: hashed.append(p) or digest(p))

    paths = [tmp_path / f"mnist-train.array_record-0000{i}-of-00002" for i in range(2)]
    for i, p in enumerate(paths):
        p.write_bytes(bytes(range(i, 200 + i)))
    split = FakeTfdsSplit(tmp_path)
    assert [f for f, _, _ in tfds_lib.split_files(split)] == [str(p) for p in paths]
    first = tfds_lib.split_content_id(split)
    assert first.startswith("tfds:") and len(hashed) == 2
    assert tfds_lib.split_content_id(FakeTfdsSplit(tmp_path)) == first and len(hashed) == 2
    assert tfds_lib.split_content_id(FakeTfdsSplit(tmp_path, "train[:20]")) != first
    data = bytearray(paths[1].read_bytes())
    data[100] ^= 1  # one bit of the second file, same size
    paths[1].write_bytes(bytes(data))
    assert tfds_lib.split_content_id(split) != first
    assert tfds_lib.split_content_id(FakeTfdsSplit(tmp_path, shards=3)) is None  # one missing


@pytest.mark.slow  # among the heaviest default tests, measured
def test_evaluate_and_resume_refuse_changed_tfds_files_naming_the_split(
    mock_tfds, tmp_path, monkeypatch, capsys
):
    need_devices(8)
    from meshensemble.data import tfds as tfds_lib

    # the mock's records come from no file: the train split "reads" this file instead
    shard = tmp_path / "mnist-train.array_record-00000-of-00001"
    shard.write_bytes(bytes(range(256)) * 4)
    files = tfds_lib.split_files
    monkeypatch.setattr(
        tfds_lib,
        "split_files",
        lambda r: [(str(shard), 0, len(r))] if str(r.split) == "train" else files(r),
    )
    workdir = tmp_path / "t"
    argv = run_args(workdir, "--source", "tfds", "--input", "stream", "--validation", "8")
    argv[argv.index("--max-steps") + 1] = "1"
    with mock_tfds(num_examples=64):
        assert cli.main(argv) == 0
        held = json.loads((workdir / "config.json").read_text())["resolved"]["data_identity"]
        assert held["splits"]["train"].startswith("manifest:"), held
        evaluate = ["evaluate", "--workdir", str(workdir), "--mesh", "ensemble=4,data=2"]
        capsys.readouterr()
        assert cli.main(evaluate) == 0  # the same files: accepted
        shard.write_bytes(bytes(reversed(range(256))) * 4)  # same size, other content
        before = sorted(p.name for p in workdir.rglob("*"))
        for command, want in ((evaluate, "train and validation splits"),
                              (argv, "train split fingerprint")):  # fmt: skip
            capsys.readouterr()
            assert cli.main(command) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and want in err[0], err
        assert sorted(p.name for p in workdir.rglob("*")) == before


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "case", ["no directory", "no labels", "no train files", "malformed labels", "short labels",
             "no --data-dir", "data file", "--input device"]
)  # fmt: skip
def test_bad_arrayrecord_data_is_one_line_exit_2_and_nothing_written(files, tmp_path, capsys, case):
    directory = tmp_path / "ar"
    lazy.write_array_record_dataset(directory, me.data.synthetic(64, 16, seed=1))
    source = ["--source", "arrayrecord", "--data-dir", str(directory)]
    want = {"no directory": "no such directory", "no labels": "missing labels.npz",
            "no train files": "missing train.array_record", "malformed labels": "not readable",
            "short labels": "has train_labels of shape (3,) but the train files hold 64",
            "no --data-dir": "needs --data-dir DIR", "data file": "only read with source 'npz'",
            "--input device": "--input device would load all 64 training images"}[case]  # fmt: skip
    extra: list[str] = []
    if case == "no directory":
        source[-1] = str(tmp_path / "nowhere")
    elif case == "no labels":
        os.remove(directory / "labels.npz")
    elif case == "no train files":
        os.remove(directory / "train.array_record")
    elif case == "malformed labels":  # in a folder without a manifest (it would say first)
        (directory / "labels.npz").write_bytes(b"not an npz")
        os.remove(directory / manifest.MANIFEST_FILE)
    elif case == "short labels":
        np.savez(directory / "labels.npz", train_labels=np.zeros(3), test_labels=np.zeros(16))
        os.remove(directory / manifest.MANIFEST_FILE)
    elif case == "no --data-dir":
        source = source[:2]
    elif case == "data file":
        extra = ["--data-file", str(directory / "labels.npz")]
    else:
        extra = ["--input", "device"]
    workdir = tmp_path / "run"
    assert cli.main(run_args(workdir, *source, *extra)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and want in err[0], err
    if case not in ("no --data-dir", "data file", "--input device"):
        assert "meshensemble convert --data-file" in err[0]  # names the fix
    assert not workdir.exists()


@pytest.mark.slow  # among the heaviest default tests, measured
def test_resume_refuses_changed_arrayrecord_files(tmp_path, capsys):
    need_devices(8)
    data = me.data.synthetic(64, 16, seed=4)
    directory, workdir = tmp_path / "ar", tmp_path / "run"
    lazy.write_array_record_dataset(directory, data)
    argv = run_args(workdir, "--source", "arrayrecord", "--data-dir", str(directory))
    argv[argv.index("--max-steps") + 1] = "1"
    assert cli.main(argv) == 0
    labels = data.train_labels.copy()
    labels[9] = (labels[9] + 1) % 10  # one label of the files changed: another dataset
    changed = me.data.Dataset("mnist", data.train_images, labels, data.test_images,
                              data.test_labels, source="synthetic", note="x")  # fmt: skip
    lazy.write_array_record_dataset(directory, changed, overwrite=True)
    capsys.readouterr()
    argv[argv.index("--max-steps") + 1] = "2"
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train split fingerprint" in err[0], err


def test_convert_writes_the_files_train_reads(tmp_path, capsys):
    npz = me.data.save_npz(me.data.synthetic(64, 16, seed=2), tmp_path / "d.npz")
    out = tmp_path / "ar"
    argv = ["convert", "--data-file", npz, "--out", str(out), "--shards", "3"]
    mask = os.umask(0o022)
    try:
        assert cli.main(argv) == 0
    finally:
        os.umask(mask)
    assert oct(os.stat(out).st_mode & 0o777) == oct(0o755)  # not mkdtemp's 0700: shared data
    names = sorted(os.listdir(out))
    assert names == ["labels.npz", "manifest.json", "test.array_record", "train.array_record"]
    ds = me.data.load_array_record_dataset(out)
    np.testing.assert_array_equal(
        ds.train_images[np.arange(64)], me.data.load_npz(npz).train_images
    )
    assert cli.main(["convert", "--data-file", npz, "--out", str(out), "--shards", "0"]) == 2


def test_convert_caps_shards_refuses_a_full_folder_and_leaves_no_partial_one(
    tmp_path, capsys, monkeypatch
):
    npz = me.data.save_npz(me.data.synthetic(2048, 16, seed=2), tmp_path / "d.npz")
    out = tmp_path / "ar"
    argv = ["convert", "--data-file", npz, "--out", str(out)]
    assert cli.main([*argv, "--shards", "5000"]) == 0  # not 5,000 files of 0-1 examples
    assert "--shards 5000: writing 2 train file(s) instead" in capsys.readouterr().out
    two = sorted(os.listdir(out))
    shards = [f"train.array_record-0000{i}-of-00002" for i in range(2)]
    assert two == ["labels.npz", "manifest.json", "test.array_record", *shards]
    before = {n: (out / n).read_bytes() for n in two}
    assert cli.main(argv) == 2  # a full folder: refused before anything is written
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not empty; pass --overwrite" in err, err
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before
    with pytest.raises(me.data.DataError, match="not empty; pass --overwrite"):
        lazy.write_array_record_dataset(out, BIG)  # from Python too
    with pytest.raises(me.data.DataError, match="holds 'ar', which convert did not write"):
        lazy.write_array_record_dataset(tmp_path, BIG, overwrite=True)  # never a foreign folder
    assert cli.main([*argv, "--overwrite"]) == 0  # no old shard left behind
    assert sorted(os.listdir(out)) == [*two[:3], "train.array_record"]
    me.data.load_array_record_dataset(out)
    # Ctrl-C mid-write: no partial folder, the old one intact
    write = lazy.write_array_record

    def interrupted(path, *args, **kw):
        if lazy.TEST_FILE in os.fspath(path):
            raise KeyboardInterrupt
        return write(path, *args, **kw)

    monkeypatch.setattr(lazy, "write_array_record", interrupted)
    before = {n: (out / n).read_bytes() for n in os.listdir(out)}
    for target in (tmp_path / "new", out):
        with pytest.raises(KeyboardInterrupt):
            lazy.write_array_record_dataset(target, BIG, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["ar", "d.npz"]
    assert {n: (out / n).read_bytes() for n in os.listdir(out)} == before


def test_a_missing_changed_or_corrupt_shard_is_named_with_the_fix(files, tmp_path):
    directory = tmp_path / "ar"
    shutil.copytree(files[0], directory)
    shard = directory / "train.array_record-00001-of-00002"
    raw = bytearray(shard.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # same size: only its content hash tells
    shard.write_bytes(bytes(raw))
    with pytest.raises(me.data.DataError) as err:  # the load reads the last image: shard 1
        me.data.load_array_record_dataset(directory)
    assert str(err.value).startswith(f"{shard}: its content differs from the SHA-256 in ")
    assert "--overwrite" in str(err.value)
    os.remove(directory / manifest.MANIFEST_FILE)  # no manifest: Riegeli's own check, named
    ds = me.data.load_array_record_dataset(directory)
    with pytest.raises(me.data.DataError, match=f"^{shard}: cannot read its records"):
        ds.train_images[np.arange(2048, 4096)]
    os.remove(directory / "train.array_record-00000-of-00002")
    with pytest.raises(me.data.DataError, match=r"train.array_record-00000-of-00002: missing"):
        me.data.load_array_record_dataset(directory)
    (directory / "train.array_record-00000-of-00003").write_bytes(b"")  # an old convert's
    with pytest.raises(me.data.DataError, match=r"shards of several conversions \(-of-00002"):
        me.data.load_array_record_dataset(directory)


def test_a_host_hashes_a_file_once_until_it_changes(tmp_path, verify_cache, monkeypatch):
    directory = tmp_path / "ar"
    lazy.write_array_record_dataset(directory, BIG, shards=2)
    me.data.load_array_record_dataset(directory)  # reads images of both shards: verifies them
    assert len(json.loads(verify_cache.read_text())) == 4  # 2 shards, test file, labels
    hashed = []
    digest = manifest.file_digest
    monkeypatch.setattr(manifest, "file_digest", lambda p: hashed.append(p) or digest(p))
    me.data.load_array_record_dataset(directory)  # another start on this host: no hash
    assert hashed == []
    shard = directory / "train.array_record-00001-of-00002"
    os.utime(shard, ns=(1, 1))  # the file was rewritten (same bytes here): hashed again
    ds = me.data.load_array_record_dataset(directory)
    assert hashed == [str(shard)]
    ds.train_images[np.arange(4096)]  # reads both shards: each verified once
    assert hashed == [str(shard)]


# ------------------------------------------------------------------ 2 processes
TRACE = mp.TRACE.replace("stream.ArraySource", "stream.ArrayRecordSource")
"""Every process logs the example indices it reads from the ArrayRecord files."""


@pytest.mark.slow
def test_two_processes_read_their_half_of_each_batch_from_the_files(tmp_path, monkeypatch):
    need_devices(8)
    directory = tmp_path / "ar"
    lazy.write_array_record_dataset(directory, mp.DATA)
    npz = me.data.save_npz(mp.DATA, tmp_path / "d.npz")
    trace, hook = tmp_path / "trace", tmp_path / "hook"
    trace.mkdir(), hook.mkdir()
    (hook / "sitecustomize.py").write_text(TRACE)
    env = {"STREAM_TRACE": str(trace), "PYTHONPATH": f"{hook}{os.pathsep}{mp.REPO}"}
    mesh, workdir = "ensemble=1,data=8", tmp_path / "multi"
    argv = mp.args(npz, workdir, mesh)
    argv[argv.index("npz")] = "arrayrecord"
    argv[argv.index("--data-file") : argv.index("--data-file") + 2] = ["--data-dir", str(directory)]
    argv += ["--input", "stream"]
    assert mp.launch_local(argv, 2, 4, timeout=300, env=env, prefix_output=False) == 0
    one_reads = []
    read = stream.ArraySource.read
    monkeypatch.setattr(
        stream.ArraySource,
        "read",
        lambda self, idx: one_reads.append(np.asarray(idx).reshape(-1)) or read(self, idx),
    )
    one = mp.one_process(npz, tmp_path, mesh, input="stream")
    reads = [
        {tuple(int(i) for i in s.split()) for s in (trace / f"p{p}.txt").read_text().splitlines()}
        for p in range(2)
    ]
    batches = [r for r in one_reads if len(r) == 32][:3]
    assert len(batches) == 3
    for batch in batches:  # process 0 read the first 16 rows of each batch, process 1 the rest
        assert tuple(batch[:16]) in reads[0] and tuple(batch[16:]) in reads[1]
        assert tuple(batch) not in reads[0] | reads[1]
    for mine in reads:  # besides 16-row halves: the fingerprint (all 128), 2 checked, 1 init
        assert {len(r) for r in mine} <= {16, 128, 2, 1, 32, 40}  # sample, the test split (40)
        assert {r for r in mine if len(r) == 32} <= {tuple(range(32))}  # the tuner's batch
    mp.assert_equals_one_process(workdir, one)
