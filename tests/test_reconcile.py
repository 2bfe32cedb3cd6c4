"""The rules a resume applies to a salvaged store (`pipeline.run.reconcile`), one salvage at a time.

The launcher's side, on real damaged LMDB files and real runs, is in tests/test_corruption_resume.py;
here each rule is checked on its own, including the cases no small run reaches (an ambiguous
salvage without a checkpoint record, a record of another step).
"""

from __future__ import annotations

from core.types import Batch, Group, group_id_for
from pipeline.run.reconcile import DAMAGED, NOT_REPLAYED, TOO_NEW, UNKNOWN, prompt_of, reconcile
from storage import Coverage, Cursor, Salvage
from tests.test_store import finished, fresh, generated


def _fresh(gid: str) -> Group:
    return fresh(int(gid.split(".")[0][-9:]))


def _plan(salvage: Salvage, coverage: Coverage | None, checkpoint_step: int = 1):
    return reconcile(
        salvage, checkpoint_step=checkpoint_step, coverage=coverage, n_prompts=100, batch_size=2, fresh=_fresh
    )


def _id(i: int) -> str:
    return group_id_for(0, i)


def test_with_a_record_nothing_covered_is_kept_and_every_open_prompt_is_accounted_for():
    """Checkpoint v2 (step 1) covers prompts 0..3; 4..7 were unsettled then, 8..9 admitted after.
    Step 2's batch is readable (trained again), step 3's groups are all damaged (a trailing
    empty step: dropped, its prompts generated again); the resume then rebuilds version 3, so
    partial prompt 8 (tokens of version 3) is carried over and prompt 9 (version 4) is not."""
    coverage = Coverage(1, Cursor(0, 8, 8), tuple(_id(i) for i in range(4, 8)))
    salvage = Salvage(
        Cursor(0, 10, 10),
        3,
        (),
        partial=(generated(fresh(8), 3), generated(fresh(9), 4)),
        ready=(finished(fresh(1), 1),),  # covered by the checkpoint: dropped
        trained_ids=frozenset(_id(i) for i in range(4, 8)),
        batches={2: (_id(4), _id(5)), 3: (_id(6), _id(7))},
        replay={2: (finished(fresh(4), 2), finished(fresh(5), 2)), 3: ()},
        replay_damaged=(_id(6), _id(7)),
    )
    plan = _plan(salvage, coverage)
    assert plan.trained_step == 2 and [b.step for b, _ in plan.replay] == [2]
    assert plan.covered_dropped == 1 and plan.ready == ()
    assert [g.group_id for g in plan.partial if g.group_id not in plan.regenerated] == [_id(8)]
    assert plan.regenerated == (_id(6), _id(7), _id(9))
    assert dict(plan.why) == {DAMAGED: (_id(6), _id(7)), TOO_NEW: (_id(9),)}
    assert plan.cursor == Cursor(0, 10, 10) and not plan.notes


def test_with_a_record_and_nothing_readable_the_record_alone_decides():
    """A store truncated with its main tree in the lost half (what `salvage_store` returns then):
    whatever it admitted after the checkpoint's cursor is unknown. The cursor rewinds to the
    checkpoint's, which admits those prompts again as new work; only the prompts the record names
    unsettled are generated again (generating any prompt at or past the cursor would admit it twice)."""
    coverage = Coverage(1, Cursor(0, 8, 8), (_id(5), _id(7)))
    plan = _plan(Salvage(None, None, ("nothing can be read",), groups_lost=True), coverage)
    assert plan.cursor == Cursor(0, 8, 8) and plan.trained_step == 1 and not plan.replay
    assert plan.regenerated == (_id(5), _id(7)) and dict(plan.why) == {UNKNOWN: (_id(5), _id(7))}
    assert not plan.ready and all(prompt_of(g.group_id) < (0, 8) for g in plan.partial)


