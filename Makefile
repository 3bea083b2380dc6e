# The two commands of the README: `make run` (install + main job) and `make test`.
PY := .venv/bin/python
PIP := $(PY) -m pip
TH := .venv/bin/tokenhaul
PROMPT ?= Write a haiku about moving parcels of data.
TEST_MODELS := smollm2-135m gemma3-270m qwen2.5-coder-0.5b qwen2.5-coder-1.5b

.venv/.installed: pyproject.toml
	python3.11 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e '.[dev,bench,ray]'
	touch $@

install: .venv/.installed
	$(TH) models install smollm2-135m
	@# compile the default model's batch-1 decode step now (about a minute, saved), so `run` is not eager
	$(TH) generate --model smollm2-135m --prompt "Hi" --max-tokens 1 --compile on > /dev/null \
		|| echo "tokenhaul: decode step not compiled (see above); make run decodes eagerly"

run: install
	$(TH) generate --model smollm2-135m --prompt "$(PROMPT)" --max-tokens 64 --temperature 0 --chat --ledger

test: .venv/.installed
	for m in $(TEST_MODELS); do $(TH) models install $$m || exit 1; done
	$(PY) -m ruff check tokenhaul tests bench
	$(PY) -m pytest -v --durations=25

.PHONY: install run test
