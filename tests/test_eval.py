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
from pipeline.metrics import MetricsSink, is_eval_record
from pipeline.run.cli import main
from pipeline.run.eval_run import InlineEvaluator, _bar
from pipeline.run.eval_run import main as eval_main
from stages.sglang_client.wire import GenerateResult
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


def _eval_versions(out: Path) -> list[int]:
    """The versions of eval.jsonl's complete lines, in order (a torn line is skipped, as EvalLog does)."""
    versions = []
    for line in (out / "eval.jsonl").read_text().splitlines():
        try:
            versions.append(json.loads(line)["version"])
        except json.JSONDecodeError:
            continue
    return versions


def _evaluations(out: Path) -> list[dict]:
    """The evaluations' own lines of the metrics file (`pipeline.metrics.eval_record`)."""
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if is_eval_record(r)]


def _eval_keys(record: dict) -> set[str]:
    return {k for k in record if k.startswith("eval/") and k != "eval/step"}


def test_inline_evaluation_at_the_interval_resumes_without_repeating_a_step(tmp_path):
    out, flags = tmp_path / "run", _flags(tmp_path)
    records = _run(out, flags, 4)
    steps = [r for r in records if not is_eval_record(r)]
    assert [r["step"] for r in steps] == [0, 1, 2, 3]
    evaluated = [r["step"] for r in steps if "eval/easy" in r]
    assert evaluated == [1, 3]
    # The starting weights first (slime's evaluation before training), at step 0: its own line.
    assert _eval_versions(out) == [0, 2, 4]
    [start] = _evaluations(out)
    assert records[0] == start and (start["step"], start["eval/step"], start["version"]) == (0, 0, 0)
    inline = steps[1]
    assert _eval_keys(start) == _eval_keys(inline) and start["time/eval"] > 0
    for r in steps:
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
    # A resume evaluates its own due steps and never weights already in eval.jsonl: not the
    # starting ones again (its engines serve step 3's).
    _run(out, flags, 6)
    assert _eval_versions(out) == [0, 2, 4, 6]
    assert len(_evaluations(out)) == 1
    # A crash between step 5's commit and its evaluation (the line torn): the resume evaluates it
    # first, once, then trains step 6 (not due). The evaluation gets a line of its own.
    lines = (out / "eval.jsonl").read_text().splitlines()
    (out / "eval.jsonl").write_text("\n".join(lines[:3]) + "\n" + lines[3][: len(lines[3]) // 2])
    _run(out, flags, 7)
    assert _eval_versions(out) == [0, 2, 4, 6]
    assert [(r["step"], r["version"]) for r in _evaluations(out)] == [(0, 0), (5, 6)]
    # python -m pipeline.eval: every saved version not evaluated yet, then nothing left; a version
    # named explicitly is evaluated again. Saved: a checkpoint at the last step of each life (v4, v6,
    # v7; --save-interval 10 is never reached) and the weights-only folder the engines served last
    # (v7); v4 and v6 hold steps 3 and 5, evaluated inline, so only v7 (step 6) is new. Its results
    # go where the run's do: a line of the metrics file at step 6, with the inline keys.
    saved = sorted(int(p.name[1:]) for p in (out / "checkpoints").glob("v*"))
    assert saved == [4, 6, 7]
    assert eval_main(["--output-dir", str(out), "--no-progress", "--log-level", "warning", *flags]) == 0
    assert sorted(_eval_versions(out)) == [0, 2, 4, 6, 7]
    standalone = _evaluations(out)[-1]
    assert (standalone["step"], standalone["eval/step"], standalone["version"]) == (6, 6, 7)
    assert _eval_keys(standalone) == _eval_keys(inline)
    assert eval_main(["--output-dir", str(out), "--no-progress", *flags]) == 0
    assert len(_eval_versions(out)) == 5
    assert eval_main(["--output-dir", str(out), "--no-progress", *flags, "--eval-version", "0"]) == 0
    last = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    assert (last["step"], last["version"]) == (0, 0)
    assert [(r["step"], r["version"]) for r in _evaluations(out)] == [(0, 0), (5, 6), (6, 7), (0, 0)]  # appended
    # Where its seconds go: each version's load, the engines' start on a call's first line only.
    assert (
        eval_main(["--output-dir", str(out), "--no-progress", *flags, "--eval-version", "4", "--eval-version", "7"])
        == 0
    )
    first, second = _evaluations(out)[-2:]
    assert (first["version"], second["version"]) == (4, 7)
    assert first["time/eval_load"] > 0 and second["time/eval_load"] > 0
    assert first["time/eval_engine_start"] > 0 and "time/eval_engine_start" not in second


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
    assert m["eval/s-truncated_ratio"] == 0.5 and "eval/s/truncated_ratio" not in m  # slime's name, once
    assert (m["eval/s/reward_min"], m["eval/s/reward_max"]) == (2.0, 3.0)
    assert all(p["temperature"] == 0.3 and p["max_new_tokens"] == 3 for p in engine.params)
    assert len({p["sampling_seed"] for p in engine.params}) == 6


def test_eval_log_skips_a_torn_line_and_appends_after_it(tmp_path):
    log = EvalLog(tmp_path / "eval.jsonl")
    log.append({"step": 1, "version": 2, "eval/x": 0.5})
    with (tmp_path / "eval.jsonl").open("ab") as fh:
        fh.write(b'{"step": 3, "eval/')
    assert list(log.evaluated()) == [2]  # by version: the weights evaluated
    log.append({"step": 3, "eval/x": 0.25})  # a line of before versions were written: step + 1
    assert list(log.evaluated()) == [2, 4]


@pytest.mark.anyio
async def test_the_starting_weights_are_evaluated_once_and_only_by_a_run_that_starts_at_step_0(tmp_path):
    sets = [EvalSet("s", (PromptTask(0, (1, 2), None),), lambda task, sample: 1.0)]

    def evaluator() -> InlineEvaluator:  # a new one each time: a new life of the run
        return InlineEvaluator(_Engine(), sets, EvalSettings(max_response_len=3), interval=2, log_path=tmp_path / "e")

    with MetricsSink(tmp_path / "metrics.jsonl") as sink:
        # A run resumed past step 0: its engines serve later weights; python -m pipeline.eval's job.
        assert await evaluator().before_training(3, sink) == {}
        assert (await evaluator().before_training(0, sink))["eval/s"] == 1.0
        # A crash before step 0's commit: the resumed run does not evaluate the same weights again.
        assert await evaluator().before_training(0, sink) == {}
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval/step"], r["version"], r["eval/s"]) for r in lines] == [(0, 0, 0, 1.0)]
    assert list(EvalLog(tmp_path / "e").evaluated()) == [0]
    assert load_config(["--eval-interval", "2", "--skip-eval-before-train"]).rollout.skip_eval_before_train
    assert not load_config(["--eval-interval", "2"]).rollout.skip_eval_before_train


def test_the_eval_progress_bar_draws_on_a_terminal_only(capsys):
    # Before: python -m pipeline.eval drew its bar into a log file, one carriage return per refresh.
    tick = _bar(load_config([]), 3)  # --progress is on by default; stderr here is no terminal
    for _ in range(3):
        tick()
    tick.close()
    assert "\r" not in capsys.readouterr().err
