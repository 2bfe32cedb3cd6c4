"""The torch trainer's step on a long-tailed batch, its ways of shaping the forward side by side.

    python -m benchmarks.trainer_step [--device cuda] [--dtype bfloat16] [--model-size 0.6b|tiny] [--layers 28]
                                      [--groups 16 --group 8 --prompt 128 --max-len 256]
                                      [--length-tail lognormal:-1.9,0.8] [--budget 16384] [--steps 3]
                                      [--variants 'all rows,padded,packed,compiled,+ budget,no step-KL']
                                      [--profile [--profile-variant compiled]]

One batch as the modes benchmark trains it (`--groups` x `--group` samples, `--prompt` prompt
tokens, response lengths drawn from the simulated engine's long tail up to `--max-len`, two
optimizer steps per batch, the step-KL check on, lr 1e-5), trained by one trainer per variant,
the variants taking turns step by step so that drift of the machine hits each alike (each round
starting at the next variant, since the first of a round is slower):

    all rows      the LM head at every position of the padded batch, the response rows gathered
                  after it (the trainer before `trainers.response_rows`)
    padded        the LM head at the response rows only, the batch right-padded (the trainer
                  before `trainers.packed_attention`)
    packed        and the samples end to end without padding (the default): attention by torch's
                  variable-length flash kernel on a GPU in bf16, else in padded blocks
    blocks        packed, attention always in padded blocks of like length (the packed forward
                  before the variable-length kernel: q, k, v scattered into blocks and gathered back)
    compiled      packed, `--trainer-compile`: the decoder layers and the token scorer compiled, AdamW
                  fused on a GPU (its warm-up step compiles)
    compiled layers  packed, the decoder layers compiled and nothing else (`--trainer-compile` before
                  2026-12-06: the token scorer eager, AdamW's foreach kernels)
    with cache    packed, a KV cache built in each forward as transformers does unless told not to
                  (the trainer before 2026-12-05: every layer's K and V copied into it)
    compiled with cache  both: the cache's per-layer slots made each layer compile anew, and past
                  torch's recompile limit (8) the rest of the layers ran eagerly (the layer class's
                  graphs are one process's: `compiled`'s already count against that limit here)
    + budget      and micro-batches of like length within `--budget` padded positions
                  (`--max-tokens-per-gpu`)
    no step-KL    packed without the step-KL check (`--max-step-kl 0`): what the check costs

It prints each variant's median step time (`--variants` picks some), its ratio to the first, and
the peak device memory of a step; then the seconds of writing the publish folder (`save_model`,
where disk publishes spend them): fp32 and bf16 through `save_pretrained` (what a bf16 trainer
wrote before) against bf16 through one reused page-locked buffer (now). `--profile` adds the top
device kernels of one step of `--profile-variant` (`packed` unless named; torch.profiler), then
where in the code its copies, multiplies, scatters and concatenations were called from. The
first step of each variant is a warm-up and is not counted. Then the step against its arithmetic
(`step_flops`: real tokens, no padding, at `--peak-tflops`), and issue 48's target: within 2x of it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def _batch(args: argparse.Namespace, vocab: int) -> Any:
    from core.types import Batch, FinishReason, Group, PromptTask, Sample, Segment
    from engines.sim_model import LengthModel

    rng = random.Random(0)
    tail = LengthModel.parse(args.length_tail)
    groups = []
    for g in range(args.groups):
        prompt = tuple(rng.randrange(3, vocab) for _ in range(args.prompt))
        task = PromptTask(index=g, prompt_ids=prompt, label=None)
        samples = []
        for i in range(args.group):
            target = tail.target(g * args.group + i, prompt, args.max_len)
            n = args.max_len if target is None else target
            reason = FinishReason.LENGTH if target is None else FinishReason.STOP
            ids = tuple(rng.randrange(3, vocab) for _ in range(n))
            s = Sample(index=i, prompt_ids=prompt).extended(
                Segment(ids, (-2.0,) * n, reason, 0), max_response_len=args.max_len
            )
            samples.append(dataclasses.replace(s, reward=rng.random()))
        groups.append(Group.fresh(task, epoch=0, n_samples=args.group, version=0, seq=g).with_samples(samples))
    return Batch(0, tuple(groups))


@contextlib.contextmanager
def _kv_cache(net: Any) -> Iterator[None]:
    """The model's forward with transformers' own `use_cache` (True in train mode too): the
    trainer's forward before it said False (`trainers.response_rows.response_logits`)."""
    bound = net.forward

    def forward(*args: Any, use_cache: bool | None = None, **kwargs: Any) -> Any:
        return bound(*args, **kwargs)

    net.forward = forward
    try:
        yield
    finally:
        del net.forward


