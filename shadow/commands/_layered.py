"""A command's options from every source, later ones winning: defaults < YAML file < environment <
command-line flags, all parsed and typed by the command's own parser."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

CONFIG = "config"  # the option naming the YAML file (itself never read from the file)


def _option_tokens(parser: argparse.ArgumentParser, values: Mapping[str, Any], where: str) -> list[str]:
    """Turn {option: value} (YAML or env) into command-line tokens parsed like flags."""
    by_dest = {a.dest: a for a in parser._actions if a.option_strings}
    out: list[str] = []
    for key, value in values.items():
        dest = str(key).replace("-", "_")
        action = by_dest.get(dest)
        if action is None or dest == CONFIG:
            known = sorted(d for d in by_dest if d not in ("help", CONFIG))
            raise ValueError(f"{where}: unknown option {key!r} (known: {', '.join(known)})")
        flag = (
            action.option_strings[-1]
            if action.option_strings[-1].startswith("--")
            else action.option_strings[0]
        )
        if isinstance(action, argparse._StoreTrueAction):
            if isinstance(value, str):
                value = value.strip().lower() in ("1", "true", "yes", "on")
            if value:
                out.append(flag)
            continue
        if isinstance(action, argparse._AppendAction):
            if isinstance(value, Mapping):
                items = [f"{k}={v}" for k, v in value.items()]
            elif isinstance(value, str):
                items = [x for x in value.split(",") if x]
            elif isinstance(value, list):
                items = [str(x) for x in value]
            else:
                raise ValueError(f"{where}: {key} must be a list or a mapping of NAME: URL")
            for item in items:
                out += [flag, item]
            continue
        if isinstance(value, list):
            value = ",".join(str(x) for x in value)
        if value is None:
            continue
        out += [flag, str(value)]
    return out


def _yaml_options(path: str) -> dict[str, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ValueError(f"config {path}: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ValueError(f"config {path}:{where} invalid YAML") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"config {path}: must be a mapping of option: value")
    return data


def resolve(
    build_parser: Callable[[], argparse.ArgumentParser],
    explicit: Mapping[str, Any],
    environ: Mapping[str, str],
    env_prefix: str,
) -> argparse.Namespace:
    """Every option's value: `explicit` (the flags given) over `env_prefix`<OPTION> variables over
    the YAML file of `--config` (or `env_prefix`CONFIG) over the parser's defaults."""
    parser = build_parser()
    tokens: list[str] = []
    config = explicit.get(CONFIG) or environ.get(env_prefix + CONFIG.upper())
    if config:
        tokens += _option_tokens(parser, _yaml_options(config), f"config {config}")
    env = {
        k[len(env_prefix) :].lower(): v
        for k, v in environ.items()
        if k.startswith(env_prefix) and k != env_prefix + CONFIG.upper()
    }
    tokens += _option_tokens(parser, env, "environment")
    base = parser.parse_args(tokens)
    for k, v in explicit.items():
        setattr(base, k, v)
    return base


def explicit_only(parser: argparse.ArgumentParser) -> None:
    """Leave options not given out of the parsed namespace (`resolve` fills them in)."""
    for action in parser._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The options a sub-command's namespace holds (not the CLI's own `func` and `command`)."""
    return {k: v for k, v in vars(args).items() if k not in ("func", "command")}
