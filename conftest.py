"""Repository-root conftest: makes the root importable (``tests``, ``examples``).

The plugin itself is loaded through its ``pytest11`` entry point once the
package is installed (``pip install -e .``).
"""
