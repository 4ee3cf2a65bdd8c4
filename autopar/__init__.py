"""autopar: compiler-style auto-parallelization for PyTorch."""
