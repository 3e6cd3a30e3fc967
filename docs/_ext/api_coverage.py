"""Sphinx extension: fail the build when a public name is missing from the API reference.

After all pages are read (``env-check-consistency``), every name in
``<api_coverage_module>.__all__`` must be a Python object described on the page
``api_coverage_docname`` as ``<module>.<name>`` (by ``autoclass``, ``autofunction``,
``autodata``, ``automodule`` ... or a ``py:`` directive); each one missing is a warning
(an error under ``-W``). A top-level name described there but not exported is reported too.

Config values (``conf.py``): ``api_coverage_module`` (e.g. ``"meshensemble"``) and
``api_coverage_docname`` (default ``"api"``).
"""

from __future__ import annotations

import importlib
from typing import Any

from sphinx.application import Sphinx
from sphinx.environment import BuildEnvironment
from sphinx.util import logging

logger = logging.getLogger(__name__)


def documented_names(env: BuildEnvironment, module: str, docname: str) -> set[str]:
    """Top-level names ``module.X`` that ``docname`` describes, as ``{"X", ...}``."""
    domain: Any = env.get_domain("py")
    prefix = module + "."
    found = set()
    for fullname, entry in domain.objects.items():
        if entry.docname != docname or not fullname.startswith(prefix):
            continue
        rest = fullname[len(prefix) :]
        if "." not in rest or entry.objtype == "module":
            found.add(rest)
    return found


def check_coverage(app: Sphinx, env: BuildEnvironment) -> None:
    module = app.config.api_coverage_module
    if not module:
        return
    docname = app.config.api_coverage_docname
    if docname not in env.found_docs:
        logger.warning(
            "api_coverage: page %r does not exist; it must document %s.__all__",
            docname,
            module,
            type="api_coverage",
        )
        return
    exported = list(importlib.import_module(module).__all__)
    documented = documented_names(env, module, docname)
    for name in exported:
        if name not in documented:
            logger.warning(
                "api_coverage: %s.%s is in %s.__all__ but not documented in %s; add an "
                "autodoc entry (e.g. '.. autofunction:: %s.%s') there",
                module,
                name,
                module,
                env.doc2path(docname, base=False),
                module,
                name,
                location=docname,
                type="api_coverage",
            )
    for name in sorted(documented - set(exported)):
        if "." not in name:
            logger.warning(
                "api_coverage: %s.%s is documented in %s but not in %s.__all__",
                module,
                name,
                env.doc2path(docname, base=False),
                module,
                location=docname,
                type="api_coverage",
            )


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_config_value("api_coverage_module", "", "env", types=[str])
    app.add_config_value("api_coverage_docname", "api", "env", types=[str])
    app.connect("env-check-consistency", check_coverage)
    return {"version": "1.0", "parallel_read_safe": True, "parallel_write_safe": True}
