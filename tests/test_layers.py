"""Imports flow one way: control -> serve | train -> formats -> grid -> parallel -> model -> kernels; serve and train
are siblings on one floor and never import each other; policies, io, steering and jobs import none of them, and no
module imports one that imports it back. Checked on the source (every import statement, function-level ones too), so
a new upward or sideways import or a cycle fails here."""
from __future__ import annotations

import ast

from conftest import REPO

LAYER = {"control": 7, "serve": 6, "train": 6, "formats": 5, "grid": 4, "parallel": 3, "model": 2, "kernels": 1}
PURE = ("policies", "io", "steering", "jobs")


def k3ray_imports(path) -> list[str]:
    """The k3ray packages a module imports (k3ray.<package>...)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
        found += [n.split(".")[1] for n in names if n.startswith("k3ray.") and n.count(".") >= 1]
    return found


def wrong_way(root) -> list[str]:
    """Every import of the package `root`/k3ray that goes up a floor, or sideways to another package of its floor
    (serve <-> train)."""
    found = []
    for path in sorted((root / "k3ray").rglob("*.py")):
        package = path.relative_to(root / "k3ray").parts[0]
        for target in k3ray_imports(path):
            if package in PURE and target in LAYER:
                found.append(f"{path.relative_to(root)} imports k3ray.{target}")
            elif package in LAYER and target in LAYER and target != package and LAYER[target] >= LAYER[package]:
                found.append(f"{path.relative_to(root)} imports k3ray.{target}")
    return found


def test_no_module_imports_upward_or_sideways():
    assert wrong_way(REPO) == []


def test_the_check_sees_an_upward_import(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from k3ray.grid.worker_group import WorkerGroup\n")
    assert k3ray_imports(module) == ["grid"]


def test_the_check_sees_serve_and_train_import_each_other(tmp_path):
    for package, target in (("serve", "train.incidents"), ("train", "serve.engine")):
        (tmp_path / "k3ray" / package).mkdir(parents=True)
        (tmp_path / "k3ray" / package / "m.py").write_text(f"def f():\n    from k3ray.{target} import X\n")
    assert wrong_way(tmp_path) == ["k3ray/serve/m.py imports k3ray.train", "k3ray/train/m.py imports k3ray.serve"]


def _module_imports(path) -> set[str]:
    """The k3ray modules (dotted names) a module imports, function-level imports included."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("k3ray")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("k3ray"):
            found |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
    return found


def import_graph(root) -> dict[str, set[str]]:
    """module -> the k3ray modules it imports (function-level imports included; its own packages left out), over
    the package `root`/k3ray."""
    modules = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (root / "k3ray").rglob("*.py")}
    return {m: {t for t in _module_imports(p) if t in modules and t != m and not m.startswith(t + ".")}
            for m, p in modules.items()}


def cycles_in(graph: dict[str, set[str]]) -> list[str]:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_no_module_imports_one_that_imports_it_back():
    assert cycles_in(import_graph(REPO)) == []


def test_the_check_sees_a_cycle_closed_by_a_function_level_import(tmp_path):
    (tmp_path / "k3ray" / "serve").mkdir(parents=True)
    (tmp_path / "k3ray" / "serve" / "engine.py").write_text("from k3ray.serve.drills import Stream\n")
    (tmp_path / "k3ray" / "serve" / "drills.py").write_text("def f():\n    from k3ray.serve import engine\n")
    assert cycles_in(import_graph(tmp_path)) == ["k3ray.serve.drills -> k3ray.serve.engine -> k3ray.serve.drills"]