@contextlib.contextmanager
def _blocks() -> Iterator[None]:
    """Packed attention in padded blocks even where the variable-length kernel would run."""
    from trainers import packed_attention

    kept = packed_attention._varlen_kernel
    packed_attention._varlen_kernel = lambda: None
    try:
        yield
    finally:
        packed_attention._varlen_kernel = kept


@contextlib.contextmanager
def _all_rows() -> Iterator[None]:
    """The LM head at every position, then the response rows picked: the trainer before the hook."""
    from trainers import grpo

    def every_row(net: Any, ids: Any, attention: Any, positions: Any, layout: Any = None) -> Any:
        logits = net(input_ids=ids, attention_mask=attention, use_cache=False).logits
        return logits.reshape(-1, logits.shape[-1]).index_select(0, positions)

    kept = grpo.response_logits
    grpo.response_logits = every_row
    try:
        yield
    finally:
        grpo.response_logits = kept


def _call_sites(prof: Any, ops: tuple[str, ...], cuda: bool, top: int = 12) -> str:
    """Where in the Python code `ops` were called from, the costliest sites first: each site's
    calls and device (or CPU) time, and its innermost frames of this project, transformers and
    torch (a profile's table names kernels, not who launched them; a backward's ops sit under the
    `backward` call)."""
    sites: dict[tuple[str, str], list[float]] = {}
    for event in prof.events():
        if event.name not in ops:
            continue
        frames = []  # with_stack: each Python frame is an event of its own, the ops' ancestor
        caller = event.cpu_parent
        while caller is not None and len(frames) < 3:
            if ".py(" in caller.name and any(k in caller.name for k in ("trainers/", "transformers/", "torch/")):
                frames.append(caller.name.split(": ")[0])
            caller = caller.cpu_parent
        where = " < ".join(f.rsplit("/", 1)[-1] for f in frames) or "(no Python frame)"
        cost = (event.device_time_total if cuda else event.cpu_time_total) / 1e3
        entry = sites.setdefault((event.name, where), [0, 0.0])
        entry[0] += 1
        entry[1] += cost
    rows = sorted(sites.items(), key=lambda kv: -kv[1][1])[:top]
    return "call sites:\n" + "\n".join(
        f"  {name:<18} {int(n):>6} calls {ms:8.1f} ms  {where}" for (name, where), (n, ms) in rows
    )


