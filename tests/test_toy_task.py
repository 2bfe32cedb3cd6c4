"""The toy task (dataset, reward, length profile of the random-init model) and bring-your-own JSONL
prompts with a `module:function` reward."""

from __future__ import annotations

import statistics

import orjson
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from core.errors import ConfigError
from core.types import FinishReason, PromptTask, Sample, SampleStatus, Segment
from pipeline.tasks.jsonl import load_jsonl_prompts
from pipeline.tasks.tiny_model import EOS_ID, build_tokenizer, make_model_folder
from pipeline.tasks.toy import TOY_CHARS, TOY_MAX_COUNT, decode, encode, toy_dataset, toy_prompt, toy_reward

pytestmark = pytest.mark.usefixtures("restore_torch_threads")


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def _answer(task: PromptTask, text: str, reason: FinishReason = FinishReason.STOP, *, eos: bool = True) -> Sample:
    ids = encode(text) + ((EOS_ID,) if eos else ())
    seg = Segment(ids, (-1.0,) * len(ids), reason, 0)
    return Sample(index=0, prompt_ids=task.prompt_ids).extended(seg, max_response_len=64)


TASK = PromptTask(index=0, prompt_ids=encode(toy_prompt("b", 3)), label={"char": "b", "count": 3})


# ---- the dataset ------------------------------------------------------------------------------


def test_toy_dataset_is_deterministic_and_tokenizes_like_the_tokenizer(tokenizer):
    tasks = toy_dataset(50, seed=7)
    assert tasks == toy_dataset(50, seed=7)
    assert tasks != toy_dataset(50, seed=8)
    assert [t.index for t in tasks] == list(range(50))
    for t in tasks:
        char, count = t.label["char"], t.label["count"]
        assert char in TOY_CHARS and 1 <= count <= TOY_MAX_COUNT
        assert list(t.prompt_ids) == tokenizer(toy_prompt(char, count))["input_ids"]
        assert decode(t.prompt_ids) == toy_prompt(char, count)
    assert {t.label["char"] for t in tasks} == set(TOY_CHARS)  # every target shows up
    with pytest.raises(ValueError, match="'B'"):
        encode("say B")


# ---- the reward -------------------------------------------------------------------------------


def test_toy_reward_gives_partial_credit_and_nothing_for_rambling():
    assert toy_reward(TASK, _answer(TASK, "bbb")) == 1.0
    assert toy_reward(TASK, _answer(TASK, "bb")) == pytest.approx(0.5 + 0.5 * 2 / 3)
    assert toy_reward(TASK, _answer(TASK, "bxb")) == pytest.approx(0.5 * 2 / 3 + 0.5)
    assert toy_reward(TASK, _answer(TASK, "bbbbbb")) == pytest.approx(0.5 + 0.5 * 3 / 6)
    assert toy_reward(TASK, _answer(TASK, "aaa")) == pytest.approx(0.5)  # right length, wrong char
    assert toy_reward(TASK, _answer(TASK, "")) == 0.0  # stopping at once earns nothing
    truncated = _answer(TASK, "bbb", FinishReason.LENGTH, eos=False)
    assert truncated.status is SampleStatus.TRUNCATED and toy_reward(TASK, truncated) == 0.0
    assert toy_reward(TASK, _answer(TASK, "bbb", FinishReason.ERROR)) == 0.0  # failed
    assert toy_reward(TASK, _answer(TASK, "bbb", FinishReason.ABORT)) == 0.0  # partial


@given(st.lists(st.integers(0, 63), max_size=20), st.sampled_from(list(FinishReason)))
def test_toy_reward_stays_in_the_unit_interval(ids, reason):
    seg = Segment(tuple(ids), (-1.0,) * len(ids), reason, 0)
    sample = Sample(index=0, prompt_ids=TASK.prompt_ids).extended(seg, max_response_len=64)
    assert 0.0 <= toy_reward(TASK, sample) <= 1.0


# ---- response lengths of the random-init model ------------------------------------------------


