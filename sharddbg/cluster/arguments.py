"""Arguments checked before anything is sent to a rank: timeouts, ranks, counts. Each check raises one
``ClusterError`` that says what was given and what is accepted, so bad input never reaches the engines
(where it would fail on some ranks only, or after the code already ran)."""

from __future__ import annotations

import collections
import math
import numbers
import unicodedata

from ..errors import ClusterError


# torch.distributed's collective timeout also bounds how long the ranks wait for each other while their
# process group connects at start: below a second the start fails (a store wait "after 0ms") on any host.
MIN_COLLECTIVE_TIMEOUT_S = 1.0


def seconds(name: str, value, *, allow_none: bool = False) -> float | None:
    """A timeout: a finite number of seconds above 0 (``None`` too when ``allow_none``)."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ClusterError(f"{name} must be a number of seconds (e.g. 60), got {type(value).__name__} {value!r}")
    value = float(value)
    if math.isnan(value) or math.isinf(value) or value <= 0:
        raise ClusterError(f"{name} must be a finite number of seconds above 0, got {value!r}"
                           + ("; every wait in sharddbg is bounded" if math.isinf(value) else ""))
    return value


def collective_timeout(value) -> float:
    """torch.distributed's collective timeout: a number of seconds of at least ``MIN_COLLECTIVE_TIMEOUT_S``."""
    value = seconds("collective_timeout", value)
    if value < MIN_COLLECTIVE_TIMEOUT_S:
        raise ClusterError(
            f"collective_timeout must be at least {MIN_COLLECTIVE_TIMEOUT_S:g} s, got {value!r}: it also bounds how "
            f"long the ranks wait for each other while torch.distributed connects them at start, so a shorter one "
            f"fails the start; give 1 or more seconds (the default is 60)")
    return value


def positive_int(name: str, value) -> int:
    """A count of at least 1 (an int, not a bool or a float)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ClusterError(f"{name} must be a whole number of at least 1, got {type(value).__name__} {value!r}")
    return int(value)


def flag(name: str, value) -> bool:
    """True or False, nothing else (a string "False" would read as true)."""
    if not isinstance(value, bool):
        raise ClusterError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def ranks(targets, n: int, name: str = "targets") -> list[int]:
    """``targets`` as a list of ranks of a cluster of ``n``: None (every rank), an int, a range/slice, or a
    list of ints; refused when empty, out of range, not ints, or naming a rank twice (``name``: the argument,
    in the message)."""
    if targets is None:
        return list(range(n))
    if isinstance(targets, slice):
        chosen = list(range(n))[targets]
    elif isinstance(targets, range):
        chosen = list(targets)
    elif isinstance(targets, numbers.Integral) and not isinstance(targets, bool):
        chosen = [int(targets)]
    elif isinstance(targets, (list, tuple, set, frozenset)):
        chosen = list(targets)
    else:
        raise ClusterError(f"{name} must be a rank, a list of ranks or a slice, got {type(targets).__name__} "
                           f"{targets!r}")
    bad = [r for r in chosen if isinstance(r, bool) or not isinstance(r, numbers.Integral) or not 0 <= r < n]
    if bad:
        raise ClusterError(f"ranks {bad} do not exist; this cluster has ranks 0..{n - 1}")
    if not chosen:
        raise ClusterError(f"{name} {targets!r} name no rank; this cluster has ranks 0..{n - 1}")
    chosen = [int(r) for r in chosen]
    repeated = repeated_ranks(chosen)
    if repeated:
        # each rank would run the call twice, once after the other: never what was meant
        raise ClusterError(f"{name} {targets!r} name {_ranks_words(repeated)} more than once; each rank runs a call "
                           f"once: give each rank once ({name}={list(dict.fromkeys(chosen))})")
    return chosen


def repeated_ranks(chosen: list[int]) -> list[int]:
    """The ranks ``chosen`` holds more than once, in order."""
    return sorted(r for r, count in collections.Counter(chosen).items() if count > 1)


def _ranks_words(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def variable_name(name: str) -> str:
    """``name`` as Python stores a variable of that name: identifiers are NFKC-normalised when code is
    compiled (``µ = 1``, with MICRO SIGN, binds ``μ``, GREEK SMALL LETTER MU), so a name the user types must
    be normalised the same way to be found in a namespace."""
    return unicodedata.normalize("NFKC", name)


# What one engine holds once torch, physicsnemo and every patch are loaded, measured on this project's CPU
# machine (bench/RESULTS.md, "memory per engine"): about 0.63 GB; rounded up for the work a cell adds.
ENGINE_MEMORY_BYTES = int(0.7e9)


def check_memory(n: int) -> None:
    """Refuse ``n`` engines that would not fit in the memory available now (``Cluster(force=True)`` skips
    this): starting them would swap or bring in the OOM killer halfway through the start."""
    import psutil

    need = n * ENGINE_MEMORY_BYTES
    available = psutil.virtual_memory().available
    if need > available:
        fits = max(1, available // ENGINE_MEMORY_BYTES)
        raise ClusterError(
            f"{n} ranks need about {need / 1e9:.0f} GB ({ENGINE_MEMORY_BYTES / 1e9:.1f} GB per engine) but this "
            f"host has {available / 1e9:.1f} GB available: at most {fits} ranks fit. Pass force=True "
            f"(%shard_cluster start --force) to start them anyway.")
