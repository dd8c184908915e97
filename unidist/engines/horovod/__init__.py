"""Horovod: its record, Engine and Manager, Horovod's gloo rendezvous, and the trainer behind ``prepare`` on
Horovod's own optimizer."""
