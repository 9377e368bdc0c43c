"""Speed, overhead and device measurements (not timed tests), run from the repository root as modules:
`python -m benchmarks.<name>` (`make bench`, `make gpu-check`)."""
