"""`shadow dashboards`: build the Grafana dashboards (and the files generated with them) from code,
or push them to a Grafana server."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from shadow.base.extras import missing_extra
from shadow.commands._help import add_command

EXAMPLES = """\
examples:
  shadow dashboards build                      # regenerate dashboards/, docs/metrics.md, deploy/ files
  shadow dashboards build --check              # exit 1 if any generated file is stale (CI)
  shadow dashboards push --url http://grafana:3000 --token "$GRAFANA_TOKEN" --folder "Shadow routing"
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = add_command(
        sub, "dashboards", "build Grafana dashboards from code, or push them to Grafana",
        "Build the Grafana dashboards from code (needs the extra shadow[dashboards]) and the files "
        "generated with them, or publish them idempotently by uid.", EXAMPLES)
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    b = verbs.add_parser(
        "build",
        help="regenerate dashboards/*.json, docs/metrics.md and the generated Kubernetes manifests",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    b.add_argument("--root", default=".", help="repository root to write into")
    b.add_argument("--check", action="store_true",
                   help="write nothing; exit 1 if a generated file differs")
    b.add_argument("--runbook-base", metavar="URL", default=os.environ.get("SHADOW_RUNBOOK_BASE"),
                   help="absolute URL where docs/runbooks/ is published: every alert's runbook_url is "
                   "URL/PAGE.md (env SHADOW_RUNBOOK_BASE; default: a placeholder, "
                   "https://runbooks.example.com/shadow)")
    b.set_defaults(func=_build)
    u = verbs.add_parser(
        "push",
        help="publish dashboards to Grafana (idempotent by uid)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    u.add_argument("--url", required=True, help="Grafana root URL, e.g. http://grafana:3000")
    u.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"),
                   help="service-account token (default: $GRAFANA_TOKEN)")
    u.add_argument("--folder", default=None,
                   help="folder title (created by uid if missing); default: General")
    u.add_argument("--dir", default="dashboards",
                   help="directory of dashboard JSON files; built from code if it does not exist")
    u.add_argument("--timeout", type=float, default=10.0, help="seconds per HTTP request")
    u.set_defaults(func=_push)


def generated_files(root: Path, runbook_base: str | None = None) -> dict[Path, str]:
    """Every generated file under `root` with its content, built from code and the repo's sources
    (`runbook_base`: where docs/runbooks/ is published; default the placeholder)."""
    try:
        from shadow.telemetry import manifests
        from shadow.telemetry.dashboards import build_all, render
    except ImportError as exc:
        raise SystemExit(
            f"shadow dashboards build needs the extra: pip install 'shadow[dashboards]' ({exc.name})"
        ) from None
    from shadow.app.catalogue import catalogue

    dashboards = {name: render(obj) for name, obj in build_all().items()}
    out = {root / "dashboards" / name: text for name, text in dashboards.items()}
    out[root / "docs" / "metrics.md"] = catalogue().markdown()
    base = root / "deploy" / "kubernetes" / "base" / "generated"
    out[base / "dashboards.yaml"] = manifests.render_configmaps(dashboards)
    sources = sorted((root / "alerts" / "src").glob("*.yaml"))
    if not sources:
        raise SystemExit(f"no alert rule files under {root / 'alerts' / 'src'} (is --root the repository?)")
    runbooks = runbook_base or manifests.DEFAULT_RUNBOOK_BASE
    try:
        for src in sources:
            out[root / "alerts" / "rules" / src.name] = manifests.render_rule_file(src, runbooks)
        out[base / "prometheusrule.yaml"] = manifests.render_rule(sources, runbooks)
    except ValueError as exc:
        raise SystemExit(f"shadow dashboards build: {exc}") from None
    return out


def _build(args: argparse.Namespace) -> int:
    root = Path(args.root)
    files = generated_files(root, args.runbook_base)
    stale = [p for p, text in files.items()
             if not p.is_file() or p.read_text(encoding="utf-8") != text]
    if args.check:
        for p in stale:
            print(f"stale: {p}", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(files[p], encoding="utf-8")
    print(f"{len(files)} generated files, {len(stale)} rewritten")
    return 0


def _load(dir_: Path) -> dict[str, dict[str, Any]]:
    if dir_.is_dir():
        found = {p.name: json.loads(p.read_text(encoding="utf-8")) for p in sorted(dir_.glob("*.json"))}
        if not found:
            raise SystemExit(f"no dashboard JSON files in {dir_}")
        return found
    try:
        from shadow.telemetry.dashboards import build_all
    except ImportError:
        raise SystemExit(f"{dir_} does not exist, and building dashboards needs pip install "
                         "'shadow[dashboards]'") from None
    return build_all()


def _push(args: argparse.Namespace) -> int:
    missing = missing_extra("grafana_client", "grafana", "shadow dashboards push")
    if missing:
        print(f"error: {missing}", file=sys.stderr)
        return 2
    from shadow.telemetry.publish import PushError, push

    if not args.token:
        print("error: no token: pass --token or set GRAFANA_TOKEN", file=sys.stderr)
        return 2
    dashboards = _load(Path(args.dir))
    try:
        outcomes = push(dashboards, url=args.url, token=args.token, folder=args.folder,
                        timeout_s=args.timeout)
    except PushError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for o in outcomes:
        print(f"{o.action:>20}  {o.uid}")
    return 0
