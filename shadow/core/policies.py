"""The one registry of policy names: what each policy is, its parameters, and its router's factory.

Every caller resolves names here (lanes, `schedule_round`, the active proxy, the CLI's choices, the
metric label sets); a name means one policy everywhere. A policy's factory takes only its own
parameter dataclass, which picks its part of a caller's `RouterOptions`.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass, field, fields
from functools import partial
from typing import Any, Generic, Literal, Self, TypeVar

from shadow.core.baselines import (
    Baseline,
    JoinShortestQueue,
    JoinShortestQueueBytes,
    LeastTokens,
    PowerOfTwo,
    RoundRobin,
    UniformRandom,
)
from shadow.core.bra import BRAParams
from shadow.core.incumbents import (
    SglangTotalRequests,
    SglangTotalTokens,
    SmgMinTokens,
    TrtllmADP,
    VllmDP,
    VllmDPLegacy,
)
from shadow.core.params import BRParams
from shadow.core.predictors import PREDICTORS, make_predictor
from shadow.core.routers import BindingRouter, ForcedRouter, PoolRouter, Router

#: baseline: binds each request at arrival; incumbent: likewise, a production router's own rule
#: (`shadow.core.incumbents`), read at its default staleness; pool: places from a waiting pool into
#: free slots; forced: replays given placements (the real router's, the `actual` lane).
Kind = Literal["baseline", "incumbent", "pool", "forced"]
#: The kinds that bind at arrival by a rule: what a comparison's "best baseline" is taken from.
BASELINE_KINDS: tuple[Kind, ...] = ("baseline", "incumbent")


@dataclass(frozen=True, slots=True)
class RouterOptions:
    """What a caller sets for the routers it asks for; each policy takes only its own part."""

    br: BRParams = field(default_factory=BRParams)
    bra: BRAParams = field(default_factory=BRAParams)
    predictor: str | None = None
    seed: int = 0
    only_free: bool = False
    assignments: Mapping[Hashable, int] | None = None
    workers: int = 0
    view_age_s: float | None = None  # None: the policy's own default (`Policy.view_age_s`)


class _FromOptions:
    """A policy's parameters: the caller's `RouterOptions` fields of the same names."""

    __slots__ = ()

    @classmethod
    def of(cls, o: RouterOptions) -> Self:
        return cls(**{f.name: getattr(o, f.name) for f in fields(cls)})  # type: ignore[arg-type]  # (a dataclass mixin)


@dataclass(frozen=True, slots=True)
class BaselineParams(_FromOptions):
    """A baseline's random stream seed; `only_free`: bind only into free slots (a routing round);
    `view_age_s`: the age of its view of the engines at most (`StaleView`; None: its default)."""

    seed: int = 0
    only_free: bool = False
    view_age_s: float | None = None


@dataclass(frozen=True, slots=True)
class BalanceRouteParams(_FromOptions):
    """BR-0/BR-H: BalanceRoute's knobs and (BR-H) a length predictor by name; without one BR-H
    takes predicted steps from its caller."""

    br: BRParams = field(default_factory=BRParams)
    predictor: str | None = None
    view_age_s: float | None = None


@dataclass(frozen=True, slots=True)
class AdaptiveParams(_FromOptions):
    """BRA: BalanceRoute's knobs, BRA's own and a length predictor by name (optional)."""

    br: BRParams = field(default_factory=BRParams)
    bra: BRAParams = field(default_factory=BRAParams)
    predictor: str | None = None
    view_age_s: float | None = None


@dataclass(frozen=True, slots=True)
class ForcedParams:
    """The placements to replay (request id -> worker index) over `workers` workers."""

    assignments: Mapping[Hashable, int]
    workers: int

    @classmethod
    def of(cls, o: RouterOptions) -> ForcedParams:
        if o.assignments is None:
            raise ValueError("a forced lane needs its assignments")
        return cls(o.assignments, o.workers)


P = TypeVar("P")

#: The incumbents' default view ages: vLLM's DP coordinator publishes every 100 ms; SGLang's DP
#: controller refreshes at most every 20 ms; SMG polls every --load-monitor-interval, 10 s.
VLLM_DP_VIEW_S = 0.100
SGLANG_VIEW_S = 0.020
SMG_VIEW_S = 10.0


@dataclass(frozen=True, slots=True)
class Policy(Generic[P]):
    """One policy: its name and kind, a one-line summary, its parameters (`select` takes them from a
    caller's options) and the factory of its router. `predicted`: takes a length predictor (a lane
    needs one); `active`: active mode can route with it; `retired`: old names active mode took
    for it and now refuses, naming this policy; `view_age_s`: the age of the view of the engines
    it routes on by default (an incumbent's refresh period; a lane's `name@AGE` overrides it)."""

    name: str
    kind: Kind
    summary: str
    select: Callable[[RouterOptions], P]
    factory: Callable[[P], Router]
    aliases: tuple[str, ...] = ()
    predicted: bool = False
    active: bool = False
    retired: tuple[str, ...] = ()
    rule: type[Baseline] | None = None  # a baseline's rule
    view_age_s: float = 0.0

    @property
    def binds_at_arrival(self) -> bool:
        return self.kind != "pool"

    def make(self, options: RouterOptions) -> Router:
        """A fresh router from this policy's part of `options`."""
        if options.predictor is not None and not self.predicted:
            raise ValueError(f"policy {self.name!r} takes no predictor")
        return self.factory(self.select(options))