def test_with_the_cursor_lost_and_the_states_read_the_cursor_goes_past_the_last_prompt_any_record_names():
    """The cursor and trained step are unreadable, the states and batch records are not: the
    cursor is past the newest prompt any surviving record names (partial 12), never the older one
    checkpoint v2 records (9), so no group carried over is admitted twice; every prompt below it
    that nothing accounts for is generated again, and the ones the lost store admitted after 12
    (which nothing names) are admitted again from the cursor."""
    coverage = Coverage(1, Cursor(0, 9, 9), tuple(_id(i) for i in range(4, 9)))
    salvage = Salvage(
        None,
        None,
        ("cursor: damaged", "trained step: damaged"),
        partial=(generated(fresh(12), 2),),
        settled=frozenset({_id(10)}),
        trained_ids=frozenset({_id(4), _id(5)}),
        batches={2: (_id(4), _id(5))},
    )
    plan = _plan(salvage, coverage)
    assert plan.cursor == Cursor(0, 13, 13) and plan.trained_step == 1 and not plan.replay
    assert [g.group_id for g in plan.partial if g.group_id not in plan.regenerated] == [_id(12)]
    assert dict(plan.why) == {NOT_REPLAYED: (_id(4), _id(5)), UNKNOWN: tuple(map(_id, (6, 7, 8, 9, 11)))}


def test_without_a_record_a_lost_cursor_starts_the_dataset_again_and_says_what_that_costs():
    plan = _plan(Salvage(None, 3, ()), None, checkpoint_step=4)
    assert plan.start_over and plan.cursor == Cursor() and plan.trained_step == 4
    assert "steps 0..4 (about 10) are trained a second time" in plan.notes[0]


def test_without_a_record_the_batch_records_of_the_checkpoints_steps_decide():
    """The newer meta page was lost: the other says step 0 was the last trained, but checkpoint
    v2 covers step 1, whose batch (still open in that view) is dropped, not trained again; step
    2's batch, trained after the checkpoint, is not in that view's batches: its prompts are not
    known, and not generated."""
    salvage = Salvage(
        Cursor(0, 6, 6),
        0,
        (),
        ready=(finished(fresh(2), 1), finished(fresh(3), 1), finished(fresh(4), 1)),
        trained_ids=frozenset({_id(0), _id(1)}),
        batches={0: (_id(0), _id(1)), 1: (_id(2), _id(3))},
    )
    plan = _plan(salvage, None)
    assert plan.trained_step == 1 and plan.covered_dropped == 2
    assert [g.group_id for g in plan.ready] == [_id(4)] and not plan.regenerated


def test_without_a_record_and_the_states_lost_an_incomplete_batch_history_generates_nothing():
    """Steps 0..1 were collected: which prompts below the cursor checkpoint v2 covers is unknown,
    so none is generated again (that could train one twice), said; step 3's, trained after the
    checkpoint and not trained again (its groups are lost), are."""
    salvage = Salvage(Cursor(0, 6, 6), 3, (), groups_lost=True, batches={3: (_id(4), _id(5))}, collected_step=1)
    plan = _plan(salvage, None)
    assert plan.regenerated == (_id(4), _id(5)) and dict(plan.why) == {NOT_REPLAYED: (_id(4), _id(5))}
    assert "garbage collected" in plan.notes[0] and "6 prompts" in plan.notes[0]
    complete = Salvage(Cursor(0, 4, 4), 2, (), groups_lost=True, batches={0: (_id(0),), 1: (_id(1),), 2: (_id(2),)})
    plan = _plan(complete, None)  # every batch record is there: what they do not name is generated again
    assert plan.regenerated == (_id(2), _id(3)) and dict(plan.why) == {NOT_REPLAYED: (_id(2),), UNKNOWN: (_id(3),)}


def test_a_record_of_another_step_is_not_used():
    plan = _plan(Salvage(Cursor(0, 4, 4), 1, ()), Coverage(7, Cursor(0, 99, 99), ()))
    assert plan.cursor == Cursor(0, 4, 4) and "says step 7, not 1" in plan.notes[0]


def test_a_replayed_step_keeps_its_metrics_record():
    salvage = Salvage(
        Cursor(0, 2, 2),
        0,
        (),
        batches={0: (_id(0), _id(1))},
        replay={0: (finished(fresh(0), 0), finished(fresh(1), 0))},
        replay_metrics={0: {"version": 0, "train/minibatch_samples": 4}},
    )
    plan = _plan(salvage, None, checkpoint_step=-1)
    [(batch, record)] = plan.replay
    assert isinstance(batch, Batch) and batch.step == 0 and record == {"version": 0, "train/minibatch_samples": 4}
