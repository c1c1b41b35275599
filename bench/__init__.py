"""Benchmarks: `make bench`. Each prints a table of times measured side by side."""
