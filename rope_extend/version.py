"""The package version (pyproject.toml has the same number; tests/test_structure.py checks they agree)."""

__version__ = "0.1.0"
