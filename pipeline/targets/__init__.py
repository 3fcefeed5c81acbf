"""Target builders, registered by kind name. A new target family is one module imported here."""

# Importing a module registers its builders: gguf; awq and gptq; trtllm; modelopt.
from pipeline.targets import gguf, int4, modelopt, trtllm  # noqa: F401
from pipeline.targets.base import BUILDERS, BuildContext, TargetBuilder

__all__ = ["BUILDERS", "BuildContext", "TargetBuilder"]
