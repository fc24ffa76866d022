"""Package version (kept in its own module so setup.py can read it without importing torch)."""

__version__ = "0.1.0"
