"""What a running request weighs in the loads BR-0, BR-H and BRA balance: the step cost it adds.

Under τ_g = a·L_g + c·n_g + p·P_g + b a running sequence holding w KV tokens adds a·w + c to its
worker's step, i.e. w + κ KV tokens' worth with κ = c/a (`StepTimeModel.kappa_tokens`). The
policies score in those units: a worker's load is L_g + κ·n_g, a request's contribution s + κ
(token units, `RouteCost(1, κ)`). With κ = 0 (c = 0, the paper's model) every load is the paper's
and every decision is the paper's, exactly (`TOKENS` takes the same code paths as before).

The a = 0 limit (KV tokens cost nothing measurable, the step is paid per sequence: κ = ∞) is not a
huge κ: the policies score in sequence units instead, `RouteCost(0, 1)` — a worker's load is its
running sequences n_g, a request weighs one — and tokens only break ties (between workers: fewer
KV tokens first; between requests: a request that fits takes the longest, one that overflows the
shortest, as the paper's rule would on tokens alone).

`p` (per prefill token scheduled into a step) is a one-off cost of a request's admission on an
engine that mixes prefill into decode steps, not a per-step load: it does not enter the loads.
Pure: numbers in, numbers out.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from shadow.core.stepmodel import StepTimeModel


@dataclass(frozen=True, slots=True)
class RouteCost:
    """A request weighs `token`·(its KV tokens) + `seq` (one running sequence), in the units the
    policies score in: token units `(1, κ)` with κ >= 0 finite, or sequence units `(0, 1)`."""

    token: float = 1.0
    seq: float = 0.0
    #: The paper's loads: KV tokens only (κ = 0). (Plain attributes, not properties: the routing
    #: round reads them at every step.)
    paper: bool = field(init=False, repr=False, compare=False)
    #: Sequence units (the a = 0 limit).
    sequences: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.token == 0.0:
            if self.seq != 1.0:
                raise ValueError(f"route cost: sequence units weigh a sequence 1, got {self.seq!r}")
        elif self.token != 1.0 or not (math.isfinite(self.seq) and self.seq >= 0):
            raise ValueError(
                f"route cost: token units are (1, kappa) with kappa a finite number >= 0, "
                f"got ({self.token!r}, {self.seq!r})"
            )
        object.__setattr__(self, "paper", self.seq == 0.0)
        object.__setattr__(self, "sequences", self.token == 0.0)

    @classmethod
    def of(cls, model: StepTimeModel) -> RouteCost:
        """The cost of one step model: (1, κ), or sequence units when KV tokens cost nothing (κ = ∞)."""
        return cls.kappa(model.kappa_tokens)

    @classmethod
    def kappa(cls, kappa: float) -> RouteCost:
        """Token units with per-sequence term κ (KV tokens); sequence units for κ = ∞."""
        if math.isinf(kappa) and kappa > 0:
            return SEQUENCES
        return TOKENS if kappa == 0 else cls(1.0, kappa)

    @classmethod
    def fleet(cls, models: Iterable[StepTimeModel]) -> RouteCost:
        """One cost for workers stepping on `models` (one per worker): a model they all share gives
        its own; models that differ give κ = Σc / Σa (the κ of their mean model), ∞ when no worker's
        KV tokens cost anything and some worker's sequences do."""
        ms = list(models)
        if not ms:
            return TOKENS
        first = ms[0]
        if all(m.a == first.a and m.c == first.c for m in ms):
            return cls.of(first)
        a, c = math.fsum(m.a for m in ms), math.fsum(m.c for m in ms)
        return cls.kappa(0.0 if c == 0 else (c / a if a > 0 else math.inf))

    @property
    def kappa_tokens(self) -> float:
        """κ: a sequence's weight in KV tokens (∞ in sequence units)."""
        return math.inf if self.sequences else self.seq

    def weight(self, tokens: float, seqs: float = 1.0) -> float:
        """What `seqs` sequences holding `tokens` KV tokens in all weigh."""
        if self.seq == 0.0:
            return tokens
        return self.token * tokens + self.seq * seqs

    def loads(self, tokens: Sequence[float], seqs: Sequence[float]) -> list[float]:
        """Per worker: the weight of its `seqs[g]` sequences holding `tokens[g]` KV tokens."""
        if len(tokens) != len(seqs):
            raise ValueError(f"{len(tokens)} loads but {len(seqs)} sequence counts")
        t, s = self.token, self.seq
        return [t * x + s * n for x, n in zip(tokens, seqs, strict=True)]

    def tokens_at(self, weight: float, seqs: float = 1.0) -> float:
        """The KV tokens `seqs` sequences hold when they weigh `weight` (the inverse of `weight`);
        in sequence units +∞ when they fit in `weight` (any tokens do), −∞ when they do not."""
        if self.sequences:
            return math.inf if self.seq * seqs <= weight else -math.inf
        return weight - self.seq * seqs

    def describe(self) -> str:
        """One line for reports: what the policies balance."""
        if self.paper:
            return "KV tokens (kappa = 0: the paper's loads)"
        if self.sequences:
            return "running sequences (a = 0: KV tokens cost nothing measurable; tokens break ties)"
        return f"KV tokens + {self.seq:.4g} per running sequence (kappa = c/a)"


#: The paper's loads: KV tokens alone.
TOKENS = RouteCost(1.0, 0.0)
#: The a = 0 limit: running sequences, tokens breaking ties.
SEQUENCES = RouteCost(0.0, 1.0)
