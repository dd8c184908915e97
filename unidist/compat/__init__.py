"""Compatibility layers: the engines' own Python APIs, on every unidist backend.

``import unidist.compat.horovod as hvd`` is ``horovod.torch``'s API. Each layer is written on the layers
below it (the managers' collectives, ``unidist.train``, ``unidist.checkpoint``); nothing below imports it.
"""
