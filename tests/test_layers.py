"""The house by domain, held to its shape: packages in layers, imports running one way.

Every import in linkctl/ counts (module level, inside functions, under TYPE_CHECKING):
a lazy import is still a dependency. The layers, bottom first; a module may import its
own package and the packages of the layers below, never a layer above nor a sibling
package of its own layer:

    core                      errors, runner, paths, profile, records, log, output
    net, gguf, host, trust    the link (netlink, NetworkManager, networksetup); GGUF headers;
                              this machine's accelerator and memory; the pair secret and
                              the authenticated channel
    llama                     llama.cpp binaries, RPC client, invocation, HTTP client
    probe, estimate           measure the link; predict a model's speed
    calibrate, serve, pair    measure a host; run and verify the pair; pair two hosts
    disagg                    prefill on one host, decode on the other
    service                   boot units
    lifecycle                 up and down: the stages above, in order, and undone
    lab                       namespaces, the demo, the boot harness
    doctor                    one read-only pass over all of it
    commands                  the thin CLI
    cli                       the root app
    __main__                  python -m linkctl
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from support.paths import REPO

PKG = REPO / "linkctl"
LAYERS: list[set[str]] = [
    {"core", "__init__"},
    {"net", "gguf", "host", "trust"},
    {"llama"},
    {"probe", "estimate"},
    {"calibrate", "serve", "pair"},
    {"disagg"},
    {"service"},
    {"lifecycle"},
    {"lab"},
    {"doctor"},
    {"commands"},
    {"cli"},
    {"__main__"},
]
LEVEL = {name: i for i, layer in enumerate(LAYERS) for name in layer}
MAX_LINES = 600
MAX_TOP_MODULES = 5


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package."""
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(REPO).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = p
    return out


def imports_of(path: Path, name: str, known: dict[str, Path]) -> set[str]:
    """The linkctl modules ``path`` imports, resolved to modules (``from linkctl.x import
    y`` is module linkctl.x.y when that is a module, else linkctl.x)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "linkctl"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")
                up = up[: len(up) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            if base.split(".")[0] != "linkctl":
                continue
            for a in node.names:
                sub = f"{base}.{a.name}"
                out.add(sub if sub in known else base)
    return {m for m in out if m in known and m != name}


def graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(path, name, known) for name, path in known.items()}


def area(module: str) -> str:
    """The layer key of a module: its package under linkctl, or the top-level module."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_package_has_a_layer():
    areas = {area(m) for m in modules()}
    assert areas - LEVEL.keys() == set(), "give each new package a layer in LAYERS"
    assert LEVEL.keys() - areas == set(), "a layer names a package that is gone"


def test_imports_run_down_the_layers():
    bad = []
    for mod, deps in graph().items():
        here = area(mod)
        for dep in deps:
            there = area(dep)
            if there == here:
                continue
            if LEVEL[there] >= LEVEL[here]:
                why = "a layer above" if LEVEL[there] > LEVEL[here] else "a sibling of its layer"
                bad.append(f"{mod} imports {dep} ({there}: {why})")
    assert bad == [], "\n".join(sorted(bad))


def _cycle(g: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(g.get(n, ())):
            if state.get(d) == 1:
                return [*stack[stack.index(d) :], d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(g):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycle():
    cycle = _cycle(graph())
    assert cycle is None, " -> ".join(cycle or [])


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


@pytest.mark.parametrize("path", sorted(PKG.rglob("*.py")), ids=lambda p: str(p.relative_to(PKG)))
def test_no_module_over_600_lines(path: Path):
    n = len(path.read_text().splitlines())
    assert n <= MAX_LINES, (
        f"{path.relative_to(REPO)} has {n} lines: give its jobs modules of their own"
    )


def test_few_top_level_modules():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
