"""Benchmarks behind `invoke bench.*`; each writes its JSON under bench/results/."""
