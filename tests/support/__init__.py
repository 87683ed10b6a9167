"""What the tests and the benchmarks share: ``oracles/`` (real runs and published formulas,
importing nothing of memsim), ``predict`` (a report compared with a real run), ``zoo`` (small
models), ``hf_models`` (small Hugging Face configurations) and ``examples`` (the repository's
example files, loaded). Imported as ``tests.support.NAME`` with the repository root on the path:
pytest puts it there, the benchmarks run as ``python3 -m benchmarks.NAME`` from it."""
