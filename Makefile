# `make run`: set up .venv and run the demo on built-in defaults: VeriCache against full-KV greedy
# and the same lossy cache decoded alone (`vericache demo --help`); exits non-zero unless identical.
# `make test`: set up .venv (plus a Redis server binary) and run the whole test suite.
.PHONY: run test lint

run:
	scripts/setup.sh
	.venv/bin/vericache demo

# The quick suite on two pytest-xdist workers (one file per worker at a time: module fixtures such
# as the shared reference decodes stay in one process); then the end-to-end modules, each in a
# fresh pytest process, two at a time (scripts/e2e.sh says why).
test:
	scripts/setup.sh --test
	.venv/bin/python -m pytest -q -ra --timeout=1800 -m "not e2e" -n 2 --dist loadfile
	scripts/e2e.sh

lint:
	.venv/bin/ruff check lmcache_vericache tests benchmarks
