"""A command's options from every source, later ones winning: defaults < YAML file < environment <
command-line flags, all parsed and typed by the command's own parser."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping
from typing import Any

from shadow.base.safeyaml import load_yaml

CONFIG = "config"  # the option naming the YAML file (itself never read from the file)
MAX_CONFIG_BYTES = 1 << 20  # a config file is a mapping of options: far smaller


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
    """The options in the YAML file at `path`: at most MAX_CONFIG_BYTES, no aliases (`load_yaml`)."""
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"config {path}: {exc.strerror or exc}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ValueError(f"config {path}: larger than {MAX_CONFIG_BYTES} bytes (the limit)")
    data = load_yaml(raw, f"config {path}", "--config")
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
    the YAML file of `--config` (or `env_prefix`CONFIG) over the parser's defaults.

    The namespace's `option_sources` says where each option not at its default came from:
    {dest: "flag" | "config FILE" | "env NAME"} (see `origin`)."""
    parser = build_parser()
    tokens: list[str] = []
    sources: dict[str, str] = {}
    config = explicit.get(CONFIG) or environ.get(env_prefix + CONFIG.upper())
    if config:
        options = _yaml_options(config)
        tokens += _option_tokens(parser, options, f"config {config}")
        sources.update({str(k).replace("-", "_"): f"config {config}" for k in options})
    env = {
        k[len(env_prefix) :].lower(): v
        for k, v in environ.items()
        if k.startswith(env_prefix) and k != env_prefix + CONFIG.upper()
    }
    tokens += _option_tokens(parser, env, "environment")
    sources.update({k.replace("-", "_"): f"env {env_prefix}{k.upper()}" for k in env})
    base = parser.parse_args(tokens)
    for k, v in explicit.items():
        setattr(base, k, v)
        sources[k] = "flag"
    base.option_sources = sources
    return base


def origin(args: argparse.Namespace, dest: str) -> str:
    """Where option `dest` came from: "flag", "config FILE", "env NAME" or "default"."""
    sources: Mapping[str, str] = getattr(args, "option_sources", {})
    return sources.get(dest, "default")


def explicit_only(parser: argparse.ArgumentParser) -> None:
    """Leave options not given out of the parsed namespace (`resolve` fills them in)."""
    for action in parser._actions:
        if action.dest != "help":
            action.default = argparse.SUPPRESS


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The options a sub-command's namespace holds (not the CLI's own `func` and `command`)."""
    return {k: v for k, v in vars(args).items() if k not in ("func", "command")}
