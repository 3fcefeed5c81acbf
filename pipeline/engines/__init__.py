"""Validation in the serving engines that several target kinds share (vLLM, SGLang): the core
side, which asks the engine's worker (pipeline.workers.<engine>) for scores and turns them into a
verdict."""
