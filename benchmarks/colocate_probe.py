"""The largest Qwen3 shape that trains and generates colocated on one GPU, and where its memory goes.

    python -m benchmarks.colocate_probe [--shapes 4b,8b] [--smaller 1.7b,0.6b] [--budget 270]
        [--slots 64] [--context 2048] [--mem-fraction 0.4]

For each shape (random init in bf16 from the Qwen3 config: nothing is downloaded), what `--colocate`
does, for real: a built-in engine subprocess on the GPU with `--enable-memory-saver`, one generate
round (16 samples, up to 256 tokens) over HTTP, the engine released, the torch trainer (fp32
masters, bf16 autocast, AdamW) built in this process and one GRPO step on that round's samples,
the publish by CUDA IPC (resume weights, buckets, resume KV cache and graphs), one more round.

It walks `--shapes` upward while they fit, then, if the first did not, `--smaller` downward. A
shape "fits" when all of that ran; one that runs out of memory says where. Memory, per shape:

- trainer (this process, `torch.cuda` counters): parameters, gradients and optimizer state (their
  tensors' bytes after the step), the step's peak (`max_memory_allocated`, activations included);
- engine (its `/server_info` and the device, measured from outside with `mem_get_info`): weights,
  KV pool, what a release gave back, what it kept (its CUDA context and the small buffers outside
  the releasable regions), and the device in use while both hold their memory (the second round).

Prints one JSON line per shape, each followed by the table so far and `largest: SHAPE`.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import torch

GIB = 2**30

# Qwen3's published configs (hidden, intermediate, layers, heads, kv heads, tied embeddings).
SHAPES: dict[str, tuple[int, int, int, int, int, bool]] = {
    "0.6b": (1024, 3072, 28, 16, 8, True),
    "1.7b": (2048, 6144, 28, 16, 8, True),
    "4b": (2560, 9728, 36, 32, 8, True),
    "8b": (4096, 12288, 36, 32, 8, False),
}
PROMPT_LEN, RESPONSE_LEN, GROUPS, PER_GROUP = 64, 256, 4, 4


def _used() -> int:
    free, total = torch.cuda.mem_get_info()
    return int(total - free)


def model_folder(shape: str, root: Path) -> Path:
    """A random-init Qwen3 of `shape`, built on the GPU in bf16 and saved with the tiny tokenizer."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    from pipeline.tasks.tiny_model import BOS_ID, EOS_ID, PAD_ID, build_tokenizer

    hidden, inter, layers, heads, kv, tied = SHAPES[shape]
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=128,
        max_position_embeddings=40960,
        tie_word_embeddings=tied,
        rope_theta=1_000_000,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=BOS_ID,
    )
    path = root / shape
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():  # small weights: a random model's logits then stay finite in bf16
        for p in model.parameters():
            p.mul_(0.5)
    model.save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


async def _round(fleet: Any, seed: int) -> list[Any]:
    """One generate round: GROUPS x PER_GROUP samples of random prompts, as the pipeline sends them."""
    import random

    from core.types import Group, PromptTask, Sample, Segment

    rng = random.Random(seed)
    params = {"max_new_tokens": RESPONSE_LEN, "temperature": 1.0}
    groups = []
    async with anyio.create_task_group() as tg:
        results: dict[tuple[int, int], Any] = {}
        tasks = [
            PromptTask(index=g, prompt_ids=tuple(rng.randrange(3, 20000) for _ in range(PROMPT_LEN)))
            for g in range(GROUPS)
        ]

        async def one(g: int, i: int) -> None:
            results[(g, i)] = await fleet.generate(
                tasks[g].prompt_ids, {**params, "sampling_seed": g * 100 + i}, rid=f"r{seed}-{g}-{i}"
            )

        for g in range(GROUPS):
            for i in range(PER_GROUP):
                tg.start_soon(one, g, i)
    for g, task in enumerate(tasks):
        samples = []
        for i in range(PER_GROUP):
            r = results[(g, i)]
            s = Sample(index=i, prompt_ids=task.prompt_ids).extended(
                Segment(r.token_ids, r.logprobs, r.finish_reason, 0), max_response_len=RESPONSE_LEN
            )
            samples.append(dataclasses.replace(s, reward=float(i % 2)))
        groups.append(Group.fresh(task, epoch=0, n_samples=PER_GROUP, version=0, seq=g).with_samples(samples))
    return groups


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


