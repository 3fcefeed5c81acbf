# The README's two commands are `make build` and `make test`; both set up .venv first.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup build test lint bench lock
setup: $(VENV)/.setup-done

$(VENV)/.setup-done: scripts/setup.sh scripts/uv.sh pyproject.toml $(wildcard envs/*.lock)
	scripts/setup.sh
	touch $@

build: setup  ## build + validate every target of the default recipe
	$(BIN)/pipeline build recipes/smollm2-135m.yaml

test: setup  ## lint + the test suite (includes a real end-to-end build)
	$(BIN)/ruff check pipeline tests benchmarks
	$(BIN)/pytest -q --durations=12

bench: setup  ## benchmark script: prints numbers
	$(BIN)/python benchmarks/bench_gguf.py
	$(BIN)/python benchmarks/bench_int4.py
	$(BIN)/python benchmarks/bench_trtllm_checkpoint.py --samples 16 --seq-len 256

lock:  ## re-resolve envs/*.lock from envs/*.txt + pyproject.toml (then review and commit the diff)
	scripts/lock.sh
