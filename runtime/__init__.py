"""Loading and running artifacts; imports nothing from the compiler."""

from .session import Session
from .slot_group import SlotGroup

__all__ = ["Session", "SlotGroup"]
