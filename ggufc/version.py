"""The version of ggufc (the runtime checks artifacts against it)."""

__version__ = "0.2.0"
