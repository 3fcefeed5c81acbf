"""Step workers: each module runs inside one tool environment as `python -m pipeline.workers.<name>`
(see pipeline.environments). Importing this package imports nothing heavy."""
