"""The config tree: defaults, TOML + flags, every problem in one error, plugins resolved at load."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from core.errors import ConfigError, PluginError
from core.types import PauseMode, RolloutMode, StoreTransport
from pipeline import RolloutPlan
from pipeline.config import (
    Config,
    EngineConfig,
    OutputConfig,
    RolloutConfig,
    StorageConfig,
    TrainerConfig,
    build_parser,
    config_to_dict,
    load_config,
    section_from_dict,
)
from pipeline.config.draft import Draft
from pipeline.config.load import load_step
from pipeline.config.parsing import read_argv
from pipeline.config.rules import check_bounds, check_rules
from stages.plugins import resolve_function, split_path

# Plugins referenced by path from the tests below.


def toy_reward(sample):
    return 1.0


def keep_all(group):
    return True


NOT_CALLABLE = 3


def problems_of(argv, **kw) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(argv, **kw)
    # The message lists every problem, so a user sees them all at once.
    for problem in info.value.problems:
        assert problem in str(info.value)
    return info.value.problems


def write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


# --- defaults and derived defaults -------------------------------------------------------------


def test_defaults():
    config = load_config([])
    r, d, e, s, t, o = (config.rollout, config.data, config.engine, config.storage, config.trainer, config.output)
    assert (r.mode, r.rollout_batch_size, r.n_samples_per_prompt) == ("sync", 8, 8)
    assert (r.partial_rollout, r.mask_offpolicy_in_partial_rollout, r.max_response_len) == (False, False, 64)
    assert (r.temperature, r.top_p, r.top_k, r.num_rollout) == (1.0, 1.0, -1, 100)
    assert (r.max_staleness, r.pause_mode, r.seed, r.eval_interval) == (None, "abort", 42, None)
    assert (r.request_timeout, r.max_retries, r.reward_timeout) == (600.0, 3, 30.0)
    assert (d.prompt_data, d.input_key, d.label_key, d.num_prompts) == (None, "prompt", "label", 512)
    assert d.custom_rm_path is None and d.reward_fn is None and d.filter_fn is None
    assert (e.urls, e.router_url, e.num_engines, e.sglang_server_concurrency) == ((), None, 1, 64)
    assert (e.hf_checkpoint, e.host) == (None, "127.0.0.1")
    assert (s.transport, s.run_id) == ("memory", "default")
    assert (t.lr, t.eps_clip, t.use_tis, t.tis_clip, t.max_grad_norm) == (5e-3, 0.2, True, 2.0, 1.0)
    assert (o.progress, o.log_level) == (True, "info")
    assert config.warnings == ()
    assert not r.resumes_partial_groups


def test_derived_defaults_follow_what_they_derive_from():
    config = load_config(["--rollout-batch-size", "12", "--rollout-queue-run-id", "exp-1", "--eps-clip", "0.3"])
    assert config.rollout.over_sampling_batch_size == 12
    assert config.rollout.prefetch == 12
    assert config.output.dir == Path("runs/exp-1")
    assert config.output.metrics_file == Path("runs/exp-1/metrics.jsonl")
    assert config.storage.data_dir == Path("runs/exp-1/rollout_data")
    assert config.trainer.eps_clip_high == 0.3

    config = load_config(
        ["--save", "/tmp/out", "--rollout-prefetch", "0", "--over-sampling-batch-size", "3", "--partial-rollout"]
    )
    assert config.output.dir == Path("/tmp/out")
    assert config.output.metrics_file == Path("/tmp/out/metrics.jsonl")
    assert config.storage.data_dir == Path("/tmp/out/rollout_data")
    assert config.rollout.prefetch == 0  # explicit values are kept, 0 included
    assert config.rollout.over_sampling_batch_size == 3


def test_explicit_paths_win_over_derived_ones():
    config = load_config(
        [
            "--output-dir",
            "o",
            "--metrics-file",
            "m.jsonl",
            "--rollout-data-dir",
            "d",
            "--rollout-data-transport",
            "lmdb",
        ]
    )
    assert (config.output.metrics_file, config.storage.data_dir) == (Path("m.jsonl"), Path("d"))
    assert config.warnings == ()


def test_over_sampling_smaller_than_batch_is_allowed():
    config = load_config(["--rollout-batch-size", "8", "--over-sampling-batch-size", "2", "--partial-rollout"])
    assert config.rollout.over_sampling_batch_size == 2
    assert config.rollout.resumes_partial_groups
    assert config.warnings == ()


def test_over_sampling_without_partial_rollout_warns():
    config = load_config(["--over-sampling-batch-size", "16"])
    assert config.rollout.over_sampling_batch_size == 16
    assert len(config.warnings) == 1 and "--over-sampling-batch-size=16 without --partial-rollout" in config.warnings[0]
    # In async mode aborted groups are always resumed: nothing to warn about.
    assert load_config(["--over-sampling-batch-size", "16", "--rollout-mode", "async"]).warnings == ()


def test_other_legal_but_odd_settings_warn():
    warnings = load_config(
        [
            "--mask-offpolicy-in-partial-rollout",
            "--n-samples-per-prompt",
            "1",
            "--rollout-data-dir",
            "x",
            "--engine-host",
            "0.0.0.0",
            "--rollout-min-new-tokens",
            "64",
        ]
    ).warnings
    assert any(w.startswith("--mask-offpolicy-in-partial-rollout without --partial-rollout") for w in warnings)
    assert any(w.startswith("--n-samples-per-prompt=1") for w in warnings)
    assert any(w.startswith("--rollout-data-dir='x' with --rollout-data-transport=memory") for w in warnings)
    assert any(w.startswith("--engine-host='0.0.0.0'") for w in warnings)
    # no stop before the cap (legal: fixed-length generation; before, not a word about it)
    assert any(w.startswith("--rollout-min-new-tokens=64 with --rollout-max-response-len=64") for w in warnings)
    assert len(warnings) == 5


def test_the_tree_is_frozen():
    config = load_config([])
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.rollout.rollout_batch_size = 3  # type: ignore[misc]
    assert not hasattr(config.rollout, "__dict__")  # slotted


# --- TOML and flags ----------------------------------------------------------------------------


def test_toml_then_flags_override(tmp_path):
    toml = write(
        tmp_path / "run.toml",
        """