def _baseline(rule: type[Baseline], default_age_s: float, p: BaselineParams) -> Router:
    age = default_age_s if p.view_age_s is None else p.view_age_s
    return BindingRouter(rule(random.Random(p.seed)), only_free=p.only_free, view_age_s=age)


def _check_predictor(variant: str, predictor: str | None) -> None:
    if predictor is not None and predictor not in PREDICTORS:
        raise ValueError(f"{variant} predictor must be one of {list(PREDICTORS)}; got {predictor!r}")


def _balance_route(variant: str, p: BalanceRouteParams) -> Router:
    _check_predictor(variant, p.predictor)
    return PoolRouter(variant, p.br, make_predictor(p.predictor) if p.predictor else None,
                      view_age_s=p.view_age_s or 0.0)


def _adaptive(p: AdaptiveParams) -> Router:
    _check_predictor("bra", p.predictor)
    return PoolRouter("bra", p.br, make_predictor(p.predictor) if p.predictor else None, p.bra,
                      view_age_s=p.view_age_s or 0.0)


def _forced(p: ForcedParams) -> Router:
    return ForcedRouter(p.assignments, p.workers)


def _rule(
    rule: type[Baseline],
    summary: str,
    aliases: tuple[str, ...] = (),
    active: bool = False,
    retired: tuple[str, ...] = (),
    kind: Kind = "baseline",
    view_age_s: float = 0.0,
) -> Policy[BaselineParams]:
    return Policy(
        rule.name,
        kind,
        summary,
        BaselineParams.of,
        partial(_baseline, rule, view_age_s),
        aliases=aliases,
        active=active,
        retired=retired,
        rule=rule,
        view_age_s=view_age_s,
    )


def _incumbent(rule: type[Baseline], summary: str, view_age_s: float) -> Policy[BaselineParams]:
    return _rule(rule, summary, kind="incumbent", view_age_s=view_age_s)