async def probe(shape: str, root: Path, args: argparse.Namespace) -> dict[str, Any]:
    from core.clock import VersionClock
    from core.types import Batch, PauseMode
    from launch.builtin_engine import start_engine
    from stages.publisher import publish_weights
    from stages.sglang_client import EngineFleet
    from stages.sglang_client.publish_tensor import ColocatedWeights
    from trainers import GRPOTrainer

    row: dict[str, Any] = {"shape": shape, "fits": False}
    started = time.perf_counter()
    base = _used()  # this process's context, before anything of the shape
    where = "building the model folder"
    made: list[Any] = []  # the trainer, once built (after the release, as the launcher's colocated run)

    def parameters() -> Any:
        return made[0].model.named_parameters()

    try:
        folder = await anyio.to_thread.run_sync(model_folder, shape, root)
        where = "starting the engine"
        extra = [
            "--device", "cuda", "--dtype", "bfloat16", "--enable-memory-saver",
            "--mem-fraction-static", str(args.mem_fraction), "--context-length", str(args.context),
        ]  # fmt: skip
        engine = await start_engine(folder, max_running_requests=args.slots, startup_timeout=600, extra_args=extra)
        async with engine, EngineFleet([engine.url]) as fleet, aiohttp.ClientSession() as http:
            info = await (await http.get(engine.url + "/server_info")).json()
            row["engine_kv_gib"] = info["kv_cache_bytes"] / GIB
            where = "the first generate round"
            groups = await _round(fleet, seed=0)
            engine_resident = _used() - base
            row["engine_resident_gib"] = engine_resident / GIB

            colocated = ColocatedWeights(parameters, fleet, device="cuda", send_dtype=torch.bfloat16)
            await colocated.release()
            row["engine_released_gib"] = (engine_resident - (_used() - base)) / GIB
            row["engine_kept_gib"] = (_used() - base) / GIB
            where = "building the trainer"
            trainer = await anyio.to_thread.run_sync(
                lambda: GRPOTrainer(
                    folder, device="cuda", dtype="bfloat16", lr=1e-6, micro_batch_size=4, num_threads=None
                )
            )
            made.append(trainer)  # the publish reads its parameters
            model = trainer.model
            row["params_b"] = sum(p.numel() for p in model.parameters()) / 1e9
            row["engine_weights_gib"] = row["params_b"] * 1e9 * 2 / GIB  # bf16, tied counted once
            row["trainer_params_gib"] = _tensor_bytes(model.parameters()) / GIB
            where = "the training step"
            torch.cuda.reset_peak_memory_stats()
            before_step = torch.cuda.memory_allocated()
            await anyio.to_thread.run_sync(lambda: trainer.train_step(Batch(0, tuple(groups))))
            row["trainer_grads_gib"] = row["trainer_params_gib"]  # fp32, one per parameter, at the peak
            row["trainer_optimizer_gib"] = (
                _tensor_bytes(t for st in trainer.optimizer.state.values() for t in st.values()) / GIB
            )
            peak = torch.cuda.max_memory_allocated()
            row["trainer_peak_gib"] = peak / GIB
            grads_and_state = (row["trainer_grads_gib"] + row["trainer_optimizer_gib"]) * GIB
            row["trainer_activations_gib"] = (peak - before_step - grads_and_state) / GIB
            row["device_peak_training_gib"] = row["engine_kept_gib"] + torch.cuda.max_memory_reserved() / GIB
            where = "the publish (resume, CUDA IPC, resume)"
            report = await publish_weights(
                VersionClock(), fleet, folder, pause_mode=PauseMode.ABORT, transfer=colocated
            )
            row["publish_gate_s"] = report.gate_closed_seconds
            row["publish_resume_s"] = colocated.timings["resume_weights"] + colocated.timings["resume_rest"]
            where = "the second generate round (trainer and engine both resident)"
            await _round(fleet, seed=1)
            row["device_both_resident_gib"] = (_used() - base) / GIB
            row["fits"] = True
    except Exception as exc:  # torch.OutOfMemoryError here; an engine that ran out says so over HTTP
        row["failed_at"] = where
        row["error"] = _leaf_errors(exc)
    finally:
        made.clear()
        trainer = model = None
        gc.collect()
        torch.cuda.empty_cache()
        shutil.rmtree(root / shape, ignore_errors=True)
    row["seconds"] = time.perf_counter() - started
    return row


