"""``RecordingOptions``: what a recording keeps and checks, as one frozen value.

It is built and checked once where a user hands options to sharddbg (``Cluster.trace``, ``%%shard_trace``,
``sharddbg.record()``), then travels as it is: to the ranks as a plain dict (``as_dict`` / ``from_dict``, as
everything that crosses to an engine), into the recorder, and back in every payload's meta (the same field
names, ``schema.PAYLOAD_META_FIELDS``). Nothing here imports torch: the client and the engines share it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import RecordingOptionsError

DEFAULT_MAX_EVENTS = 200_000


@dataclass(frozen=True)
class RecordingOptions:
    """What one recording keeps and checks, on every rank alike.

    Parameters
    ----------
    max_events : int
        Events kept per rank (at least 1); beyond it events are only counted, as ``dropped``.
    unmask : bool
        Re-raise a TypeError that PyTorch would report only as "unsupported operand type(s)" as
        ``UnmaskedOpError``, chained to the real one.
    comm : bool
        Record every collective too, attributed to the op that caused it.
    spec_check : bool
        Compare each ShardTensor result's spec with its local tensor (at export, off the hot path).
    replicas : bool
        Digest every tensor that claims Replicate after each forward op (a copy and a hash per tensor).
    preflight : bool
        Compare each collective inside a recorded op across its group before it is issued (needs ``comm``).
    memory : bool
        On CUDA, the allocator's delta over each device-timed op (two counter reads per op).
    dtensor : bool
        Record the user's calls on plain DTensors too (not ShardTensors: those are always recorded), with the
        paths "dtensor_propagation" and "dtensor_redistribute": a torch function mode sees every torch call of
        the recording thread while it records.

    Raises
    ------
    RecordingOptionsError
        A field of the wrong type or out of range, or ``preflight`` without ``comm``.

    Examples
    --------
    >>> RecordingOptions(replicas=True).replace(max_events=1000)
    RecordingOptions(max_events=1000, unmask=True, comm=True, spec_check=True, replicas=True, preflight=False, memory=False, dtensor=True)
    """

    max_events: int = DEFAULT_MAX_EVENTS
    unmask: bool = True
    comm: bool = True
    spec_check: bool = True
    replicas: bool = False
    preflight: bool = False
    memory: bool = False
    dtensor: bool = True

    def __post_init__(self) -> None:
        if type(self.max_events) is not int or self.max_events < 1:
            raise RecordingOptionsError(f"max_events must be a positive integer, got {self.max_events!r}")
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.type == "bool" and type(value) is not bool:
                raise RecordingOptionsError(f"{field.name} must be True or False, got {value!r}")
        if self.preflight and not self.comm:
            raise RecordingOptionsError("preflight checks collectives: it needs comm=True")

    @classmethod
    def build(cls, options: "RecordingOptions | None" = None, **settings) -> "RecordingOptions":
        """``options`` (default: the defaults) with the ``settings`` that are not None in place.

        Parameters
        ----------
        options : RecordingOptions or None
            Where to start from.
        **settings
            Field names and values; a value of None leaves the field as ``options`` has it.

        Returns
        -------
        RecordingOptions
            The options, checked.

        Raises
        ------
        RecordingOptionsError
            ``options`` is not a RecordingOptions, a name is not a field, or a value is not allowed.

        Examples
        --------
        >>> RecordingOptions.build(None, memory=True, replicas=None).memory
        True
        """
        if options is None:
            options = cls()
        elif not isinstance(options, cls):
            raise RecordingOptionsError(f"options must be a RecordingOptions, got {type(options).__name__} {options!r}")
        given = {k: v for k, v in settings.items() if v is not None}
        return options.replace(**given) if given else options

    def replace(self, **changes) -> "RecordingOptions":
        """A copy with ``changes`` (field names and values), checked like a new one.

        Parameters
        ----------
        **changes
            Field names and their new values.

        Returns
        -------
        RecordingOptions
            The changed copy.

        Raises
        ------
        RecordingOptionsError
            A name that is not a field, or a value that is not allowed.

        Examples
        --------
        >>> RecordingOptions().replace(comm=False).comm
        False
        """
        unknown = sorted(set(changes) - set(self.names()))
        if unknown:
            raise RecordingOptionsError(f"no recording option named {', '.join(map(repr, unknown))}; the options: "
                                        f"{', '.join(self.names())}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The field names, in order.

        Returns
        -------
        tuple of str
            ``("max_events", "unmask", ...)``.

        Examples
        --------
        >>> RecordingOptions.names()[0]
        'max_events'
        """
        return tuple(f.name for f in dataclasses.fields(cls))

    def as_dict(self) -> dict:
        """The options as a plain dict (what travels to a rank and into a payload's meta).

        Returns
        -------
        dict
            Field name -> value.

        Examples
        --------
        >>> RecordingOptions().as_dict()["unmask"]
        True
        """
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "RecordingOptions":
        """The options ``as_dict`` wrote, checked again.

        Parameters
        ----------
        values : dict
            Field name -> value; fields left out take their defaults.

        Returns
        -------
        RecordingOptions
            The options.

        Raises
        ------
        RecordingOptionsError
            ``values`` is not a dict, or holds a name that is not a field or a value that is not allowed.

        Examples
        --------
        >>> RecordingOptions.from_dict({"max_events": 10}).max_events
        10
        """
        if not isinstance(values, dict):
            raise RecordingOptionsError(f"recording options must be a dict of field names, got {type(values).__name__}")
        return cls().replace(**values)
