from pipeline.events import EventLog, read_events
from pipeline.timeline import _on_one_clock, main, render_timeline, slot_busy_fraction


def test_event_log_round_trips_and_skips_a_torn_last_line(tmp_path):
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    with log.span("train", step=0):
        pass
    log.record("request", slot=0, group="g", sample=0, start=0.0, end=1.0, prefix=0, tokens=3, finish="stop", version=0)
    log.close()
    with path.open("ab") as f:
        f.write(b'{"kind": "requ')  # a crash mid-write
    events = list(read_events(path))
    assert [e["kind"] for e in events] == ["run", "train", "request"]
    assert events[1]["end"] >= events[1]["start"]


def test_busy_fraction_counts_slot_time_in_flight():
    req = dict(kind="request", group="g", sample=0, prefix=0, tokens=1, finish="stop", version=0)
    events = [dict(req, slot=0, start=0.0, end=4.0), dict(req, slot=1, start=0.0, end=1.0)]
    assert slot_busy_fraction(events) == 5 / 8


def test_timeline_draws_every_request_and_marks_resumed_ones(tmp_path):
    req = dict(kind="request", group="e0-p1", sample=0, tokens=5, version=1)
    events = [
        dict(req, slot=0, start=0.0, end=1.0, prefix=0, finish="abort"),
        dict(req, slot=1, start=1.5, end=2.0, prefix=7, finish="stop"),
        dict(kind="train", step=0, start=1.0, end=1.4),
        dict(kind="publish", version=1, start=1.4, end=1.5),
    ]
    page = render_timeline(events)
    assert page.count("<rect") == 2 + 1 + 2  # two requests, the resumed edge, train and publish
    assert "after 7" in page and "#d04a3a" in page
    path = tmp_path / "events.jsonl"
    log = EventLog(path)
    for e in events:
        log.record(**e)
    log.close()
    assert main([str(path)]) == 0
    assert (tmp_path / "timeline.html").read_text().startswith("<!doctype html>")


def test_a_resumed_run_is_drawn_after_the_first():
    req = dict(kind="request", group="g", sample=0, prefix=0, tokens=1, finish="stop", version=0, slot=0)
    events = [
        {"kind": "run", "started_at": 100.0},
        dict(req, start=0.0, end=1.0),
        {"kind": "run", "started_at": 110.0},
        dict(req, start=0.0, end=1.0),
    ]
    page = render_timeline(events)
    assert "controller restarted" in page
    # the second run's request starts 10 s after the first's, not on top of it
    assert slot_busy_fraction(_on_one_clock(events)) == 2 / 11


def test_the_command_names_a_file_that_is_not_an_event_log(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"  # a near miss: the run's other JSONL file
    metrics.write_text('{"step": 0, "reward/mean": 0.5}\n')
    assert main([str(metrics)]) == 1
    assert "is not a readable event log" in capsys.readouterr().err
    assert not (tmp_path / "timeline.html").exists()


def test_the_command_takes_the_run_dir_too(tmp_path, capsys):
    log = EventLog(tmp_path / "events.jsonl")
    with log.span("train", step=0):
        pass
    log.close()
    assert main([str(tmp_path)]) == 0
    assert (tmp_path / "timeline.html").read_text().startswith("<!doctype html>")
    assert main([str(tmp_path / "nowhere")]) == 1
    assert "nowhere" in capsys.readouterr().err