def _leaf_errors(exc: BaseException) -> str:
    """What failed, with a task group's wrapper taken off: its own message says only how many."""
    if isinstance(exc, BaseExceptionGroup):
        return "; ".join(_leaf_errors(e) for e in exc.exceptions)
    return f"{type(exc).__name__}: {str(exc)[:300]}"


async def main(args: argparse.Namespace) -> None:
    assert torch.cuda.is_available(), "the probe needs a GPU"
    deadline = time.perf_counter() + args.budget
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)

        async def run(shape: str) -> bool:
            left = deadline - time.perf_counter()
            if left < args.min_left:
                print(f"{shape}: skipped, {left:.0f} s of the budget left", flush=True)
                return False
            row = await probe(shape, root, args)
            rows.append(row)
            print(json.dumps(row), flush=True)
            _table(rows)  # after every shape: a probe cut off by its time limit still leaves its table
            return bool(row["fits"])

        ups = [s for s in args.shapes.split(",") if s]
        first_fit = False
        for shape in ups:
            fit = await run(shape)
            first_fit = first_fit or fit
            if not fit:
                break
        if not first_fit:
            for shape in [s for s in args.smaller.split(",") if s]:
                if await run(shape):
                    break


def _table(rows: list[dict[str, Any]]) -> None:
    cols = [
        ("params_b", "params B"),
        ("trainer_params_gib", "tr params"),
        ("trainer_grads_gib", "tr grads"),
        ("trainer_optimizer_gib", "tr optim"),
        ("trainer_activations_gib", "tr activ"),
        ("trainer_peak_gib", "tr peak"),
        ("device_peak_training_gib", "dev train"),
        ("engine_weights_gib", "eng wts"),
        ("engine_kv_gib", "eng KV"),
        ("engine_released_gib", "released"),
        ("engine_kept_gib", "kept"),
        ("device_both_resident_gib", "both res"),
        ("publish_gate_s", "publish s"),
    ]
    print("\ncolocated on one GPU (GiB unless said; tr = trainer, fp32 masters + AdamW; eng = engine, bf16)")
    print(f"{'shape':6}{'fits':>6}" + "".join(f"{h:>11}" for _, h in cols))
    for r in rows:
        cells = "".join(f"{r[k]:>11.2f}" if isinstance(r.get(k), float) else f"{'-':>11}" for k, _ in cols)
        print(f"{r['shape']:6}{'yes' if r['fits'] else 'no':>6}{cells}")
        if not r["fits"]:
            print(f"       {r['shape']} failed at {r.get('failed_at')}: {r.get('error')}")
    fits = [r["shape"] for r in rows if r["fits"]]
    largest = max(fits, key=lambda s: list(SHAPES).index(s)) if fits else "none"
    print(f"largest: {largest}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="4b,8b", help="tried upward while they fit")
    parser.add_argument("--smaller", default="1.7b,0.6b", help="tried downward if the first shape did not fit")
    parser.add_argument("--budget", type=float, default=260.0, help="seconds for the whole probe")
    parser.add_argument("--min-left", type=float, default=140.0, help="no new shape with less than this left")
    parser.add_argument("--slots", type=int, default=64, help="the engine's --max-running-requests")
    parser.add_argument("--context", type=int, default=2048, help="the engine's --context-length")
    parser.add_argument("--mem-fraction", type=float, default=0.4, help="the engine's --mem-fraction-static")
    anyio.run(main, parser.parse_args())
