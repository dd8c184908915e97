"""mpi4py: its record, the MPI Engine and Manager, the message guard and MPICH's shared-memory sweep (which
Horovod on MPICH uses too)."""
