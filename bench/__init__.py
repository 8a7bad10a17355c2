"""Benchmarks behind `invoke bench.*`; each writes its JSON under ./work/bench-results/ (or --results-dir)."""
