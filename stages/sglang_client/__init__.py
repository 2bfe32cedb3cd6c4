"""The pipeline's HTTP client for SGLang engines (real SGLang, the built-in engine, the simulator).

Three rooms, each importing only the one before it:

- `wire`: the wire format, pure parsing of `/generate` answers (`GenerateResult`, finish reasons,
  log-probs, per-token version spans) and the shapes of control answers (`EngineLoad`).
- `engine`: `EngineClient`, the HTTP calls to one URL (an engine, or the router for `/generate`).
- `fleet`: `EngineFleet`, what the pipeline holds: `/generate` to one URL, control calls fanned out
  to every engine; R3 requests behind a router that drops their fields go to the engines
  themselves, placed by `dispatch.EnginePicker`.
"""

from stages.sglang_client.engine_client import EngineClient, EngineStatistics
from stages.sglang_client.fleet import CONTROL_HEADROOM, EngineFleet
from stages.sglang_client.wire import PAUSE_MODES, EngineLoad, EngineSpan, GenerateResult

__all__ = [
    "CONTROL_HEADROOM",
    "PAUSE_MODES",
    "EngineClient",
    "EngineFleet",
    "EngineLoad",
    "EngineSpan",
    "EngineStatistics",
    "GenerateResult",
]