REGISTRY: Mapping[str, Policy[Any]] = {
    p.name: p
    for p in (
        _rule(RoundRobin, "round-robin over the workers", aliases=("round-robin",), active=True),
        _rule(UniformRandom, "a uniformly random worker"),
        _rule(PowerOfTwo, "the fewer outstanding requests of two random workers"),
        _rule(JoinShortestQueue, "JSQ-count: fewest outstanding requests"),
        _rule(
            JoinShortestQueueBytes,
            "JSQ-bytes, the vllm-ascend P/D proxy's rule (examples/disaggregated_prefill_v1/"
            "load_balance_proxy_server_example.py): least outstanding request-body bytes, held until "
            "the stream ends (without body sizes, e.g. traces: 4 bytes per prompt token)",
            active=True,
            retired=("jsq",),
        ),
        _rule(LeastTokens, "least KV tokens held plus prompt tokens queued"),
        _incumbent(VllmDP, "vLLM's DP load balancer (vllm-project/vllm vllm/v1/engine/core_client.py "
                   "DPLBAsyncMPClient, PR #49204): min max(inflight, waiting+running) + "
                   "6·waiting·max(0, kv_usage-0.5), ties rotated (PR #47420); counts published every "
                   "100 ms", VLLM_DP_VIEW_S),
        _incumbent(VllmDPLegacy, "vLLM's DP load balancer before PR #49204 (vllm-project/vllm "
                   "vllm/v1/engine/core_client.py DPLBAsyncMPClient): min 4·waiting + running, ties "
                   "to the first engine; counts published every 100 ms", VLLM_DP_VIEW_S),
        _incumbent(SglangTotalTokens, "SGLang's DP controller --load-balance-method total_tokens "
                   "(sgl-project/sglang python/sglang/srt/managers/data_parallel_controller.py "
                   "DPBudget, PR #21699): min total tokens, ties fewer requests; +input length "
                   "between refreshes (at most every 20 ms)", SGLANG_VIEW_S),
        _incumbent(SglangTotalRequests, "SGLang's DP controller --load-balance-method total_requests "
                   "(sgl-project/sglang python/sglang/srt/managers/data_parallel_controller.py "
                   "DPBudget): min running+waiting requests; +1 between refreshes (at most every "
                   "20 ms)", SGLANG_VIEW_S),
        _incumbent(SmgMinTokens, "SMG's --dp-minimum-tokens-scheduler (lightseekorg/smg "
                   "model_gateway/src/policies/dp_min_token.rs, worker/monitor.rs, PR #1007): min "
                   "cached num_used_tokens, +ceil(1.3·words) per dispatch; polled every "
                   "--load-monitor-interval (10 s)", SMG_VIEW_S),
        _incumbent(TrtllmADP, "TensorRT-LLM's DefaultADPRouter (NVIDIA/TensorRT-LLM "
                   "tensorrt_llm/_torch/pyexecutor/scheduler/adp_router.py, PR #11633): min-heap on "
                   "(Σ prompt lengths, requests), each rank capped at ceil(total/G); per-iteration "
                   "allgather (current)", 0.0),
        Policy("br0", "pool", "BalanceRoute BR-0 over a prompt pool", BalanceRouteParams.of,
               partial(_balance_route, "br0"), active=True),
        Policy("brh", "pool", "BalanceRoute BR-H (horizon look-ahead with a length predictor)",
               BalanceRouteParams.of, partial(_balance_route, "brh"), predicted=True, active=True),
        Policy("bra", "pool", "BRA, this project's BalanceRoute-adaptive (shadow.core.bra)",
               AdaptiveParams.of, _adaptive, predicted=True),
        Policy("forced", "forced", "replays the real router's placements (the `actual` lane)",
               ForcedParams.of, _forced),
    )
}
_BY_NAME: Mapping[str, Policy[Any]] = {**REGISTRY, **{a: p for p in REGISTRY.values() for a in p.aliases}}


def names(kind: Kind | None = None, *, active: bool | None = None) -> tuple[str, ...]:
    """Policy names in registry order, of one `kind` and/or whether they route actively."""
    return tuple(
        p.name
        for p in REGISTRY.values()
        if (kind is None or p.kind == kind) and (active is None or p.active == active)
    )


#: Policies one can pick by name for a lane, `schedule_round` or a sweep (all but `forced`).
POLICIES: tuple[str, ...] = (*names("baseline"), *names("incumbent"), *names("pool"))
#: Policies active mode routes with (BalanceRoute's first).
ACTIVE: tuple[str, ...] = (*names("pool", active=True), *names("baseline", active=True))
#: The `policy` label of actively routed requests: the active policies and `router` (shadow mode).
ROUTE_LABELS: tuple[str, ...] = (*ACTIVE, "router")


