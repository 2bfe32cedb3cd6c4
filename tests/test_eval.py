"""Evaluation (issue 31) end to end: inline in a sync run at `--eval-interval` on the built-in
engine over real HTTP, never mixed into training, a resume that never evaluates a step twice and
evaluates the one a crash left out; `python -m pipeline.eval` on a run's saved weights; the config
rules. The metric formulas: `pipeline.evaluation` on a fake engine below."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import ConfigError
from core.types import FinishReason, PromptTask
from pipeline.config import load_config
from pipeline.evaluation import EvalLog, EvalSet, EvalSettings, eval_due, evaluate
from pipeline.run.cli import main
from pipeline.run.eval_run import main as eval_main
from stages.sglang.wire import GenerateResult
from storage import LmdbStore

ROOT = Path(__file__).resolve().parent.parent
RM = "tests.test_eval:short_answer_reward"


def short_answer_reward(task, sample) -> float:
    """1 for a response of exactly `label` tokens before the end token, else 0."""
    return float(sample.response_len - 1 == int(task.label))


def _prompts(path: Path, words: str, n: int) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"{words} {k}:", "label": k % 4 + 1}) + "\n" for k in range(n)))
    return path


def _flags(tmp_path: Path) -> list[str]:
    train = _prompts(tmp_path / "train.jsonl", "answer in letters", 16)
    easy = _prompts(tmp_path / "easy.jsonl", "held out easy", 3)
    hard = _prompts(tmp_path / "hard.jsonl", "held out hard", 2)
    return [
        "--prompt-data",
        str(train),
        "--custom-rm-path",
        "tests.test_eval:short_answer_reward",
        "--rollout-batch-size",
        "4",
        "--rollout-max-response-len",
        "16",
        "--rollout-data-transport",
        "lmdb",
        "--eval-interval",
        "2",
        "--eval-prompt-data",
        "easy",
        str(easy),
        "hard",
        str(hard),
        "--n-samples-per-eval-prompt",
        "3",
        "--eval-max-response-len",
        "8",
    ]


def _run(out: Path, flags: list[str], steps: int) -> list[dict]:
    code = main(
        ["--output-dir", str(out), "--no-progress", "--log-level", "warning", "--num-rollout", str(steps), *flags]
    )
    assert code == 0
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _eval_steps(out: Path) -> list[int]:
    """The steps of eval.jsonl's complete lines, in order (a torn line is skipped, as EvalLog does)."""
    steps = []
    for line in (out / "eval.jsonl").read_text().splitlines():
        try:
            steps.append(json.loads(line)["step"])
        except json.JSONDecodeError:
            continue
    return steps


