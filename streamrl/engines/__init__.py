"""Generation engines behind one interface (:class:`streamrl.engines.base.Engine`)."""
from streamrl.engines.base import Engine, Generation

__all__ = ["Engine", "Generation"]
