"""The metric catalogue: the families each exporter declares, in one table that dashboards, alert
rules and docs/metrics.md are checked against (assembled by `shadow.app.catalogue`)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from shadow.base.families import Family, MetricType

#: Exporters and what they are, as docs/metrics.md explains them.
EXPORTERS: dict[str, str] = {
    "mirror": "the analysis: the mirror, fed by the taps (`shadow serve`, `shadow capture`)",
    "capture": "passive capture, beside the mirror's families (`shadow capture`, `shadow serve --capture`)",
    "dataplane": "`shadow tap`, the data plane: its own /metrics on --metrics-port (scraped to page when a "
    "tap is down)",
    "serve": "the live lanes (`shadow serve`); `serve (--active)`: only when `shadow serve --active` "
    "runs the active proxy and the mode controller",
    "router": "`shadow router`, the stand-in for an existing router (it also exports the active "
    "proxy's `serve (--active)` families)",
    "fleet": "the simulated fleet's ground truth",
    "vllm": "worker metrics that shadow reads (vLLM exports them; so does the simulated fleet)",
    "probe": "shadow's step probe inside a real vLLM engine (on the engine's /metrics)",
}

#: Every label any catalogued family carries, with what bounds its values (closed sets: each
#: family's own, listed in docs/metrics.md).
LABELS: dict[str, str] = {
    "worker": "configured worker or tap names (bounded by fleet size)",
    "lane": "`actual` plus one per configured policy (jsq-bytes, br0, brh-survival, ...)",
    "source": "where a mirrored event came from; step times: events | sse; vLLM: where prompt tokens "
    "came from",
    "kind": "event kind (the event contract's types)",
    "reason": "a closed set per family where one is declared; otherwise the causes the code names "
    "(queue_full, record_full, parse_error, ...)",
    "stage": "analysis stage that raised (analysis, listener, record, housekeeping, ...); "
    "`shadow router`: the routing stage",
    "leg": "prefill | decode (taps); the active proxy's upstream legs",
    "engine": "engine index of one simulated or vLLM server",
    "model_name": "served model name (from the worker's configuration)",
    "finished_reason": "why the engine finished a request (vLLM's finish reasons)",
    "block_size": "KV block size (vLLM cache config info)",
    "enable_prefix_caching": "True | False (vLLM cache config info)",
    "num_gpu_blocks": "KV capacity in blocks (vLLM cache config info)",
    "kv_cache_size_tokens": "KV capacity in tokens (vLLM cache config info)",
    "mode": "operator mode (the gauge) or the mode a request was routed in",
    "policy": "the policy requests are routed with; `router` = the existing router (shadow mode)",
    "outcome": "how an actively routed request or a probed engine step ended",
    "prompt_bucket": "prompt length in tokens, bucketed",
    "round_stage": "BalanceRoute's two stages within a routing round",
    "result": "whether a predictor prompt-key lookup found the key; ok | failed for a cohort's requests",
    "cohort": "shadow (routed by shadow's policy) | router (passed to the existing router)",
    "metric": "what a canary test compared: error_rate | ttft | tpot | spread",
    "backend": "`shadow router`'s configured backend names",
    "listener": "one of shadow's own listeners: api (the API/admin port), active (the proxy's client port)",
    "version": "shadow's version (one per running build)",
    "python": "the Python version running shadow",
    "figure": "a live lane figure compared with the actual lane: spread | imbalance | idle | throughput",
    "bound": "mean | low | high: a ratio and its 95% interval's bounds",
    "verdict": "better | no significant difference | worse | too few windows | not trustworthy (live "
    "comparisons); pass | fail | promoted (a canary step)",
    "direction": "passive capture: to_server | to_client",
    "group": "a barrier group of decode workers: their names joined by + (one worker where none is shared)",
    "term": "a step-cost term: b (fixed) | c (per running sequence) | a (per KV token) | p (per prefill "
    "token)",
    "form": "a candidate step-cost form: its terms joined by + (b, b+c, ..., b+c+a+p)",
    "stat": "a host factor's statistic: recent (the last windows) | median | low | high (10th and 90th "
    "percentiles); a lane's balance ratio: mean | p10; its max/min ratio: p50 | p90 | p95",
}

#: docs/metrics.md's section on the balance figures in the field's units and how they relate.
BALANCE_UNITS: tuple[str, ...] = (
    "## Balance in the field's units",
    "",
    "Per lane, from each decode step's per-worker KV loads L_g (G workers; `shadow.engine.balance`),",
    "beside spread and I(k) = Σ_g (max L − L_g) = G·max L − Σ_g L_g, in `/v1/report` (each lane),",
    "`shadow replay`'s second table and JSON, and the families below:",
    "",
    "| figure | per step | over the run | family |",
    "|---|---|---|---|",
    "| balance ratio (NVIDIA TRT-LLM ADP blog: avg/max tokens per rank) | r = mean L / max L | "
    "step-time-weighted mean; p10 of the time | `shadow_lane_balance_ratio{stat=mean\\|p10}` |",
    "| idle rate (BF-IO) | mean_g (1 − L_g / max L) = 1 − r | step-time-weighted mean | "
    "`shadow_lane_idle_rate_ratio` |",
    "| speed-of-light throughput (NVIDIA: sol_tps = elapsed / Σ_k t_k·r_k × tps) | – | "
    "throughput / mean r | `shadow_lane_sol_throughput_tokens_per_second` |",
    "| max/min (SGLang PR #25235) | max L / min L (∞ when a worker holds nothing) | p50, p90, p95 over "
    "steps | `shadow_lane_max_min_ratio{stat=p50\\|p90\\|p95}` |",
    "",
    "Identities: 1 − r = (G·max L − Σ_g L_g) / (G·max L) = I(k) / (G·max L): NVIDIA's 1 − balance",
    "ratio is shadow's I(k) over G·max L, and BF-IO's `avg_imbalance` is I(k) itself; idle rate = 1 − r; SOL",
    "throughput / throughput = 1 / mean r. These are in KV tokens: barrier idle (time) weighs them by",
    "the step model (idle = a·I(k) / (G·T(k)) with T = a·max L + b), so it is smaller by the fixed",
    "part b of the step. Steps with max L = 0 are left out; r and min/max are kept in 1/1000 bins",
    "(percentiles exact to a bin: max/min to 0.1 % near 1, ±10 % at 100; beyond 1000 it counts as ∞).",
)

_HIST_SUFFIXES = ("_bucket", "_sum", "_count", "_created")


@dataclass(frozen=True)
class Exported:
    """Families one exporter declares; `only="active"`: only under `shadow serve --active`."""

    exporter: str
    families: tuple[Family, ...]
    only: str = ""


@dataclass(frozen=True)
class Entry:
    """One catalogued family with the exporter that declares it."""

    family: Family
    exporter: str
    only: str = ""

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def type(self) -> MetricType:
        return self.family.type

    @property
    def labels(self) -> tuple[str, ...]:
        return self.family.labels

    @property
    def help(self) -> str:
        return self.family.help


class Catalogue:
    """Every family of `exported`, one entry each (ValueError on a name declared twice, an unknown
    exporter or a label outside `LABELS`)."""

    def __init__(self, exported: Iterable[Exported]) -> None:
        entries: list[Entry] = []
        for group in exported:
            if group.exporter not in EXPORTERS:
                raise ValueError(f"unknown exporter {group.exporter!r}; known: {', '.join(EXPORTERS)}")
            entries += [Entry(f, group.exporter, group.only) for f in group.families]
        self.entries = tuple(entries)
        self._by_name = {e.name: e for e in self.entries}
        twice = sorted(n for n, k in Counter(e.name for e in self.entries).items() if k > 1)
        if twice:
            raise ValueError(f"families declared twice: {twice}")
        for e in self.entries:
            unknown = set(e.labels) - set(LABELS)
            if unknown:
                raise ValueError(f"{e.name}: labels {sorted(unknown)} are not in LABELS")

    def __iter__(self) -> Iterator[Entry]:
        return iter(self.entries)

    def get(self, name: str) -> Entry | None:
        """The entry of family `name` exactly as catalogued (None when there is none)."""
        return self._by_name.get(name)

    def lookup(self, series_name: str) -> Entry | None:
        """The entry a series name belongs to (`x_total`, `x_bucket`, `x_created`, ... map to x's)."""
        entry = self._by_name.get(series_name)
        if entry is not None:
            return entry
        for suffix in _HIST_SUFFIXES:
            if series_name.endswith(suffix):
                base = series_name[: -len(suffix)]
                entry = self._by_name.get(base) or self._by_name.get(base + "_total")
                if entry is not None and entry.type != "gauge":
                    return entry
        return None

    def for_exporter(self, *exporters: str, active: bool = True) -> tuple[Entry, ...]:
        """Entries of `exporters`; without `active`, only those exported whatever the mode."""
        return tuple(e for e in self.entries if e.exporter in exporters and (active or not e.only))

    def active_only(self) -> frozenset[str]:
        """Names exported only by `shadow serve --active`."""
        return frozenset(e.name for e in self.entries if e.only == "active")

    def check_exposition(self, text: str, exporters: Iterable[str] = EXPORTERS) -> list[str]:
        """Problems with one `/metrics` text against the catalogue (empty when it conforms): each
        family exposed once, catalogued for one of `exporters`, with its type, help (where a HELP
        line gives it), label names, closed label sets and declared histogram buckets."""
        allowed = set(exporters)
        problems: list[str] = []
        types = Counter(line.split()[2] for line in text.splitlines()
                        if line.startswith("# TYPE ") and len(line.split()) > 2)
        problems += [f"{name}: exposed {n} times on one page (Prometheus' parser refuses it)"
                     for name, n in types.items() if n > 1]
        for fam in text_string_to_metric_families(text):
            if fam.name.endswith("_created") and fam.type == "gauge":
                owner = self.lookup(fam.name)
                if owner is not None and owner.type != "gauge" and owner.exporter in allowed:
                    continue  # the client's `_created` series of a catalogued counter or histogram
            name = fam.name + "_total" if fam.type == "counter" else fam.name
            entry = self._by_name.get(name)
            if entry is None and fam.type == "counter":
                entry = self._by_name.get(fam.name)
            if entry is None or entry.exporter not in allowed:
                problems.append(f"{name}: not in the catalogue for {sorted(allowed)} "
                                "(declared beside its exporter; shadow/app/catalogue.py)")
                continue
            problems += _family_problems(entry.family, fam.type, fam.documentation, fam.samples)
        return problems

    def markdown(self) -> str:
        """The catalogue as the Markdown document docs/metrics.md (generated; do not edit by hand)."""
        out = [
            "# Metrics",
            "",
            "Generated by `shadow dashboards build` from the metric families each exporter declares",
            "(assembled in `shadow/app/catalogue.py`); do not edit. Names are as PromQL sees them",
            "(counters end in `_total`, histograms add `_bucket`, `_sum`, `_count`); help is the text",
            "the exporter sends. Exporters:",
            "",
            *(f"- `{k}`: {v}." for k, v in EXPORTERS.items()),
            "",
            "| name | type | unit | labels | exporter | help |",
            "|---|---|---|---|---|---|",
        ]
        for e in self.entries:
            labels = ", ".join(f"`{x}`" for x in e.labels) or "–"
            exporter = f"{e.exporter} (--{e.only})" if e.only else e.exporter
            text = f"{e.help} {e.family.note}" if e.family.note else e.help
            out.append(f"| `{e.name}` | {e.type} | {e.family.unit} | {labels} | {exporter} | {_cell(text)} |")
        out += ["", *BALANCE_UNITS]
        out += ["", "## Labels", "", "| label | bounded by |", "|---|---|"]
        out += [f"| `{k}` | {_cell(v)} |" for k, v in LABELS.items()]
        out += ["", "## Closed label sets", "",
                "An exporter may give these labels no other values (checked on every real exporter).",
                "", "| metric | label | values |", "|---|---|---|"]
        out += [f"| `{e.name}` | `{label}` | {', '.join(f'`{x}`' for x in values)} |"
                for e in self.entries for label, values in e.family.values.items()]
        out += ["", "## Histogram buckets", "", "Upper bounds in the family's unit (`+Inf` added); "
                "histograms not listed choose theirs at run time.", "", "| metric | buckets |", "|---|---|"]
        out += [f"| `{e.name}` | {', '.join(f'{b:g}' for b in e.family.buckets)} |"
                for e in self.entries if e.family.buckets]
        return "\n".join(out) + "\n"


def _cell(text: str) -> str:
    """`text` safe inside a Markdown table cell."""
    return text.replace("|", "\\|")


def _family_problems(family: Family, type_: str, help_: str, samples: Iterable[Sample]) -> list[str]:
    """How one exposed family differs from its declaration."""
    name = family.name
    problems: list[str] = []
    if family.type != type_:
        problems.append(f"{name}: exported as {type_}, catalogued as {family.type}")
    if help_ and family.help != help_:  # (a text without HELP lines is checked for the rest)
        problems.append(f"{name}: help {help_!r}, declared {family.help!r}")
    seen: set[str] = set()
    bounds: set[str] = set()
    declared = {repr(float(b)) for b in family.buckets}
    any_sample = False
    for sample in samples:
        any_sample = True
        labels = sample.labels
        seen |= set(labels) - {"le", "quantile"}
        if sample.name.endswith("_bucket") and labels.get("le", "+Inf") != "+Inf":
            bounds.add(repr(float(labels["le"])))
        for label, value in labels.items():
            closed = family.values.get(label)
            if closed is not None and value not in closed:
                problems.append(f"{name}: {label}={value!r} outside the closed set {list(closed)}")
    if any_sample and seen != set(family.labels):
        problems.append(f"{name}: labels {sorted(seen)}, catalogued {sorted(family.labels)}")
    if family.buckets and bounds and bounds != declared:
        problems.append(f"{name}: buckets {sorted(bounds, key=float)}, declared "
                        f"{sorted(declared, key=float)}")
    return problems
