"""Rank 0 of a torch-backend job started by mpiexec cannot listen on its rendezvous address (here: an address
that is not this host's, as a misconfigured interface would give): rank 0 must say so and end the whole MPI
job, not leave the other ranks waiting for the address it was to broadcast."""

import unidist
import unidist.engines.torch.manager as torch_manager

torch_manager.rendezvous_address = lambda single_node: "192.0.2.77"  # TEST-NET-1: never this host's
with unidist.init() as mgr:
    print("started despite the unusable address", flush=True)
