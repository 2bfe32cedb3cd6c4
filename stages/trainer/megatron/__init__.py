"""The megatron-core trainer backend (`--train-backend megatron`).

    trainer.py     MegatronTrainer: the Trainer protocol on megatron ranks (rank 0 leads, others follow)
    rows.py        a Batch as rows for the ranks, and the shared loss (stages.trainer.loss) on them
    qwen3.py       the Qwen3-shaped GPTModel, and HF <-> megatron weight conversion (exact)
    cpu_patches.py the runtime patches megatron-core 0.16.1 needs on CPU, applied only there

How ranks are started is `launch.megatron_ranks`. Importing this package does not import
megatron-core (an optional dependency: `pip install 'rollout-pipeline[megatron]'`).
"""

from __future__ import annotations

from typing import Any

__all__ = ["MegatronTrainer"]


def __getattr__(name: str) -> Any:
    if name == "MegatronTrainer":
        from stages.trainer.megatron.trainer import MegatronTrainer

        return MegatronTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
