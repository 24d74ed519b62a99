"""Benchmarks: offline engine throughput (``bench --offline``) and serving load (``bench --url``)."""
