"""A custom multi-turn agent plugged into `python -m pipeline.launch`.

    python -m examples.custom_agent --num-rollout 3

which is the same as

    python -m pipeline.launch --custom-generate-function-path examples.custom_agent:retry_agent \
        --custom-rm-path examples.custom_agent:last_turn_reward --num-rollout 3

The agent, written only against `pipeline`'s public API: the model answers the toy prompt; if it
rambles (its turn hits the token budget instead of stopping), the environment says "no!" and the
model gets one more try. The reward scores the last model turn only.

It is a small state machine over `ctx.state` (JSON, stored with the sample): when the pipeline
stops a sample mid-conversation (partial rollout, a publish, a restart), the agent is re-entered
with the stored transcript and state and continues from `ctx.state["step"]`; it never starts over.
"""

from __future__ import annotations

import sys

from pipeline import (
    AgentContext,
    FinishReason,
    PromptTask,
    Sample,
    SampleStatus,
    Segment,
)
from pipeline.tasks.toy import encode, toy_reward

TURN_LEN = 12
FEEDBACK = encode(" no!")


async def retry_agent(ctx: AgentContext, sample: Sample) -> None:
    while (step := ctx.state.get("step", "answer")) != "done":
        if step == "answer":
            turn = await ctx.generate(max_new_tokens=TURN_LEN)
            # Rambled (hit the turn's budget) and there is room for a retry: give feedback.
            retry = turn.finish_reason is FinishReason.LENGTH and ctx.state.get("tries", 0) == 0
            ctx.state["tries"] = ctx.state.get("tries", 0) + 1
            ctx.state["step"] = "feedback" if retry and ctx.remaining > len(FEEDBACK) + TURN_LEN else "done"
        elif step == "feedback":
            ctx.append(FEEDBACK)  # environment tokens: loss mask 0, never trained
            ctx.state["step"] = "answer"


def last_turn_reward(task: PromptTask, sample: Sample) -> float:
    """The toy task's reward, for the model's last turn (the tokens after the last mask-0 token)."""
    last_env = max((i for i, m in enumerate(sample.loss_mask) if not m), default=-1)
    turn = sample.response_ids[last_env + 1 :]
    if sample.status is not SampleStatus.COMPLETED or not turn:
        return 0.0
    # Score the turn as if it were the whole response (toy_reward wants a finished sample).
    alone = Sample(index=sample.index, prompt_ids=sample.prompt_ids).extended(
        Segment(turn, (0.0,) * len(turn), FinishReason.STOP, 0), max_response_len=len(turn) + 1
    )
    return toy_reward(task, alone)


if __name__ == "__main__":
    from pipeline.run.cli import main

    sys.exit(
        main(
            [
                "--custom-generate-function-path",
                "examples.custom_agent:retry_agent",
                "--custom-rm-path",
                "examples.custom_agent:last_turn_reward",
                *sys.argv[1:],
            ]
        )
    )
