"""The ("ddp", "domain") mesh a cluster is built with: parsing and validation, before anything starts."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import MeshError

AXES = ("ddp", "domain")


@dataclass(frozen=True)
class MeshSpec:
    """A 2-D mesh of ``ddp * domain`` ranks. Rank r sits at (r // domain, r % domain)."""

    ddp: int
    domain: int

    @property
    def size(self) -> int:
        return self.ddp * self.domain

    @property
    def shape(self) -> tuple[int, int]:
        return (self.ddp, self.domain)

    def coordinate(self, rank: int) -> dict[str, int]:
        return {"ddp": rank // self.domain, "domain": rank % self.domain}

    def domain_group(self, rank: int) -> list[int]:
        """Global ranks sharing ``rank``'s domain group (the ranks one sample is sharded over)."""
        first = (rank // self.domain) * self.domain
        return list(range(first, first + self.domain))

    def as_dict(self) -> dict[str, int]:
        return {"ddp": self.ddp, "domain": self.domain}

    def __str__(self) -> str:
        return f"ddp={self.ddp},domain={self.domain}"


def _as_size(axis: str, value) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool):
        raise MeshError(f"mesh axis {axis!r} must be a positive integer, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        if not text.lstrip("-").isdigit():
            raise MeshError(
                f"mesh axis {axis!r} must be a positive integer, got {value!r}; "
                f"write for example --mesh ddp=1,domain=4"
            )
        value = int(text)
    if isinstance(value, float):
        if not value.is_integer():
            raise MeshError(f"mesh axis {axis!r} must be a positive integer, got {value!r}")
        value = int(value)
    if not isinstance(value, int):
        raise MeshError(f"mesh axis {axis!r} must be a positive integer, got {type(value).__name__} {value!r}")
    if value == -1:
        return None  # "infer me", as torch's init_device_mesh spells it
    if value < 1:
        raise MeshError(f"mesh axis {axis!r} must be at least 1, got {value}")
    return value


def parse_mesh(mesh) -> dict:
    """Accept ``{"ddp": 1, "domain": 4}``, ``"ddp=1,domain=4"``, ``(1, 4)`` or None; return a dict of axis -> size|None."""
    if mesh is None:
        return {"ddp": None, "domain": None}
    given = mesh
    if isinstance(mesh, MeshSpec):
        return mesh.as_dict()
    if isinstance(mesh, str):
        parsed = {}
        for part in filter(None, (p.strip() for p in mesh.split(","))):
            if "=" not in part:
                raise MeshError(f"mesh entry {part!r} is not NAME=SIZE; write for example ddp=1,domain=4")
            name, _, size = part.partition("=")
            name = name.strip()
            if name in parsed:  # a dict keeps the last, silently: the user meant one of the two
                raise MeshError(f"mesh {mesh!r} gives axis {name!r} twice ({name}={parsed[name].strip()} and "
                                f"{name}={size.strip()}); give each axis once, e.g. ddp=1,domain=4")
            parsed[name] = size
        mesh = parsed
    elif isinstance(mesh, (tuple, list)):
        if len(mesh) != 2:
            raise MeshError(f"a mesh given as a sequence needs 2 sizes (ddp, domain), got {len(mesh)}: {mesh!r}")
        mesh = dict(zip(AXES, mesh))
    if not isinstance(mesh, dict):
        raise MeshError(f"mesh must be a dict like {{'ddp': 1, 'domain': 4}} or 'ddp=1,domain=4', got {mesh!r}")
    unknown = set(mesh) - set(AXES)
    if unknown:
        raise MeshError(f"unknown mesh axis {sorted(unknown)}; the axes are {AXES}")
    sizes = {axis: _as_size(axis, mesh.get(axis)) for axis in AXES}
    # given, yet read as None: written -1, "infer this axis"; only one of two can be inferred from n
    inferred = [axis for axis in AXES if mesh.get(axis) is not None and sizes[axis] is None]
    if len(inferred) == len(AXES):
        raise MeshError(f"mesh {given!r} gives both axes as -1 (inferred), but at most one axis may be -1: give "
                        f"the other its size, e.g. ddp=1,domain=-1 (or leave the mesh out: ddp=1, every rank in one "
                        f"domain group)")
    return sizes


def resolve_mesh(n: int | None, mesh=None) -> MeshSpec:
    """Validate ``ddp * domain == n``, inferring whichever of the three is missing."""
    if n is not None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise MeshError(f"the number of ranks must be a positive integer, got {n!r}")
    sizes = parse_mesh(mesh)
    ddp, domain = sizes["ddp"], sizes["domain"]
    if n is None:
        if ddp is None and domain is None:
            raise MeshError("give the number of ranks (-n) or both mesh axes (ddp=..,domain=..)")
        if ddp is None or domain is None:
            missing = "ddp" if ddp is None else "domain"
            raise MeshError(f"the mesh leaves {missing} to be inferred, but the number of ranks is not given: give "
                            f"the number of ranks (-n), or both mesh axes (ddp=..,domain=..)")
        return MeshSpec(ddp, domain)
    if ddp is None and domain is None:
        return MeshSpec(1, n)  # the common case: one sample sharded over every rank
    if domain is None:
        if n % ddp:
            raise MeshError(f"{n} ranks cannot be split into ddp={ddp} groups (n % ddp = {n % ddp})")
        return MeshSpec(ddp, n // ddp)
    if ddp is None:
        if n % domain:
            raise MeshError(f"{n} ranks cannot be split into domain groups of {domain} (n % domain = {n % domain})")
        return MeshSpec(n // domain, domain)
    if ddp * domain != n:
        raise MeshError(
            f"mesh ddp={ddp} x domain={domain} has {ddp * domain} ranks but the cluster has n={n}; "
            f"make ddp * domain == n, or give one axis and let the other be inferred"
        )
    return MeshSpec(ddp, domain)
