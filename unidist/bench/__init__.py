"""Benchmarks runnable under any launcher: ``unidist bench -n 2 --backend mpi`` or
``mpiexec -n 2 python -m unidist.bench.allreduce``."""
