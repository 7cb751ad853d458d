"""Client side: start/stop ranks, run code on them with bounded waits, hang reports, traces, orphans.

``Cluster`` is the facade; ``processes``, ``execution``, ``control`` and ``recording`` do its work (see
``cluster.cluster``). ``mesh`` validates the mesh before anything starts; ``registry`` finds and reaps
clusters a dead owner left; ``hang`` turns the ranks' diagnoses into a report; ``versions`` warns about
untested torch / physicsnemo versions.
"""

from .cluster import Cluster, active_cluster, running_clusters
from .execution import RankOutput
from ..analysis.hang import HangReport
from .mesh import MeshSpec, resolve_mesh
from .versions import TESTED_VERSIONS, check_versions, tested_version

__all__ = ["Cluster", "RankOutput", "active_cluster", "running_clusters", "HangReport", "MeshSpec", "resolve_mesh",
           "TESTED_VERSIONS", "check_versions", "tested_version"]
