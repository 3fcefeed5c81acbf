"""pipeline: build, validate and record LLM deployment artifacts from one recipe per model."""

__version__ = "0.1.0"
