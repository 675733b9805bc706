"""The one backoff both retry loops of the active proxy use: budget and doubling waits."""

from __future__ import annotations

import asyncio

import pytest

from shadow.active.backoff import Backoff
from shadow.active.clientgone import Gone
from shadow.active.proxyconfig import ActiveConfig


def test_retry_n_waits_the_delay_doubled_n_minus_one_times_within_the_budget() -> None:
    b = ActiveConfig(decode={"d0": "http://x"}, slots=1, retries=3, retry_delay_s=0.01).backoff()
    assert [b.delay(n) for n in (1, 2, 3)] == pytest.approx([0.01, 0.02, 0.04])
    assert [b.allows(n) for n in (1, 2, 3, 4)] == [True, True, True, False]
    assert not Backoff(0, 0.01).allows(1)


def test_a_wait_ends_early_when_the_client_goes() -> None:
    async def scenario() -> None:
        gone = asyncio.get_running_loop().create_future()
        gone.set_result(None)
        with pytest.raises(Gone):
            await Backoff(1, 60.0).wait(1, gone)
        await Backoff(1, 0.001).wait(1)  # no client to race: just the sleep

    asyncio.run(asyncio.wait_for(scenario(), 5))
