"""Admission in front of a pool: a full pool serves waiters by (priority, arrival); queues are bounded."""

import asyncio

import pytest

from raylane.config import TierConfig
from raylane.router.admission import AdmissionController, PoolLoad
from raylane.router.errors import KeyConcurrencyError, OverloadedError

PREMIUM = TierConfig(name="premium", priority=0, max_queue_depth=8, max_queue_wait_s=5)
STANDARD = TierConfig(name="standard", priority=1, max_queue_depth=8, max_queue_wait_s=5)
FREE = TierConfig(name="free", priority=2, max_queue_depth=8, max_queue_wait_s=5, sheddable=True)


def controller(capacity: int = 1, max_waiting: int = 16) -> AdmissionController:
    admission = AdmissionController()
    admission.add_pool("coding", capacity=capacity, max_waiting=max_waiting)
    return admission


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def test_full_pool_dispatches_by_priority_then_arrival():
    admission = controller(capacity=1)
    holder = await admission.acquire("coding", STANDARD)
    served: list[str] = []

    async def request(name: str, tier: TierConfig) -> None:
        ticket = await admission.acquire("coding", tier)
        served.append(name)
        await asyncio.sleep(0)
        ticket.release()

    arrivals = [("free-1", FREE), ("std-1", STANDARD), ("premium-1", PREMIUM), ("std-2", STANDARD)]
    tasks = []
    for name, tier in arrivals:
        tasks.append(asyncio.create_task(request(name, tier)))
        await settle()  # arrive in this order
    assert admission.load("coding").waiting == 4
    holder.release()
    await asyncio.gather(*tasks)
    assert served == ["premium-1", "std-1", "std-2", "free-1"]
    assert admission.load("coding").in_flight == 0


async def test_tier_queue_depth_is_bounded_with_retry_after():
    admission = controller(capacity=1)
    shallow = TierConfig(name="free", priority=2, max_queue_depth=1, max_queue_wait_s=5)
    holder = await admission.acquire("coding", PREMIUM)
    waiting = asyncio.create_task(admission.acquire("coding", shallow))
    await settle()
    with pytest.raises(OverloadedError) as excinfo:
        await admission.acquire("coding", shallow)
    assert excinfo.value.status == 429 and excinfo.value.reason == "queue_depth"
    assert int(excinfo.value.headers()["retry-after"]) >= 1
    holder.release()
    (await waiting).release()


async def test_wait_budget_runs_out_with_429():
    admission = controller(capacity=1)
    impatient = TierConfig(name="free", priority=2, max_queue_wait_s=0.05)
    holder = await admission.acquire("coding", PREMIUM)
    with pytest.raises(OverloadedError) as excinfo:
        await admission.acquire("coding", impatient)
    assert excinfo.value.reason == "wait_budget" and excinfo.value.retry_after > 0
    assert admission.load("coding").waiting == 0  # the timed-out waiter left no trace
    holder.release()


async def test_known_slow_pool_turns_away_at_once_what_would_wait_too_long():
    now = [0.0]
    admission = AdmissionController(clock=lambda: now[0])
    admission.add_pool("coding", capacity=1, max_waiting=16)
    first = await admission.acquire("coding", PREMIUM)
    now[0] = 20.0
    first.release()  # the pool now takes ~20 s per request
    holder = await admission.acquire("coding", PREMIUM)
    with pytest.raises(OverloadedError) as excinfo:
        await admission.acquire("coding", STANDARD)  # may wait 5 s
    assert excinfo.value.reason == "wait_budget" and excinfo.value.retry_after >= 20
    holder.release()


async def test_full_queue_sheds_lower_priority_sheddable_waiter_for_premium():
    admission = controller(capacity=1, max_waiting=2)
    holder = await admission.acquire("coding", STANDARD)
    free_1 = asyncio.create_task(admission.acquire("coding", FREE))
    await settle()
    free_2 = asyncio.create_task(admission.acquire("coding", FREE))
    await settle()
    with pytest.raises(OverloadedError) as excinfo:
        await admission.acquire("coding", FREE)  # no one below free to shed
    assert excinfo.value.reason == "queue_full"
    premium = asyncio.create_task(admission.acquire("coding", PREMIUM))
    await settle()
    with pytest.raises(OverloadedError) as excinfo:
        await free_2  # the newest free waiter made room
    assert excinfo.value.reason == "shed"
    assert admission.load("coding").waiting == 2
    holder.release()
    (await premium).release()
    (await free_1).release()


