"""The mode comparison on the built-in engine (`python -m benchmarks.modes --engine builtin`).

    python -m benchmarks.modes --engine builtin --device cuda --model-size 0.6b [--steps 8] [--timeline-dir DIR]
    python -m benchmarks.modes --engine builtin --quick          # the tiny model on the CPU, 3 steps

Each mode is a real run of the launcher (`pipeline.run.cli.main`): a built-in engine process with a KV
cache on `--device`, the real GRPO trainer on the same device taking real training steps (not a
fixed-time trainer), and a real publish after each step: over torch.distributed (NCCL) when the
engine can have a GPU of its own (the second, when torch sees two: NCCL refuses two ranks on one
GPU), else from disk. The task is
the quick start's; with `--model-size 0.6b` the model is a random-init Qwen3 of the 0.6B shape,
its window cut to 2048 tokens so that the engine's KV cache (slots x window) fits beside the
trainer. `--dtype bfloat16` trains under bf16 autocast (fp32 masters, what the engine receives) and,
with `--length-tail`, serves in bf16: what a user runs on a GPU, and a trainer that no longer takes
most of the step (in fp32, 4 steps of 16 groups x 8 trained 4-5 s each against about 2 s of
generation, so async could not keep the slots busy). Times are wall seconds.

`--length-tail lognormal:-1.9,0.8` gives the real model the simulated engine's long tail: the
engine (started here, the pipeline reaching it by `--sglang-url`) ends each sample at a length
drawn from the simulated engine's distribution, a function of the sample (`engines/
length_tail.py`), with `--max-len` the response limit; a fourth mode, async with an overlapped
publish, runs then too.

With the tail, a simulated twin of the same runs follows (`simulated_twin`): the real run's
prompts and seed on the simulated engine, whose time model is fitted to the real engine's own
step timings, each mode's training seconds and the GPU-sharing slowdown; ratios and slot-busy
fractions are printed side by side. With `--timeline-dir` its inputs are saved
(`twin-inputs.json`), and `python -m benchmarks.modes --twin-from FILE` runs the twin alone.

Columns: groups/s and tokens/s end to end; ratio over sync; slot busy (share of engine slot time
holding a request, from the run's events); train and publish seconds per step (medians).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.events import read_events
from pipeline.run.cli import main as launch_main
from pipeline.tasks.tiny_model import make_model_folder
from pipeline.tasks.toy import toy_dataset
from pipeline.timeline import render_timeline, slot_busy_fraction, steady_window, work_span

MODES: dict[str, list[str]] = {
    "sync": ["--rollout-mode", "sync"],
    "sync+partial": ["--rollout-mode", "sync", "--partial-rollout", "--over-sampling-batch-size", "{double}"],
    "async": ["--rollout-mode", "async"],
}
ROLLOUT_SEED = 42  # the launcher's default
NUM_PROMPTS = 512  # the toy dataset's size, the launcher's default
TAIL_MODES = {**MODES, "async+overlap": ["--rollout-mode", "async", "--overlap-weight-transfer"]}


def _model(args: argparse.Namespace, root: Path) -> Path:
    if args.model_size == "0.6b":
        from benchmarks.engine import qwen3_06b_folder

        folder = qwen3_06b_folder(root / "qwen3-0.6b")
        config = json.loads((folder / "config.json").read_text())
        config["max_position_embeddings"] = 2048  # bounds the KV cache: 64 slots x 2048 x 28 layers
        (folder / "config.json").write_text(json.dumps(config))
        return folder
    return make_model_folder(root / "tiny", seed=0)


def _transport(device: str) -> str:
    # Disk only where the engine shares the trainer's one GPU; gloo on the CPU, NCCL across two GPUs.
    return "disk" if device.startswith("cuda") and _engine_device(device) == device else "distributed"


def _engine_device(device: str) -> str:
    """Where the engine runs: the second GPU when there is one (the trainer keeps `device`), so the
    engine has a GPU of its own, as in a disaggregated run and in the simulated twin, and the
    publish goes over NCCL (which refuses two ranks on one GPU); else beside the trainer."""
    import torch

    if device.startswith("cuda") and torch.cuda.device_count() > 1:
        trainer = torch.device(device).index or 0
        return f"cuda:{1 if trainer == 0 else 0}"
    return device


def run_mode(name: str, args: argparse.Namespace, model: Path, root: Path) -> dict[str, Any]:
    out = root / name.replace("+", "-")
    flags = [f.format(double=2 * args.batch) for f in TAIL_MODES[name]]
    engine = None
    if args.length_tail:
        flags += ["--rollout-max-response-len", str(args.max_len)]
        engine = _start_tail_engine(args, model, out)
        flags += ["--sglang-url", engine[1]]
    transport = _transport(args.device)
    t0 = time.perf_counter()
    forward: dict[str, Any] = {}
    try:
        code = _launch(args, model, out, transport, flags)
        wall = time.perf_counter() - t0
        if engine is not None:
            with urllib.request.urlopen(engine[1] + "/server_info", timeout=10) as resp:
                forward = json.loads(resp.read()).get("forward_statistics", {})
    finally:
        if engine is not None:
            engine[0].terminate()
            engine[0].wait(30)
    if code != 0:
        raise SystemExit(f"{name}: the run failed (exit {code}); see {out}")
    return {**_summary(name, args, out, wall, transport), "forward": forward}


SIM_NAMES = {"sync": "sync", "sync+partial": "sync+partial", "async": "async", "async+overlap": "async, overlap"}


SHARED = 0.02  # a mode whose engine holds this share of its busy slot-time inside training steps


def twin_fit(args: argparse.Namespace, results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The simulated twin's time model, fitted to the real runs: decode step = a + b x rows + c x
    context and prefill = base + per token (least squares, the prefilling steps' decode part taken
    out) over the modes whose engine never decodes while the trainer trains; publish seconds the
    real median; and how much slower the engine's forwards run while its trainer trains."""
    fs = [r["forward"] for r in results.values() if r.get("forward")]
    # Sync modes' engines idle while their trainer trains, so their steps are the engine's own
    # cost. Fitted over every mode, the async modes' slower steps (one GPU shared with the
    # trainer) leaked into the model of every mode and out of the measure of the sharing.
    alone = [r["forward"] for r in results.values() if r.get("forward") and r["share in training"] < SHARED]
    base, per_row, per_context, n = _decode_fit(alone or fs)
    prefill_base, prefill = _prefill_fit(alone or fs, base, per_row, per_context)
    slowdowns = [
        _slowdown_from_decode(r["forward"], (base, per_row, per_context), r["share in training"])
        for r in results.values()
        if r.get("forward") and r["share in training"] >= SHARED
    ]
    shared = _engine_device(args.device) == args.device  # one GPU: 1 when the engine has its own
    slowdown = max(1.0, statistics.median(slowdowns)) if slowdowns and shared else 1.0
    return {
        "decode_base": base, "decode_per_row": per_row, "decode_per_context": per_context, "decode_steps": n,
        "prefill_base": prefill_base, "prefill_per_token": prefill,
        "publish": results["sync"]["publish s"], "slowdown": slowdown,
    }  # fmt: skip


