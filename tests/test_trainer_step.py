"""The trainer's step benchmark (benchmarks/trainer_step.py) on a CPU at a tiny shape: its
variants each take a timed step, and its profile names where the step's copies were called from."""

from __future__ import annotations

import re

import pytest

pytestmark = pytest.mark.usefixtures("restore_torch_threads")


def test_the_variants_are_timed_and_the_profile_names_its_call_sites(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.trainer_step import main

    argv = ["--device", "cpu", "--dtype", "float32", "--model-size", "tiny", "--steps", "1"]
    argv += ["--groups", "2", "--group", "2", "--prompt", "8", "--max-len", "16"]
    argv += ["--variants", "blocks,packed,with cache", "--profile", "--profile-variant", "packed"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for name in ("blocks", "packed", "with cache"):
        assert re.search(rf"^step {name} +\d+ ms", out, re.M), out
    sites = out.split("call sites:\n", 1)[1].splitlines()
    assert sites and all(re.match(r"  aten::\S+ +\d+ calls +[\d.]+ ms  ", line) for line in sites[:3])
    # The model's own frames name where its ops come from (a profile's table names only kernels).
    assert any("modeling_qwen3.py(" in line or "linear.py(" in line for line in sites), sites
