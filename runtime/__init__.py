"""What runs on the ranks: autograd-aware collectives, the parallel module, its state."""

from .collectives import COUNTER, count_bytes
from .parallelize import ParallelModule, parallelize

__all__ = ["parallelize", "ParallelModule", "count_bytes", "COUNTER"]
