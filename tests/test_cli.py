"""The ``meshensemble`` command line: flags generated from TrainConfig, one-line errors."""

from __future__ import annotations

import argparse
import dataclasses
import re

import pytest

import meshensemble as me
from meshensemble import cli, data
from meshensemble.cli import common
from meshensemble.cli import evaluate as cli_evaluate
from meshensemble.cli import train as cli_train
from meshensemble.training.config import (
    GROUPS,
    config_field,
    field_choices,
    field_help,
)

FIELDS = {f.name: f for f in dataclasses.fields(me.TrainConfig)}


def subparser(module) -> argparse.ArgumentParser:
    return module.add_parser(common.Parser(prog="meshensemble").add_subparsers())


def actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and "-h" not in a.option_strings]


def test_every_field_has_a_flag_with_its_help_choices_and_default():
    parser = subparser(cli_train)
    by_dest = {a.dest: a for a in actions(parser)}
    for name, f in FIELDS.items():
        assert name in by_dest, f"TrainConfig.{name} has no train flag"
        action = by_dest[name]
        assert f"--{name.replace('_', '-')}" in action.option_strings
        assert field_help(f) and field_help(f).replace("%", "%%") in action.help
        assert f"(default: {common.format_default(f.default)})" in action.help, action.help
        if f.type in ("bool", bool):
            assert f"--no-{name.replace('_', '-')}" in action.option_strings
        if field_choices(f) is not None:
            assert tuple(action.choices) == field_choices(f)
        assert action.default is None  # "not given" is told apart from the default
    text = parser.format_help()
    assert "(default: " in text and "%" not in re.sub(r"\d%", "", text)


def test_conv_help_names_what_auto_does_on_each_platform():
    from meshensemble.models.conv import default_conv
    from meshensemble.training.tuning import conv_candidates

    text = " ".join(field_help(config_field("conv")).split())
    assert f"(CPU: {', '.join(conv_candidates('cpu'))};" in text, text
    assert f"without it: {default_conv('cpu')}, " in text, text  # not im2col on CPU
    assert f"{default_conv('gpu')} matmuls on GPU, {default_conv('tpu')} on TPU" in text, text


def test_every_flag_is_a_field_or_one_of_the_few_others():
    others = set(cli_train.OTHER_FLAGS)
    for action in actions(subparser(cli_train)):
        if action.dest in FIELDS:
            continue
        assert set(action.option_strings) <= others, action.option_strings


def test_docstring_lists_every_field_with_its_help():
    doc = me.TrainConfig.__doc__
    listed = re.findall(r"^  (\w+): ", doc.split("Attributes:")[1], re.MULTILINE)
    assert listed == list(FIELDS)
    flat = " ".join(doc.split())
    for name, f in FIELDS.items():
        assert f"{name}: {field_help(f)}" in flat, name


