"""benchmarks/mutations.py's list stays applicable: each mutation's text occurs exactly once in
its file (a stale one fails the mutation run, which is run on demand: this says so at once), and
each names tests that exist."""

import os

from benchmarks.mutations import MUTATIONS, ROOT


def test_every_mutation_applies_and_names_existing_tests():
    stale, missing = [], []
    for m in MUTATIONS:
        with open(os.path.join(ROOT, m.path)) as f:
            if f.read().count(m.old) != 1:
                stale.append(m.name)
        for t in m.tests:
            path, _, name = t.partition("::")
            with open(os.path.join(ROOT, path)) as f:
                if name and f"def {name.split('[')[0]}(" not in f.read():
                    missing.append(f"{m.name}: {t}")
    assert not stale, f"mutations whose text is not once in its file: {stale}"
    assert not missing, f"mutations naming tests that do not exist: {missing}"
    assert len({m.name for m in MUTATIONS}) == len(MUTATIONS), "duplicate mutation names"
