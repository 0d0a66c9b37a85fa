"""The parts of scripts/bench_gpu.py: checkpoints and workloads, what a child process measures,
how the parent runs children and `neuron serve`, and the report. Standard library only at module
level, so `bench_gpu.py --help` stays fast; torch and neuron are imported where they are used."""
