"""Target builders, registered by kind name. A new target family is one module imported here."""

from pipeline.targets import gguf, int4  # noqa: F401  (register the gguf, awq and gptq builders)
from pipeline.targets.base import BUILDERS, BuildContext, TargetBuilder

__all__ = ["BUILDERS", "BuildContext", "TargetBuilder"]
