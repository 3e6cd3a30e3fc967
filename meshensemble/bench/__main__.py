"""``python -m meshensemble.bench``: points to the command, ``meshensemble bench``.

The benchmark's command line lives in :mod:`meshensemble.cli.bench` (the bench package
never imports the CLI), so this entry point only says where to go and exits 2.
"""

import sys

args = " ".join(sys.argv[1:]) or "..."
print(
    f"error: run `meshensemble bench {args}` (or `python -m meshensemble.cli bench {args}`); "
    "python -m meshensemble.bench no longer runs the benchmark",
    file=sys.stderr,
)
sys.exit(2)
