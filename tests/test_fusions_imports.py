"""The import graph of megatron_core.fusions flows one way: the dispatching modules (fusions/<name>.py) import
the kernels (fusions/triton_kernels/*), the kernels import only `_common` and the helpers below the
dispatchers (`_collectives`), and there are no cycles. A function-local import is allowed only for an
optional dependency (triton, apex) or a kernel module (which imports triton), never to dodge a cycle.
Read from the source with `ast`, so it needs neither triton nor apex."""

import ast
from pathlib import Path

import megatron_core.fusions

PACKAGE = "megatron_core.fusions"
ROOT = Path(megatron_core.fusions.__file__).parent
# Modules of the package that a kernel module may import: the shared launch helpers and what sits below
# the dispatchers. Everything else in fusions/ (the dispatchers, backends, the package itself) is above.
KERNEL_MAY_IMPORT = {f"{PACKAGE}.triton_kernels._common", f"{PACKAGE}._collectives", f"{PACKAGE}.triton_kernels"}
# Optional or heavy imports that only one backend needs: triton, apex, our kernels, and inductor (seconds to
# import, only for backend "compile").
LAZY_ALLOWED_PREFIXES = ("triton", "apex", f"{PACKAGE}.triton_kernels.", "torch._inductor")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path):
    """(imported module, is function-local) for each import statement; `from pkg import mod` counts as
    pkg.mod when mod is a module of the package."""
    tree = ast.parse(path.read_text())
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, id(node) not in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                candidate = f"{node.module}.{alias.name}"
                is_module = candidate.startswith(PACKAGE) and (
                    (ROOT.parent.parent / Path(*candidate.split("."))).with_suffix(".py").exists()
                    or (ROOT.parent.parent / Path(*candidate.split(".")) / "__init__.py").exists())
                found.append((candidate if is_module else node.module, id(node) not in top_level))
    return found


MODULES = {module_name(path): path for path in ROOT.rglob("*.py")}
GRAPH = {name: [(target, lazy) for target, lazy in imports_of(path)] for name, path in MODULES.items()}


def test_the_graph_was_read():
    assert f"{PACKAGE}.triton_kernels.cross_entropy" in GRAPH and f"{PACKAGE}.cross_entropy" in GRAPH
    assert (f"{PACKAGE}._collectives", False) in GRAPH[f"{PACKAGE}.triton_kernels.cross_entropy"]


def test_kernels_import_only_common_and_lower_helpers():
    for name, targets in GRAPH.items():
        if not name.startswith(f"{PACKAGE}.triton_kernels."):
            continue
        others = sorted({t for t, _ in targets if t.startswith(PACKAGE) and t not in KERNEL_MAY_IMPORT})
        assert not others, f"{name} imports {others}; a kernel module imports only {sorted(KERNEL_MAY_IMPORT)}"


def test_function_local_imports_are_only_optional_dependencies():
    for name, targets in GRAPH.items():
        lazy = sorted({t for t, is_lazy in targets if is_lazy and not t.startswith(LAZY_ALLOWED_PREFIXES)})
        assert not lazy, f"{name} imports {lazy} inside a function; import it at the top (no cycle to dodge)"


def test_no_import_cycles_inside_fusions():
    edges = {name: {t for t, _ in targets if t in MODULES and t != name} for name, targets in GRAPH.items()}
    # A package's __init__ is imported by its submodules implicitly; the edges above are explicit ones only.
    state: dict = {}

    def visit(node, stack):
        state[node] = "open"
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                cycle = stack[stack.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = "done"

    for start in sorted(edges):
        if start not in state:
            visit(start, [start])
