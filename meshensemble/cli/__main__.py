"""``python -m meshensemble.cli``: the same as the ``meshensemble`` command."""

import sys

from meshensemble.cli import main

sys.exit(main())