def _share_in_training(events: list[dict[str, Any]]) -> float:
    """The share of the engine's busy slot-seconds that fell inside training steps: 0 in sync modes
    (the engine idles while the trainer trains), large in async ones."""
    trains = [(e["start"], e["end"]) for e in events if e["kind"] == "train"]
    busy = inside = 0.0
    for e in events:
        if e["kind"] == "request":
            busy += e["end"] - e["start"]
            inside += sum(max(0.0, min(e["end"], b) - max(e["start"], a)) for a, b in trains)
    return inside / busy if busy else 0.0


def _slowdown_from_decode(forward: dict[str, Any], fit: tuple[float, float, float], share: float) -> float:
    """How much slower this engine's decode steps ran while its trainer trained: the steps' real
    seconds over what the engine alone would take (`fit`, from the sync modes) is k = (1 - f) + f x s
    for a share f of the steps inside training, so s = 1 + (k - 1) / f. Reading the requests' token
    rates inside and outside training steps instead came out at 1.0 on the twin itself, whose
    engine was set to 1.1: the rows and contexts around a training step are not those of the rest."""
    a, b, c = fit
    predicted = a * forward["decode_timed_steps"] + b * forward["decode_rows"] + c * forward.get("decode_context", 0)
    if predicted <= 0:  # an engine from before the decode sums
        return 1.0
    return 1.0 + (forward["decode_seconds"] / predicted - 1.0) / share


