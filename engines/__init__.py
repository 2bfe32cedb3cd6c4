"""The engines: SGLang-compatible servers the pipeline reaches only over HTTP.

- `builtin`: a real torch causal LM with a KV cache and continuous batching
  (`python -m engines.builtin --model-path DIR`);
- `sim`: a time model instead of a network, for benchmarks (`python -m engines.sim`);
- `instant`: answers at once, to measure the controller alone (`python -m engines.instant`).

The built-in and simulated engines are one scheduler (`scheduler.EngineCore`) behind one HTTP
surface (`http.EngineServer`); they differ only in the object behind the one seam,
`seam.ModelForward`: what a model forward (or a time model) provides. To add an engine, write a
`ModelForward` and serve it with `serving.open_engine`. The instant engine shares nothing on
purpose: it is a bare asyncio protocol so that it costs far less per request than the controller.
"""
