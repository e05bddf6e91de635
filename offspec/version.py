"""offspec's version, in one place (the package, profiles and reports record it)."""

__version__ = "0.1.0"