def simulated_twin(
    args: argparse.Namespace,
    results: dict[str, dict[str, Any]],
    fit: dict[str, float],
    *,
    time_scale: float = 0.25,
    timeline_dir: str | None = None,
) -> dict[str, dict[str, Any]]:
    """The same modes on the simulated engine with `fit`'s time model and each mode's own training
    seconds, step by step; same steps, groups, limit and slots, and the same samples (the real
    run's prompts and seed, so each sample ends at the length it ended at there). Returns the
    simulated modes' results by the real modes' names. With `timeline_dir`, each mode's page and
    events go there as `timeline-twin-*.html` and `events-twin-*.jsonl`, beside the real runs'."""
    import anyio

    from benchmarks import modes_sim as sim

    # Each mode's own training times, step by step (`perf/train_time`): the first step holds the
    # trainer's warm-up and the last the final checkpoint, and a step beside a decoding engine on
    # the same GPU is slower than one with the GPU alone (async against sync). One median for every
    # mode and step, as before, gave sync's steady steps a training time 1.4x their own.
    trains = {name: r["train steps"] for name, r in results.items()}
    print(
        f"simulated twin: decode step {fit['decode_base'] * 1e3:.2f} ms + {fit['decode_per_row'] * 1e6:.1f} us x rows "
        f"+ {fit['decode_per_context'] * 1e9:.1f} ns x context tokens (from {fit['decode_steps']} steps), "
        f"prefill {fit['prefill_base'] * 1e3:.2f} ms + {fit['prefill_per_token'] * 1e6:.1f} us/token, "
        "training s a step "
        + "; ".join(f"{name} " + " ".join(f"{t:.1f}" for t in ts) for name, ts in trains.items())
        + f", publish {fit['publish']:.2f} s, forwards {fit['slowdown']:.2f}x slower while training, "
        f"time scale {time_scale}"
    )
    twin = argparse.Namespace(
        rollout_seed=args.rollout_seed,
        batch=args.batch, group=args.group, steps=args.steps, slots=64, max_len=args.max_len, time_scale=time_scale,
        train_time=0.0, train_slowdown=fit["slowdown"], prompt_len=16, timeline_dir=timeline_dir,
        sim_flags=[
            "--step-base", str(fit["decode_base"]), "--step-per-request", str(fit["decode_per_row"]),
            "--step-per-context-token", str(fit["decode_per_context"]),
            "--prefill-base", str(fit["prefill_base"]), "--prefill-per-token", str(fit["prefill_per_token"]),
            "--weight-update-time", str(fit["publish"]),
            "--length-dist", args.length_tail,
        ],
    )  # fmt: skip
    plans = sim.plans(twin)
    # The real run's prompts and seed: each sample draws the length it drew there (the length tail
    # and the simulated engine key it alike), so both sides run the same samples, not merely the
    # same distribution. With 4 steps a round's longest sample, which sets its end, varied by
    # seconds between draws.
    prompts = toy_dataset(args.num_prompts, seed=args.rollout_seed)
    work = Path(tempfile.mkdtemp(prefix="twin-"))
    # Time scale 0.25: a real step of a few ms is then ~1 ms of wall time, which the simulated engine
    # keeps on 16 cores (at 0.1 it ran late on a loaded CPU and its async modes came out slower
    # than sync). Where it still runs late, rerun the twin slower from the saved inputs (`--twin-from`).
    out = {}
    for name in results:
        mode_args = argparse.Namespace(**{**vars(twin), "train_time": trains[name]})
        out[name] = anyio.run(
            sim.run_mode, f"twin-{name.replace('+', '-')}", plans[SIM_NAMES[name]], mode_args, 0, work, prompts
        )
    late = sum(r["late"] for r in out.values())
    if late:
        print(f"note: the simulated twin ran late on {late} forwards (its timing is then approximate)")
    return out


# What a rerun of the twin needs from the real runs (`--twin-from`): the workload, the fit, and
# each mode's measured figures. The raw forward statistics are fitted once, before saving.
TWIN_WORKLOAD = ("steps", "batch", "group", "max_len", "length_tail", "device", "rollout_seed", "num_prompts")
TWIN_RESULTS = ("span", "busy", "steady busy", "train steps", "share in training", "publish s")


