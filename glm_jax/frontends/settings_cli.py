"""Command lines generated from the settings dataclasses (`glm_jax.settings`) by tyro: each
field's flag, default, rule, choices and help are written once, in its `setting(...)`.

    @dataclasses.dataclass(frozen=True)
    class TrainCommand:                     # a front end's command: its settings and its own flags
        settings: TrainConfig = TrainConfig()
        run_config: str | None = None       # the settings file (SETTINGS_FILE_FIELD)
        coordinator: Annotated[str | None, optional_value("ADDRESS")] = None

    command = settings_cli.parse(TrainCommand, argv, description="...", load_file=run_config.load)
    command.settings                        # a checked TrainConfig (a bad value: cli.UserError)

One override mechanism for every front end: the settings file that the command's settings-file
field names (YAML: train.py --run-config, sections as a run directory's run_config.yaml;
decode.py --decode-config, DecodeConfig's fields) gives the defaults, and the flags given
override them. Flags keep the flat spellings of the fields
(`--lr`, not `--schedule.lr`); a bool is a `--x/--no-x` pair; a field's `aliases` are accepted
as they are and its `deprecated` spellings with a note naming the flag. A mapping setting
(FrozenDict) has no flag of its own: the front end sets it (e.g. from --kernel-config items).
Only the front ends import tyro (the `cli` extra).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from typing import Annotated, Any, Literal

from glm_jax import settings as settings_lib
from glm_jax.frontends import cli
from glm_jax.settings import FrozenDict, Settings


def _tyro():
    from glm_jax.extras import require

    return require("tyro")


def optional_value(metavar: str) -> Any:
    """tyro's marker for a command's own optional flag (default None): `metavar` names its value
    in --help, and no "(default: None)" follows its help."""
    return _tyro().conf.arg(metavar=metavar, help_behavior_hint="")


@dataclasses.dataclass(frozen=True)
class Processes:
    """Several processes (hosts): every process runs the same command; the mesh spans all their
    devices; only process 0 prints and writes files."""

    coordinator: Annotated[str | None, optional_value("ADDRESS")] = None
    """process 0's address HOST:PORT, which every process gives (with --num-processes, --process-id)"""
    num_processes: Annotated[int | None, optional_value("N")] = None
    """N processes"""
    process_id: Annotated[int | None, optional_value("ID")] = None
    """0..N-1"""
    distributed: bool = False
    """join a multi-process run that jax.distributed detects by itself (TPU pod, SLURM, Open MPI, or
    JAX_COORDINATOR_ADDRESS in the environment, which also turns this on)"""


class _Pending(dict):
    """A settings section's values as parsed, constructed (and checked) after the parse."""

    def __init__(self, cls: type, values: dict):
        super().__init__(values)
        self.cls = cls

    def build(self) -> Settings:
        return self.cls(**{k: v.build() if isinstance(v, _Pending) else v for k, v in self.items()})


def _field_type(f: dataclasses.Field, hint: Any) -> Any:
    """The annotated type tyro makes field `f`'s flag of."""
    tyro = _tyro()
    md = f.metadata
    choices = md.get("choices")
    if choices is not None:
        choices = tuple(choices() if callable(choices) else choices)
        hint = Literal[choices] | None if type(None) in settings_lib._types(hint) else Literal[choices]
    aliases = tuple(md.get("aliases", ()))      # the deprecated spellings are rewritten before the parse
    return Annotated[hint, tyro.conf.arg(aliases=aliases or None, metavar=md.get("metavar") or _metavar(hint),
                                         help_behavior_hint=_default_hint(f))]


#: The value a flag takes, by its type, where the setting names none: no `{None}|STR` in --help.
_METAVARS = {str: "TEXT", int: "INT", float: "FLOAT"}


def _metavar(hint: Any) -> str | None:
    """`STR` for `str | None` and the like (an optional scalar); None: tyro's own (choices, bools)."""
    kinds = settings_lib._types(hint) - {type(None)}
    if type(None) not in settings_lib._types(hint) or len(kinds) != 1:
        return None
    return _METAVARS.get(next(iter(kinds)))


