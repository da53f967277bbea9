"""The size limits of the project's rules, checked with ``ast`` over agent/, rendezvous/, bench/.

Why a test: "modules ≤ ~400 lines, functions ≤ ~60 lines, nesting ≤ 4" holds only if something
fails when it stops holding. What is measured:

- a module: its physical lines;
- a function: from its ``def`` to its last line (decorators left out, nested functions in);
- nesting: block statements inside a function (if, for, while, with, try, match), ``elif``
  counted as the ``if`` it continues; a nested function, class or lambda is measured on its own.

Generated code (``*_pb2.py``) is left out, and so are hidden folders: bench/compare.py creates
its venv as bench/.venv-torch, whose installed packages are not ours.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("agent", "rendezvous", "bench")
MODULE_LINES, FUNCTION_LINES, DEPTH = 400, 60, 4

BLOCKS = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.Match)
if hasattr(ast, "TryStar"):  # Python 3.11+
    BLOCKS += (ast.TryStar,)
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def nesting(node: ast.AST, depth: int = 0) -> int:
    """The deepest block nesting under ``node``, not looking into nested scopes."""
    deepest = depth
    for name, value in ast.iter_fields(node):
        children = value if isinstance(value, list) else [value]
        for child in children:
            if not isinstance(child, ast.AST) or isinstance(child, SCOPES):
                continue
            is_elif = (
                isinstance(node, ast.If)
                and name == "orelse"
                and len(children) == 1
                and isinstance(child, ast.If)
            )
            inner = depth + (isinstance(child, BLOCKS) and not is_elif)
            deepest = max(deepest, nesting(child, inner))
    return deepest


def functions(tree: ast.Module) -> list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef]]:
    """(qualified name, node) of every function and method, nested ones included."""
    found = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, FUNCTIONS):
                found.append((prefix + child.name, child))
                walk(child, f"{prefix}{child.name}.<locals>.")
            elif isinstance(child, ast.ClassDef):
                walk(child, f"{prefix}{child.name}.")
            else:
                walk(child, prefix)

    walk(tree, "")
    return found


def offenders(path: Path) -> dict[str, str]:
    """``"<path>: <what>"`` → the measure that is over its limit, for one module."""
    rel = path.relative_to(ROOT).as_posix()
    text = path.read_text()
    out = {}
    if len(text.splitlines()) > MODULE_LINES:
        out[f"{rel}: module"] = f"{len(text.splitlines())} lines > {MODULE_LINES}"
    for name, fn in functions(ast.parse(text, filename=rel)):
        lines, depth = fn.end_lineno - fn.lineno + 1, nesting(fn)
        over = []
        if lines > FUNCTION_LINES:
            over.append(f"{lines} lines > {FUNCTION_LINES}")
        if depth > DEPTH:
            over.append(f"nesting {depth} > {DEPTH}")
        if over:
            out[f"{rel}: {name}"] = f"line {fn.lineno}, " + ", ".join(over)
    return out


def all_offenders() -> dict[str, str]:
    found: dict[str, str] = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            hidden = any(p.startswith(".") for p in path.relative_to(ROOT).parts)
            if not path.name.endswith("_pb2.py") and not hidden:
                found.update(offenders(path))
    return found


def test_modules_and_functions_stay_within_the_limits():
    found = all_offenders()
    assert not found, "over the size limits:\n" + "\n".join(
        f"  {k} ({v})" for k, v in found.items()
    )


def _shape(code: str) -> dict[str, str]:
    tree = ast.parse(code)
    return {name: f"{fn.end_lineno - fn.lineno + 1}/{nesting(fn)}" for name, fn in functions(tree)}


def test_the_measures():
    code = (
        "class A:\n"
        "    def m(self):\n"
        "        if a:\n"
        "            pass\n"
        "        elif b:\n"  # elif: the same level as its if
        "            for x in y:\n"
        "                with z:\n"
        "                    try:\n"
        "                        def inner():\n"  # measured on its own
        "                            if q:\n"
        "                                pass\n"
        "                    except E:\n"
        "                        pass\n"
    )
    assert _shape(code) == {"A.m": "12/4", "A.m.<locals>.inner": "3/1"}
    deep = (
        "def f():\n"
        + "".join("    " * (i + 1) + "if x:\n" for i in range(5))
        + "    " * 6
        + "pass\n"
    )
    assert _shape(deep) == {"f": "7/5"}