def save_twin_inputs(
    path: Path, args: argparse.Namespace, results: dict[str, dict[str, Any]], fit: dict[str, float]
) -> None:
    inputs = {
        "workload": {k: getattr(args, k) for k in TWIN_WORKLOAD},
        "fit": fit,
        "modes": {name: {k: r[k] for k in TWIN_RESULTS} for name, r in results.items()},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(inputs, indent=1))


def rerun_twin(path: Path, *, time_scale: float, timeline_dir: str | None) -> None:
    """The simulated twin again from a real run's saved inputs, no GPU needed: at a slower time
    scale where the first one ran late, or with its events kept for a step-by-step comparison."""
    inputs = json.loads(path.read_text())
    missing = [k for k in ("workload", "fit", "modes") if k not in inputs]
    missing += [k for k in TWIN_WORKLOAD if k not in inputs.get("workload", {})]
    if missing or "sync" not in inputs["modes"]:
        raise SystemExit(
            f"--twin-from {path}: not a twin-inputs file (needs workload, fit and a sync mode; missing {missing})"
        )
    args = argparse.Namespace(**inputs["workload"])
    results = inputs["modes"]
    compare(results, simulated_twin(args, results, inputs["fit"], time_scale=time_scale, timeline_dir=timeline_dir))


def _line(n: float, x: float, y: float, xx: float, xy: float) -> tuple[float, float]:
    """Least squares y = a + b x from the sums (count, x, y, x^2, xy); (a, b), neither below 0."""
    spread = n * xx - x * x
    b = max(0.0, (n * xy - x * y) / spread) if spread > 0 else 0.0
    return max(0.0, (y - b * x) / max(n, 1)), b


def _decode_fit(fs: list[dict[str, Any]]) -> tuple[float, float, float, int]:
    """A decode-only step's seconds = a + b x rows + c x context (the rows' positions summed), over
    every such step the engine timed; (a, b, c, steps). Attention reads each row's whole context,
    which long responses make a real part of the step. Without the context sums (an engine from
    before them), or where the three-term fit gives a negative term, the fit is a + b x rows (c 0)."""
    n = sum(f["decode_timed_steps"] for f in fs)

    def total(key: str) -> float:
        return float(sum(f.get(key, 0) for f in fs))

    rows, seconds = total("decode_rows"), total("decode_seconds")
    if n and total("decode_context"):
        ctx = total("decode_context")
        gram = np.array(
            [
                [n, rows, ctx],
                [rows, total("decode_rows_squared"), total("decode_rows_context")],
                [ctx, total("decode_rows_context"), total("decode_context_squared")],
            ]
        )
        moments = np.array([seconds, total("decode_rows_seconds"), total("decode_context_seconds")])
        a, b, c = np.linalg.lstsq(gram, moments, rcond=None)[0]
        if min(a, b, c) >= 0:
            return float(a), float(b), float(c), n
    a, b = _line(n, rows, seconds, total("decode_rows_squared"), total("decode_rows_seconds"))
    return a, b, 0.0, n


def _prefill_fit(fs: list[dict[str, Any]], a: float, b: float, c: float = 0.0) -> tuple[float, float]:
    """A prefill's seconds = base + per token x t, on the simulated engine's terms (a forward of its
    own). The built-in engine decodes the held requests in the step that prefills (h rows with
    context c_h beside t prefill tokens): those seconds minus the decode fit's a + b x h + c x c_h
    are the prefill's. Dividing the whole step by its tokens, as this did before, charged a 10 ms
    decode to a 16-token prompt and made the twin's over-sampling 5x too costly. (base, per token)."""

    def total(key: str) -> float:
        return float(sum(f.get(key, 0) for f in fs))

    n, t = total("prefills"), total("prefill_tokens")
    r = (
        total("prefill_seconds")
        - a * total("prefill_steps_decoding")
        - b * total("prefill_step_held_rows")
        - c * total("prefill_step_held_context")
    )
    tr = (
        total("prefill_step_tokens_seconds")
        - a * total("prefill_step_tokens_decoding")
        - b * total("prefill_step_tokens_held")
        - c * total("prefill_step_tokens_held_context")
    )
    return _line(n, t, r, total("prefill_step_tokens_squared"), tr)


