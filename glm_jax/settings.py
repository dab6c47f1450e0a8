"""Settings of a program's run as frozen dataclasses: one place for each setting's default,
its rule and its name on the command line, shared by train, decode and serve settings.

    @dataclasses.dataclass(frozen=True)
    class ScheduleConfig(Settings):
        SECTION = "schedule"
        steps: int = setting(600, at_least=1)
        lr: float = setting(3e-3, above=0, flag="--lr")

Constructing one checks every field (`Settings.__post_init__`): a value of the wrong type or
outside its rule is a `SettingError` naming the setting, its flag and the rule, in one line.
A dataclass may hold sections (fields whose default is another `Settings`); `from_dict` reads
the nested mapping of a YAML file, `to_dict` writes it, `with_values` sets fields by their
flat names (each field name is unique over the sections, so a flag's dest names one field) and
`differences` lists what changed between two of them.

Settings are hashable (a settings value may be a static argument of a jitted function): a
mapping-valued setting is a `FrozenDict` (a tuple of pairs that reads as a mapping).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

MISSING = dataclasses.MISSING


class SettingError(ValueError):
    """A setting whose value is of the wrong type or outside its rule, or a name no setting has."""


class FrozenDict(Mapping):
    """An immutable, hashable mapping (its `items`: a tuple of (key, value) pairs, in order);
    nested mappings are FrozenDicts too. Equal to a dict of the same items, shown as one."""

    __slots__ = ("pairs",)

    def __init__(self, mapping: Any = ()):      # a mapping or (key, value) pairs
        pairs = mapping.items() if isinstance(mapping, Mapping) else mapping
        object.__setattr__(self, "pairs", tuple((k, FrozenDict(v) if isinstance(v, Mapping) else v)
                                                for k, v in pairs))

    def __setattr__(self, name, value):
        raise AttributeError("a FrozenDict is immutable")

    def __getitem__(self, key):
        for k, v in self.pairs:
            if k == key:
                return v
        raise KeyError(key)

    def __iter__(self):
        return (k for k, _ in self.pairs)

    def __len__(self) -> int:
        return len(self.pairs)

    def __hash__(self) -> int:
        return hash(frozenset(self.pairs))

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and dict(self.pairs) == dict(other.items())

    def to_dict(self) -> dict:
        """A plain dict (nested ones too), e.g. for YAML."""
        return {k: v.to_dict() if isinstance(v, FrozenDict) else v for k, v in self.pairs}

    def __repr__(self) -> str:
        return repr(self.to_dict())


def setting(default: Any = MISSING, *, default_factory: Any = MISSING, at_least: float | None = None,
            above: float | None = None, at_most: float | None = None, choices: Any = None,
            flag: str | None = None, help: str | None = None, metavar: str | None = None,
            aliases: tuple[str, ...] = (), deprecated: tuple[str, ...] = (), cli: bool = True,
            fixed: str | None = None, per_invocation: bool = False) -> Any:
    """A settings field. at_least / above / at_most: bounds of a number (None passes); choices:
    the values it may take (a tuple, checked; or a function giving them, for the command line);
    flag: its command-line name in messages (default `--` + the name with dashes); help,
    metavar: its command line's (the front ends generate their parsers from these); aliases:
    other spellings its flag is accepted by; deprecated: old spellings, accepted with a note
    naming the flag; cli: False for a setting the front end sets itself (no flag of its own);
    fixed: why a resumed run cannot change it; per_invocation: a setting of one
    invocation, not of the run (never compared)."""
    rule = {"at_least": at_least, "above": above, "at_most": at_most}
    metadata = {"rule": {k: v for k, v in rule.items() if v is not None}, "flag": flag, "fixed": fixed,
                "per_invocation": per_invocation, "help": help, "metavar": metavar, "choices": choices,
                "aliases": tuple(aliases), "deprecated": tuple(deprecated), "cli": cli}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def impl_choices(op: str):
    """`choices` of a kernel setting: a function giving the implementations of pallas_kernels op
    `op` (its registry, through `glm_jax.ops`; imports jax, so only a command line calls it)."""
    def choices() -> tuple[str, ...]:
        from glm_jax.ops import impl_choices as registered

        return tuple(registered(op))
    return choices


def section(cls: type) -> Any:
    """A field holding a section: a Settings dataclass with its defaults."""
    return dataclasses.field(default_factory=cls)


class Settings:
    """Base of the settings dataclasses (frozen): checks and normalises its fields on construction."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for f in dataclasses.fields(self):
            if not _is_section(f):
                object.__setattr__(self, f.name, _checked(self, f, hints[f.name], getattr(self, f.name)))


def _flag_of(owner: type | Settings, name: str) -> str:
    """The command-line name of field `name` of `owner`."""
    f = {f.name: f for f in dataclasses.fields(owner)}[name]
    return f.metadata.get("flag") or "--" + name.replace("_", "-")


def _path_of(owner: type | Settings, name: str) -> str:
    """The dotted name of a field as a YAML file nests it: `schedule.lr`."""
    return f"{owner.SECTION}.{name}" if owner.SECTION else name


def _is_section(f: dataclasses.Field) -> bool:
    return f.default_factory is not MISSING and isinstance(f.default_factory, type) \
        and issubclass(f.default_factory, Settings)


