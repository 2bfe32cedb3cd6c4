import anyio
import pytest

from stages.admission import Admission, Outcome

pytestmark = pytest.mark.anyio


async def test_tickets_settle_and_wake_waiters():
    adm = Admission()
    taken = []

    async def dispenser():
        for _ in range(3):
            await adm.take_ticket()
            taken.append(1)

    async with anyio.create_task_group() as tg:
        tg.start_soon(dispenser)
        await anyio.wait_all_tasks_blocked()
        assert taken == []  # no ticket, no admission
        adm.grant(2)
        await anyio.wait_all_tasks_blocked()
        assert len(taken) == 2 and adm.outstanding == 2
        adm.settle(Outcome.READY)
        adm.settle(Outcome.PARTIAL)
        with anyio.fail_after(1):
            await adm.wait_settled()
        adm.grant(5)
        await anyio.wait_all_tasks_blocked()
        assert adm.revoke() == 4  # one was taken by the dispenser
        assert adm.outstanding == 1
        adm.settle(Outcome.REJECTED)
    assert adm.count(Outcome.READY) == adm.count(Outcome.PARTIAL) == adm.count(Outcome.REJECTED) == 1


async def test_settle_without_an_admitted_group_is_a_bug():
    adm = Admission()
    adm.grant(1)  # granted but not taken
    with pytest.raises(RuntimeError, match="no admitted group"):
        adm.settle(Outcome.READY)
