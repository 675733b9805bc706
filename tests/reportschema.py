"""Checks a `/v1/report` document against the published JSON Schema (`shadow.contracts.report`)."""

from __future__ import annotations

from functools import cache
from typing import Any

import jsonschema

from shadow.contracts.report import report_schema


@cache
def _validator() -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(report_schema())


def check_report(doc: dict[str, Any], schema: dict[str, Any] | None = None) -> None:
    """AssertionError naming every place `doc` (less the demo's own `demo` block) breaks the schema
    (`schema`: one served over HTTP; default: the types' own)."""
    body = {k: v for k, v in doc.items() if k != "demo"}
    v = _validator() if schema is None else jsonschema.Draft202012Validator(schema)
    errors = [f"{'/'.join(map(str, e.absolute_path)) or '(top)'}: {e.message[:160]}"
              for e in v.iter_errors(body)]
    assert not errors, "\n".join(errors[:20])
