"""batonlm: an LLM serving engine built around an overlap event loop."""

from batonlm.engine import Engine
from batonlm.version import __version__

__all__ = ["Engine", "__version__"]
