"""The benchmark harness: python -m torchreplay_bench --help."""
