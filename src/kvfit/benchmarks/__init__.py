"""Benchmark records: one JSON schema for every benchmark, and the figures each one claims.

Used by `kvfit bench ...` and the scripts under `bench/` (which also plot and compare records).
Imports nothing from the engine: a record is read and checked without torch doing any work.
"""
