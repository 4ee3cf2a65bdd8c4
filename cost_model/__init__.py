"""Costs of strategies and reshards, hardware profiles, and the ILP that picks a plan."""