async def test_cancelled_waiter_frees_its_place_and_slot():
    admission = controller(capacity=1)
    holder = await admission.acquire("coding", STANDARD)
    waiter = asyncio.create_task(admission.acquire("coding", STANDARD))
    await settle()
    waiter.cancel()  # the client disconnected while queued
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert admission.load("coding").waiting == 0
    holder.release()
    holder.release()  # idempotent
    assert admission.load("coding").in_flight == 0
    (await admission.acquire("coding", STANDARD)).release()


async def test_raising_capacity_admits_waiters():
    admission = controller(capacity=1)
    holder = await admission.acquire("coding", STANDARD)
    waiter = asyncio.create_task(admission.acquire("coding", STANDARD))
    await settle()
    admission.set_capacity("coding", 2)
    ticket = await asyncio.wait_for(waiter, 1)
    assert admission.load("coding").in_flight == 2
    ticket.release()
    holder.release()


async def test_a_tier_past_its_pool_share_leaves_slots_for_the_others():
    """Free may hold 2 of 4 slots: a flood of free requests queues, premium still gets a slot at once,
    and a free waiter held back by the share does not block a standard one behind it."""
    admission = controller(capacity=4)
    half_free = FREE.model_copy(update={"max_pool_share": 0.5})
    held = [await admission.acquire("coding", half_free) for _ in range(2)]
    flood = [asyncio.create_task(admission.acquire("coding", half_free)) for _ in range(3)]
    await settle()
    assert admission.load("coding") == PoolLoad(in_flight=2, waiting=3, capacity=4)
    premium = await asyncio.wait_for(admission.acquire("coding", PREMIUM), 1)  # no wait
    standard = await asyncio.wait_for(admission.acquire("coding", STANDARD), 1)
    assert admission.load("coding").in_flight == 4
    premium.release()  # a free slot, but free holds its share: nobody of the flood gets it
    await settle()
    assert not any(t.done() for t in flood)
    held[0].release()  # free's own slot: the first free waiter takes it
    await settle()
    assert [t.done() for t in flood] == [True, False, False]
    for ticket in [standard, held[1], flood[0].result()]:
        ticket.release()
    await settle()
    for task in flood[1:]:
        (await task).release()
    assert admission.load("coding") == PoolLoad(in_flight=0, waiting=0, capacity=4)


