"""See attention: the textbook walk-through, attention maps of real models, the cost curve.

Heavy dependencies (matplotlib, transformers) are imported inside the functions that need them.
"""

from .explain import Walkthrough, cost, render, walkthrough

__all__ = ["Walkthrough", "cost", "render", "walkthrough"]
