"""The built-in multi-turn task: look the answer up with a tool, then reply (issue 9).

The prompt hides the character: "ask x3:" means "say three copies of the secret character". The
model's first turn is the tool call: a turn that contains "?" asks the lookup tool, which answers
"=b." (the secret). The second model turn is the reply, scored like the toy task ("bbb<eos>").

The agent (`lookup_agent`) uses only what an agent author gets from the public API
(`pipeline.AgentContext`: `generate`, `append`, `state`, `transcript`), so it doubles as the example
of a tool-calling agent. It is a state machine over `ctx.state`: a sample stopped in any turn (partial
rollout, an abort-mode publish, a restart) re-enters it and continues the same conversation. The
tool is a pure function of the task (idempotent), and its answer is kept in the transcript, so
nothing is looked up twice to the same effect.

Reward, in [0, 1], read from the whole transcript (model turns are where the loss mask is 1):
0 without a tool call; 0.3 for the call, plus 0.7 x the toy task's score of the reply.
The tiny model learns the call first (emit "?" early), then to copy the looked-up character.
"""

from __future__ import annotations

import random

from core.types import PromptTask, Sample, SampleStatus
from pipeline.tasks.tiny_model import EOS_ID
from pipeline.tasks.toy import TOY_CHARS, TOY_MAX_COUNT, encode
from stages.agent import AgentContext

__all__ = ["CALL_TURN_LEN", "REPLY_TURN_LEN", "lookup_agent", "model_turns", "tool_dataset", "tool_reward"]

CALL_TURN_LEN = 8  # tokens the model gets to ask for the tool
REPLY_TURN_LEN = 8  # tokens for the reply
_CALL = encode("?")[0]


def tool_dataset(n: int, seed: int) -> list[PromptTask]:
    """`n` prompts "ask x<count>:" with the secret character in the label (same seed, same list)."""
    rng = random.Random(seed)
    tasks = []
    for index in range(n):
        char, count = rng.choice(TOY_CHARS), rng.randint(1, TOY_MAX_COUNT)
        tasks.append(PromptTask(index=index, prompt_ids=encode(f"ask x{count}:"), label={"char": char, "count": count}))
    return tasks


def _tool(task: PromptTask) -> tuple[int, ...]:
    """The lookup tool: a pure function of the task, so running it again is harmless."""
    return encode(f"={task.label['char']}.")


async def lookup_agent(ctx: AgentContext, sample: Sample) -> None:
    """call turn -> tool answer (when asked) -> reply turn; `ctx.state["step"]` says where it is."""
    while True:
        step = ctx.state.get("step", "call")
        if step == "call":
            turn = await ctx.generate(max_new_tokens=CALL_TURN_LEN)
            ctx.state["step"] = "tool" if _CALL in turn.token_ids else "done"
        elif step == "tool":
            ctx.append(_tool(ctx.group.task))
            ctx.state["step"] = "reply"
        elif step == "reply":
            await ctx.generate(max_new_tokens=REPLY_TURN_LEN)
            ctx.state["step"] = "done"
        else:
            return


def model_turns(sample: Sample) -> list[tuple[int, ...]]:
    """The model's turns in the transcript: the runs of tokens with loss mask 1."""
    turns: list[tuple[int, ...]] = []
    run: list[int] = []
    for token, mask in zip(sample.response_ids, sample.loss_mask, strict=True):
        if mask:
            run.append(token)
        elif run:
            turns.append(tuple(run))
            run = []
    if run:
        turns.append(tuple(run))
    return turns


def tool_reward(task: PromptTask, sample: Sample) -> float:
    """The reward described in the module docstring."""
    turns = model_turns(sample)
    if sample.status is not SampleStatus.COMPLETED or len(turns) < 2 or _CALL not in turns[0]:
        return 0.0
    reply = turns[1]
    if not reply or reply[-1] != EOS_ID or len(reply) == 1:
        return 0.3
    answer = reply[:-1]
    target, count = encode(task.label["char"])[0], int(task.label["count"])
    hit = sum(1 for t in answer if t == target) / len(answer)
    length = min(len(answer), count) / max(len(answer), count)
    return 0.3 + 0.7 * (0.5 * hit + 0.5 * length)
