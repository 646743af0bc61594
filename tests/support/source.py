"""Parse the project's own source files for the tests that check its layout."""
from __future__ import annotations

import ast
import gc
from pathlib import Path


def parse_file(path: Path) -> ast.Module:
    """The module's syntax tree, parsed with the garbage collector off.

    CPython 3.11 keeps one AST-constructor depth counter per interpreter: if a collection
    during the parse runs a finaliser that formats a traceback (asyncio logs "Future
    exception was never retrieved" with one, and 3.11's traceback parses the line to place
    its carets), the nested parse resets the counter and the outer one raises
    "SystemError: AST constructor recursion depth mismatch". Keeping collections out of the
    parse keeps the layout tests independent of what earlier tests left for the collector.
    """
    source = path.read_text()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        return ast.parse(source, str(path))
    finally:
        if was_enabled:
            gc.enable()
