# SPDX-License-Identifier: Apache-2.0
"""No Python file of ours reads a global name that nothing defines.

CI runs on a CPU, where the GPU tests and the GPU host's scripts never execute: a name
used but not imported there fails only on the device (a GPU test did, 2026-12-06).
The compiler's own symbol tables (`symtable`) say which names each scope reads from the
module's globals; each must be bound at module level (an assignment, import, def or
class, or a `global` assignment in a function) or be a builtin."""

import ast
import builtins
import symtable
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TREES = ("vllm_overlay", "tests", "benchmarks", "tools")
MODULE_NAMES = {"__file__", "__name__", "__doc__", "__spec__", "__builtins__", "__path__",
                "__loader__", "__package__", "__annotations__", "__dict__", "__cached__"}


def _scopes(table: symtable.SymbolTable):
    yield table
    for child in table.get_children():
        yield from _scopes(child)


def undefined_names(source: str, filename: str = "<source>") -> list[str]:
    """`scope:line name` for each global name read and never bound."""
    if any(isinstance(node, ast.ImportFrom) and any(a.name == "*" for a in node.names)
           for node in ast.walk(ast.parse(source, filename))):
        return ["a star import hides which names are bound"]
    top = symtable.symtable(source, filename, "exec")
    scopes = list(_scopes(top))
    bound = set(dir(builtins)) | MODULE_NAMES
    for scope in scopes:
        for sym in scope.get_symbols():
            at_module = scope.get_type() == "module"
            if (at_module and (sym.is_assigned() or sym.is_imported() or sym.is_namespace())
                    or sym.is_declared_global() and sym.is_assigned()):
                bound.add(sym.get_name())
    out = []
    for scope in scopes:
        for sym in scope.get_symbols():
            name = sym.get_name()
            if not sym.is_referenced() or name in bound:
                continue
            # is_global() alone: CPython 3.11 takes every local of a function named `top`
            # for a module's (its module table's name)
            if scope.get_type() == "module" or (sym.is_global() and not sym.is_local()):
                out.append(f"{scope.get_name()}:{scope.get_lineno()} {name}")
    return out


def our_files() -> list[Path]:
    files = [ROOT / "build.py"]
    for tree in TREES:
        files += sorted((ROOT / tree).rglob("*.py"))
    return files


def test_every_global_name_is_bound():
    bad = {str(f.relative_to(ROOT)): found for f in our_files()
           if (found := undefined_names(f.read_text(), str(f)))}
    assert not bad, bad


@pytest.mark.parametrize("source,expected", [
    # the GPU test of 2026-12-06: a module used in a test, never imported
    ("import torch\n\ndef test_x():\n    return gguf_kernels.TABLE, torch\n",
     ["gguf_kernels"]),
    # a function named `top`: its locals are not globals
    ("def top(a):\n    b = a\n    return b, c\n", ["c"]),
    # class bodies, comprehensions and the module itself read globals too
    ("class A:\n    x = y\n", ["y"]),
    ("def f():\n    return [v for v in range(3) if v in w]\n", ["w"]),
    ("x = z\n", ["z"]),
])
def test_an_unbound_name_is_found(source, expected):
    assert [found.split()[-1] for found in undefined_names(source)] == expected


def test_a_star_import_is_refused():
    assert undefined_names("from os import *\n") == ["a star import hides which names are bound"]


@pytest.mark.parametrize("source", [
    "import os\n\ndef f():\n    return os.sep, len\n",
    "def f():\n    global g\n    g = 1\n\ndef h():\n    return g\n",
    "try:\n    import gguf\nexcept ImportError:\n    gguf = None\n\ndef f():\n    return gguf\n",
    "def f(a):\n    def inner():\n        return a\n    return inner\n",
    "class A:\n    def m(self):\n        return __class__, A\n",
    "def f():\n    return __file__\n",
])
def test_a_bound_name_is_not_reported(source):
    assert undefined_names(source) == []
