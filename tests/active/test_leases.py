"""Leader leases on a real etcd (started per test): one holder at a time, renewals keep it, a
release or a lapse hands it over; a replica that stops renewing stops leading (its fence deadline)
before another can acquire; an unreachable etcd is an error at once, never a hang. Takeover after
a lapse is measured against 2 x the TTL."""

from __future__ import annotations

import asyncio
import time

import pytest

from shadow.active.etcdlease import EtcdError, EtcdLease
from shadow.active.leader import LeaderElector
from shadow.active.lease import Fence, LeaseConfig
from tests.etcdserver import EtcdServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

TTL = 2.0


def test_the_fence_ends_before_the_servers_ttl_and_the_config_is_checked() -> None:
    f = Fence(LeaseConfig(ttl_s=TTL))
    assert not f.leader(0.0)
    f.held(10.0)
    assert f.leader(11.49) and not f.leader(11.5)  # 10 + 2 - 0.5
    f.lost()
    assert not f.leader(10.0)
    for bad in (LeaseConfig(ttl_s=0.5), LeaseConfig(ttl_s=2.5), LeaseConfig(ttl_s=2, renew_every_s=1.8),
                LeaseConfig(ttl_s=2, margin_s=2)):
        with pytest.raises(ValueError):
            bad.validate()


def test_one_holder_at_a_time_and_a_release_hands_it_over() -> None:
    async def main(url: str) -> None:
        a, b = EtcdLease(url, "/shadow/leader"), EtcdLease(url, "/shadow/leader")
        try:
            assert await a.acquire("a", TTL)
            assert not await b.acquire("b", TTL)
            assert await a.holder() == "a" and await b.holder() == "a"
            assert await a.renew()
            assert not await b.renew()  # b holds nothing
            await a.release()
            assert await b.holder() is None
            assert await b.acquire("b", TTL) and await a.holder() == "b"
            assert not await a.acquire("a", TTL)
        finally:
            await a.aclose()
            await b.aclose()

    with EtcdServer() as etcd:
        asyncio.run(main(etcd.url))


def test_a_lapsed_leader_stops_before_the_standby_takes_over_within_2x_ttl() -> None:
    """Two electors; the leader's renewals stop (as a paused or killed process's would): its fence
    ends first, then the standby acquires, within 2 x TTL of the last renewal."""

    async def main(url: str) -> tuple[float, float, float]:
        cfg = LeaseConfig(ttl_s=TTL)
        a = LeaderElector(EtcdLease(url, "/k"), "a", cfg)
        b = LeaderElector(EtcdLease(url, "/k"), "b", cfg)
        await a.step()
        assert a.leader() and a.role == "leader"
        tb = asyncio.create_task(b.run())
        try:
            for _ in range(3):  # a renews a few rounds; b stands by
                await asyncio.sleep(cfg.renew_s)
                await a.step()
                assert a.leader() and not b.leader()
            last_renew = time.monotonic()
            a_end = a.fence.until  # a renews no more
            while not b.leader():
                assert not (a.leader() and b.leader())
                await asyncio.sleep(0.01)
            took = time.monotonic() - last_renew
            return a_end, b.fence.until - (cfg.ttl_s - cfg.fence_margin_s), took
        finally:
            tb.cancel()
            await asyncio.gather(tb, return_exceptions=True)

    with EtcdServer() as etcd:
        a_end, b_sent, took = asyncio.run(main(etcd.url))
    assert a_end < b_sent, (a_end, b_sent)  # a's deadline passed before b's winning acquire was sent
    assert took <= 2 * TTL, took


def test_an_unreachable_etcd_is_an_error_at_once_and_a_standby_stays_standby() -> None:
    async def main() -> None:
        lease = EtcdLease("http://127.0.0.1:9", "/k", timeout_s=0.5)
        t0 = time.monotonic()
        with pytest.raises(EtcdError):
            await lease.acquire("a", TTL)
        assert time.monotonic() - t0 < 5
        e = LeaderElector(lease, "a", LeaseConfig(ttl_s=TTL))
        await e.step()
        assert not e.leader() and e.errors == 1 and "EtcdError" in (e.last_error or "")
        await lease.aclose()

    asyncio.run(main())
