"""Side-by-side benchmarks against PyTorch's own implementations (never part of the tests)."""