[rollout]
mode = "async"
rollout_batch_size = 4
temperature = 1
partial_rollout = true

[engine]
urls = ["http://127.0.0.1:30000/", "http://127.0.0.1:30001"]

[storage]
transport = "lmdb"
run_id = "from-toml"

[trainer]
use_tis = false
""",
    )
    config = load_config(["--config", str(toml), "--rollout-batch-size", "6", "--no-partial-rollout"])
    assert config.rollout.mode == "async"  # from the file
    assert config.rollout.rollout_batch_size == 6  # the flag wins
    assert config.rollout.partial_rollout is False  # a flag can turn a file's true off
    assert config.rollout.temperature == 1.0 and isinstance(config.rollout.temperature, float)
    assert config.rollout.over_sampling_batch_size == 6  # derived after the merge
    assert config.engine.urls == ("http://127.0.0.1:30000", "http://127.0.0.1:30001")
    assert config.engine.num_engines == 2
    assert config.storage.transport == "lmdb" and config.output.dir == Path("runs/from-toml")
    assert config.trainer.use_tis is False

    # toml_path= is the caller's default file; the same file loads the same way.
    assert load_config([], toml_path=toml).rollout.rollout_batch_size == 4
    # --config replaces toml_path.
    other = write(tmp_path / "other.toml", "[rollout]\nrollout_batch_size = 5\n")
    assert load_config(["--config", str(other)], toml_path=toml).rollout.rollout_batch_size == 5


def test_repeated_url_flags_replace_the_file_list(tmp_path):
    toml = write(tmp_path / "run.toml", '[engine]\nurls = ["http://h:1"]\n')
    config = load_config(["--config", str(toml), "--sglang-url", "http://a:1", "--sglang-url", "http://b:2"])
    assert config.engine.urls == ("http://a:1", "http://b:2")


def test_toml_problems_name_section_key_and_file(tmp_path):
    toml = write(
        tmp_path / "bad.toml",
        """
