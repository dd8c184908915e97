"""The collective layer: written once on a backend's primitives, for the world and for groups.

It knows nothing of models or optimizers (``unidist.train`` builds on it, never the reverse).
"""

from unidist.comm.collectives import Collectives
from unidist.comm.dtypes import SUPPORTED_DTYPES, split_sizes
from unidist.comm.group import Group, SoloComm, SoloGroup
from unidist.comm.primitives import Primitives
from unidist.comm.work import DONE, EngineWork, Handle, Work

__all__ = ["DONE", "SUPPORTED_DTYPES", "Collectives", "EngineWork", "Group", "Handle", "Primitives", "SoloComm",
           "SoloGroup", "Work", "split_sizes"]
