"""Where ``SinkCache`` was imported from before it moved under ``hf`` (``rope_extend.hf.sinks``, with the other
transformers work); ``rope_extend.SinkCache`` is its public name. Nothing in the package imports this module."""

from .hf.sinks import SinkCache

__all__ = ["SinkCache"]
