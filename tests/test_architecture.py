"""The package's layering, read from its source: imports only go downwards, no import circle, the transport
layer holds no averaging math, and the averaging code stays in small functions."""

from __future__ import annotations

import ast
from pathlib import Path

import ddpkit

PACKAGE = Path(ddpkit.__file__).parent
# bottom to top; a module may import its own layer and the ones below it
LAYERS = [
    "distributed",
    "fault_tolerance",
    "algorithms",
    "optim",
    "nn",
    "testing",
    "measure",
    "train",
    "integrations",
    "compat",
    "cli",
]
AVERAGING_CODE = [PACKAGE / "algorithms", PACKAGE / "nn" / "slowmo_ddp.py", PACKAGE / "nn" / "slowmo_checks.py"]
MAX_FUNCTION_LINES = 60


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _runtime_nodes(tree: ast.Module) -> list[ast.AST]:
    """Every node but those under ``if TYPE_CHECKING:`` (imports for type hints only, never run)."""
    out: list[ast.AST] = []
    todo: list[ast.AST] = [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, ast.If) and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
            todo.extend(node.orelse)
            continue
        out.append(node)
        todo.extend(ast.iter_child_nodes(node))
    return out


def _imports(path: Path, top_level_only: bool = False) -> set[str]:
    """The ddpkit modules `path` imports when it runs (a name imported from a package counts as that submodule if
    it is one), in functions too; with `top_level_only`, only those that run when the module is imported."""
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else _runtime_nodes(tree)
    out: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ddpkit"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                out.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name.startswith("ddpkit"))
    return out


def _layer(module: str) -> int:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in ("__main__",):
        return len(LAYERS)  # the package itself (its version) and the entry point: above everything
    return LAYERS.index(parts[1])


def test_every_module_belongs_to_a_layer():
    assert all(m == "ddpkit" or m.split(".")[1] in [*LAYERS, "__main__"] for m in MODULES), sorted(MODULES)


def test_imports_only_go_downwards():
    upward = [
        (module, target)
        for module, path in MODULES.items()
        for target in _imports(path)
        if target != "ddpkit" and _layer(target) > _layer(module)
    ]
    assert upward == [], "these imports go up a layer: " + ", ".join(f"{m} -> {t}" for m, t in upward)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_circle_at_import_time():
    graph = {m: {t for t in _imports(p, top_level_only=True) if t in MODULES and t != m} for m, p in MODULES.items()}
    assert _cycles(graph) == []


def test_no_import_circle_even_through_imports_inside_functions():
    """A circle hidden in a function-level import (as config.py and workload.py had) is still a circle."""
    graph = {m: {t for t in _imports(p) if t in MODULES and t != m} for m, p in MODULES.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_transport_holds_no_averaging_math():
    distributed = {p.stem for p in (PACKAGE / "distributed").glob("*.py")}
    math = {
        "quantize",
        "gossip_graphs",
        "gossip_mixing",
        "gossip",
        "push_sum",
        "compressed_allreduce",
        "compressed_mean",
    }
    assert distributed & math == set()
    for name in ("quantize", "gossip_graphs", "gossip_mixing", "push_sum", "compressed_mean", "slow_momentum"):
        assert (PACKAGE / "algorithms" / f"{name}.py").exists(), name
    # and nothing in the transport layer imports an algorithm (also covered by the layering test)
    for path in (PACKAGE / "distributed").glob("*.py"):
        assert not any(t.startswith("ddpkit.algorithms") for t in _imports(path)), path


def _long_functions(path: Path) -> list[str]:
    long = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                body = body[1:]  # the docstring
            if body and body[-1].end_lineno - body[0].lineno + 1 > MAX_FUNCTION_LINES:
                long.append(f"{path.name}:{node.name}")
    return long


def test_averaging_code_has_no_function_over_60_lines():
    paths = [p for entry in AVERAGING_CODE for p in ([entry] if entry.is_file() else sorted(entry.glob("*.py")))]
    assert len(paths) > 5
    assert [f for p in paths for f in _long_functions(p)] == []


def test_slowmo_names_no_averaging_mode():
    """A new mode is a new file: the wrapper never mentions one of the built-in modes by name or class."""
    source = (PACKAGE / "nn" / "slowmo_ddp.py").read_text()
    code = ast.unparse(ast.parse(source))  # without comments; docstrings stay, so look at names only
    names = {n.id for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Attribute)}
    built_in = {"OuterSync", "PseudoGradientAverager", "SGPEngine", "GossipAverager", "ExactAverager", "_sgp", "_outer"}
    assert names & built_in == set()


def test_measuring_and_workloads_load_without_the_trainer():
    """`ddpkit bench` and benchmarks/ share timing, advisor, plots and the workloads without the trainer."""
    import subprocess
    import sys

    code = (
        "import sys, ddpkit.measure.timing, ddpkit.measure.advisor, ddpkit.measure.plots, ddpkit.train.workloads.gpt;"
        "print(sorted(m for m in sys.modules if m.startswith('ddpkit.train.loop')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout


COLLECTIVES = {
    "all_reduce",
    "broadcast",
    "reduce",
    "send",
    "recv",
    "isend",
    "irecv",
    "all_gather",
    "barrier",
    "all_to_all",
    "all_to_all_single",
    "gather",
    "scatter",
    "reduce_scatter",
    "new_group",
}


def test_only_the_transport_layer_issues_collectives():
    """Above `distributed/`, torch.distributed serves for types, ReduceOp and rank queries: every collective goes
    through ddpkit's transport, where it is counted and named in the ledger."""
    direct = []
    for module, path in MODULES.items():
        if module.startswith("ddpkit.distributed"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and ast.unparse(node.value) == "dist":
                direct.append(f"{module}: dist.{node.attr} (line {node.lineno})")
    assert direct == []


def test_no_issue_numbers_and_no_packed_lines_in_the_code_and_its_tests():
    """Code and tests explain themselves without the tracker's numbers, and no line asks the formatter to leave it
    packed (long calls take keyword arguments instead)."""
    import re

    found = []
    for folder in ("ddpkit", "tests", "tools", "benchmarks"):
        for path in (PACKAGE.parent / folder).rglob("*.py"):
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if re.search(r"\bissues? #?\d+", line, re.IGNORECASE) or "fmt: " + "skip" in line:
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{number}")
    assert found == [], found
