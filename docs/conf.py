"""Sphinx configuration of the meshensemble documentation.

Build (no network needed; warnings are errors):

    python -m sphinx -W --keep-going -b html docs docs/_build/html
"""

from __future__ import annotations

import os
import sys

# The executed code is tiny: XLA's LLVM optimisations would cost more compile time than
# they save at run time (about half of the build's CPU time), so they are off.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]
).strip()

import jax  # noqa: E402

# JAX must see its CPU devices before anything initialises a backend. The pages' executed
# code (docs/_ext/exec_code.py) and autodoc both import JAX in this one process, so the
# device count is fixed here, once, before any of them run: 8 simulated CPU devices, the
# same as the tests, whatever accelerator the building machine has.
jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", 8)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "_ext"))
sys.path.insert(0, os.path.dirname(HERE))  # the package, also when it is not installed

import meshensemble  # noqa: E402

project = "meshensemble"
author = "meshensemble authors"
copyright = "meshensemble authors, Apache-2.0"  # noqa: A001
version = release = meshensemble.__version__

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "exec_code",  # docs/_ext: runs the pages' {exec-code} blocks at build time
    "api_coverage",  # docs/_ext: every name of meshensemble.__all__ is in api.md
    "reexported_docs",  # docs/_ext: docstrings of constants re-exported by __init__.py
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "_ext", "Thumbs.db", ".DS_Store"]

# MyST: ::: fences for the side-by-side containers, header anchors for in-page links.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc + napoleon: Google-style docstrings of the package.
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented"
autodoc_type_aliases = {"ArrayLike": "jax.typing.ArrayLike"}
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_use_ivar = False
napoleon_attr_annotations = False
add_module_names = False

# API coverage check (docs/_ext/api_coverage.py).
api_coverage_module = "meshensemble"
api_coverage_docname = "api"

html_theme = "alabaster"
html_theme_options = {
    "page_width": "1180px",
    "sidebar_width": "220px",
    "description": "Deep ensembles on a JAX device mesh",
    "show_relbars": True,
}
html_static_path = ["_static"]
html_css_files = ["custom.css"]
html_title = f"meshensemble {release}"
pygments_style = "default"
