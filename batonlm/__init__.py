"""batonlm: an LLM serving engine built around an overlap event loop."""

from batonlm.engine import Engine

__all__ = ["Engine"]
__version__ = "0.1.0"
