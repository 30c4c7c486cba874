"""A gallery of the bugs the plugin catches: one small module per bug class, beside its fix.

Each module's docstring shows what ``pytest --cudagraph-verify`` prints for
the buggy version; ``test_gallery.py`` asserts that check and message, and
that every fix passes every check, so the gallery cannot rot.
"""
