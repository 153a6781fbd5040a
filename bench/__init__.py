"""dataferry.bench: benchmarks that print numbers."""
