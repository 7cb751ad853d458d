"""The answer of a re-run without sharddbg (``blame=True``): does the failure happen in plain processes too?

``Blame`` holds what the plain processes found (``cluster.blame`` runs them): whether the statement fails
there too, each output and gradient compared with the unsharded reference, what it raised, the versions, and
whether any sharddbg module was loaded after all (none should be). Pure data.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Blame", "BlameTensor"]


@dataclass(frozen=True)
class BlameTensor:
    """One output or gradient of the plain re-run against the unsharded reference."""

    name: str
    section: str  # "outputs", "input_grads", "param_grads"
    max_abs: float
    ok: bool
    note: str = ""


@dataclass
class Blame:
    """What the re-run without sharddbg found. ``fails_without``: True (it fails there too: not sharddbg's
    doing), False (it passes there: sharddbg caused it), None (the re-run itself could not be made:
    ``problem`` says why)."""

    fails_without: bool | None
    command: str
    tensors: list[BlameTensor]
    raised: str | None
    versions: dict
    sharddbg_loaded: list[str] = field(default_factory=list)
    problem: str | None = None

    @property
    def short(self) -> str:
        """A few words for a table row (the smoke matrix): "fails without sharddbg too (what it raised, or what
        is off)", "passes without sharddbg: sharddbg's doing", or why it could not be told."""
        if self.fails_without is None:
            return f"without sharddbg: could not be told ({self.problem})"
        if self.fails_without:
            what = self.raised or "; ".join(f"{t.name} off by {t.max_abs:.1e}" for t in self.tensors if not t.ok)
            return f"fails without sharddbg too ({what})"
        return "passes without sharddbg: sharddbg's doing"

    @property
    def summary(self) -> str:
        """One sentence: fails there too (what, with which versions), passes there (sharddbg's doing), or why
        it could not be told."""
        if self.fails_without is None:
            return f"could not be told: {self.problem}"
        versions = ", ".join(f"{k} {v}" for k, v in self.versions.items() if k != "python")
        if self.fails_without:
            if self.raised:
                what = f"it raises {self.raised}"
            else:
                bad = [t for t in self.tensors if not t.ok]
                what = "; ".join(f"{t.name} max abs {t.max_abs:.3g}" for t in bad[:3]) + (", ..." if len(bad) > 3 else "")
                what = f"{what} still depart{'s' if len(bad) == 1 else ''} from the single-device run"
            return (f"fails without sharddbg too ({versions}): in plain processes (torch.distributed, physicsnemo, "
                    f"your code; no sharddbg module loaded) {what}: not sharddbg's doing")
        return (f"passes without sharddbg ({versions}): in plain processes every output and gradient "
                f"({len(self.tensors)}) agrees with the single-device run, so sharddbg itself changed the result: "
                f"a sharddbg problem, please report it")
