"""Mutation testing (``python scripts/mutants.py``): the runner (runner.py), what the tables share
(common.py) and the mutants, a module per area of the package they mutate (tables/)."""
