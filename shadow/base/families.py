"""Metric families declared once, beside the code that updates them: a `Family` builds the
prometheus_client family or instrument that exports it, and the catalogue is made of them."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, Generic, Literal, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

MetricType = Literal["counter", "gauge", "histogram"]
#: Label values of one sample: one string for one label, a tuple for several, () for none.
LabelKey = TypeVar("LabelKey", bound=str | tuple[str, ...])
Source = TypeVar("Source")


@dataclass(frozen=True)
class Family:
    """One metric family: `name` as PromQL sees it (counters end in `_total`), the exported `help`,
    its base `unit`, label names, closed label value sets (`values`: label -> the only values it
    may take), fixed histogram `buckets` (empty: chosen by the exporter) and a docs-only `note`."""

    name: str
    type: MetricType
    help: str
    unit: str
    labels: tuple[str, ...] = ()
    values: Mapping[str, tuple[str, ...]] = field(default_factory=dict, hash=False)
    buckets: tuple[float, ...] = ()
    note: str = ""

    def __post_init__(self) -> None:
        if self.name.endswith("_total") != (self.type == "counter") and ":" not in self.name:
            raise ValueError(f"{self.name}: counters, and only counters, end in _total")
        if not set(self.values) <= set(self.labels):
            raise ValueError(f"{self.name}: closed sets for labels it does not have: "
                             f"{sorted(set(self.values) - set(self.labels))}")
        if self.buckets and (self.type != "histogram" or list(self.buckets) != sorted(set(self.buckets))):
            raise ValueError(f"{self.name}: buckets are for histograms, increasing")
        object.__setattr__(self, "values", MappingProxyType(dict(self.values)))

    def closed(self, label: str) -> tuple[str, ...]:
        """The closed value set of `label` (KeyError when the label is not closed)."""
        return self.values[label]

    def family(self) -> Metric:
        """An empty prometheus_client family of this declaration (what `describe()` yields)."""
        if self.type == "counter":
            return self.counter_family()
        if self.type == "gauge":
            return self.gauge_family()
        return self.histogram_family()

    def counter_family(self) -> CounterMetricFamily:
        """An empty counter family; samples are added with `add_metric(labels, value, created)`."""
        self._expect("counter")
        return CounterMetricFamily(self.name, self.help, labels=self.labels)

    def gauge_family(self) -> GaugeMetricFamily:
        """An empty gauge family; samples are added with `add_metric(labels, value)`."""
        self._expect("gauge")
        return GaugeMetricFamily(self.name, self.help, labels=self.labels)

    def histogram_family(self) -> HistogramMetricFamily:
        """An empty histogram family; samples are added with `add_metric(labels, buckets, sum)`."""
        self._expect("histogram")
        return HistogramMetricFamily(self.name, self.help, labels=self.labels)

    def sampled(self, values: Mapping[LabelKey, float | None], created: float | None = None) -> Metric:
        """A counter or gauge family with one sample per label key (None values are left out);
        `created` stamps counter samples."""
        if self.type == "counter":
            counter = self.counter_family()
            for key, v in values.items():
                if v is not None:
                    counter.add_metric([key] if isinstance(key, str) else list(key), v, created=created)
            return counter
        gauge = self.gauge_family()
        for key, v in values.items():
            if v is not None:
                gauge.add_metric([key] if isinstance(key, str) else list(key), v)
        return gauge

    def cumulative(self, counts: Iterable[float], count: float) -> list[tuple[str, float]]:
        """Histogram buckets `(le, cumulative count)` over the declared bounds, `+Inf` = `count`."""
        out = [(repr(float(b)), float(c)) for b, c in zip(self.buckets, counts, strict=True)]
        out.append(("+Inf", float(count)))
        return out

    def value(self, v: float | None) -> Metric:
        """The unlabelled family with one sample `v` (none when `v` is None)."""
        return self.sampled({(): v})

    def counter(self, registry: CollectorRegistry) -> Counter:
        """The prometheus_client Counter of this declaration, registered on `registry`."""
        self._expect("counter")
        return Counter(self.name, self.help, self.labels, registry=registry)

    def gauge(self, registry: CollectorRegistry) -> Gauge:
        """The prometheus_client Gauge of this declaration, registered on `registry`."""
        self._expect("gauge")
        return Gauge(self.name, self.help, self.labels, registry=registry)

    def histogram(self, registry: CollectorRegistry) -> Histogram:
        """The prometheus_client Histogram of this declaration (its buckets), on `registry`."""
        self._expect("histogram")
        if not self.buckets:
            raise ValueError(f"{self.name}: an instrument needs declared buckets")
        return Histogram(self.name, self.help, self.labels, buckets=self.buckets, registry=registry)

    def _expect(self, type_: MetricType) -> None:
        if self.type != type_:
            raise TypeError(f"{self.name} is a {self.type}, not a {type_}")


class DeclaredCollector(Collector):
    """A custom collector whose `describe()` yields its declared `families` (every family its
    `collect()` may yield), so a registry learns its names without collecting."""

    families: ClassVar[tuple[Family, ...]] = ()

    def describe(self) -> Iterable[Metric]:
        return [f.family() for f in self.families]


class SourceCollector(DeclaredCollector, Generic[Source]):
    """A declared collector that reads one `source` (its state and counters) at each scrape."""

    def __init__(self, source: Source) -> None:
        self.source = source
