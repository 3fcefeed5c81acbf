# The README's commands: `make build`, `make check` (the fast loop while editing) and `make test`
# (the whole suite: what CI runs); each sets up .venv first.
VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup build check test lint bench lock report
setup: $(VENV)/.setup-done

$(VENV)/.setup-done: scripts/setup.sh scripts/uv.sh pyproject.toml $(wildcard envs/*.lock)
	scripts/setup.sh
	touch $@

build: setup  ## build + validate every target of the default recipe
	$(BIN)/pipeline build recipes/smollm2-135m.yaml

check: setup  ## lint + every test that starts no engine or build (tests marked `slow` left out): ~2 min
	$(BIN)/ruff check pipeline tests benchmarks
	$(BIN)/pytest -q -m "not slow" --durations=5

# `make test`: two pytest-xdist workers, one test file each at a time (`--dist loadfile`: the
# end-to-end module's tests build on each other; tests/conftest.py orders the longest files first
# and --no-loadscope-reorder keeps that order), then the `serial` tests alone (they measure other processes' load).
test: setup  ## lint + the whole suite (includes a real end-to-end build)
	$(BIN)/ruff check pipeline tests benchmarks
	$(BIN)/pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not serial" --durations=12
	$(BIN)/pytest -q -m serial

report: setup  ## the report page: the default recipe's CPU rows beside the GPU host's committed 7B ones
	$(BIN)/pipeline report recipes/smollm2-135m.yaml --html bench-out/report.html \
		--beside benchmarks/gpu/qwen2-7b-serving.yaml --beside benchmarks/gpu/qwen2-7b-serving-llama.yaml \
		--beside-artifacts gpu/artifacts

bench: setup  ## benchmark script: prints numbers
	$(BIN)/python benchmarks/bench_gguf.py
	$(BIN)/python benchmarks/bench_int4.py
	$(BIN)/python benchmarks/bench_trtllm_checkpoint.py --samples 16 --seq-len 256

lock:  ## re-resolve envs/*.lock from envs/*.txt + pyproject.toml (then review and commit the diff)
	scripts/lock.sh
