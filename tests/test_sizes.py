"""Sizes a reader can hold: no class in `shadow/` over 400 lines and no function over 80, unless its
`def`/`class` line says why (`# long by design: ...`: a declaration such as a dashboard's panel
list, one statement per panel)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "shadow"
LIMITS = {ast.ClassDef: 400, ast.FunctionDef: 80, ast.AsyncFunctionDef: 80}
REASON = "# long by design:"


def oversized(root: Path = PACKAGE) -> list[str]:
    """One line per class or function over its limit without a reason on its first line."""
    out = []
    for path in sorted(root.rglob("*.py")):
        src = path.read_text(encoding="utf-8")
        lines = src.splitlines()
        for node in ast.walk(ast.parse(src, str(path))):
            limit = LIMITS.get(type(node))
            if limit is None:
                continue
            assert isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if size > limit and REASON not in lines[node.lineno - 1]:
                where = f"{path.relative_to(root.parent)}:{node.lineno}"
                out.append(f"{where} {node.name}: {size} lines > {limit}")
    return out


def test_no_class_or_function_is_over_its_limit_without_a_reason() -> None:
    found = oversized()
    assert not found, "split these, or say why on their first line (" + REASON + "):\n" + "\n".join(found)


def test_the_check_finds_a_long_function_and_honours_a_reason(tmp_path: Path) -> None:
    pkg = tmp_path / "shadow"
    pkg.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(80))
    (pkg / "a.py").write_text(f"def long():\n{body}\n\ndef kept():  {REASON} a list\n{body}")
    assert oversized(pkg) == ["shadow/a.py:1 long: 81 lines > 80"]
