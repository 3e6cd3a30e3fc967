"""Sphinx extension: run a page's ``{exec-code}`` blocks at build time, so its code cannot rot.

Usage in a MyST page::

    ```{exec-code}
    import meshensemble as me
    print(me.make_mesh(ensemble=4, data=2).shape)
    ```

The block is shown as Python code and executed while the page is read. All blocks of a
page share one namespace (a fresh module per page, blocks run top to bottom); what they
print is shown under the block. A block that raises fails the build: the traceback is
reported as a Sphinx warning (an error under ``-W``) at the block's line, and the page's
later blocks are shown but not run.

Options:

``:hide-output:``
    run the block but do not show what it printed.
``:hide-code:``
    run the block but do not show its code (for plumbing such as writing figures).
``:always:``
    run the block even when an earlier block of the page failed (for clean-up).

Figures: the namespace has ``save_figure(fig, name, caption=None)``, which writes a
matplotlib figure as PNG into the build's output (``<outdir>/_static/exec/``) and puts
it in the page right after the block (Sphinx then copies it into ``_images/`` as usual).
Use the Agg backend (``matplotlib.use("Agg")``).

JAX: the device count must be set before JAX starts, so ``conf.py`` sets it once for
the whole build (``jax.config.update("jax_num_cpu_devices", 8)``).
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective

logger = logging.getLogger(__name__)

FIGURE_DIR = ("_static", "exec")
"""Where figures go, under the builder's output directory."""


class _Page:
    """The execution state of one page: its module namespace and whether a block failed."""

    def __init__(self, app: Sphinx, docname: str):
        self.docname = docname
        self.modname = "_exec_code_" + re.sub(r"\W", "_", docname)
        self.module = types.ModuleType(self.modname, f"Executed code of {docname}")
        sys.modules[self.modname] = self.module  # dataclasses and pickling look modules up
        self.failed = False
        self.figures: list[tuple[Path, str | None]] = []
        self.seconds = 0.0
        self.outdir = Path(app.outdir).joinpath(*FIGURE_DIR)
        self.module.__dict__["save_figure"] = self.save_figure

    def save_figure(self, fig: Any, name: str, caption: str | None = None) -> Path:
        """Writes ``fig`` as ``name`` (PNG) and shows it after the current block."""
        if not re.fullmatch(r"[\w.-]+", name):
            raise ValueError(f"figure name {name!r}: use letters, digits, '.', '-', '_'")
        stem = re.sub(r"\W", "_", self.docname)
        path = self.outdir / f"{stem}-{name if name.endswith('.png') else name + '.png'}"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100, bbox_inches="tight")
        self.figures.append((path, caption))
        return path

    def close(self) -> None:
        sys.modules.pop(self.modname, None)


_PAGES: dict[str, _Page] = {}


class ExecCode(SphinxDirective):
    """``{exec-code}``: show a Python block and run it in the page's namespace."""

    has_content = True
    option_spec = {
        "hide-output": directives.flag,
        "hide-code": directives.flag,
        "always": directives.flag,
    }

    def run(self) -> list[nodes.Node]:
        docname = self.env.docname
        page = _PAGES.get(docname)
        if page is None:
            page = _PAGES[docname] = _Page(self.env.app, docname)
        code = "\n".join(self.content)
        result: list[nodes.Node] = []
        if "hide-code" not in self.options:
            block = nodes.literal_block(code, code, language="python", classes=["exec-code"])
            self.set_source_info(block)
            result.append(block)
        if page.failed and "always" not in self.options:
            return result  # an earlier block of this page failed; already reported
        source = self.env.doc2path(docname)
        # Pad with blank lines so that traceback line numbers are the page's line numbers:
        # the code starts after the fence line and one line per option.
        padded = "\n" * (self.lineno + len(self.options)) + code
        out = io.StringIO()
        page.figures = []
        start = time.perf_counter()
        try:
            compiled = compile(padded, str(source), "exec")
            with contextlib.redirect_stdout(out):
                exec(compiled, page.module.__dict__)
        except BaseException as err:  # noqa: BLE001 - any failure must fail the build
            if isinstance(err, KeyboardInterrupt):
                raise
            page.failed = True
            tb = "".join(traceback.format_exception(err))
            logger.warning(
                "exec-code: this block raised %s; the page's later blocks were not run "
                "(except :always: ones).\n%s",
                type(err).__name__,
                tb,
                location=(docname, self.lineno),
                type="exec_code",
            )
        finally:
            page.seconds += time.perf_counter() - start
        printed = out.getvalue()
        if printed and "hide-output" not in self.options:
            shown = nodes.literal_block(printed, printed, language="text")
            result.append(nodes.container("", shown, classes=["exec-output"]))
        for path, caption in page.figures:
            result.append(self._figure(path, caption))
        return result

    def _figure(self, path: Path, caption: str | None) -> nodes.Node:
        srcdir = Path(self.env.srcdir).resolve()
        rel = Path(os.path.relpath(path.resolve(), srcdir)).as_posix()
        image = nodes.image(uri="/" + rel, alt=caption or path.stem)
        figure = nodes.figure("", image, classes=["exec-figure"])
        if caption:
            figure += nodes.caption(caption, caption)
        return figure


def _source_read(app: Sphinx, docname: str, source: list[str]) -> None:
    """A page is (re)read: start it with a fresh namespace."""
    old = _PAGES.pop(docname, None)
    if old is not None:
        old.close()


def _doctree_read(app: Sphinx, doctree: nodes.document) -> None:
    """A page is parsed: drop its namespace (and the arrays it holds)."""
    page = _PAGES.pop(app.env.docname, None)
    if page is not None:
        logger.info("exec-code: ran %s in %.1fs", page.docname, page.seconds)
        page.close()


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("exec-code", ExecCode)
    app.connect("source-read", _source_read)
    app.connect("doctree-read", _doctree_read)
    return {"version": "1.0", "parallel_read_safe": False, "parallel_write_safe": True}
