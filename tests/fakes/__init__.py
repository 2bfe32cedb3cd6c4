"""Fakes the tests may use where a real part cannot run here (a GPU SGLang engine)."""

from tests.fakes.fake_sglang import FakeRequest, FakeSGLang, default_token_fn, detokenize

__all__ = ["FakeRequest", "FakeSGLang", "default_token_fn", "detokenize"]
