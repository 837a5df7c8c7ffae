"""Benchmarks users can reproduce with one command: ``tideserve bench serve | offline | plot``.

datasets.py builds the workloads, serve.py is the HTTP load generator, offline.py drives the engine
in-process, report.py turns per-request records into metrics, tables, JSON and charts, launch.py starts
servers under test. Nothing here is imported by the engine or the server.
"""
