"""The table of docs/sharing.md from finished runs: sizes, step time and test scores.

Run (after the commands of README.md):

    python examples/sharing/table.py single=runs/single deep=runs/deep be=runs/be lora=runs/lora

For each ``label=RUN`` it reads the run's newest checkpoint's shapes (orbax metadata) and
``metrics.jsonl`` (the last evaluation), times the run's restored training step on one
device (:func:`step_ms`: the runs take turns, the fastest of 10 rounds of 20 steps), and
prints one Markdown row:
trained and frozen parameters, the state's bytes on one device (every run here is on one
device, so the whole state) and on each device of an ``ensemble=8`` mesh (the shared part
whole, the members' part an eighth: what ``state_bytes_per_device`` reports there),
milliseconds per step, and the ensemble's test accuracy, NLL, ECE and pairwise
disagreement.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

from meshensemble.training.checkpoint import list_checkpoints
from meshensemble.training.restore import restore_run

logging.getLogger("absl").setLevel(logging.ERROR)  # orbax's notes on optional metadata


def sizes(run: Path) -> dict[str, int]:
    """Parameters (trained, frozen) and state bytes from the newest checkpoint's metadata."""
    step = max(list_checkpoints(str(run)))
    with ocp.StandardCheckpointer() as reader:
        meta = reader.metadata(str((run / "checkpoints" / str(step) / "state").resolve()))
    tree = getattr(getattr(meta, "item_metadata", meta), "tree", meta)
    flat = lambda t: [v for v in _leaves(t) if v is not None]
    numbers = lambda t: sum(int(np.prod(v.shape)) for v in flat(t))
    nbytes = lambda t: sum(int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize for v in flat(t))
    shared = {k: tree.get(k) for k in ("shared", "shared_opt_state")}
    members = {k: v for k, v in tree.items() if k not in shared}
    trained_paths = _paths(tree.get("opt_state")) | _paths(tree.get("shared_opt_state"))
    params = _by_path(tree["params"]) | _by_path(tree.get("shared") or {})
    trained = sum(int(np.prod(v.shape)) for p, v in params.items() if p in trained_paths)
    return {
        "trained": trained,
        "frozen": numbers(params) - trained,
        "bytes": nbytes(tree),  # on one device: all of it
        "bytes8": nbytes(shared) + nbytes(members) / 8,  # ensemble=8: one member a device
    }


def _leaves(tree):
    if isinstance(tree, dict):
        for v in tree.values():
            yield from _leaves(v)
    elif isinstance(tree, list | tuple):
        for v in tree:
            yield from _leaves(v)
    else:
        yield tree


def _by_path(tree, prefix=()):
    out = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out |= _by_path(v, (*prefix, str(k)))
    elif tree is not None:
        out[prefix] = tree
    return out


def _paths(opt_state) -> set[tuple[str, ...]]:
    """Parameter paths that have optimizer state (the trained ones): momentum's ``trace``."""
    found = set()
    for path in _by_path(_as_dict(opt_state)):
        for i in range(len(path)):
            found.add(path[i:])
    return found


def _as_dict(tree):
    if isinstance(tree, list | tuple):
        return {str(i): _as_dict(v) for i, v in enumerate(tree)}
    if isinstance(tree, dict):
        return {k: _as_dict(v) for k, v in tree.items()}
    return tree


def step_ms(runs: dict[str, Path], rounds: int = 10, steps: int = 20) -> dict[str, float]:
    """Milliseconds per training step of each run's ensemble, restored on one device.

    Each run's ``train_step`` program (its batch size, the MNIST image shape) runs
    ``steps`` steps per round, the runs taking turns, ``rounds`` rounds; a run's time is
    its fastest round: the machine's other jobs slow every round, the fastest least.
    """
    built = {}
    for label, run in runs.items():
        restored = restore_run(str(run), mesh="ensemble=1,data=1")
        b = restored.cfg.batch_size
        x = np.zeros((b, *restored.sample.shape[1:]), restored.sample.dtype)
        y = np.zeros((b,), np.int32)
        fn = restored.ensemble.train_step_fn()
        state, metrics = fn(restored.state, x, y)  # compiles
        jax.block_until_ready(metrics)
        built[label] = [fn, state, x, y]
    best = dict.fromkeys(runs, float("inf"))
    for _ in range(rounds):
        for label, item in built.items():
            fn, state, x, y = item
            start = time.perf_counter()
            for _ in range(steps):
                state, metrics = fn(state, x, y)
            jax.block_until_ready(metrics)
            best[label] = min(best[label], (time.perf_counter() - start) / steps * 1000)
            item[1] = state
    return best


def row(label: str, run: Path, ms: float) -> str:
    record = json.loads(run.joinpath("metrics.jsonl").read_text().splitlines()[-1])
    cfg = json.loads(run.joinpath("config.json").read_text())
    s = sizes(run)
    eight = f"{s['bytes8'] / 1024:,.0f} KiB" if cfg["members"] % 8 == 0 else "-"
    score = lambda k: record[f"test_ensemble_{k}"]
    return (
        f"| {label} | {cfg['members']} | {s['trained']:,} | {s['frozen']:,} | "
        f"{s['bytes'] / 1024:,.0f} KiB | {eight} | "
        f"{ms:.1f} | "
        f"{100 * score('accuracy'):.2f}% | {score('nll'):.4f} | {score('ece'):.4f} | "
        f"{score('disagreement'):.4f} |"
    )


def main(argv: list[str]) -> None:
    print(
        "| run | members | trained parameters | frozen parameters | state on 1 device | "
        "state per device, ensemble=8 | ms/step | accuracy | NLL | ECE | disagreement |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    runs = {label: Path(run) for label, run in (arg.split("=", 1) for arg in argv)}
    times = step_ms(runs)
    for label, run in runs.items():
        print(row(label, run, times[label]))


if __name__ == "__main__":
    main(sys.argv[1:])