def test_model_choices_come_from_the_registry(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the default workdir: a run there (the main job's) is resumed
    assert "resnet" in me.TrainConfig.__doc__ and "cnn or mlp" not in me.TrainConfig.__doc__
    monkeypatch.setitem(me.models.REGISTRY, "tiny", me.models.MLP)
    assert "tiny" in field_help(config_field("model"))  # read when used: later entries too
    args = cli.build_parser().parse_args(["train", "--model", "tiny"])
    assert cli_train.config_from_args(args).model == "tiny"
    args = cli.build_parser().parse_args(["train", "--model", "tiny_no"])
    with pytest.raises(ValueError, match="model='tiny_no' is unknown.*module:Class"):
        cli_train.config_from_args(args).validate()


def test_train_help_lists_every_flag_in_its_fields_group():
    parser = subparser(cli_train)
    groups = {g.title: g for g in parser._action_groups}
    assert [t for t in groups if t in GROUPS] == list(GROUPS)  # all, in order
    def where(flag):
        return next(g.title for g in parser._action_groups
                    if any(flag in a.option_strings for a in g._group_actions))  # fmt: skip

    for name, f in FIELDS.items():
        assert where("--" + name.replace("_", "-")) == f.metadata["group"], name
    assert where("--coordinator") == "multi-host"
    assert where("--fake-devices") == "ensemble and mesh"
    assert where("--config") == "run control"
    text = parser.format_help()
    assert [t for t in GROUPS if f"\n{t}:\n" in text] == list(GROUPS)
    assert text.index("\ndata:\n") < text.index("\n  --validation") < text.index("\nmodel:\n")
    with pytest.raises(ValueError, match="group"):
        me.training.fields.config_field_of(1, "x", group="elsewhere")


def test_existing_flag_spellings_keep_working(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # the default workdir: a run there (the main job's) is resumed
    parse = lambda *argv: cli.build_parser().parse_args(["train", *argv])
    args = parse("--no-checkpoint", "--no-resume", "--overwrite", "--streaming", "--tensorboard")
    assert (args.checkpoint, args.resume, args.overwrite) == (False, False, True)
    assert (args.streaming, args.tensorboard) == (True, True)
    args = parse("--quiet", "--checkpoint-every", "5", "--keep", "2", "--max-steps", "3")
    assert (args.quiet, args.checkpoint_every, args.keep, args.max_steps) == (True, 5, 2, 3)
    assert parse("--checkpoint").checkpoint is True and parse().checkpoint is None
    cfg = cli_train.config_from_args(parse("--learning-rate", "0.05", "--mesh", "ensemble=2"))
    assert (cfg.learning_rate, cfg.mesh, cfg.members) == (0.05, "ensemble=2", 8)


def test_rank_without_a_backbone_is_refused_not_ignored(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    parse = lambda *argv: cli.build_parser().parse_args(["train", *argv])
    with pytest.raises(me.UsageError, match=r"^--rank 3 is the rank of --backbone adapters.*"
                       r"drop --rank, or add --backbone RUN_OR_FILE$"):  # fmt: skip
        cli_train.config_from_args(parse("--rank", "3"))
    assert cli_train.config_from_args(parse("--rank", "3", "--backbone", "b.npz")).rank == 3
    assert cli_train.config_from_args(parse()).rank == 4  # the default, not given: no refusal


def test_evaluate_flags_reuse_the_fields_metadata():
    by_flag = {a.option_strings[0]: a for a in actions(subparser(cli_evaluate))}
    assert tuple(by_flag["--source"].choices) == data.SOURCES  # the tables too
    for flag, name in (
        ("--mesh", "mesh"),
        ("--source", "source"),
        ("--data-file", "data_file"),
        ("--workdir", "workdir"),
        ("--batch-size", "eval_batch_size"),
    ):
        if name != "workdir":
            assert field_help(config_field(name)) in by_flag[flag].help, flag
        assert by_flag[flag].dest == name
    assert by_flag["--workdir"].required
    assert by_flag["--batch-size"].default == 1000 and by_flag["--batch-size"].type is int


def test_every_subcommand_has_debug():
    parser = cli.build_parser()
    for command in ("train", "evaluate", "bench"):
        argv = [command, "--debug"] + (["--workdir", "x"] if command == "evaluate" else [])
        assert parser.parse_args(argv).debug is True, command


def test_unexpected_errors_are_one_line_unless_debug(monkeypatch, capsys, tmp_path):
    def boom(cfg):
        raise RuntimeError("boom\nsecond line")

    monkeypatch.setattr(cli_train, "train", boom)
    monkeypatch.delenv(common.DEBUG_ENV, raising=False)
    argv = ["train", "--workdir", str(tmp_path / "w")]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert err == "error: RuntimeError: boom second line (rerun with --debug for the traceback)\n"
    assert cli.main([*argv, "--debug"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and err.endswith("traceback)\n")
    monkeypatch.setenv(common.DEBUG_ENV, "1")
    assert cli.main(argv) == 1
    assert "Traceback (most recent call last)" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--warmup-epochs", "-1"], "warmup_epochs=-1.0 must be >= 0"),
        (["--warmup-epochs", "nan"], "warmup_epochs=nan must be >= 0"),
        (["--learning-rate", "nan"], "learning_rate=nan must be a positive number"),
        (["--learning-rate", "inf"], "learning_rate=inf must be a positive number"),
        (["--weight-decay", "-0.1"], "weight_decay=-0.1 must be >= 0"),
        (["--weight-decay", "nan"], "weight_decay=nan must be >= 0"),
        (["--momentum", "nan"], "momentum=nan must be in [0, 1)"),
        (["--momentum", "-0.5"], "momentum=-0.5 must be in [0, 1)"),
    ],
)
def test_bad_numbers_are_one_line_errors(tmp_path, capsys, argv, message):
    workdir = tmp_path / "w"
    assert cli.main(["train", "--source", "sample", "--workdir", str(workdir), *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"error: {message}\n"
    assert not workdir.exists()


# ------------------------------------------------------------------ errors as types
def test_exit_codes_follow_the_error_kind_not_its_name(monkeypatch, capsys, tmp_path):
    """A subclass of a kind, whatever its name, maps like the kind (isinstance)."""

    class DiskGone(me.CheckpointError):
        pass

    class OddLabels(me.data.DataError):
        pass

    for err, code in [
        (DiskGone("checkpoints/: disk gone; free space"), 1),
        (OddLabels("labels.npy: 11 classes; use 10"), 2),
        (me.errors.UsageError("--x 1: bad"), 2),
        (me.errors.Interrupted("stopped at step 3"), 130),
        (KeyboardInterrupt(), 130),
    ]:
        assert common.exit_code(err) == code == me.errors.exit_code(err), err
    # every existing error is a kind, and still what it was
    assert issubclass(me.CheckpointError, me.RunFailedError | RuntimeError)
    assert issubclass(me.training.NonFiniteError, me.RunFailedError)
    from meshensemble.training.outputs import OutputError

    assert issubclass(OutputError, me.errors.RunFailedError) and issubclass(
        OutputError, RuntimeError
    )
    assert me.data.DataError is me.errors.DataError and issubclass(me.data.DataError, ValueError)
    assert common.UsageError is me.UsageError and issubclass(me.UsageError, ValueError)
    assert all(isinstance(t, type) for t in common.FAILED_RUN_ERRORS)

    def fails(cfg):
        raise DiskGone("checkpoints/: disk gone\nfree space")

    monkeypatch.setattr(cli_train, "train", fails)
    monkeypatch.delenv(common.DEBUG_ENV, raising=False)

    def hard_exit(code, line):  # a CheckpointError leaves at once, past orbax's threads
        raise SystemExit((code, line))

    monkeypatch.setattr(cli, "hard_exit", hard_exit)
    with pytest.raises(SystemExit) as left:
        cli.main(["train", "--workdir", str(tmp_path / "w")])
    assert left.value.code == (1, "error: checkpoints/: disk gone free space")


@pytest.mark.parametrize("command", ["evaluate", "bench", "convert"])
def test_ctrl_c_in_any_subcommand_is_one_line_and_exit_130(monkeypatch, capsys, command):
    module = {"evaluate": cli_evaluate, "bench": cli.bench, "convert": cli.convert}[command]

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(module, "run", interrupted)
    argv = {"evaluate": ["--workdir", "w"], "convert": ["--data-file", "x", "--out", "o"]}
    argv = argv.get(command, [])
    assert cli.main([command, *argv]) == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C)\n"


@pytest.mark.slow  # among the heaviest default tests, measured
def test_ctrl_c_during_train_saves_then_exits_130(monkeypatch, capsys, tmp_path):
    """SIGINT after the first call: checkpoint 1 saved, one line, exit 130 (not 0)."""
    import os
    import signal

    from meshensemble.testing import need_devices
    from meshensemble.training.checkpoint import list_checkpoints
    from meshensemble.training.feeder import Feeder

    need_devices(8)
    run = Feeder.run

    def run_then_ctrl_c(self, *args):
        out = run(self, *args)
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs in this (the main) thread
        return out

    monkeypatch.setattr(Feeder, "run", run_then_ctrl_c)
    workdir = tmp_path / "w"
    argv = ["train", "--source", "sample", "--model", "mlp", "--members", "2"]
    argv += ["--mesh", "ensemble=2", "--batch-size", "64", "--chunk-steps", "1"]
    argv += ["--max-steps", "5", "--member-strategy", "vmap", "--workdir", str(workdir)]
    assert cli.main(argv) == 130
    out = capsys.readouterr().out
    assert "mesh ensemble=2 x data=1 x model=1 on 8 cpu (6 idle)," in out
    stopped = [line for line in out.splitlines() if line.startswith("stopped by")]
    assert stopped == [
        f"stopped by SIGINT at step 1: saved checkpoint 1 in {workdir}; run the "
        "same command to resume"
    ]
    assert list_checkpoints(str(workdir)) == [1]


def test_orbax_metadata_warning_is_silenced_other_absl_lines_are_not(monkeypatch):
    import logging

    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    absl = logging.getLogger("absl")
    absl.addHandler(handler)
    try:
        monkeypatch.setattr(cli_evaluate, "run", lambda args: 0)
        assert cli.main(["evaluate", "--workdir", "w"]) == 0  # main sets the filter up
        absl.warning("Metadata file does not exist: /w/checkpoints/2/state/_CHECKPOINT_METADATA")
        absl.warning("something else")
    finally:
        absl.removeHandler(handler)
    assert seen == ["something else"]


@pytest.fixture
def python_sigint():
    """SIGINT with Python's own handler for the test, restored after."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield signal
    signal.signal(signal.SIGINT, before)


def test_a_ctrl_c_while_the_command_imports_is_held_then_ends_it(
    python_sigint, monkeypatch, capsys
):
    """The console script holds SIGINT from the package's first import: a Ctrl-C that
    arrives while JAX imports is recorded (not raised where a gc callback would swallow
    it), and main() ends with exit 130 and one line before any work."""
    import os

    signal, startup = python_sigint, me.startup
    monkeypatch.setattr("sys.argv", ["/usr/local/bin/meshensemble", "train"])
    startup.hold()
    assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
    os.kill(os.getpid(), signal.SIGINT)  # recorded, not raised
    assert cli.main(["train", "--members", "0"]) == 130  # before parsing: not exit 2
    assert (
        capsys.readouterr().err == "error: interrupted (Ctrl-C) while starting; nothing was done\n"
    )
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # Python's again
    assert cli.main(["train", "--members", "0"]) == 2  # nothing held any more
    monkeypatch.setattr("sys.argv", ["python", "mine.py"])  # a library import: left alone
    startup.hold()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_distributed_flags_name_what_add_distributed_flags_adds():
    parser = argparse.ArgumentParser(add_help=False)
    common.add_distributed_flags(parser)
    assert tuple(a.option_strings[0] for a in parser._actions) == common.DISTRIBUTED_FLAGS
