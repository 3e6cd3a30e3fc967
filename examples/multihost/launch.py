"""Start N local processes of `meshensemble`, each with fake CPU devices (gloo collectives).

    python examples/multihost/launch.py --num-processes 2 --devices-per-process 4 -- \
        train --source sample --members 8 --mesh ensemble=4,data=2 --max-steps 20

Every process runs the same command with `--coordinator localhost:PORT --num-processes N
--process-id I --fake-devices D` added; only process 0 prints progress and writes the
workdir's outputs. On a real cluster, run the same command on every host instead (see
docs/multihost.md).
"""

from __future__ import annotations

import argparse
import sys

from meshensemble.runtime.distributed import launch_local


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-processes", type=int, default=2)
    parser.add_argument("--devices-per-process", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then meshensemble args")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the meshensemble command after --, e.g. -- train --max-steps 5")
    return launch_local(command, args.num_processes, args.devices_per_process, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
