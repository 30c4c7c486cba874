"""Mutation testing: does the suite notice when the code that says "equal" (or any check) lies?

Each mutant is one small, hand-written change to the package: an exact snippet
of today's code and what replaces it. For every mutant the script copies the
working tree (tracked files and untracked files git does not ignore, as
``git ls-files -co --exclude-standard`` lists them) into a fresh temporary
folder, applies the mutant there (the tree it reads is never written), and
runs pytest on the copy with ``PYTHONPATH`` pointing at it, after checking in a
subprocess that ``pytest_cudagraph`` really imports from the copy:

1. the mutant's targeted tests, ``python -m pytest -x -q -p no:cacheprovider <tests>``;
2. only if they all pass (and without ``--fast``): the whole suite, ``tests``
   and then ``examples``, each with ``-x``.

A mutant is **killed** when a run fails (or times out), **survived** when every
run passes, and **invalid** when the mutated package does not even import (a
mutant that breaks the import proves nothing about the tests). A snippet that
is not found exactly once is a **stale** mutant, an error: the code moved or
changed and the mutant must be rewritten. Only for code that is moved between
files is a snippet not found in the file named looked for in every file of the
package, so those mutants (``manager/*``, ``checks/builtin/*``, ``checks/engine.py``:
marked ``*`` in the table) follow it.

Before the mutants, the unmutated copy must import and pass every selected
mutant's targeted tests (the baseline), or nothing is run.

Run it (CPU work: one thread per pytest process)::

    OMP_NUM_THREADS=1 python scripts/mutants.py              # every mutant, whole suite for survivors
    OMP_NUM_THREADS=1 python scripts/mutants.py --fast       # targeted tests only
    python scripts/mutants.py --cuda --fast                  # on a GPU: the mutants of CUDA-only code
    python scripts/mutants.py --list                         # the mutants
    python scripts/mutants.py --only compare-all-any --only suite-address-identity
    python scripts/mutants.py --jobs 4                       # mutants in parallel
    python scripts/mutants.py --tree /path/to/a/clean/copy  # mutate another copy of the repo

It prints a table (id, file, result, the test that killed it or why not,
seconds) and the kill rate, killed / (killed + survived); invalid mutants are
counted apart. The exit status is 1 if a mutant survived, 2 on a stale mutant
or a failing baseline, 0 otherwise.

The code is in the package beside this file, ``scripts/mutants/``: ``runner.py``
(copying the tree, running pytest, the table), ``common.py`` (the ``Mutant``
record, the files and tests the tables name) and ``tables/``, the mutants, a
module per area of the package they mutate (``checks``, ``manager``, ``plan``,
``precision``, ``plugin``, ``runner``, ``capturability``, ``training``), which
``tables/__init__.py`` puts in the order they run. A new mutant goes in its
area's module.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Run as a script, this folder is already first on the path; imported from elsewhere, it is put there.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from mutants.common import Mutant  # noqa: E402
from mutants.runner import main  # noqa: E402
from mutants.tables import MUTANTS  # noqa: E402

__all__ = ["MUTANTS", "Mutant", "main"]

if __name__ == "__main__":
    sys.exit(main())
