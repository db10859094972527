"""Imports flow one way: control -> controller -> parallel -> model -> kernels; policies and io import none of them.
Checked on the source (every import statement, function-level ones too), so a new upward import fails here."""
from __future__ import annotations

import ast

from conftest import REPO

LAYER = {"control": 5, "controller": 4, "parallel": 3, "model": 2, "kernels": 1}
PURE = ("policies", "io")


def k3ray_imports(path) -> list[str]:
    """The k3ray packages a module imports (k3ray.<package>...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        found += [n.split(".")[1] for n in names if n.startswith("k3ray.") and n.count(".") >= 1]
    return found


def test_no_module_imports_upward():
    upward = []
    for path in sorted((REPO / "k3ray").rglob("*.py")):
        package = path.relative_to(REPO / "k3ray").parts[0]
        for target in k3ray_imports(path):
            if package in PURE and target in LAYER:
                upward.append(f"{path.relative_to(REPO)} imports k3ray.{target}")
            elif package in LAYER and target in LAYER and LAYER[target] > LAYER[package]:
                upward.append(f"{path.relative_to(REPO)} imports k3ray.{target}")
    assert upward == []


def test_the_check_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from k3ray.grid.worker_group import WorkerGroup\n")
    assert k3ray_imports(module) == ["controller"]
