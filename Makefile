# The two commands a newcomer needs:  `make train`  (the main job)  and  `make test`  (the test suite).
# Each installs what it needs first (torch pinned to 2.13.0: see requirements.txt).
PYTHON ?= python3
STAMP := .install-stamp

.PHONY: install train test gpu-test bench

install: $(STAMP)

$(STAMP): requirements.txt setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/cuda/*)
	$(PYTHON) -m pip install -q -r requirements.txt
	$(PYTHON) -m pip install -q --no-build-isolation --no-deps -e .
	touch $@

train: install
	$(PYTHON) tools/pretrain_gpt.py --config configs/tiny.yaml $(ARGS)

test: install
	$(PYTHON) -m pytest -q $(ARGS)

gpu-test: install
	$(PYTHON) -m pytest -q -m gpu $(ARGS)