def _checked(owner: Settings, f: dataclasses.Field, hint: Any, value: Any) -> Any:
    """`value` as field `f` holds it (an int for a float field as float, a list for a tuple
    field as tuple) -> the value, or SettingError."""
    name = f"{_flag_of(owner, f.name)} ({_path_of(owner, f.name)})"
    allowed = _types(hint)
    if value is None:
        if type(None) in allowed:
            return None
        raise SettingError(f"{name} needs a value")
    if float in allowed and isinstance(value, str):    # YAML reads 3e-3 (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            pass
    if float in allowed and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if tuple in allowed and isinstance(value, list):
        value = tuple(value)
    if FrozenDict in allowed and isinstance(value, Mapping) and not isinstance(value, FrozenDict):
        value = FrozenDict(value)
    if isinstance(value, bool) and bool not in allowed or not isinstance(value, tuple(allowed)):
        kinds = " or ".join(sorted(t.__name__ for t in allowed if t is not type(None)))
        raise SettingError(f"{name} must be {_article(kinds)}, got {value!r}")
    choices = f.metadata.get("choices")
    if isinstance(choices, tuple) and value not in choices:
        raise SettingError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
    rule = f.metadata.get("rule", {})
    for key, bound, ok in (("at_least", ">=", lambda v, b: v >= b), ("above", ">", lambda v, b: v > b),
                           ("at_most", "<=", lambda v, b: v <= b)):
        if key in rule and not ok(value, rule[key]):
            raise SettingError(f"{name} must be {bound} {rule[key]:g}, got {value!r}")
    return value


def _types(hint: Any) -> set[type]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return set().union(*(_types(h) for h in typing.get_args(hint)))
    if hint is None or hint is type(None):
        return {type(None)}
    return {typing.get_origin(hint) or hint}


def _article(kinds: str) -> str:
    return ("an " if kinds[0] in "aeiou" else "a ") + {"int": "integer", "float": "number", "str": "string",
                                                      "bool": "boolean"}.get(kinds, kinds)


# ---------------------------------------------------------------------- reading and writing
def to_dict(settings: Settings, *, per_invocation: bool = True) -> dict:
    """The nested mapping of a YAML file: sections as mappings, tuples as lists; without the
    settings of one invocation unless `per_invocation`."""
    out = {}
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if _is_section(f):
            out[f.name] = to_dict(value, per_invocation=per_invocation)
        elif per_invocation or not f.metadata.get("per_invocation"):
            out[f.name] = (list(value) if isinstance(value, tuple) else value.to_dict()
                           if isinstance(value, FrozenDict) else value)
    return out


def from_dict(cls: type, data: Mapping, *, where: str) -> Settings:
    """The settings of the nested mapping `data` (missing keys keep their defaults); a key no
    setting has is a SettingError naming `where` (e.g. the file) and the known keys."""
    if not isinstance(data, Mapping):
        raise SettingError(f"{where}: expected a mapping of settings, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise SettingError(f"{where}: unknown setting {_path_of(cls, unknown[0])!r} (known: "
                           f"{', '.join(sorted(fields))})")
    values = {name: from_dict(fields[name].default_factory, value, where=where) if _is_section(fields[name])
              else value for name, value in data.items()}
    return cls(**values)


def with_values(settings: Settings, values: Mapping[str, Any]) -> Settings:
    """`settings` with the fields named by `values` (flat names, found in any section) set."""
    left = dict(values)
    new = _set(settings, left)
    if left:
        raise SettingError(f"no setting named {sorted(left)[0]!r}")
    return new


def _set(settings: Settings, left: dict) -> Settings:
    changes = {}
    for f in dataclasses.fields(settings):
        if _is_section(f):
            changes[f.name] = _set(getattr(settings, f.name), left)
        elif f.name in left:
            changes[f.name] = left.pop(f.name)
    return dataclasses.replace(settings, **changes)


def flat(settings: Settings) -> dict[str, Any]:
    """Every field of `settings` and its sections by its flat name (a command line's dests)."""
    return {f.name: value for _, f, value, _ in _pairs(settings, settings)}


# ---------------------------------------------------------------------- comparing
@dataclasses.dataclass(frozen=True)
class Change:
    """A setting that differs between two settings of one run; `fixed`: why it may not."""

    path: str
    flag: str
    old: Any
    new: Any
    fixed: str | None

    def __str__(self) -> str:
        return f"{self.path} ({self.flag}) {shown(self.old)} -> {shown(self.new)}"


def differences(old: Settings, new: Settings) -> list[Change]:
    """The settings of the run (not those of one invocation) that differ from `old` to `new`."""
    return [Change(_path_of(owner, f.name), _flag_of(owner, f.name), a, b, f.metadata.get("fixed"))
            for owner, f, a, b in _pairs(old, new) if a != b and not f.metadata.get("per_invocation")]


def _pairs(old: Settings, new: Settings) -> Iterator[tuple[Settings, dataclasses.Field, Any, Any]]:
    for f in dataclasses.fields(old):
        a, b = getattr(old, f.name), getattr(new, f.name)
        if _is_section(f):
            yield from _pairs(a, b)
        else:
            yield old, f, a, b


def shown(value: Any) -> str:
    """A setting's value as a message shows it (a tuple of paths space-separated, None as "(default)")."""
    if isinstance(value, tuple):
        return " ".join(map(str, value)) or "(none)"
    return "(default)" if value is None else str(value)
