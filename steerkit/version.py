"""The steerkit version (one place: the package, the CLI's --version and exported files read it)."""
__version__ = "0.1.0"
