"""Evaluation from the config: the sets and sampling it names, inline in a sync run (the starting
weights first, unless `--skip-eval-before-train`), and `python -m pipeline.eval`, which evaluates a
run's saved weights on engines of its own.

    python -m pipeline.eval --output-dir RUN_DIR [the run's flags] [--eval-version N ...]

Without `--eval-version` every saved weights folder (`RUN_DIR/checkpoints/vN` or `RUN_DIR/weights/vN`,
N >= 1: the weights step N-1 made) that `RUN_DIR/eval.jsonl` does not hold yet is evaluated, oldest
first; with it, the versions named (0 = the initial weights), also when already evaluated. The
run's flags say what to evaluate and how (`--eval-prompt-data`, `--n-samples-per-eval-prompt`,
`--eval-temperature` ...) and which engines to use: `--sglang-url`/`--sglang-router-url` (engines of
its own: their weights are replaced, so never a live run's), or built-in engines started and
stopped here. The results go where the run's go: one line each to the run's metrics file
(`pipeline.metrics.eval_record`: at the step that made the weights, with the inline evaluation's
`eval/...` keys, marked by `eval/step`), to its TensorBoard and W&B (on the `eval/step` axis in
W&B, which only accepts growing steps), and to `RUN_DIR/eval.jsonl`; with a progress bar over the
samples on a terminal.

An async run cannot evaluate inline (the config refuses it); this command runs beside it, or after.
Beside it, both append to the metrics file (whole lines, one `write` each, in append mode).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio
import structlog

from core.errors import ConfigError, PipelineError
from pipeline.checkpoints import CHECKPOINTS_DIR, PUBLISH_DIR
from pipeline.config import Config, config_to_dict, load_config
from pipeline.config.derived import derived
from pipeline.evaluation import EvalLog, EvalSet, EvalSettings, eval_due, evaluate
from pipeline.metric_sinks import open_step_sinks
from pipeline.metrics import MetricsSink, eval_record
from pipeline.run.records import dashboard_settings, draws_a_bar
from pipeline.run.run_engines import RunEngines  # the run's engines: its own URLs, or built-in ones
from stages.generator import GenerateEngine

__all__ = ["InlineEvaluator", "eval_sets", "eval_settings", "main", "saved_weights"]

log = structlog.get_logger("eval")

EVAL_FILE = "eval.jsonl"
TOY_EVAL_PROMPTS = 64
_TOY_EVAL_SEED_OFFSET = 1_000_003  # the toy evaluation draws: another seed than the training set's


def eval_sets(config: Config, tokenizer: Any) -> list[EvalSet]:
    """The evaluation sets the config names (`--eval-prompt-data NAME PATH ...`), or, when it names
    none and the run trains the toy task, 64 toy prompts drawn with another seed (the toy task has
    only 12 distinct prompts: this measures the policy on them, not generalisation)."""
    d, r = config.data, config.rollout
    pairs = r.eval_prompt_data
    if pairs:
        from pipeline.tasks.jsonl import load_jsonl_prompts

        reward = derived(d.reward_fn, "data.reward_fn")  # the rules ask for --custom-rm-path
        return [
            EvalSet(
                name,
                tuple(load_jsonl_prompts(path, tokenizer, input_key=d.input_key, label_key=d.label_key)),
                reward,
            )
            for name, path in zip(pairs[0::2], pairs[1::2], strict=True)
        ]
    if d.prompt_data or d.task != "toy":
        raise ConfigError(["evaluation needs --eval-prompt-data NAME PATH (only the toy task has a held-out set)"])
    from pipeline.tasks.toy import toy_dataset, toy_reward

    tasks = toy_dataset(TOY_EVAL_PROMPTS, seed=r.seed + _TOY_EVAL_SEED_OFFSET)
    return [EvalSet("toy", tuple(tasks), d.reward_fn or toy_reward)]


def eval_settings(config: Config) -> EvalSettings:
    """slime's eval sampling flags, each defaulting to its rollout counterpart."""
    r, e = config.rollout, config.engine
    params: dict[str, Any] = {
        "temperature": r.temperature if r.eval_temperature is None else r.eval_temperature,
        "top_p": r.top_p if r.eval_top_p is None else r.eval_top_p,
        "top_k": r.top_k if r.eval_top_k is None else r.eval_top_k,
    }
    n_engines = max(1, len(e.urls) or e.num_engines)
    return EvalSettings(
        n_samples=r.n_samples_per_eval_prompt,
        sampling_params=params,
        max_response_len=r.max_response_len if r.eval_max_response_len is None else r.eval_max_response_len,
        concurrency=e.sglang_server_concurrency * n_engines,
        reward_timeout=r.reward_timeout,
        seed=r.seed,
    )


