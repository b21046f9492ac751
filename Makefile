# `make run`: set up .venv and run the main job on built-in defaults.
# `make test`: set up .venv (plus a Redis server binary) and run the whole test suite.
.PHONY: run test lint

run:
	scripts/setup.sh
	.venv/bin/vericache generate --reference
	.venv/bin/vericache compressors

test:
	scripts/setup.sh --test
	.venv/bin/python -m pytest -q -ra --timeout=1800

lint:
	.venv/bin/ruff check lmcache_vericache tests benchmarks