def test_random_init_lengths_are_long_tailed(tmp_path):
    """What makes partial rollout matter: most responses stop well short of the limit, some run to it.

    Measured (512 responses, limit 128, model seeds 0 and 1): p25 24, median 52, p75 ~100 tokens,
    18% truncated at 128; p10 is 11.
    """
    from transformers import AutoModelForCausalLM

    from tests.test_trainer_grpo import _generate  # the same engine-like sampler the learning test uses

    limit = 128
    torch.set_num_threads(1)  # tiny matmuls: one thread is fastest on a shared box (see GRPOTrainer)
    model = AutoModelForCausalLM.from_pretrained(make_model_folder(tmp_path / "m", seed=0))
    tasks = toy_dataset(64, seed=0)
    gen = torch.Generator().manual_seed(0)
    outputs = _generate(model, [t.prompt_ids for t in tasks for _ in range(2)], gen, max_len=limit)
    lengths = sorted(len(tokens) if tokens[-1] == EOS_ID else limit + 1 for tokens, _ in outputs)
    truncated = sum(n > limit for n in lengths) / len(lengths)
    assert statistics.median(lengths) < limit / 2  # the typical response is short ...
    assert lengths[len(lengths) // 4] < limit / 4
    assert 0.05 < truncated < 0.4  # ... and a real share run to the limit: the stragglers


# ---- bring your own prompts -------------------------------------------------------------------


def _write_jsonl(path, rows) -> None:
    path.write_text("\n".join(r if isinstance(r, str) else orjson.dumps(r).decode() for r in rows) + "\n")


def test_load_jsonl_prompts_reads_prompts_labels_and_metadata(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    _write_jsonl(path, [{"prompt": "say a x2:", "label": "aa", "source": "x"}, "", {"prompt": "1+1=", "label": 2}])
    tasks = load_jsonl_prompts(path, tokenizer)
    assert [t.index for t in tasks] == [0, 1]
    assert tasks[0].prompt_ids == encode("say a x2:") and tasks[0].label == "aa"
    assert dict(tasks[0].metadata) == {"source": "x"}
    assert tasks[1].prompt_ids == encode("1+1=") and tasks[1].label == 2

    other = tmp_path / "other.jsonl"
    _write_jsonl(other, [{"q": "abc"}])
    (task,) = load_jsonl_prompts(other, tokenizer, input_key="q", label_key=None)
    assert task.prompt_ids == encode("abc") and task.label is None


def test_load_jsonl_prompts_names_every_bad_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    _write_jsonl(
        path,
        [
            {"prompt": "ok", "label": 1},
            {"label": 1},  # line 2: no prompt
            "{not json",  # line 3
            {"prompt": "ok"},  # line 4: no label
            "[1, 2]",  # line 5: not an object
            {"prompt": 5, "label": 1},  # line 6: not text
        ],
    )
    with pytest.raises(ConfigError) as info:
        load_jsonl_prompts(path, tokenizer)
    problems = info.value.problems
    assert len(problems) == 5
    assert f"{path}:2: missing key(s) ['prompt']" in problems[0]
    assert f"{path}:3: not valid JSON" in problems[1]
    assert f"{path}:4: missing key(s) ['label']" in problems[2]
    assert f"{path}:5: expected a JSON object" in problems[3]
    assert f"{path}:6: key 'prompt'" in problems[4]

    with pytest.raises(ConfigError, match="cannot be read"):
        load_jsonl_prompts(tmp_path / "missing.jsonl", tokenizer)
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ConfigError, match="no prompts"):
        load_jsonl_prompts(tmp_path / "empty.jsonl", tokenizer)


def test_load_jsonl_prompts_applies_a_chat_template_only_when_asked(tmp_path, tokenizer):
    path = tmp_path / "chat.jsonl"
    _write_jsonl(path, [{"prompt": "hi", "label": 0}, {"prompt": [{"role": "user", "content": "yo"}], "label": 0}])
    # The char tokenizer has no template: plain text still loads, a message list cannot.
    with pytest.raises(ConfigError, match=r"chat\.jsonl:2: .*no chat template"):
        load_jsonl_prompts(path, tokenizer)

    tok = build_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}.{% endfor %}"
        "{% if add_generation_prompt %}=:{% endif %}"
    )
    plain, chat = load_jsonl_prompts(path, tok)
    assert plain.prompt_ids == encode("hi")  # not templated unless asked
    assert chat.prompt_ids == encode("user: yo.=:")
    templated, _ = load_jsonl_prompts(path, tok, apply_chat_template=True)
    assert templated.prompt_ids == encode("user: hi.=:")