def lookup(name: str) -> Policy[Any] | None:
    """The policy called `name` (or one of its aliases), None when there is none."""
    return _BY_NAME.get(name)


def policy(name: str) -> Policy[Any]:
    """The policy called `name` (or one of its aliases); ValueError naming the known ones."""
    p = _BY_NAME.get(name)
    if p is None:
        raise ValueError(f"unknown policy {name!r}; known: {list(REGISTRY)}")
    return p


def make_router(name: str, options: RouterOptions | None = None) -> Router:
    """A fresh router for policy `name` from its part of `options` (ValueError on a bad pair)."""
    return policy(name).make(options or RouterOptions())


def active_policy(name: str) -> str:
    """The active policy `name` means (an alias gives its policy's name).

    ValueError naming the active policies when `name` is none of them, and for a retired old
    spelling the policy it meant (a name means one policy everywhere: `jsq` is JSQ-count).
    """
    for meant in REGISTRY.values():
        if name in meant.retired:
            raise ValueError(
                f"active policy {name!r} is retired: it was the old spelling of {meant.name!r} "
                f"({meant.summary}); say {meant.name!r} ({name!r} is {policy(name).summary}, "
                f"which active mode does not run)"
            )
    p = lookup(name)
    if p is None or not p.active:
        raise ValueError(f"policy must be one of {', '.join(ACTIVE)}, got {name!r}")
    return p.name


def make_baseline(name: str, rng: random.Random) -> Baseline:
    """A fresh baseline rule by policy name (ValueError for a name that is no baseline)."""
    p = lookup(name)
    if p is None or p.rule is None:
        raise ValueError(f"unknown baseline policy {name!r}; known: {list(names('baseline'))}")
    return p.rule(rng)


def lane_names() -> str:
    """The lane names for `--help`: every policy, `name[:predictor]` where one takes a predictor,
    an incumbent with its default view age (`name@AGE` sets any policy's)."""
    preds = "|".join(PREDICTORS)

    def one(p: Policy[Any]) -> str:
        name = f"{p.name}[:{preds}]" if p.predicted else p.name
        return f"{name} (@{format_age(p.view_age_s)})" if p.view_age_s else name

    return ", ".join(one(p) for p in REGISTRY.values() if p.kind != "forced") + (
        "; any lane takes @AGE (e.g. vllm-dp@10ms, br0@100ms, jsq-bytes@0): the age of its view of "
        "the engines, refreshed when a decision finds it that old"
    )


_AGE_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}


def parse_age(text: str) -> float:
    """A view age: "100ms", "10s", "250us", "0" (a bare number is seconds); ValueError otherwise."""
    t = text.strip()
    for unit in ("us", "ms", "s"):
        if t.endswith(unit):
            number, scale = t[: -len(unit)], _AGE_UNITS[unit]
            break
    else:
        number, scale = t, 1.0
    try:
        age = float(number) * scale
    except ValueError:
        raise ValueError(f"a view age is a number with us, ms or s (e.g. 100ms), got {text!r}") from None
    if not (age >= 0 and math.isfinite(age)):
        raise ValueError(f"a view age must be finite and >= 0, got {text!r}")
    return age


def format_age(age_s: float) -> str:
    """`parse_age`'s inverse in the shortest unit that keeps it whole where one does ("100ms")."""
    if age_s == 0:
        return "0"
    for unit in ("s", "ms", "us"):
        x = age_s / _AGE_UNITS[unit]
        if abs(x - round(x)) < 1e-9 * max(1.0, abs(x)):
            return f"{round(x)}{unit}"
    return f"{age_s:g}s"


def active_names() -> str:
    """The active policies for `--help`, each with its summary."""
    return "; ".join(f"{name}: {REGISTRY[name].summary}" for name in ACTIVE)
