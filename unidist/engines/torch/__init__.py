"""Torch.distributed (gloo, NCCL): its record, Engine and Manager."""
