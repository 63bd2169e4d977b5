"""The service's `/events` fan-out (service/jobs.py `EventBus`): a subscriber that reads too slowly loses its oldest
events, never holds up the service, and is told so by a `lagged` event before the ones it still has — what
`Client.results` takes as its cue to ask after every task it still waits for."""

from __future__ import annotations

import asyncio

from polar_mitm.service.jobs import EventBus
from polar_mitm.service.models import LAGGED_EVENT


def test_a_subscriber_that_fell_behind_is_told_once_then_gets_the_newest_events():
    async def scenario() -> tuple[list[dict], list[dict]]:
        bus = EventBus(buffered=3)
        slow, quick = bus.stream(kinds=frozenset({"task"})), bus.stream()
        slow_first = asyncio.ensure_future(anext(slow))  # both subscribed before anything is published
        quick_first = asyncio.ensure_future(anext(quick))
        await asyncio.sleep(0)
        bus.publish({"type": "task", "task_id": "t0", "status": "queued"})
        kept_up = [await quick_first]
        fell_behind = [await slow_first]
        for k in range(
            1, 6
        ):  # five more for a buffer of three, two of them session events the slow one never wants
            bus.publish({"type": "task" if k != 2 else "session", "task_id": f"t{k}", "status": "completed"})
            kept_up.append(await anext(quick))
        fell_behind += [await anext(slow) for _ in range(4)]
        assert not bus.lagging  # told, and forgotten
        await slow.aclose()
        await quick.aclose()
        assert not bus.subscribers
        return fell_behind, kept_up

    fell_behind, kept_up = asyncio.run(scenario())
    assert [e["task_id"] for e in kept_up] == ["t0", "t1", "t2", "t3", "t4", "t5"]
    assert LAGGED_EVENT not in [e["type"] for e in kept_up]
    # t0 read; t1, t3, t4, t5 published for it into a buffer of 3: t1 was dropped, said once before the rest
    assert [e["type"] for e in fell_behind] == ["task", LAGGED_EVENT, "task", "task", "task"]
    assert [e.get("task_id") for e in fell_behind] == ["t0", None, "t3", "t4", "t5"]
    ids = [e["id"] for e in fell_behind]
    assert ids[0] < ids[2] < ids[3] < ids[4] and ids[1] > ids[0]
