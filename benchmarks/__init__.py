"""The benchmarks, each a module run from the repository's root: ``python -m benchmarks.e2e_bench --help``.

A regular package rather than a namespace one, so that a top-level ``benchmarks`` package some installed
distribution ships cannot take its place on the import path.
"""
