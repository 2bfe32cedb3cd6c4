import dataclasses

import anyio
import pytest

from core.errors import GroupsFailingError
from core.types import Group, PromptTask, SampleStatus
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


def _failed(index: int, error: str) -> Group:
    task = PromptTask(index=index, prompt_ids=(5, 6))
    group = Group.fresh(task, epoch=0, n_samples=2, version=0, seq=index)
    failed = dataclasses.replace(group.samples[0], status=SampleStatus.FAILED, error=error)
    return group.with_samples([failed, group.samples[1]])


async def test_a_run_of_failed_groups_stops_admission_with_the_newest_error():
    adm = Admission(failing_limit=3)
    adm.grant(5)
    await adm.take_tickets(5)
    adm.settle(Outcome.FAILED, _failed(0, "HTTP 400: too long"))
    adm.settle(Outcome.FAILED, _failed(1, "HTTP 400: too long"))
    adm.settle(Outcome.READY)  # a success in between: the count starts again
    adm.settle(Outcome.FAILED, _failed(2, "HTTP 400: too long"))
    adm.settle(Outcome.PARTIAL)  # an aborted group says nothing either way
    adm.grant(2)  # two in a row: still admitted
    await adm.take_tickets(2)
    adm.settle(Outcome.FAILED, _failed(3, "HTTP 400: too long"))
    adm.settle(Outcome.FAILED, _failed(4, "reward: ValueError('boom')"))
    with pytest.raises(GroupsFailingError, match=r"last 3 groups all failed.*e0000-p000000004: reward: ValueError"):
        adm.grant(1)
    assert adm.outstanding == 0 and adm.count(Outcome.FAILED) == 5
    adm.grant(0)  # nothing asked, nothing refused
    with pytest.raises(ValueError, match="failing_limit=0"):
        Admission(failing_limit=0)
