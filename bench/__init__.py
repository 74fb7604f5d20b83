"""The project's benchmarks, run from the repository root as `python -m bench.NAME` (`--help` says what each measures);
bench/common.py holds what they share."""
