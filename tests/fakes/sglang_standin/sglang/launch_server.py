"""`python -m sglang.launch_server` with SGLang's flags, served by the built-in engine.

Flags the built-in engine has are passed through; the GPU ones (`--tp-size`,
`--mem-fraction-static`) are accepted and echoed to the log with the visible devices, so tests can
check what the launcher asked for. `--api-key` is the built-in engine's, which enforces it as SGLang
does: every request except the health probes needs `Authorization: Bearer KEY`, or it gets 401.
"""

from __future__ import annotations

import argparse
import os
import sys

import engines.builtin as engine_server


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m sglang.launch_server (stand-in)")
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--mem-fraction-static", type=float, default=None)
    ap.add_argument("--api-key", default=None)
    # R3: the built-in engine answers routes for any MoE model; SGLang needs this flag for it.
    ap.add_argument("--enable-return-routed-experts", action="store_true")
    known, rest = ap.parse_known_args()
    print(
        f"standin: tp_size={known.tp_size} mem_fraction_static={known.mem_fraction_static} "
        f"api_key={'set' if known.api_key else 'none'} CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')} "
        f"HIP_VISIBLE_DEVICES={os.environ.get('HIP_VISIBLE_DEVICES')} "
        f"enable_return_routed_experts={known.enable_return_routed_experts}",
        file=sys.stderr,
        flush=True,
    )
    if known.api_key:  # the built-in engine enforces it as SGLang does (engines/guards.py)
        rest += ["--api-key", known.api_key]
    return engine_server.main(rest)


if __name__ == "__main__":
    sys.exit(main())
