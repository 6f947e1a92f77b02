"""The package version (read by pyproject.toml, the CLI and the server)."""

__version__ = "0.1.0"