def _start_tail_engine(args: argparse.Namespace, model: Path, out: Path) -> tuple[subprocess.Popen[bytes], str]:
    """The built-in engine with the length tail, as the launcher would start it; (process, url)."""
    from launch.builtin_engine import free_port

    port = free_port()
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "tail-engine.log").open("wb")
    cmd = [sys.executable, "-m", "engines.builtin", "--model-path", str(model), "--port", str(port)]
    cmd += ["--device", _engine_device(args.device), "--dtype", args.dtype, "--max-running-requests", "64"]
    cmd += ["--length-tail", args.length_tail]
    cmd += ["--length-tail-limit", str(args.max_len)]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:  # its log lies in a temporary folder: say here what it said
            said = (out / "tail-engine.log").read_text(errors="replace").splitlines()[-40:]
            raise SystemExit(f"the tail engine exited ({proc.returncode}); its log ends:\n" + "\n".join(said))
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.5)
    proc.terminate()
    raise SystemExit("the tail engine did not answer within 300 s")


def _launch(args: argparse.Namespace, model: Path, out: Path, transport: str, flags: list[str]) -> int:
    return launch_main(
        [
            "--output-dir",
            str(out),
            "--no-progress",
            "--log-level",
            "warning",
            "--hf-checkpoint",
            str(model),
            "--rollout-device",
            _engine_device(args.device),
            "--trainer-device",
            args.device,
            "--trainer-dtype",
            args.dtype,
            "--update-weight-transport",
            transport,
            "--num-rollout",
            str(args.steps),
            "--rollout-batch-size",
            str(args.batch),
            "--n-samples-per-prompt",
            str(args.group),
            # Stated, not defaulted: the twin takes the same seed and prompts to draw the same lengths.
            "--rollout-seed",
            str(ROLLOUT_SEED),
            "--num-prompts",
            str(NUM_PROMPTS),
            # The default --lr (5e-3) is the tiny toy model's. On the 0.6B shape it proposes steps
            # of 7-400 nats a token, which --max-step-kl (0.2) halves 6 times and then undoes:
            # every step trained nothing and cost 14 extra forwards (measured on the H200).
            *(["--lr", "1e-5"] if args.model_size == "0.6b" else []),
            # Micro-batches of like length, as a GPU user sets them: less padding and, beside an
            # engine on the same GPU, a quarter less peak memory (benchmarks/trainer_step.py).
            *(["--max-tokens-per-gpu", "16384"] if args.model_size == "0.6b" else []),
            *flags,
        ]
    )


def _summary(name: str, args: argparse.Namespace, out: Path, wall: float, transport: str) -> dict[str, Any]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    events = list(read_events(out / "events.jsonl"))
    window = steady_window(events)
    if args.timeline_dir:
        page = Path(args.timeline_dir) / f"timeline-builtin-{name.replace('+', '-')}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(render_timeline(events, title=f"{name} on the built-in engine ({args.device})"))
        # The per-step metrics beside the page: the run's folder is temporary, and a train time
        # that surprises is read from these (time/*, train/step_kl_halvings, lengths).
        (page.parent / f"metrics-builtin-{name.replace('+', '-')}.jsonl").write_text(
            (out / "metrics.jsonl").read_text()
        )
        (page.parent / f"events-builtin-{name.replace('+', '-')}.jsonl").write_text((out / "events.jsonl").read_text())
    return {
        "groups/s": args.steps * args.batch / wall,
        "tokens/s": sum(r["batch/tokens"] for r in records) / wall,
        "busy": slot_busy_fraction(events),
        # Between the run's two ends (the trainer's warm-up in the first step, the final full
        # checkpoint in the last), where the engine waits by design: what a long run sees.
        "steady busy": slot_busy_fraction(events, start=window[0], end=window[1]) if window else float("nan"),
        # Seconds the trainer waited for its batch after its warm-up: 0 in every step means the
        # trainer set the pace, and the engine idled whenever the collector's bound was reached.
        "trainer waits s": sum(r.get("perf/train_wait_time", 0.0) for r in records[1:]),
        "span": work_span(events),
        "train s": statistics.median(r["perf/train_time"] for r in records) if "perf/train_time" in records[0] else 0.0,
        "train steps": [r.get("perf/train_time", 0.0) for r in records],
        "share in training": _share_in_training(events),
        "publish s": statistics.median(r["time/publish_gate_closed"] for r in records),
        "transport": transport,
    }


