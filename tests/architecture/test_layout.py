"""The tree reads as the data flows, and stays that way: stage folders in pipeline order, imports
pointing one way (a stage never imports a later one), no import cycles between modules, modules of
a readable size, and tests laid out like the package."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

from conftest import REPO

# Pipeline order: a stage may import itself and the stages before it, never one after it.
# "base" holds what every stage shares: the sample/alert types (model.py), error and health
# counters, safe file opening, the plug-in registry, the configuration models, the kernels.
STAGES = ["base", "sources", "readers", "series", "fusion", "dumps", "compare", "detectors", "engine",
          "store", "exporters", "daemon", "commands"]
BASE = {"(root)", "model", "errors", "health", "safeio", "registry", "config", "kernels", "protowire"}
# Imports against the flow that are deliberate, each with its reason. Only function-level imports
# may be listed: nothing here runs at import time.
ALLOWED_UPWARD = {
    # configuration validators look up the plug-in registries of the stages that own them (log
    # formats, compare presets, rule kinds, the metrics the kinds read) when a value is checked
    ("precision_agent.config.agent", "precision_agent.readers.parsers"),
    ("precision_agent.config.agent", "precision_agent.readers.parsers.custom"),
    ("precision_agent.config.agent", "precision_agent.compare.verdict"),
    ("precision_agent.config.rules", "precision_agent.detectors"),
    ("precision_agent.config.ruletest", "precision_agent.detectors"),
    ("precision_agent.config.ruletest", "precision_agent.readers.parsers"),
}
# Modules allowed past MAX_LINES, with the reason.
MAX_LINES = 420
LONG_MODULES = {
    "agent/kernels/compare_numpy.py": "the numpy twin of compare.c, pass by pass, read side by side with it",
}
# Test folders that mirror no package folder, with the reason.
TEST_ONLY_FOLDERS = {"support": "the shared test helpers", "e2e": "real Prometheus/Alertmanager/fleet end to end",
                     "fuzzing": "the fuzz suite",
                     "benchmarks": "smoke runs of bench/", "architecture": "this file",
                     "fixtures": "data files too costly to make per test (made by the make.py beside them)"}


def _modules() -> dict[str, Path]:
    out = {}
    for top, prefix in (("agent", ["precision_agent"]), ("exporters", ["precision_agent", "exporters"])):
        for p in (REPO / top).rglob("*.py"):
            parts = list(p.relative_to(REPO / top).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(prefix + parts)] = p
    return out


def _stage(mod: str) -> str:
    parts = mod.split(".")
    first = parts[1] if len(parts) > 1 else "(root)"
    if first == "__main__":
        return "commands"  # `python -m precision_agent` is the command line
    return "base" if first in BASE else first


def _type_checking(node: ast.If) -> bool:
    t = node.test
    return isinstance(t, ast.Name) and t.id == "TYPE_CHECKING" or \
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING"


def _imports(mod: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, bool, int]]:
    """(imported module, at import time?, line) for every precision_agent import of ``mod``."""
    is_pkg = path.name == "__init__.py"
    pkg = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, top: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _type_checking(child):
                for other in child.orelse:   # the body is typing only; an else branch runs
                    visit(ast.Module(body=[other], type_ignores=[]), top)
                continue
            if isinstance(child, ast.Constant) and isinstance(child.value, str) \
                    and re.fullmatch(r"precision_agent(\.\w+)+", child.value):
                # a module named for importlib (a kernel, a plug-in): a dependency all the same
                name = child.value if child.value in modules else child.value.rsplit(".", 1)[0]
                out.append((name, False, getattr(child, "lineno", 0)))
            if isinstance(child, ast.ImportFrom):
                if child.level:
                    base = ".".join(pkg[:len(pkg) - (child.level - 1)] + ([child.module] if child.module else []))
                elif child.module and child.module.startswith("precision_agent"):
                    base = child.module
                else:
                    continue
                for alias in child.names:  # `from . import kernels` imports a module
                    sub = f"{base}.{alias.name}"
                    out.append((sub if sub in modules else base, top, child.lineno))
            elif isinstance(child, ast.Import):
                out.extend((a.name, top, child.lineno) for a in child.names if a.name.startswith("precision_agent"))
            visit(child, top and not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text()), True)
    return out


def test_every_module_belongs_to_a_known_stage() -> None:
    unknown = sorted({_stage(m) for m in _modules()} - set(STAGES))
    assert not unknown, f"folders that are no pipeline stage (add them to STAGES in order): {unknown}"


def test_imports_point_down_the_pipeline() -> None:
    modules = _modules()
    order = {s: i for i, s in enumerate(STAGES)}
    wrong = []
    for mod, path in modules.items():
        for target, top, line in _imports(mod, path, modules):
            if order[_stage(target)] <= order[_stage(mod)]:
                continue
            if not top and (mod, target) in ALLOWED_UPWARD:
                continue
            wrong.append(f"{path.relative_to(REPO)}:{line}: {_stage(mod)} imports {target} ({_stage(target)})"
                         + (" at import time" if top else ""))
    assert not wrong, "imports against the pipeline's direction:\n" + "\n".join(wrong)


def test_no_import_cycles() -> None:
    modules = _modules()
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in modules.items():
        for target, top, _ in _imports(mod, path, modules):
            if top and target != mod and target in modules:
                graph[mod].add(target)
    # Tarjan's strongly connected components: any with two or more modules is a cycle
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []

    def strong(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(modules):
        if v not in index:
            strong(v)
    assert not cycles, f"import cycles: {cycles}"


def test_modules_stay_readable() -> None:
    long = []
    for path in list((REPO / "agent").rglob("*.py")) + list((REPO / "exporters").rglob("*.py")):
        rel = str(path.relative_to(REPO))
        n = len(path.read_text().splitlines())
        if n > MAX_LINES and rel not in LONG_MODULES:
            long.append(f"{rel}: {n} lines")
    assert not long, f"modules over {MAX_LINES} lines (split them, or say why in LONG_MODULES): {long}"


def test_tests_mirror_the_package() -> None:
    stages = {p.name for p in (REPO / "agent").iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    stages |= {"exporters", "config"}
    folders = {p.name for p in (REPO / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))}
    strays = sorted(folders - stages - set(TEST_ONLY_FOLDERS))
    assert not strays, f"test folders that mirror no package folder: {strays}"
    loose = sorted(p.name for p in (REPO / "tests").glob("test_*.py"))
    assert not loose, f"tests outside the stage folders: {loose}"


def test_tests_share_helpers_through_support_only() -> None:
    """A test module never imports another one (in its code or in a subprocess script it runs):
    shared helpers live in tests/support/, so each test file runs alone."""
    pattern = re.compile(r"^\s*(from test_\w+ import|import test_\w+)", re.M)
    offenders = [f"{p.relative_to(REPO)}:{s.count(chr(10), 0, m.start()) + 1}"
                 for p in (REPO / "tests").rglob("*.py") if p.parent.name != "architecture"
                 for s in [p.read_text()] for m in pattern.finditer(s)]
    assert not offenders, f"test modules importing test modules (move the helper to tests/support/): {offenders}"