class InlineEvaluator:
    """`run_pipeline(evaluate=...)` for a sync run: every `--eval-interval` steps, on the engines.

    Weights already in `eval.jsonl` are never evaluated again (a resumed run). `before_training`
    evaluates the starting weights; `catch_up` evaluates the last trained step when a crash came
    between its commit and its evaluation (the resumed engines serve exactly its weights), so no
    due step is lost either."""

    def __init__(
        self,
        engines: GenerateEngine,
        sets: Sequence[EvalSet],
        settings: EvalSettings,
        *,
        interval: int,
        log_path: Path,
        version_of: Callable[[int], int] = lambda step: step + 1,
    ) -> None:
        self.engines, self.sets, self.settings, self.interval = engines, list(sets), settings, interval
        self.log = EvalLog(log_path)
        self._done = set(self.log.evaluated())
        self._version_of = version_of

    async def __call__(self, step: int) -> dict[str, float]:
        version = self._version_of(step)
        if not eval_due(step, self.interval) or version in self._done:
            return {}
        return await self._evaluate(step, version)

    async def before_training(self, start_step: int, sink: MetricsSink) -> dict[str, float]:
        """Evaluate the starting weights, as slime does before training (`--skip-eval-before-train`
        is the caller's): a baseline for every later evaluation. Only a run that starts at step 0
        does it, and only once: a crash before step 0's commit leaves it in `eval.jsonl`, and a
        run resumed past step 0 has engines that no longer serve those weights (evaluate them
        with `python -m pipeline.eval --eval-version 0`). Its line goes to the metrics file and
        the dashboards (`eval_record`, at step 0)."""
        if start_step != 0 or 0 in self._done:
            return {}
        started = time.perf_counter()
        metrics = await self._evaluate(0, 0)
        sink.write_eval(eval_record(0, {**metrics, "time/eval": time.perf_counter() - started}))
        return metrics

    async def catch_up(self, last_trained_step: int, sink: MetricsSink | None = None) -> dict[str, float]:
        """Evaluate `last_trained_step` if it was due and is not in the log; its metrics get a line
        of their own in the metrics file and the dashboards (`eval_record`: the step's line was
        written before the crash)."""
        if last_trained_step < 0:
            return {}
        started = time.perf_counter()
        metrics = await self(last_trained_step)
        if metrics and sink is not None:
            version = self._version_of(last_trained_step)
            sink.write_eval(eval_record(version, {**metrics, "time/eval": time.perf_counter() - started}))
        return metrics

    async def _evaluate(self, step: int, version: int) -> dict[str, float]:
        metrics = await evaluate(self.engines, self.sets, self.settings, step=step)
        self.log.append({"step": step, "version": version, **metrics})
        self._done.add(version)
        log.info(
            "evaluated", step=step, version=version, **{k: round(v, 4) for k, v in metrics.items() if k.count("/") == 1}
        )
        return metrics


# ---- python -m pipeline.eval --------------------------------------------------------------------


def saved_weights(out: Path) -> dict[int, Path]:
    """Every complete `vN` folder of the run, by version: the full checkpoints (`checkpoints/vN`,
    kept by `--save-keep-last`) and the weights-only folders the engines load between them
    (`weights/vN`, deleted once served past; a run of the older layout keeps every step there).
    A save in progress is `.vN.tmp-*` and never matches."""
    saved: dict[int, Path] = {}
    for folder in (out / PUBLISH_DIR, out / CHECKPOINTS_DIR):  # a checkpoint wins over a copy
        if folder.is_dir():
            for p in folder.iterdir():
                m = re.fullmatch(r"v(\d+)", p.name)
                if m and (p / "config.json").exists():
                    saved[int(m.group(1))] = p
    return dict(sorted(saved.items()))


def _parse(argv: Sequence[str]) -> tuple[list[int] | None, list[str]]:
    parser = argparse.ArgumentParser(
        prog="python -m pipeline.eval",
        description="Evaluate a run's saved weights (RUN_DIR/checkpoints/vN, RUN_DIR/weights/vN) on engines; "
        "the run's flags say what "
        "and how. Results: the run's metrics file (its own lines, eval/step), TensorBoard, W&B, RUN_DIR/eval.jsonl.",
        add_help=True,
    )
    parser.add_argument(
        "--eval-version",
        type=int,
        action="append",
        metavar="N",
        help="evaluate the weights of version N (repeatable; 0 = the initial weights); default: every saved "
        "version not yet in eval.jsonl",
    )
    known, rest = parser.parse_known_args(list(argv))
    return known.eval_version, rest


