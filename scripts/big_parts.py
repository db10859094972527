"""The parts of k3ray past the size the code keeps (docs/architecture.md): classes with over 15 methods and
functions (methods included) over 60 lines. Prints one line each, biggest first: `python scripts/big_parts.py`."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_METHODS, MAX_LINES = 15, 60


def big_parts(root: Path = REPO / "k3ray") -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(classes as (methods, where)), (functions as (lines, where)), each over its limit, biggest first."""
    classes, functions = [], []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(REPO)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                if methods > MAX_METHODS:
                    classes.append((methods, f"{where}:{node.lineno} {node.name}"))
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_LINES:
                    functions.append((lines, f"{where}:{node.lineno} {node.name}"))
    return sorted(classes, reverse=True), sorted(functions, reverse=True)


if __name__ == "__main__":
    classes, functions = big_parts()
    print(f"classes over {MAX_METHODS} methods:")
    for n, where in classes:
        print(f"  {n:4d} methods  {where}")
    print(f"functions over {MAX_LINES} lines:")
    for n, where in functions:
        print(f"  {n:4d} lines    {where}")
