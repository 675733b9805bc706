"""One request as its events have told it so far: the record the mirror, the live driver and the
recorded-session feed each keep per request (each adds its own bookkeeping)."""

from __future__ import annotations

from dataclasses import dataclass

from shadow.contracts.events import Arrive, Route


@dataclass(slots=True)
class RequestRecord:
    """The worker it was routed to, its prompt tokens (None until an event sizes it), its prompt
    key, the tokens generated so far, and its request body's size in bytes (None: not told)."""

    worker: str | None = None
    prompt: int | None = None
    key: str | None = None
    generated: int = 0
    body_bytes: int | None = None

    @property
    def held(self) -> int:
        """KV tokens it holds on its worker: prompt + generated (an unsized prompt counts 0)."""
        return (self.prompt or 0) + self.generated

    def learn(self, ev: Arrive | Route) -> None:
        """The first prompt size, prompt key, body size and worker an Arrive or Route tells count."""
        if isinstance(ev, Arrive):
            if self.prompt is None:
                self.prompt = ev.prompt_tokens
            self.key = self.key or ev.prompt_key
            if self.body_bytes is None:
                self.body_bytes = ev.body_bytes
        else:
            if self.worker is None:
                self.worker = ev.worker
            if self.prompt is None:
                self.prompt = ev.prompt_tokens
