"""`python -m pipeline.launch --node-rank K <the controller's flags>`: on another node of a
multi-node megatron run, start that node's ranks and wait for them. The flags are the controller's,
so this node derives the same trainer spec (`megatron_settings`) and the handshake can check it."""

from __future__ import annotations

import sys

from core.errors import ConfigError
from launch.megatron_ranks import run_node
from pipeline.config import load_config
from pipeline.trainer_settings import megatron_settings

__all__ = ["node_main"]


def node_main(argv: list[str]) -> int:
    """`--node-rank K <flags>` (or `--node-rank K -- <flags>`): exit 2 for a node outside the run."""
    try:
        node = int(argv[0])
    except (IndexError, ValueError):
        print(f"--node-rank needs an integer, got {argv[:1]}", file=sys.stderr)
        return 2
    flags = argv[1:][1:] if argv[1:2] == ["--"] else argv[1:]
    try:
        config = load_config(flags)
        t = config.trainer
        if t.backend != "megatron":
            raise ConfigError([f"--node-rank={node}: the controller's flags need --train-backend megatron"])
        if not 0 < node < t.num_nodes:
            raise ConfigError(
                [
                    f"--node-rank={node}: must be 1..{t.num_nodes - 1} for --actor-num-nodes={t.num_nodes} "
                    "(node 0 is the controller's)"
                ]
            )
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    return run_node(node, megatron_settings(config), t.num_ranks)