def main(args: argparse.Namespace) -> None:
    args.rollout_seed, args.num_prompts = ROLLOUT_SEED, NUM_PROMPTS
    if args.quick:
        args.model_size, args.steps, args.batch, args.group = "tiny", 3, 4, 4
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = _model(args, root)
        modes = TAIL_MODES if args.length_tail else MODES
        unknown = sorted(set(args.only) - set(modes))
        if unknown:
            raise SystemExit(f"--only {unknown[0]!r}: not a mode here; the modes are {', '.join(modes)}")
        results: dict[str, dict[str, Any]] = {}
        for name in modes:
            if args.only and name not in args.only:
                continue
            r = results[name] = run_mode(name, args, model, root)
            # Each mode's figures as soon as it ends: a run cut by a time limit still reports them.
            print(
                f"mode {name}: {r['groups/s']:.3f} groups/s, work span {r['span']:.2f} s, slot busy {r['busy']:.3f} "
                f"(steady steps {r['steady busy']:.3f}), train {r['train s']:.2f} s, publish {r['publish s']:.2f} s, "
                f"trainer waited {r['trainer waits s']:.1f} s after step 0",
                flush=True,
            )
    # The ratio is over sync; a run of other modes only (`--only`) shows their own figures.
    base = results["sync"]["groups/s"] if "sync" in results else float("nan")
    cols = ["groups/s", "tokens/s", "ratio", "busy", "train s", "publish s"]
    print(
        f"\nbuilt-in engine, {args.model_size} model on {_engine_device(args.device)} (trainer {args.device}); "
        f"{args.steps} steps of {args.batch} groups x "
        f"{args.group} samples; {args.dtype}; publish: {next(iter(results.values()))['transport']}"
        + (f"; length tail {args.length_tail}, max {args.max_len} tokens" if args.length_tail else "")
    )
    print(f"{'mode':16}" + "".join(f"{c:>11}" for c in cols))
    for name, r in results.items():
        r["ratio"] = r["groups/s"] / base
        print(f"{name:16}" + "".join(f"{r[c]:>11.3f}" for c in cols))
    if args.length_tail and "sync" in results:
        fit = twin_fit(args, results)
        if args.timeline_dir:
            save_twin_inputs(Path(args.timeline_dir) / "twin-inputs.json", args, results, fit)
        compare(results, simulated_twin(args, results, fit, timeline_dir=args.timeline_dir))
    elif "async+overlap" in results:
        print(overlap_verdict(results["async+overlap"]))


def compare(real: dict[str, dict[str, Any]], twin: dict[str, dict[str, Any]]) -> None:
    """Ratios and slot-busy fractions, real beside simulated, and whether each is within 10%. Here the
    ratio is over each run's work span (first request to last publish), in both: the real runs' wall
    time also holds the launcher's start-up (trainer build, first compile), which the twin has not."""
    for side in (real, twin):
        for r in side.values():
            r["ratio"] = side["sync"]["span"] / r["span"]
    print(f"\n{'mode':16}{'ratio':>9}{'sim ratio':>11}{'busy':>9}{'sim busy':>10}  within 10%")
    for name, r in real.items():
        t = twin[name]
        ok = abs(t["ratio"] - r["ratio"]) <= 0.1 * r["ratio"] and abs(t["slot busy"] - r["busy"]) <= 0.1 * r["busy"]
        cells = f"{r['ratio']:>9.3f}{t['ratio']:>11.3f}{r['busy']:>9.3f}{t['slot busy']:>10.3f}"
        print(f"{name:16}{cells}  {'yes' if ok else 'NO'}")
    if "async+overlap" in real:
        print(overlap_verdict(real["async+overlap"]))


def overlap_verdict(overlap: dict[str, Any]) -> str:
    whole, steady = overlap["busy"], overlap["steady busy"]
    verdict = "MET" if whole >= 0.95 else "MET in the steady steps" if steady >= 0.95 else "MISSED"
    return (
        f"target async busy with an overlapped publish: {whole:.3f} over the run, {steady:.3f} in the steady "
        f"steps (target >= 0.95): {verdict}"
    )