[rollout]
rollout_batch_size = "8"
rollout-max-response-len = 5
hf_checkpoint = "x"
top_p = 0

[rollouts]
mode = "async"
""",
    )
    problems = problems_of(["--config", str(toml)])
    assert f"--rollout-batch-size='8' ([rollout] rollout_batch_size in {toml}): must be an integer, got str" in problems
    # A key may be spelled as the flag (issue 33): `rollout-max-response-len` is max_response_len.
    assert not any("rollout-max-response-len" in p or "max_response_len" in p for p in problems)
    assert f"{toml}: unknown key 'hf_checkpoint' in [rollout] (it belongs in [engine])" in problems
    assert f"--rollout-top-p=0.0 ([rollout] top_p in {toml}): must be in (0, 1]" in problems
    assert any(p.startswith(f"{toml}: unknown section [rollouts]") and "did you mean rollout?" in p for p in problems)
    assert len(problems) == 4


def test_toml_file_missing_or_malformed(tmp_path):
    assert problems_of(["--config", str(tmp_path / "nope.toml")]) == [
        f"--config={str(tmp_path / 'nope.toml')!r}: file not found"
    ]
    broken = write(tmp_path / "broken.toml", "[rollout\n")
    [problem] = problems_of(["--config", str(broken)])
    assert problem.startswith(f"--config={str(broken)!r}: not valid TOML")


# --- every problem in one error ----------------------------------------------------------------


def test_several_bad_values_reported_together():
    problems = problems_of(
        [
            "--rollout-batch-size",
            "0",
            "--n-samples-per-prompt",
            "abc",
            "--rollout-temperature",
            "0",
            "--rollout-top-p",
            "1.5",
            "--rollout-top-k",
            "0",
            "--max-staleness",
            "-1",
            "--rollout-mode",
            "fast",
            "--lr",
            "nan",
            "--reward-timeout",
            "-3",
            "--rollout-queue-run-id",
            "../escape",
            "--log-level",
            "loud",
        ]
    )
    expected = [
        "--rollout-batch-size=0: must be >= 1",
        "--n-samples-per-prompt='abc': must be an integer",
        "--rollout-temperature=0.0: must be > 0 (the trainer's log-prob correction divides the logits by it)",
        "--rollout-top-p=1.5: must be in (0, 1]",
        "--rollout-top-k=0: must be -1 (off) or >= 1",
        "--max-staleness=-1: must be >= 0",
        "--rollout-mode='fast': must be one of sync, async",
        "--lr='nan': must be a finite number",
        "--reward-timeout=-3.0: must be > 0",
        "--log-level='loud': must be one of debug, info, warning, error",
    ]
    for problem in expected:
        assert problem in problems
    assert any(p.startswith("--rollout-queue-run-id='../escape': must be letters") for p in problems)
    assert len(problems) == len(expected) + 1


def test_unknown_flags_are_collected_with_suggestions():
    problems = problems_of(
        [
            "--partail-rollout",
            "--rollout-batchsize",
            "8",
            "--rollout-function-path",
            "slime.rollout.fully_async_rollout.generate_rollout_fully_async",
            "--rollout-batch-size",
            "x",
            "stray",
        ]
    )
    assert "--partail-rollout: unknown flag (did you mean --partial-rollout?)" in problems
    assert "--rollout-batchsize: unknown flag (did you mean --rollout-batch-size?)" in problems
    assert "--rollout-function-path: unknown flag (async rollout is --rollout-mode async here)" in problems
    assert "--rollout-batch-size='x': must be an integer" in problems
    assert "'stray': unexpected argument (options are --flags)" in problems
    assert len(problems) == 5  # an unknown flag's value is not reported a second time


def test_abbreviated_flags_are_refused():
    # argparse would take `--rollout-batch` for --rollout-batch-size; a typo must not pick a flag.
    assert problems_of(["--rollout-batch", "4"]) == [
        "--rollout-batch: unknown flag (did you mean --rollout-batch-size?)"
    ]


def test_a_flag_without_its_value_names_the_flag():
    assert problems_of(["--rollout-batch-size"]) == ["argument --rollout-batch-size: expected one argument"]


# --- forbidden combinations --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "rule"),
    [
        (
            ["--rollout-mode", "async", "--eval-interval", "5"],
            "--eval-interval=5 with --rollout-mode=async: async rollout does not run inline evaluation; "
            "evaluate separately",
        ),
        (
            ["--rollout-mode", "async", "--rollout-all-samples-process-path", "tests.test_config:keep_all"],
            "--rollout-all-samples-process-path='tests.test_config:keep_all' with --rollout-mode=async: async rollout "
            "does not support --rollout-all-samples-process-path",
        ),
        (
            ["--rollout-data-transport", "lmdb", "--buffer-filter-path", "tests.test_config:keep_all"],
            "--buffer-filter-path='tests.test_config:keep_all' with --rollout-data-transport=lmdb: the LMDB store has "
            "its own durable ordering",
        ),
        (
            # Every group of one has reward std 0: the filter rejects all of them and no batch fills.
            ["--n-samples-per-prompt", "1", "--dynamic-sampling-filter-path", "stages.filter:reward_std_nonzero"],
            "--dynamic-sampling-filter-path='stages.filter:reward_std_nonzero' with --n-samples-per-prompt=1: "
            "a group of one has no reward spread",
        ),
        (
            ["--sglang-url", "http://127.0.0.1:1", "--sglang-router-url", "http://127.0.0.1:2"],
            "--sglang-router-url='http://127.0.0.1:2' with --sglang-url: pass engine URLs or one router URL, not both",
        ),
    ],
)
def test_forbidden_combinations_name_their_rule(argv, rule):
    [problem] = problems_of(argv)
    assert problem.startswith(rule)


def test_each_half_of_a_forbidden_combination_is_fine_alone():
    load_config(["--rollout-mode", "async"])
    load_config(["--eval-interval", "5"])
    load_config(["--rollout-all-samples-process-path", "tests.test_config:keep_all"])
    assert load_config(["--buffer-filter-path", "tests.test_config:keep_all"]).data.buffer_filter_fn is keep_all
    load_config(["--rollout-data-transport", "lmdb"])


def test_forbidden_combination_from_file_and_flag(tmp_path):
    toml = write(tmp_path / "c.toml", '[rollout]\nmode = "async"\n')
    [problem] = problems_of(["--config", str(toml), "--eval-interval", "2"])
    assert problem.startswith("--eval-interval=2 with --rollout-mode=async")


def test_engine_rules():
    problems = problems_of(
        [
            "--sglang-url",
            "localhost:30000",
            "--sglang-url",
            "http://h:1",
            "--sglang-url",
            "http://h:1/",
            "--rollout-num-engines",
            "3",
        ]
    )
    assert "--sglang-url='localhost:30000': must be an http(s)://host:port URL" in problems
    assert "--sglang-url='http://h:1': given more than once" in problems
    assert len(problems) == 2  # 3 URLs and 3 engines agree
    [problem] = problems_of(["--sglang-url", "http://a:1", "--rollout-num-engines", "2"])
    assert problem.startswith("--rollout-num-engines=2: 1 --sglang-url given")


# --- data --------------------------------------------------------------------------------------


def test_prompt_file_needs_a_reward_and_must_exist(tmp_path):
    missing = tmp_path / "missing.jsonl"
    problems = problems_of(["--prompt-data", str(missing)])
    assert (
        f"--prompt-data={str(missing)!r}: a JSONL prompt file needs --custom-rm-path (the built-in reward "
        "only scores the toy task)" in problems
    )
    assert f"--prompt-data={str(missing)!r}: file not found" in problems


def test_prompt_file_first_record_checks_the_keys(tmp_path):
    data = write(tmp_path / "p.jsonl", '\n{"question": "1+1", "answer": "2"}\n')
    [problem] = problems_of(["--prompt-data", str(data), "--custom-rm-path", "tests.test_config:toy_reward"])
    assert (
        problem == f"--input-key='prompt': the first record of {str(data)!r} has no such key "
        "(keys: 'question', 'answer')"
    )
    config = load_config(
        [
            "--prompt-data",
            str(data),
            "--custom-rm-path",
            "tests.test_config:toy_reward",
            "--input-key",
            "question",
            "--label-key",
            "answer",
            "--rollout-batch-size",
            "1",  # one prompt: a bigger batch repeats it, with a warning
        ]
    )
    assert config.data.prompt_data == data and config.data.reward_fn is toy_reward
    assert config.warnings == ()


# --- plugins -----------------------------------------------------------------------------------


def test_good_plugin_paths_are_resolved_onto_the_tree():
    config = load_config(
        [
            "--custom-rm-path",
            "tests.test_config:toy_reward",
            "--dynamic-sampling-filter-path",
            "tests.test_config.keep_all",
        ]
    )  # slime's spelling
    assert config.data.reward_fn is toy_reward
    assert config.data.filter_fn is keep_all
    assert config.data.all_samples_process_fn is None and config.data.buffer_filter_fn is None


def test_bad_plugin_paths_fail_at_load_all_together(tmp_path, monkeypatch):
    write(tmp_path / "cfgtest_broken_plugin.py", "raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    problems = problems_of(
        [
            "--custom-rm-path",
            "tests.no_such_module:fn",
            "--dynamic-sampling-filter-path",
            "tests.test_config:no_such_fn",
            "--rollout-all-samples-process-path",
            "tests.test_config:NOT_CALLABLE",
            "--buffer-filter-path",
            "cfgtest_broken_plugin:fn",
        ]
    )
    assert problems == [
        "--custom-rm-path='tests.no_such_module:fn': module 'tests.no_such_module' not found (is it on PYTHONPATH?)",
        "--dynamic-sampling-filter-path='tests.test_config:no_such_fn': 'tests.test_config' has no attribute "
        "'no_such_fn'",
        "--rollout-all-samples-process-path='tests.test_config:NOT_CALLABLE': 'NOT_CALLABLE' is a int, not a callable",
        "--buffer-filter-path='cfgtest_broken_plugin:fn': importing module 'cfgtest_broken_plugin' failed: "
        "RuntimeError: boom at import",
    ]


def test_resolve_function_errors_name_the_path():
    with pytest.raises(PluginError) as info:
        resolve_function("tests.test_config:toy_rewrd")
    assert info.value.path == "tests.test_config:toy_rewrd"
    assert "did you mean 'toy_reward'?" in str(info.value)
    for bad in ("", "nomodule", "a:b:c", "a-b:c", ":fn", "mod:"):
        with pytest.raises(PluginError) as info:
            resolve_function(bad)
        assert repr(bad) in str(info.value)
    assert split_path("pkg.mod:Cls.method") == ("pkg.mod", "Cls.method")
    assert split_path("pkg.mod.fn") == ("pkg.mod", "fn")
    assert resolve_function("os.path:join.__call__")  # attribute chains work


def test_a_missing_dependency_of_a_plugin_is_not_called_a_missing_plugin(tmp_path, monkeypatch):
    write(tmp_path / "cfgtest_needs_dep.py", "import cfgtest_absent_dependency\n\ndef fn():\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as info:
        resolve_function("cfgtest_needs_dep:fn")
    assert "importing module 'cfgtest_needs_dep' failed: ModuleNotFoundError" in str(info.value)
    assert "cfgtest_absent_dependency" in str(info.value)


# --- serialization and the parser --------------------------------------------------------------


def test_config_to_dict_is_json_and_complete():
    config = load_config(["--custom-rm-path", "tests.test_config:toy_reward", "--sglang-url", "http://h:1"])
    as_dict = config_to_dict(config)
    assert json.loads(json.dumps(as_dict)) == as_dict
    assert set(as_dict) == {"rollout", "data", "engine", "storage", "trainer", "output"}
    assert as_dict["data"]["custom_rm_path"] == "tests.test_config:toy_reward"
    assert "reward_fn" not in as_dict["data"]
    assert as_dict["engine"]["urls"] == ["http://h:1"]
    # a memory run's default folder is a fresh runs/default-<UTC time> (issue 33: one run, one folder)
    assert re.fullmatch(r"runs/default-\d{8}-\d{6}(-\d+)?/metrics.jsonl", as_dict["output"]["metrics_file"])
    assert as_dict["rollout"]["over_sampling_batch_size"] == 8


def test_config_dict_loads_back_as_toml(tmp_path):
    # The run metadata can reproduce the run: write the dict as TOML, load it, same settings.
    config = load_config(["--rollout-mode", "async", "--rollout-batch-size", "3", "--no-use-tis"])
    lines = []
    for section, values in config_to_dict(config).items():
        lines.append(f"[{section}]")
        lines += [f"{k} = {json.dumps(v)}" for k, v in values.items() if v is not None]
    again = load_config(["--config", str(write(tmp_path / "again.toml", "\n".join(lines)))])
    assert config_to_dict(again) == config_to_dict(config)
    assert isinstance(again, Config)


def test_parser_lists_every_flag_and_boolean_negations():
    help_text = build_parser().format_help()
    for flag in (
        "--rollout-mode",
        "--over-sampling-batch-size",
        "--sglang-url",
        "--rollout-data-transport",
        "--no-use-tis",
        "--no-progress",
        "--save",
        "--custom-rm-path MODULE:FUNCTION",
        "--config",
    ):
        assert flag in help_text
    config = load_config(["--no-use-tis", "--no-progress", "--log-level", "debug"])
    assert (config.trainer.use_tis, config.output.progress, config.output.log_level) == (False, False, "debug")


# --- storage declaration and profile -------------------------------------------------------


def test_storage_declaration_and_profile_flags(tmp_path):
    declaration = write(
        tmp_path / "deployment.json",
        json.dumps(
            {"mount_path": "/shared/juicefs", "filesystem": "fuse.juicefs", "durability": {"synced_commits": True}}
        ),
    )
    config = load_config(
        [
            "--rollout-data-transport",
            "lmdb",
            "--rollout-storage-declaration",
            str(declaration),
            "--rollout-storage-profile",
            "juicefs",
        ]
    )
    s = config.storage
    assert (s.declaration, s.profile) == (declaration, "juicefs")
    assert config.warnings == ()
    defaults = load_config([]).storage
    assert (defaults.declaration, defaults.profile) == (None, None)
    toml = write(
        tmp_path / "c.toml", f'[storage]\ntransport = "lmdb"\nprofile = "nfs"\ndeclaration = "{declaration}"\n'
    )
    assert load_config(["--config", str(toml)]).storage.profile == "nfs"


def test_storage_flag_problems_are_listed_together(tmp_path):
    bad = write(tmp_path / "bad.json", json.dumps({"mount_path": "relative", "filesystem": "nfs4"}))
    problems = problems_of(["--rollout-storage-declaration", str(bad), "--rollout-storage-profile", "gluster"])
    assert (
        f"--rollout-storage-declaration={str(bad)!r}: mount_path must be an absolute path, got 'relative'" in problems
    )
    assert any(p.startswith(f"--rollout-storage-declaration={str(bad)!r}: durability must be") for p in problems)
    assert (
        "--rollout-storage-profile='gluster': must be one of local, local-unsynced, nfs, juicefs, cephfs, "
        "lustre" in problems
    )
    assert problems_of(["--rollout-storage-declaration", str(tmp_path / "none.json")]) == [
        f"--rollout-storage-declaration={str(tmp_path / 'none.json')!r}: file not found"
    ]


def test_storage_declaration_with_the_memory_transport_warns():
    warnings = load_config(["--rollout-storage-profile", "local"]).warnings
    assert warnings == (
        "--rollout-storage-profile='local' with --rollout-data-transport=memory: there is no "
        "store on disk to declare; it is ignored",
    )


def test_gc_keep_steps_flag():
    assert load_config([]).storage.gc_keep_steps is None  # keep everything: replay sees the whole run
    assert load_config(["--rollout-gc-keep-steps", "2"]).storage.gc_keep_steps == 2
    assert load_config(["--rollout-gc-keep-steps", "0"]).storage.gc_keep_steps == 0
    assert any("--rollout-gc-keep-steps" in p for p in problems_of(["--rollout-gc-keep-steps", "-1"]))


def test_slime_flags_this_pipeline_does_not_run_are_warned_about_not_ignored():
    config = load_config(
        [
            "--eval-interval",
            "5",
            "--buffer-filter-path",
            "stages.filter:reward_std_nonzero",
            "--rollout-all-samples-process-path",
            "stages.filter:reward_std_nonzero",
        ]
    )
    text = "\n".join(config.warnings)
    assert "--eval-interval" not in text  # inline evaluation is built (issue 31)
    assert "--buffer-filter-path=" in text and "--rollout-all-samples-process-path=" in text


def test_trainer_device_is_checked_against_what_torch_sees():
    assert load_config([]).trainer.device == "cpu"
    problems = problems_of(["--trainer-device", "tpu"])
    assert len(problems) == 1 and problems[0].startswith("--trainer-device='tpu': not a torch device")
    import torch

    if not torch.cuda.is_available():
        assert problems_of(["--trainer-device", "cuda"]) == [
            "--trainer-device='cuda': torch sees no GPU here (a CPU build of torch, or no driver)"
        ]


# --- modes as enums, the load step, one home for the trainer's settings -------------------------


def test_modes_load_as_enums_and_serialize_as_their_values():
    config = load_config(["--rollout-mode", "async", "--pause-mode", "retract", "--rollout-data-transport", "lmdb"])
    assert config.rollout.mode is RolloutMode.ASYNC
    assert config.rollout.pause_mode is PauseMode.RETRACT
    assert config.storage.transport is StoreTransport.LMDB
    assert load_config([]).rollout.pause_mode is PauseMode.ABORT  # the default is the enum too
    as_dict = config_to_dict(config)
    assert (as_dict["rollout"]["mode"], as_dict["rollout"]["pause_mode"]) == ("async", "retract")
    assert type(as_dict["storage"]["transport"]) is str  # plain JSON, not an enum that happens to be a str
    assert problems_of(["--pause-mode", "drain"]) == ["--pause-mode='drain': must be one of abort, retract, in_place"]


def test_rollout_plan_takes_the_enums_and_converts_their_values():
    plan = RolloutPlan(mode="async", batch_size=2, n_samples=2, num_steps=1, pause_mode="in_place")  # type: ignore[arg-type]
    assert plan.mode is RolloutMode.ASYNC and plan.pause_mode is PauseMode.IN_PLACE
    assert RolloutPlan(mode=RolloutMode.SYNC, batch_size=2, n_samples=2, num_steps=1).pause_mode is PauseMode.ABORT
    with pytest.raises(ValueError, match="RolloutPlan mode='asink': must be one of sync, async"):
        RolloutPlan(mode="asink", batch_size=2, n_samples=2, num_steps=1)  # type: ignore[arg-type]


def test_checking_rules_reads_no_file_the_load_step_does(tmp_path):
    """The rules are pure: a prompt file that does not exist is found only by the load step."""
    missing = tmp_path / "missing.jsonl"
    draft = Draft()
    read_argv(
        draft,
        [
            "--prompt-data",
            str(missing),
            "--custom-rm-path",
            "tests.test_config:toy_reward",
            "--sglang-url",
            "http://h:1/",
        ],
    )
    check_bounds(draft)
    check_rules(draft)
    assert draft.problems == [] and draft.resolved == {}
    assert draft.values["engine"]["urls"] == ("http://h:1/",)  # rewritten only by the load step
    load_step(draft)
    assert draft.problems == [f"--prompt-data={str(missing)!r}: file not found"]
    assert draft.values["engine"]["urls"] == ("http://h:1",)
    assert draft.resolved == {("data", "reward_fn"): toy_reward}


def test_loading_the_default_config_imports_neither_torch_nor_plugins():
    # torch takes seconds to import; only a non-cpu --trainer-device needs it at load.
    code = (
        "import sys; from pipeline.config import load_config; load_config([]); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)


def test_sections_read_back_from_run_metadata_with_defaults_for_what_is_missing():
    config = load_config(["--rollout-mode", "async", "--lr", "0.01", "--no-use-tis", "--save", "/tmp/x"])
    recorded = config_to_dict(config)
    for name, cls in (
        ("rollout", RolloutConfig),
        ("engine", EngineConfig),
        ("storage", StorageConfig),
        ("trainer", TrainerConfig),
        ("output", OutputConfig),
    ):
        assert section_from_dict(cls, recorded[name]) == getattr(config, name)
    # A run recorded before a setting existed reads with the schema's default; unknown keys are ignored.
    old = section_from_dict(TrainerConfig, {"lr": 0.01, "a_setting_since_removed": 1})
    assert (old.lr, old.eps_clip, old.use_tis) == (0.01, 0.2, True)


def test_fault_tolerance_flags_use_slimes_names_and_defaults():
    plain = load_config([]).engine
    assert not plain.use_fault_tolerance
    assert (plain.health_check_interval, plain.health_check_timeout, plain.health_check_first_wait) == (30.0, 30.0, 0.0)
    e = load_config(
        [
            "--use-fault-tolerance",
            "--rollout-health-check-interval",
            "2",
            "--rollout-health-check-timeout",
            "5",
            "--rollout-health-check-first-wait",
            "1",
            "--min-live-engines",
            "2",
            "--rollout-num-engines",
            "3",
        ]
    ).engine
    assert (e.use_fault_tolerance, e.health_check_interval, e.health_check_timeout) == (True, 2.0, 5.0)
    assert (e.health_check_first_wait, e.min_live_engines, e.max_engine_restarts) == (1.0, 2, 3)


def test_min_live_engines_above_the_engine_count_is_refused_with_both_numbers():
    with pytest.raises(ConfigError, match=r"--min-live-engines=3: more than the 2 engines"):
        load_config(["--use-fault-tolerance", "--min-live-engines", "3", "--rollout-num-engines", "2"])
    with pytest.raises(ConfigError, match="--rollout-health-check-timeout"):
        load_config(["--use-fault-tolerance", "--rollout-health-check-timeout", "0"])


# --- producers on Ray (issue 13) -----------------------------------------------------------------


def test_ray_producers_need_a_group_slot_each():
    # C*E = 4 x 2 = 8 sample slots; 3 producers x 4 samples = 12: refused with the numbers and the rule.
    too_many = "--rollout-producers ray --rollout-num-producers 3 --n-samples-per-prompt 4"
    urls = " --sglang-server-concurrency 4 --sglang-url http://127.0.0.1:1 --sglang-url http://127.0.0.1:2"
    (problem,) = problems_of((too_many + urls).split())
    assert problem.startswith("--rollout-num-producers=3: ")
    assert "3 producers x 4 samples per group = 12 sample slots" in problem
    assert "4 x 2 = 8" in problem and "C*E >= W*G" in problem
    enough = "--rollout-producers ray --rollout-num-producers 2 --n-samples-per-prompt 4"
    config = load_config((enough + " --sglang-server-concurrency 4 --rollout-num-engines 2").split())
    assert config.rollout.producers == "ray" and config.rollout.num_producers == 2
    assert config.rollout.producer_lease_seconds == 5.0 and config.rollout.producer_deadline_seconds == 10.0


def test_unknown_producers_and_ray_flags_without_ray_are_refused():
    (problem,) = problems_of(["--rollout-producers", "dask"])
    assert problem.startswith("--rollout-producers=") and "must be one of local, ray" in problem
    problems = problems_of(["--ray-address", "auto", "--rollout-num-producers", "2", "--producer-lease-seconds", "0"])
    assert any(p.startswith("--ray-address=") and "only used with --rollout-producers=ray" in p for p in problems)
    assert any(p.startswith("--rollout-num-producers=2") for p in problems)
    assert any(p.startswith("--producer-lease-seconds=0") and "must be > 0" in p for p in problems)
