"""Loading and running artifacts; imports nothing from the compiler."""

from .session import Session

__all__ = ["Session"]
