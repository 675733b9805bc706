"""The floors of the house: every import in `shadow/` points down, and no modules import each other.

Tiers, lowest first (a room is `shadow/<room>/` or a top-level module of `shadow/`):

0. floor: `contracts` (events, mode/route contracts, shared label sets), `vllm` (vLLM's wire, read
   side), `base` (sockets, security checks, child processes, executables) and the package root
   `shadow` (its `__version__`). They import nothing else from shadow.
1. `core`: the pure routing core.
2. `engine`: the pure fleet engine over the core.
3. the wings: `traces`, `fleet`, `realvllm` (real vLLM servers: model builder, launcher, step
   probe), `loadgen`, `telemetry`, and the two sources of traffic copies: `dataplane` (the process
   in the traffic's path: taps, relay, supervisor) and `capture` (passive, off an interface).
4. `mirror`: the analysis process's own room (attachment, SSE analysis, mirrored state, event API).
   The data plane sits below it and so can never import it: it must outlive the analysis.
5. what runs on the mirror: `live`, `active`, `replay`.
6. `app`: assembles processes from every wing.
7. `commands`: the CLI's sub-commands.
8. `cli`: `shadow/cli.py` and `shadow/__main__.py`.

A module may import its own room and any room of a lower tier. Rooms of one tier may not import
each other, except the pairs in `SIDEWAYS` (each with its reason). Every import counts: at module
level, inside functions, under `TYPE_CHECKING`. Any cycle of module imports fails too.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "shadow"

TIERS: tuple[tuple[str, ...], ...] = (
    ("contracts", "vllm", "base", "shadow"),
    ("core",),
    ("engine",),
    ("traces", "fleet", "realvllm", "loadgen", "telemetry", "dataplane", "capture"),
    ("mirror",),
    ("live", "active", "replay"),
    ("app",),
    ("commands",),
    ("cli",),
)

#: Allowed imports between rooms of one tier: (from, to) -> why.
SIDEWAYS: dict[tuple[str, str], str] = {
    ("capture", "dataplane"): "passive capture frames HTTP/1.1 with the taps' own llhttp pieces "
    "(`dataplane.http1`), so both read a request alike",
}

#: Top-level modules of `shadow/` that belong to a room other than their own name.
MODULE_ROOMS = {"__main__": "cli", "cli": "cli"}


@dataclass(frozen=True)
class Import:
    source: str  # importing module, dotted
    target: str  # imported module, dotted
    path: Path
    line: int


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name)."""
    out: dict[str, Path] = {}
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = p
    return out


def imports(mods: dict[str, Path]) -> list[Import]:
    """Every import of one package module by another (the package named and, for `from X import
    name`, the module `X.name` when it is one)."""
    found: dict[Import, None] = {}  # insertion-ordered set
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    module = ".".join([*base, *([node.module] if node.module else [])])
                else:
                    module = node.module or ""
                targets = [module, *(f"{module}.{a.name}" for a in node.names)]
            else:
                continue
            for target in targets:
                while target and target not in mods:  # a name imported from a module: that module
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found[Import(name, target, path, node.lineno)] = None
    return list(found)


