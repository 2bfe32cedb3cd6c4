"""A stand-in for SGLang in CPU tests: `python -m sglang.launch_server` runs the built-in engine.

Put `tests/fakes/sglang_standin` on PYTHONPATH. It is not SGLang: it exists so the launcher's
real-SGLang path (detection, command line, devices, health wait, router, API key, stop) runs here.
"""
