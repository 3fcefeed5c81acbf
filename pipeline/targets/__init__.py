"""Target builders, registered by kind name. A new target family is one module imported here."""

from pipeline.targets import gguf  # noqa: F401  (registers the `gguf` builder)
from pipeline.targets.base import BUILDERS, BuildContext, TargetBuilder

__all__ = ["BUILDERS", "BuildContext", "TargetBuilder"]
