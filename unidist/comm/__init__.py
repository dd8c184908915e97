"""The collective layer: one Communicator written on a backend's Engine, for the world and for groups.

It knows nothing of models or optimizers (``unidist.train`` builds on it, never the reverse).
"""

from unidist.comm.collectives import Collectives
from unidist.comm.communicator import Communicator
from unidist.comm.dtypes import SUPPORTED_DTYPES, split_sizes
from unidist.comm.engine import Engine, SoloEngine, SortedOrder
from unidist.comm.group import Group
from unidist.comm.work import DONE, EngineWork, Handle, Work

__all__ = ["DONE", "SUPPORTED_DTYPES", "Collectives", "Communicator", "Engine", "EngineWork", "Group", "Handle",
           "SoloEngine", "SortedOrder", "Work", "split_sizes"]
