"""The benchmark harness: python -m torchreplay.bench --help."""
