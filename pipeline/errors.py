"""One error hierarchy and one exit-code map; the CLI turns these into a one-line message."""


class PipelineError(Exception):
    """Base for every error the user can act on; the message is one line saying how to fix it."""

    exit_code = 1


class RecipeError(PipelineError):
    """The recipe file is malformed or asks for something impossible."""

    exit_code = 2


class SourceError(PipelineError):
    """The source checkpoint is missing, unsafe (pickle-only) or unusable."""

    exit_code = 3


class BuildError(PipelineError):
    """A target could not be built (converter, quantizer or disk failure)."""

    exit_code = 4


class DiskFullError(BuildError):
    """The disk filled up while writing; nothing already built was touched."""


class EngineError(PipelineError):
    """An engine or tool process crashed, or its environment is missing."""

    exit_code = 5


class RegistryError(PipelineError):
    """An artifact or manifest is missing or does not match its checksums."""

    exit_code = 6


class ValidationFailed(PipelineError):
    """At least one artifact was built but failed its validation gates."""

    exit_code = 7