def _default_hint(f: dataclasses.Field) -> str | None:
    """The help's "(default: ...)": none where the default is None or the help says it already;
    None: tyro's own."""
    if f.default is None or "default" in (f.metadata.get("help") or ""):
        return ""
    return None


def _registry():
    tyro = _tyro()
    from tyro.constructors import StructConstructorSpec, StructFieldSpec

    registry = tyro.constructors.ConstructorRegistry()

    @registry.struct_rule
    def settings_rule(info) -> Any:
        cls = info.type
        if not (isinstance(cls, type) and issubclass(cls, Settings)):
            return None
        default = info.default if isinstance(info.default, cls) else cls()
        hints = typing.get_type_hints(cls)
        fields = []
        for f in dataclasses.fields(cls):
            if hints[f.name] is FrozenDict or f.metadata.get("cli") is False:
                continue                # no flag: the default's value (`given`), set by the front end
            section = settings_lib._is_section(f)
            fields.append(StructFieldSpec(name=f.name, type=hints[f.name] if section else _field_type(f, hints[f.name]),
                                          default=getattr(default, f.name), helptext=f.metadata.get("help")))
        given = lambda **values: _Pending(cls, {**{f.name: getattr(default, f.name)    # a suppressed field: its default
                                                   for f in dataclasses.fields(cls)}, **values})
        return StructConstructorSpec(instantiate=given, fields=tuple(fields))

    return registry


def deprecated_spellings(cls: type) -> dict[str, str]:
    """Old spelling -> flag, over the fields of settings class `cls` and its sections."""
    out = {}
    for f in dataclasses.fields(cls):
        if settings_lib._is_section(f):
            out |= deprecated_spellings(f.default_factory)
        else:
            out |= {old: "--" + f.name.replace("_", "-") for old in f.metadata.get("deprecated", ())}
    return out


def _settings_fields(command_cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(command_cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(command_cls)
            if isinstance(hints[f.name], type) and issubclass(hints[f.name], Settings)}


#: The command's field that names a settings file (YAML) whose values the flags override.
SETTINGS_FILE_FIELD = "run_config"


def parse(command_cls: type, argv: list[str] | None, *, description: str, load_file=None,
          settings_file: str = SETTINGS_FILE_FIELD, deprecated: dict[str, str] | None = None) -> Any:
    """Parse `argv` (default sys.argv[1:]) into an instance of the dataclass `command_cls`, whose
    Settings fields are built and checked (a SettingError -> cli.UserError); `load_file(path)` ->
    the settings of the file the command's field `settings_file` names, the flags' defaults;
    `deprecated`: old spellings of the command's own flags -> the flags."""
    tyro = _tyro()
    argv = list(sys.argv[1:] if argv is None else argv)
    settings_fields = _settings_fields(command_cls)
    spellings = dict(deprecated or {})      # old spelling -> flag, of the command's own fields
    for cls in settings_fields.values():
        spellings |= deprecated_spellings(cls)
    argv = _renamed(argv, spellings)
    defaults = {}
    if load_file is not None:
        pre = argparse.ArgumentParser(add_help=False)
        pre.add_argument("--" + settings_file.replace("_", "-"), dest="file", default=None)
        path = pre.parse_known_args(argv)[0].file
        if path:
            with cli.user_errors():
                loaded = load_file(path)
            defaults = {name: loaded for name, cls in settings_fields.items() if isinstance(loaded, cls)}
    default = command_cls(**defaults)
    with _registry():
        parsed = tyro.cli(command_cls, args=argv, default=default, description=description,
                          config=(tyro.conf.OmitArgPrefixes, tyro.conf.OmitSubcommandPrefixes))
    with cli.user_errors():
        built = {name: getattr(parsed, name).build() for name in settings_fields
                 if isinstance(getattr(parsed, name), _Pending)}
    return dataclasses.replace(parsed, **built) if built else parsed


def _renamed(argv: list[str], spellings: dict[str, str]) -> list[str]:
    """argv with each deprecated spelling replaced by its flag, a note printed for each."""
    out = []
    for arg in argv:
        name, eq, value = arg.partition("=")
        if name in spellings:
            print(f"note: {name} is deprecated; use {spellings[name]}", file=sys.stderr)
            arg = spellings[name] + eq + value
        out.append(arg)
    return out

