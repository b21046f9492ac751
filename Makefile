# `make run`: set up .venv and run the main job on built-in defaults.
# `make test`: set up .venv (plus a Redis server binary) and run the whole test suite.
.PHONY: run test lint

run:
	scripts/setup.sh
	.venv/bin/vericache generate --reference
	.venv/bin/vericache compressors

# End-to-end modules run each in a fresh pytest process: a vLLM engine with the custom proposer
# aborts at start-up when it follows the LMCache MP-connector test in the same pytest process
# (each passes alone and in the other order; see README "What does not work yet").
test:
	scripts/setup.sh --test
	.venv/bin/python -m pytest -q -ra --timeout=1800 -m "not e2e"
	rc=0; for f in tests/e2e/test_*.py; do .venv/bin/python -m pytest -q -ra --timeout=1800 $$f || rc=1; done; exit $$rc

lint:
	.venv/bin/ruff check lmcache_vericache tests benchmarks