def main(argv: Sequence[str] | None = None) -> int:
    versions, rest = _parse(sys.argv[1:] if argv is None else argv)
    try:
        config = load_config(rest)
        return anyio.run(evaluate_saved, config, versions)
    except (ConfigError, PipelineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


async def evaluate_saved(config: Config, versions: list[int] | None) -> int:
    """What `python -m pipeline.eval` does once its flags are read: evaluate `versions` (None:
    every saved one not yet in eval.jsonl) of the run in `--output-dir`; 0. Callable in a process
    of one's own too: several at once on engines of their own, each a line of eval.jsonl written
    whole, is how a benchmark evaluates without a process start per round."""
    from transformers import AutoTokenizer

    out = Path(derived(config.output.dir, "output.dir"))
    model_path = Path(config.engine.hf_checkpoint) if config.engine.hf_checkpoint else out / "model"
    if not (model_path / "config.json").exists() and not config.engine.hf_checkpoint:
        raise ConfigError([f"--output-dir={out}: no model folder {model_path} (is this a run folder?)"])
    eval_log = EvalLog(out / EVAL_FILE)
    folders = saved_weights(out)
    saved = list(folders)
    if versions is None:
        done = set(eval_log.evaluated())
        versions = [v for v in saved if v >= 1 and v not in done]
    missing = [v for v in versions if v != 0 and v not in saved]
    if missing:
        raise ConfigError(
            [
                f"--eval-version {missing}: no such weights under {out / CHECKPOINTS_DIR} "
                f"or {out / PUBLISH_DIR} (saved: {saved})"
            ]
        )
    if not versions:
        print(f"nothing to evaluate: every saved version of {out} is in {out / EVAL_FILE}")
        return 0
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    sets = eval_sets(config, tokenizer)
    settings = eval_settings(config)
    sink = _metrics_sink(config, out)
    total = len(versions) * sum(len(s.tasks) for s in sets) * settings.n_samples
    bar = _bar(config, total)
    try:
        starting = time.perf_counter()
        async with RunEngines(config, model_path) as fleet:
            # Where an evaluation's seconds go beside the decode: the engines' start (the first
            # line's), each version's weights load.
            start = {"time/eval_engine_start": time.perf_counter() - starting}
            for version in versions:
                folder = model_path if version == 0 else folders[version]
                loading = time.perf_counter()
                await fleet.update_weights_from_disk(str(folder), weight_version=str(version))
                started = time.perf_counter()
                record = eval_record(version, {})
                metrics = await evaluate(fleet, sets, settings, step=record["step"], on_sample=bar)
                eval_log.append({"step": record["step"], "version": version, **metrics})
                seconds = {"time/eval": time.perf_counter() - started, "time/eval_load": started - loading}
                sink.write_eval({**record, **metrics, **seconds, **start})
                start = {}
                print(
                    f"v{version} (step {record['step']}): "
                    + "  ".join(f"{s.name} {metrics[f'eval/{s.name}']:.4f}" for s in sets)
                )
    finally:
        sink.close()
        bar.close()
    return 0


def _metrics_sink(config: Config, out: Path) -> MetricsSink:
    """The run's metrics file and dashboards, where the evaluations' lines go."""
    settings = dashboard_settings(config)
    extras = open_step_sinks(
        settings, output_dir=out, run_id=config.storage.run_id, warn=log.warning, config=config_to_dict(config)
    )
    return MetricsSink(Path(derived(config.output.metrics_file, "output.metrics_file")), extras, warn=log.warning)


class _NoBar:
    """No bar: in a log file the line printed per version says it."""

    def __call__(self) -> None:
        pass

    def close(self) -> None:
        pass


class _Tick(_NoBar):
    """A tqdm bar, one tick a sample."""

    def __init__(self, total: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, unit="sample", desc="eval", dynamic_ncols=True)

    def __call__(self) -> None:
        self._bar.update(1)

    def close(self) -> None:
        self._bar.close()


def _bar(config: Config, total: int) -> _NoBar:
    """A progress bar over the samples, on a terminal only (as the run's: `draws_a_bar`)."""
    return _Tick(total) if draws_a_bar(config) else _NoBar()
