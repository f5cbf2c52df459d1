# Two commands on a fresh machine:
#   make demo   -- set up .venv and answer the bundled spoken question with the demo checkpoint
#   make test   -- set up .venv and run the test suite
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test lint bench wheel-smoke clean help

help:
	@echo "make demo         set up .venv and answer tests/data/question.wav with the demo checkpoint (answer.wav)"
	@echo "make test         set up .venv and run the test suite"
	@echo "make lint         ruff"
	@echo "make bench        the CPU benchmark against upstream (docs/performance-results.md)"
	@echo "make wheel-smoke  build the wheel, install it in a fresh venv and run the README's commands"
	@echo "make clean        remove .venv and the files the commands above write"

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	@echo "installing dependencies into $(VENV) (about 1.2 GB, a few minutes) ..."
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[dev,server]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/mlx-voicechat generate --audio tests/data/question.wav --output-audio answer.wav \
		-p "Be concise and answer in one sentence."

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/ruff check .

# Build the sdist + wheel, install the wheel into a fresh venv and run the README's commands
# from outside the checkout (scripts/wheel_smoke.sh; about 3 minutes, most of it pip).
wheel-smoke: $(STAMP)
	PYTHON=$(abspath $(BIN))/python scripts/wheel_smoke.sh

bench: $(STAMP)
	$(BIN)/python -m mlx_voicechat_plugin.bench --presets small medium --bits bf16 4 --repeats 3 \
		--json artifacts/bench.json --markdown docs/performance-results.md --plot docs/stage_times.png

clean:
	rm -rf $(VENV) answer.wav response.wav response_vlm.wav response_ws.wav demo-ckpt demo-small artifacts dist .pytest_cache .hypothesis
