"""`pipeline.run.end.report_failure`: the one line a run's end prints, for errors built as the
task groups deliver them (the end-to-end cases, on real processes, are in test_run_end.py)."""

from __future__ import annotations

import errno
from pathlib import Path

from core.errors import EngineError, EngineUnavailableError, StoreError
from pipeline.run.end import RunPaths, report_failure


def _paths(tmp_path: Path, *, lmdb: bool = True) -> RunPaths:
    return RunPaths(tmp_path, tmp_path / "metrics.jsonl", tmp_path / "rollout_data" if lmdb else None)


def _raised(exc: BaseException) -> BaseException:
    try:
        raise exc
    except BaseException as caught:  # with its traceback, as the run delivers it
        return caught


def test_a_refused_connection_is_the_engines_error_not_a_disk_error(tmp_path, capsys):
    refused = ConnectionRefusedError(errno.ECONNREFUSED, "Connect call failed")
    error = EngineUnavailableError("http://127.0.0.1:30000", "ClientConnectorError: cannot connect")
    error.__cause__ = refused
    group = ExceptionGroup("unhandled errors in a TaskGroup", [ExceptionGroup("inner", [_raised(error)])])
    assert report_failure(group, _paths(tmp_path)) == 1
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"error: {error}",
        "rollout state is in the store; fix the cause and run the same command again to resume",
    ]


def test_a_store_error_from_a_full_disk_gets_the_fix(tmp_path, capsys):
    error = StoreError(f"rollout store {tmp_path}: mdb_txn_commit: No space left on device")
    assert report_failure(ExceptionGroup("g", [_raised(error)]), _paths(tmp_path)) == 1
    line = capsys.readouterr().err.splitlines()[0]
    assert line.startswith("error: writing the rollout store") and "No space left on device" in line
    assert "free space on that filesystem" in line


def test_a_bug_keeps_its_own_traceback_once_then_one_line(tmp_path, capsys):
    bug = _raised(ValueError("an unexpected value 7"))
    group = ExceptionGroup("unhandled errors in a TaskGroup", [ExceptionGroup("inner", [bug, _raised(bug)])])
    assert report_failure(group, _paths(tmp_path, lmdb=False)) == 1
    err = capsys.readouterr().err
    assert "ExceptionGroup" not in err and "inner" not in err  # the leaf's traceback, not the groups'
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert lines == [
        "error: ValueError: an unexpected value 7 (an unexpected error: please report it with the traceback above)"
    ]
    assert err.rstrip().endswith("running the same command again starts the run over")


def test_one_engine_fault_is_one_line_however_many_requests_it_failed(tmp_path, capsys):
    """Issue 46.5: an engine that died under a dozen requests ended the run with a dozen `error:`
    lines that differed only in the request each named. One fault, one line."""
    url = "http://127.0.0.1:30000"
    failed = [
        _raised(EngineError(f"{url}/generate", f"request g{i}-s0-0: no engine behind the router", status=503))
        for i in range(13)
    ]
    lost = _raised(EngineUnavailableError(url, "evicted (heartbeat: connection refused)"))
    other = _raised(EngineError("http://127.0.0.1:30001/generate", "request g0-s1-0: internal error", status=503))
    group = ExceptionGroup("unhandled errors in a TaskGroup", [ExceptionGroup("inner", [*failed, lost, other])])
    assert report_failure(group, _paths(tmp_path)) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error: ")]
    assert lines == [f"error: {failed[0]}", f"error: {lost}", f"error: {other}"]
