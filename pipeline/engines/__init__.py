"""Engine workers: each module runs in its own environment as `python -m pipeline.engines.<name>`."""
