"""Graph passes: annotate (candidate strategies per node); later lower."""

from .annotate import FALLBACK_KEY, STRATEGIES_KEY, UnknownOpWarning, annotate, node_strategies

__all__ = ["annotate", "node_strategies", "STRATEGIES_KEY", "FALLBACK_KEY", "UnknownOpWarning"]
