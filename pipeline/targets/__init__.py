"""Target kinds, each one module owning its spec and behaviour, registered by kind name. Adding a
kind: one module here and its import below."""

from pipeline.targets import gguf, int4, modelopt, trtllm  # noqa: F401  (importing registers them)
from pipeline.targets.base import BuildOutput, Target

__all__ = ["BuildOutput", "Target"]
