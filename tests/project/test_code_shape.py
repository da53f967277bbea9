"""The size rule of the project, checked with ``ast`` and ``tokenize`` over agent/, rendezvous/,
bench/.

Why a test: "a module holds one concept, a function one step" holds only if something fails when
a file quietly becomes two concepts. Why it counts *code*: a rule on physical lines punished the
explanations (docstrings were trimmed, ``\"\"\"`` joined onto text, calls packed with
``# fmt: skip`` to fit), which is the opposite of what a size check is for. So:

- a module and a function are measured in *logical lines* (Python's statements: a call the
  formatter spreads over five lines is one), leaving out docstrings and comments;
- nesting: block statements inside a function (if, for, while, with, try, match), ``elif``
  counted as the ``if`` it continues; a nested function, class or lambda is measured on its own;
- ``# fmt: skip`` is refused anywhere in the project's Python: packing lines past the formatter
  hides the size a reader meets.

A module over its limit is split where a concept ends (CONTRIBUTING.md), never to fit a number.
Generated code (``*_pb2.py``) is left out, and so are hidden folders: bench/compare.py creates
its venv as bench/.venv-torch, whose installed packages are not ours.
"""

from __future__ import annotations

import ast
import io
import os
import tokenize
from pathlib import Path

from layout import ROOT

FOLDERS = ("agent", "rendezvous", "bench")
NO_PACKING = ("agent", "rendezvous", "bench", "tests", "examples", "deploy", "proto")
MODULE_STATEMENTS, FUNCTION_STATEMENTS, DEPTH = 300, 50, 4
PACKING = "fmt: skip"

BLOCKS = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.Try, ast.Match)
if hasattr(ast, "TryStar"):  # Python 3.11+
    BLOCKS += (ast.TryStar,)
SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)
_SKIPPED = (tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)


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


def docstring_lines(tree: ast.Module) -> set[int]:
    """The physical lines of every docstring (module, class, function)."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, *FUNCTIONS)) and node.body:
            first = node.body[0]
            is_doc = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
            if is_doc and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def statements(text: str, tree: ast.Module) -> list[int]:
    """The first physical line of each logical line of code (docstrings and comments left out)."""
    docs = docstring_lines(tree)
    starts, start = [], None
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type in _SKIPPED:
            continue
        if start is None:
            start = tok.start[0]
        if tok.type == tokenize.NEWLINE:
            if start not in docs:
                starts.append(start)
            start = None
    return starts


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


def measure(text: str, filename: str = "<code>") -> dict[str, tuple[int, int]]:
    """``{"<module>": (statements, 0), "<function>": (statements, nesting), ...}``."""
    tree = ast.parse(text, filename=filename)
    starts = statements(text, tree)
    out = {"<module>": (len(starts), 0)}
    for name, fn in functions(tree):
        own = sum(1 for line in starts if fn.lineno <= line <= fn.end_lineno)
        out[name] = (own, nesting(fn))
    return out


def offenders(path: Path, root: Path = ROOT) -> dict[str, str]:
    """``"<path>: <what>"`` → the measure that is over its limit, for one module."""
    rel = path.relative_to(root).as_posix()
    out = {}
    for name, (count, depth) in measure(path.read_text(), rel).items():
        limit = MODULE_STATEMENTS if name == "<module>" else FUNCTION_STATEMENTS
        over = [f"{count} statements > {limit}"] if count > limit else []
        if depth > DEPTH:
            over.append(f"nesting {depth} > {DEPTH}")
        if over:
            out[f"{rel}: {'module' if name == '<module>' else name}"] = ", ".join(over)
    return out


def _ours(folders: tuple[str, ...]) -> list[Path]:
    """Our Python files. Hidden folders are pruned before they are entered, not filtered after:
    a cache folder may hold anything, even a mounted /proc of an image build.
    """
    found = []
    for folder in folders:
        for top, dirs, files in os.walk(ROOT / folder):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            found += [
                Path(top) / f for f in files if f.endswith(".py") and not f.endswith("_pb2.py")
            ]
    return sorted(found)


def test_modules_and_functions_stay_within_the_limits():
    found: dict[str, str] = {}
    for path in _ours(FOLDERS):
        found.update(offenders(path))
    assert not found, "over the size limits:\n" + "\n".join(
        f"  {k} ({v})" for k, v in found.items()
    )


def test_no_line_is_packed_past_the_formatter():
    packed = [
        f"{path.relative_to(ROOT)}:{tok.start[0]}"
        for path in _ours(NO_PACKING)
        for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
        if tok.type == tokenize.COMMENT and PACKING in tok.string
    ]
    assert not packed, f"'# {PACKING}' packs lines the formatter would spread: {packed}"


def test_the_measures():
    code = (
        '"""A module docstring\n'
        'of two lines: not code."""\n'
        "class A:\n"
        "    def m(self):\n"
        '        """Nor is this."""\n'
        "        # nor a comment\n"
        "        if a:\n"
        "            pass\n"
        "        elif b:\n"  # elif: the same level as its if
        "            for x in y:\n"
        "                with z:\n"
        "                    try:\n"
        "                        def inner():\n"  # measured on its own
        "                            if q:\n"
        "                                call(\n"  # one statement over three lines
        "                                    1,\n"
        "                                )\n"
        "                    except E:\n"
        "                        pass\n"
    )
    shape = measure(code)
    assert shape == {"<module>": (13, 0), "A.m": (12, 4), "A.m.<locals>.inner": (3, 1)}
    deep = (
        "def f():\n"
        + "".join("    " * (i + 1) + "if x:\n" for i in range(5))
        + "    " * 6
        + "pass\n"
    )
    assert measure(deep)["f"] == (7, 5)


def test_an_offender_is_named(tmp_path):
    """The check can fail: a function one statement over, and a module far over, are named."""
    body = "".join(f"    x{i} = {i}\n" for i in range(FUNCTION_STATEMENTS))
    path = tmp_path / "probe.py"
    path.write_text("def big():\n" + body + "".join(f"y{i} = {i}\n" for i in range(300)))
    assert offenders(path, tmp_path) == {
        "probe.py: module": f"{FUNCTION_STATEMENTS + 1 + 300} statements > {MODULE_STATEMENTS}",
        "probe.py: big": f"{FUNCTION_STATEMENTS + 1} statements > {FUNCTION_STATEMENTS}",
    }