def test_inline_evaluation_at_the_interval_resumes_without_repeating_a_step(tmp_path):
    out, flags = tmp_path / "run", _flags(tmp_path)
    records = _run(out, flags, 4)
    evaluated = [r["step"] for r in records if "eval/easy" in r]
    assert evaluated == [1, 3] == _eval_steps(out)
    for r in records:
        if r["step"] in evaluated:
            assert r["eval/easy/samples"] + r["eval/easy/failed"] == 3 * 3
            assert r["eval/hard/samples"] + r["eval/hard/failed"] == 2 * 3
            assert 0.0 <= r["eval/easy"] <= 1.0 and r["eval/hard/response_len/mean"] <= 8
            assert "eval/easy-truncated_ratio" in r and r["time/eval"] > 0
    # Never mixed into training: every trained group is a training prompt.
    with LmdbStore(out / "rollout_data", readonly=True) as store:
        trained = [g for step in range(4) for g in store.batch(step).groups]
        assert len(trained) == 4 * 4
        assert {g.task.label for g in trained} <= {1, 2, 3, 4}
        assert all(g.task.index < 16 for g in trained)
    # A resume evaluates its own due steps and never one already in eval.jsonl.
    _run(out, flags, 6)
    assert _eval_steps(out) == [1, 3, 5]
    # A crash between step 5's commit and its evaluation (the line torn): the resume evaluates it
    # first, once, then trains step 6 (not due).
    lines = (out / "eval.jsonl").read_text().splitlines()
    (out / "eval.jsonl").write_text("\n".join(lines[:2]) + "\n" + lines[2][: len(lines[2]) // 2])
    _run(out, flags, 7)
    assert _eval_steps(out) == [1, 3, 5]
    # python -m pipeline.eval: every saved version not evaluated yet, then nothing left; a version
    # named explicitly is evaluated again. Saved: a checkpoint at the last step of each life (v4, v6,
    # v7; --save-interval 10 is never reached) and the weights-only folder the engines served last
    # (v7); v4 and v6 hold steps 3 and 5, evaluated inline, so only v7 (step 6) is new.
    saved = sorted(int(p.name[1:]) for p in (out / "checkpoints").glob("v*"))
    assert saved == [4, 6, 7]
    assert eval_main(["--output-dir", str(out), "--no-progress", "--log-level", "warning", *flags]) == 0
    assert sorted(_eval_steps(out)) == [1, 3, 5, 6]
    assert eval_main(["--output-dir", str(out), "--no-progress", *flags]) == 0
    assert len(_eval_steps(out)) == 4
    assert eval_main(["--output-dir", str(out), "--no-progress", *flags, "--eval-version", "0"]) == 0
    last = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    assert (last["step"], last["version"]) == (-1, 0)


def test_pipeline_eval_is_a_module_with_help():
    done = subprocess.run(
        [sys.executable, "-m", "pipeline.eval", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert done.returncode == 0 and "--eval-version" in done.stdout


def test_eval_rules_name_the_value(tmp_path):
    with pytest.raises(ConfigError, match="async rollout does not run inline evaluation"):
        load_config(["--rollout-mode", "async", "--eval-interval", "2"])
    with pytest.raises(ConfigError, match="must be NAME PATH pairs, got 3 values"):
        load_config(
            ["--eval-prompt-data", "a", "x.jsonl", "b", "--custom-rm-path", "tests.test_eval:short_answer_reward"]
        )
    with pytest.raises(ConfigError, match="set names must be unique"):
        load_config(["--eval-prompt-data", "a", "x", "a", "y", "--custom-rm-path", RM])
    with pytest.raises(ConfigError, match="name the evaluation sets with --eval-prompt-data"):
        load_config(
            [
                "--eval-interval",
                "2",
                "--prompt-data",
                str(tmp_path / "p.jsonl"),
                "--custom-rm-path",
                "tests.test_eval:short_answer_reward",
            ]
        )
    config = load_config(["--eval-interval", "3", "--eval-temperature", "0.5", "--n-samples-per-eval-prompt", "4"])
    assert (config.rollout.eval_interval, config.rollout.eval_temperature) == (3, 0.5)


def test_due_steps():
    assert [s for s in range(10) if eval_due(s, 3)] == [2, 5, 8]
    assert not eval_due(0, None)


class _Engine:
    """Answers each prompt with `len(prompt)` tokens; one prompt's requests are refused."""

    def __init__(self) -> None:
        self.params: list[dict] = []

    async def generate(self, input_ids, sampling_params, *, rid):
        from core.errors import EngineError

        self.params.append(dict(sampling_params))
        if input_ids[0] == 9:
            raise EngineError("http://fake", "refused", status=400)
        n = min(len(input_ids), sampling_params["max_new_tokens"])
        reason = FinishReason.LENGTH if n == sampling_params["max_new_tokens"] else FinishReason.STOP
        return GenerateResult(rid, tuple([5] * n), tuple([-0.5] * n), reason, None, None, "0", len(input_ids), n, 0)

    async def abort_all(self) -> None:
        pass


@pytest.mark.anyio
async def test_set_metrics_count_truncations_failures_and_rewards():
    tasks = (PromptTask(0, (1, 2), None), PromptTask(1, (1, 2, 3, 4), None), PromptTask(2, (9,), None))
    engine = _Engine()
    ticks = []
    sets = [EvalSet("s", tasks, lambda task, sample: float(sample.response_len))]
    settings = EvalSettings(n_samples=2, sampling_params={"temperature": 0.3}, max_response_len=3)
    m = await evaluate(engine, sets, settings, step=4, on_sample=lambda: ticks.append(1))
    assert len(ticks) == 6
    assert m["eval/s/samples"] == 4 and m["eval/s/failed"] == 2
    assert m["eval/s"] == pytest.approx((2 + 2 + 3 + 3) / 4)
    assert m["eval/s/truncated_ratio"] == 0.5 == m["eval/s-truncated_ratio"]
    assert (m["eval/s/reward_min"], m["eval/s/reward_max"]) == (2.0, 3.0)
    assert all(p["temperature"] == 0.3 and p["max_new_tokens"] == 3 for p in engine.params)
    assert len({p["sampling_seed"] for p in engine.params}) == 6


def test_eval_log_skips_a_torn_line_and_appends_after_it(tmp_path):
    log = EvalLog(tmp_path / "eval.jsonl")
    log.append({"step": 1, "eval/x": 0.5})
    with (tmp_path / "eval.jsonl").open("ab") as fh:
        fh.write(b'{"step": 3, "eval/')
    assert list(log.evaluated()) == [1]
    log.append({"step": 3, "eval/x": 0.25})
    assert list(log.evaluated()) == [1, 3]
