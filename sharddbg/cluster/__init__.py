"""Client side: start/stop ranks, torch.distributed bootstrap, mesh validation, bounded waits, orphans."""

from .cluster import Cluster, RankOutput, active_cluster
from .hang import HangReport
from .mesh import MeshSpec, resolve_mesh

__all__ = ["Cluster", "RankOutput", "active_cluster", "HangReport", "MeshSpec", "resolve_mesh"]