def step_flops(model: Any, samples: list[Any], *, step_kl: bool, minibatches: int) -> float:
    """The arithmetic of one training step, counting real tokens only (no padding): a forward is
    2 x the body's parameters a token (prompt and response), 2 x the LM head's at each response
    token, and the causal attention's 2 x L^2 x width a layer; a backward twice a forward. A step
    is one forward and backward of every sample, one forward more for the proximal log-probs
    when the batch is cut into several minibatches, and one more for the step-KL check."""
    config = model.config
    head = config.vocab_size * config.hidden_size
    body = sum(p.numel() for p in model.parameters()) - head  # tied: the embedding is the head
    width = config.num_attention_heads * getattr(config, "head_dim", config.hidden_size // config.num_attention_heads)
    forward = 0.0
    for s in samples:
        length = len(s.prompt_ids) + s.response_len
        forward += 2 * body * length + 2 * head * s.response_len + 2 * length**2 * width * config.num_hidden_layers
    passes = 3 + (1 if minibatches > 1 else 0) + (1 if step_kl else 0)
    return forward * passes


def main(argv: list[str] | None = None) -> int:
    import torch

    from pipeline.tasks.tiny_model import make_model_folder
    from trainers import GRPOTrainer

    p = argparse.ArgumentParser(prog="python -m benchmarks.trainer_step", description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--model-size", default="0.6b", choices=["0.6b", "tiny"])
    p.add_argument("--layers", type=int, default=28, help="the 0.6B shape's layers (fewer: a CPU's scale)")
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--length-tail", default="lognormal:-1.9,0.8")
    p.add_argument("--budget", type=int, default=16384, help="the + budget variant's --max-tokens-per-gpu")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument(
        "--variants",
        default="all rows,padded,packed,compiled,+ budget,no step-KL",
        help="which variants to time, comma-separated; the ratios are to the first",
    )
    p.add_argument("--profile", action="store_true", help="the top device kernels of one step of --profile-variant")
    p.add_argument("--profile-variant", default="packed", help="the variant --profile profiles (one of --variants)")
    p.add_argument(
        "--peak-tflops", type=float, default=790.0, help="the device's bf16 matrix rate (an H200 measured 790)"
    )
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    with tempfile.TemporaryDirectory() as tmp:
        if args.model_size == "0.6b":
            from benchmarks.engine import qwen3_06b_folder

            folder = qwen3_06b_folder(Path(tmp) / "qwen3-0.6b", layers=args.layers)
        else:
            folder = make_model_folder(Path(tmp) / "tiny", seed=0)
        vocab = int(json.loads((folder / "config.json").read_text())["vocab_size"])
        batch = _batch(args, vocab)
        samples = [s for g in batch.groups for s in g.samples]
        kw: dict[str, Any] = {"device": args.device, "dtype": args.dtype, "lr": 1e-5, "num_threads": None}
        kw["global_batch_size"] = len(samples) // 2
        settings: dict[str, dict[str, Any]] = {
            "all rows": {"max_step_kl": 0.2, "pack": False},
            "padded": {"max_step_kl": 0.2, "pack": False},
            "packed": {"max_step_kl": 0.2},
            "blocks": {"max_step_kl": 0.2},
            "compiled": {"max_step_kl": 0.2, "compile_layers": True},
            "compiled layers": {"max_step_kl": 0.2, "compile_layers": True},
            "with cache": {"max_step_kl": 0.2},
            "compiled with cache": {"max_step_kl": 0.2, "compile_layers": True},
            "+ budget": {"max_step_kl": 0.2, "max_tokens_per_gpu": args.budget},
            "no step-KL": {"max_step_kl": None},
        }
        chosen = [name.strip() for name in args.variants.split(",")]
        unknown = [name for name in chosen if name not in settings]
        if unknown:
            p.error(f"--variants: {unknown} are not among {list(settings)}")
        if args.profile and args.profile_variant not in chosen:
            p.error(f"--profile-variant {args.profile_variant!r}: not among --variants {chosen}")
        variants = {name: GRPOTrainer(folder, **settings[name], **kw) for name in chosen}
        if "compiled layers" in variants:  # the flag as it was: the scorer eager, AdamW's foreach kernels
            layers_only = variants["compiled layers"]
            layers_only.compiled_scores = False  # the layers stay compiled
            group = layers_only.optimizer.param_groups[0]
            layers_only.optimizer = torch.optim.AdamW(
                layers_only.model.parameters(), lr=group["lr"], weight_decay=group["weight_decay"], foreach=True
            )
        times: dict[str, list[float]] = {name: [] for name in variants}
        peak: dict[str, float] = dict.fromkeys(variants, 0.0)
        names = list(variants)
        for step in range(args.steps + 1):
            # Each round starts at the next variant: on an H100 the first of a round took longer
            # (`--trainer-compile`'s step 635 ms first, 457 ms after packed's, packed's 1,254 ms
            # after it against 1,175 first), so a fixed order favoured whichever came later.
            for name in names[step % len(names) :] + names[: step % len(names)]:
                trainer = variants[name]
                sync()
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                started = time.perf_counter()
                with (
                    _all_rows() if name == "all rows" else contextlib.nullcontext(),
                    _kv_cache(trainer.model) if name.endswith("with cache") else contextlib.nullcontext(),
                    _blocks() if name == "blocks" else contextlib.nullcontext(),
                ):
                    trainer.train_step(dataclasses.replace(batch, step=step))
                sync()
                if step:  # the first is a warm-up
                    times[name].append(time.perf_counter() - started)
                if cuda:
                    peak[name] = max(peak[name], torch.cuda.max_memory_allocated() / 2**30)
        real = sum(len(s.prompt_ids) + s.response_len for s in samples)
        response = sum(s.response_len for s in samples)
        longest = max(len(s.prompt_ids) + s.response_len for s in samples)
        print(
            f"{args.device} {args.dtype}, {args.model_size}: {len(samples)} samples, {response} response tokens "
            f"({real} with prompts; padded to the longest, {len(samples) * longest}), two optimizer steps"
        )
        first = chosen[0]
        base = statistics.median(times[first])
        for name, ts in times.items():
            t = statistics.median(ts)
            memory = f", peak {peak[name]:.1f} GiB" if cuda else ""
            label = f"{name} {args.budget}" if name == "+ budget" else name
            print(f"step {label:<22} {t * 1e3:8.0f} ms  {base / t:5.2f}x faster than {first}{memory}")
        for name in (
            "packed",
            "blocks",
            "compiled layers",
            "compiled",
            "with cache",
            "compiled with cache",
            "no step-KL",
        ):
            if name not in variants:
                continue
            flops = step_flops(variants[name].model, samples, step_kl=name != "no step-KL", minibatches=2)
            floor = flops / (args.peak_tflops * 1e12)
            ratio = statistics.median(times[name]) / floor
            print(
                f"flops estimate, {name}: {flops / 1e12:.1f} TFLOP, {floor * 1e3:.0f} ms at {args.peak_tflops:g} "
                f"TFLOP/s: the step takes {ratio:.1f}x it (target <= 2x: {'MET' if ratio <= 2 else 'MISSED'})"
            )
        # The publish between checkpoints (`save_model`), taking turns: the fp32 masters through
        # `save_pretrained` (what a bf16 trainer wrote first), bf16 through `save_pretrained` (the
        # fifth session), bf16 through one reused page-locked buffer (`trainers/weights_file.py`, now).
        import torch

        from trainers.checkpoint import write_folder_atomically

        trainer = variants.get("packed", variants[first])

        def bf16_save_pretrained(out: Path) -> None:
            rounded: dict[int, torch.Tensor] = {}
            state = {
                n: rounded.setdefault(t.data_ptr(), t.detach().to(torch.bfloat16))
                for n, t in trainer.model.state_dict().items()
            }
            trainer.model.save_pretrained(out, state_dict=state)

        saves: dict[str, list[float]] = {"fp32 save_pretrained": [], "bf16 save_pretrained": [], "bf16 now": []}
        for i in range(3):
            for name in saves:
                started = time.perf_counter()
                if name == "bf16 now":
                    trainer.save_model(Path(tmp) / f"pub-{i}")
                elif name == "bf16 save_pretrained":
                    write_folder_atomically(Path(tmp) / f"sp-{i}", folder, bf16_save_pretrained)
                else:
                    write_folder_atomically(Path(tmp) / f"old-{i}", folder, trainer.model.save_pretrained)
                saves[name].append(time.perf_counter() - started)
        print(
            "publish folder (save_model): "
            + ", ".join(f"{name} {statistics.median(ts):.3f} s" for name, ts in saves.items())
        )
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            profiled = variants[args.profile_variant]
            print(f"profile of one {args.profile_variant} step:")
            with profile(activities=activities, with_stack=True) as prof:
                profiled.train_step(dataclasses.replace(batch, step=args.steps + 1))
                sync()
            key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            print(prof.key_averages().table(sort_by=key, row_limit=20, max_name_column_width=60))
            print(_call_sites(prof, ("aten::copy_", "aten::mul", "aten::index_copy", "aten::cat"), cuda))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
