"""Scripts run on demand, never by the tests: each prints what a doc page quotes. Run from the
repository's root as modules, ``python3 -m benchmarks.NAME``, which makes ``memsim`` (the
checkout's), ``benchmarks`` and ``tests.support`` importable without editing ``sys.path``."""