async def test_retry_after_counts_the_tiers_own_slots_and_service_time():
    """Free may hold 2 of 4 slots and its requests hold one for 10 s; premium's short requests keep the
    pool's mean service time low. A free request that finds 2 of its tier waiting is told to come back
    after two rounds of free's own slots (20 s), not after the pool's mean: sooner, it would only be
    turned away again."""
    now = [0.0]
    admission = AdmissionController(clock=lambda: now[0])
    admission.add_pool("coding", capacity=4, max_waiting=16)
    half_free = FREE.model_copy(update={"max_pool_share": 0.5, "max_queue_wait_s": 60})
    for tier, held_s in [(half_free, 10.0)] + [(PREMIUM, 0.5)] * 10:
        ticket = await admission.acquire("coding", tier)
        now[0] += held_s
        ticket.release()
    held = [await admission.acquire("coding", half_free) for _ in range(2)]
    waiting = [asyncio.create_task(admission.acquire("coding", half_free)) for _ in range(2)]
    await settle()
    with pytest.raises(OverloadedError) as excinfo:
        await admission.acquire("coding", half_free, timeout=5)
    assert excinfo.value.reason == "wait_budget"
    assert excinfo.value.retry_after == pytest.approx(20.0)
    headers = excinfo.value.headers()  # the wait, jittered up to +50% so shed clients spread out
    assert 20_000 <= int(headers["retry-after-ms"]) <= 30_000
    assert int(headers["retry-after"]) == -(-int(headers["retry-after-ms"]) // 1000)
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    for ticket in held:
        ticket.release()
    assert admission.load("coding") == PoolLoad(in_flight=0, waiting=0, capacity=4)


async def test_clients_told_to_come_back_count_ahead_until_they_are_due():
    """Forty free clients against free's 2 slots, whose requests hold one for 1 s: each client turned
    away is told to come back after the ones told before it, so the forty are spread over the time
    those slots need to serve them instead of all returning within seconds to be turned away again.
    Once their hints have passed, a new client is told a short wait again."""
    now = [0.0]
    admission = AdmissionController(clock=lambda: now[0])
    admission.add_pool("coding", capacity=4, max_waiting=16)
    half_free = FREE.model_copy(update={"max_pool_share": 0.5, "max_queue_depth": 2})
    for _ in range(3):
        ticket = await admission.acquire("coding", half_free)
        now[0] += 1.0
        ticket.release()
    held = [await admission.acquire("coding", half_free) for _ in range(2)]
    waiting = [asyncio.create_task(admission.acquire("coding", half_free)) for _ in range(2)]
    await settle()

    async def turned_away() -> float:
        with pytest.raises(OverloadedError) as excinfo:
            await admission.acquire("coding", half_free)
        return excinfo.value.retry_after

    hints = [await turned_away() for _ in range(40)]
    assert hints[0] == pytest.approx(2.0)  # 2 waiting, 2 slots of 1 s: back in two rounds
    assert hints == sorted(hints) and hints[-1] == pytest.approx(21.0)  # 41 ahead: 21 rounds
    premium = await admission.acquire("coding", PREMIUM)  # the other half of the pool is premium's
    premium.release()
    now[0] += hints[-1]
    assert await turned_away() == pytest.approx(2.0)
    for task in waiting:
        task.cancel()
    await asyncio.gather(*waiting, return_exceptions=True)
    for ticket in held:
        ticket.release()


def test_retry_hints_are_spread_so_shed_clients_do_not_return_together():
    from raylane.router.errors import OverloadedError

    hints = [int(OverloadedError("busy", retry_after=0.3).headers()["retry-after-ms"]) for _ in range(200)]
    assert min(hints) >= 1000 and max(hints) <= 1500  # never sooner than 1 s; spread over half a second
    assert len(set(hints)) > 50 and max(hints) - min(hints) > 250


# -- fair shares between API keys ---------------------------------------------------------------


async def test_a_flooding_key_does_not_starve_another_key_of_its_tier():
    """Key A holds both slots and has five more requests waiting; key B (same tier) arrives after them
    and gets the next slot that frees, and the one after that goes back to A: they take turns."""
    admission = controller(capacity=2)
    held = [await admission.acquire("coding", STANDARD, key="A") for _ in range(2)]
    flood = [asyncio.create_task(admission.acquire("coding", STANDARD, key="A")) for _ in range(5)]
    await settle()
    victim = asyncio.create_task(admission.acquire("coding", STANDARD, key="B"))
    await settle()
    held[0].release()
    await settle()
    assert victim.done() and not any(t.done() for t in flood)  # B first, though A's waited longer
    held[1].release()
    await settle()
    assert [t.done() for t in flood] == [True, False, False, False, False]  # then A again
    for task in flood:
        task.cancel()
    await asyncio.gather(*flood, return_exceptions=True)
    (await victim).release()
    assert admission.load("coding") == PoolLoad(in_flight=1, waiting=0, capacity=2)
    assert admission.key_requests("A") == 1 and admission.key_requests("B") == 0


async def test_a_lone_key_uses_everything_its_tier_may():
    """Work-conserving: with nobody else asking, one key holds every slot its tier's share allows."""
    admission = controller(capacity=4)
    tickets = [await asyncio.wait_for(admission.acquire("coding", STANDARD, key="A"), 1) for _ in range(4)]
    assert admission.load("coding").in_flight == 4
    for ticket in tickets:
        ticket.release()
    assert admission.key_requests("A") == 0


async def test_a_key_that_fills_its_tiers_queue_makes_room_for_another_key():
    """The tier may have 3 waiting; key A has all 3. Key B's request takes the place of A's newest
    (which gets a 429 'shed') instead of being turned away; A itself cannot push B out again."""
    admission = controller(capacity=1)
    shallow = STANDARD.model_copy(update={"max_queue_depth": 3})
    holder = await admission.acquire("coding", PREMIUM, key="P")
    flood = [asyncio.create_task(admission.acquire("coding", shallow, key="A")) for _ in range(3)]
    await settle()
    victim = asyncio.create_task(admission.acquire("coding", shallow, key="B"))
    await settle()
    assert not victim.done()  # waiting, not turned away
    with pytest.raises(OverloadedError) as excinfo:
        await flood[2]
    assert excinfo.value.reason == "shed"
    with pytest.raises(OverloadedError) as excinfo:  # A 2, B 1: A may not shed B
        await admission.acquire("coding", shallow, key="A")
    assert excinfo.value.reason == "queue_depth"
    holder.release()
    first = await asyncio.wait_for(flood[0], 1)  # neither holds a slot: the oldest goes
    assert not victim.done()
    first.release()
    ticket = await asyncio.wait_for(victim, 1)  # A was just served: B's turn, before A's older waiter
    assert not flood[1].done()
    ticket.release()
    (await flood[1]).release()
    assert admission.load("coding") == PoolLoad(in_flight=0, waiting=0, capacity=1)


async def test_max_concurrent_per_key_is_a_hard_cap_with_429():
    admission = controller(capacity=8)
    capped = STANDARD.model_copy(update={"max_concurrent_per_key": 2})
    tickets = [await admission.acquire("coding", capped, key="A") for _ in range(2)]
    with pytest.raises(KeyConcurrencyError) as excinfo:  # six slots free, but A has its two
        await admission.acquire("coding", capped, key="A")
    assert (
        excinfo.value.status == 429
        and excinfo.value.to_openai()["error"]["code"] == "concurrency_limit_exceeded"
    )
    assert int(excinfo.value.headers()["retry-after"]) >= 1
    with pytest.raises(KeyConcurrencyError):  # asked before a body is read, no pool known yet
        admission.check_key_cap(capped, "A")
    admission.check_key_cap(capped, "B")
    other = await admission.acquire("coding", capped, key="B")  # another key is not held back
    tickets[0].release()
    tickets.append(await admission.acquire("coding", capped, key="A"))  # one finished: one more
    for ticket in tickets[1:] + [other]:
        ticket.release()
    assert admission.key_requests("A") == 0 and admission.load("coding").in_flight == 0


async def test_another_keys_flood_does_not_make_a_key_look_too_late_to_wait():
    """Requests hold the slot 2 s and the tier may wait 5 s. Key A has two waiting: a third of A's
    would wait three rounds (6 s) and is turned away at once. Key B's first request waits only for
    A's next turn (two rounds): it queues rather than being refused."""
    now = [0.0]
    admission = AdmissionController(clock=lambda: now[0])
    admission.add_pool("coding", capacity=1, max_waiting=16)
    learn = await admission.acquire("coding", STANDARD, key="A")
    now[0] += 2.0
    learn.release()
    holder = await admission.acquire("coding", STANDARD, key="A")
    flood = [asyncio.create_task(admission.acquire("coding", STANDARD, key="A")) for _ in range(2)]
    await settle()
    with pytest.raises(OverloadedError) as excinfo:
        await admission.acquire("coding", STANDARD, key="A")
    assert excinfo.value.reason == "wait_budget"
    victim = asyncio.create_task(admission.acquire("coding", STANDARD, key="B"))
    await settle()
    assert not victim.done() and admission.load("coding").waiting == 3
    holder.release()
    (await flood[0]).release()  # A was served last: B's turn
    (await asyncio.wait_for(victim, 1)).release()
    (await flood[1]).release()
    assert admission.load("coding") == PoolLoad(in_flight=0, waiting=0, capacity=1)


async def test_a_tiers_share_of_a_pool_counts_sequences_not_requests():
    """A batch line with n = 4 takes four of its tier's places (as it takes four of the engine's
    sequences): with a share of four, one such line leaves no place for another batch request, and
    the pool's other places stay free for other tiers."""
    admission = controller(capacity=8)
    batch = FREE.model_copy(update={"max_pool_share": 0.5, "max_queue_wait_s": 0.05})
    wide = await admission.acquire("coding", batch, sequences=4)
    assert admission.try_acquire("coding", batch, sequences=1) is None
    assert admission.try_acquire("coding", PREMIUM, sequences=4) is not None
    with pytest.raises(OverloadedError):
        await admission.acquire("coding", batch, sequences=1)
    huge = FREE.model_copy(update={"name": "huge", "max_pool_share": 0.25})
    alone = admission.try_acquire("coding", huge, sequences=100)  # larger than its share: runs alone
    assert alone is not None and admission.try_acquire("coding", huge) is None
    wide.release()
    assert admission.try_acquire("coding", batch, sequences=4) is not None
