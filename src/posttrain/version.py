"""The package version (one place: the wheel reads it from here, the CLI and model cards print it)."""

__version__ = "0.1.0"