def room(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return parts[0]
    return MODULE_ROOMS.get(parts[1], parts[1])


def tier(room_name: str) -> int:
    for i, rooms in enumerate(TIERS):
        if room_name in rooms:
            return i
    raise KeyError(room_name)


def violations(found: list[Import], root: Path = PACKAGE) -> list[str]:
    """One line per import that points up or sideways without leave (paths relative to `root`'s parent)."""
    bad: list[str] = []
    for imp in found:
        a, b = room(imp.source), room(imp.target)
        if a == b:
            continue
        ta, tb = tier(a), tier(b)
        where = f"{imp.path.relative_to(root.parent)}:{imp.line} imports {imp.target}"
        if tb > ta:
            bad.append(f"{where}: {a} (tier {ta}) -> {b} (tier {tb}) points up")
        elif tb == ta and (a, b) not in SIDEWAYS:
            bad.append(f"{where}: {a} -> {b} is sideways within tier {ta} and not in SIDEWAYS")
    return bad


def cycles(found: list[Import]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan, iterative)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for imp in found:
        edges[imp.source].add(imp.target)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(edges):
        if start in index:
            continue
        work: list[tuple[str, list[str]]] = [(start, sorted(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, todo = work[-1]
            if todo:
                w = todo.pop()
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, sorted(edges.get(w, ()))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                group: list[str] = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    group.append(w)
                    if w == v:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return groups


def test_every_room_has_a_tier() -> None:
    rooms = {room(m) for m in modules()}
    unplaced = sorted(r for r in rooms if not any(r in t for t in TIERS))
    assert not unplaced, f"rooms missing from TIERS (place them, with reason, in the docstring): {unplaced}"


def test_no_import_points_up_or_sideways() -> None:
    bad = violations(imports(modules()))
    assert not bad, "imports against the floors:\n" + "\n".join(bad)


def test_no_module_import_cycles() -> None:
    found = cycles(imports(modules()))
    assert not found, f"module import cycles: {found}"


def test_sideways_pairs_are_used_and_within_one_tier() -> None:
    used = {(room(i.source), room(i.target)) for i in imports(modules())}
    for a, b in SIDEWAYS:
        assert tier(a) == tier(b), f"SIDEWAYS {a}->{b} spans tiers: not sideways"
        assert (a, b) in used, f"SIDEWAYS {a}->{b} is no longer used: remove it"


def test_the_checks_catch_what_they_should(tmp_path: Path) -> None:
    """Upward, sideways, in-function imports and cycles are all found on a small made-up package."""
    pkg = tmp_path / "shadow"
    for d in ("core", "engine", "fleet", "telemetry", "contracts"):
        (pkg / d).mkdir(parents=True)
        (pkg / d / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "core" / "a.py").write_text("def f():\n    from shadow.engine import b\n")
    (pkg / "engine" / "b.py").write_text("from shadow.core import a\n")
    (pkg / "fleet" / "m.py").write_text("from ..telemetry.t import X\n")
    (pkg / "telemetry" / "t.py").write_text("import shadow.contracts.e\nX = 1\n")
    (pkg / "contracts" / "e.py").write_text("")
    mods = modules(pkg)
    found = imports(mods)
    bad = violations(found, pkg)
    assert any("core/a.py:2 imports shadow.engine" in b and "points up" in b for b in bad), bad
    assert any("fleet/m.py:1 imports shadow.telemetry.t" in b and "sideways" in b for b in bad), bad
    assert not any("telemetry/t.py" in b for b in bad), bad
    assert cycles(found) == [["shadow.core.a", "shadow.engine.b"]]


#: The data plane: the modules the relay process (`shadow tap`, assembled in `shadow.app.tap`) runs:
#: its own room and the floors. The analysis (`shadow.mirror`: the mirror's state, the SSE analysis,
#: the API, the reconciler) sits a tier above it; the data plane must outlive it, so it never imports
#: it; the contract between the two is `shadow.contracts` (`tapwire`, `frames`, `handshake`).
DATA_PLANE_ROOMS = frozenset({"dataplane"})


def _closure(start: str, found: list[Import]) -> set[str]:
    edges: dict[str, set[str]] = defaultdict(set)
    for imp in found:
        edges[imp.source].add(imp.target)
    seen: set[str] = set()
    todo = [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += edges.get(m, ())
    return seen


def test_the_data_plane_never_imports_the_analysis() -> None:
    """Every shadow module the relay process can load, also inside functions: only the data plane's
    own room and the floors below the wings (contracts, vllm, base)."""
    loaded = _closure("shadow.app.tap", imports(modules())) - {"shadow.app.tap"}
    assert "shadow.dataplane.relay" in loaded  # the closure is the relay's
    wrong = sorted(m for m in loaded if room(m) not in DATA_PLANE_ROOMS and tier(room(m)) > 0)
    assert not wrong, f"the data plane imports the analysis (or another wing): {wrong}"
