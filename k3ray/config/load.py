"""Reading a config: the YAML file, the command line's KEY=VALUE assignments laid over it, and validation errors
as one line per field, naming the file."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from k3ray.config.base import ConfigError
from k3ray.config.job import JobConfig


def _format_errors(err: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        name, sep, rest = msg.partition(": ")
        if sep and name.isidentifier() and e["loc"] and name in _section_fields(e["loc"]):  # a section's own check
            field, msg = f"{field}.{name}", rest
        lines.append(f"  {field}: {msg}")
    return "\n".join(lines)


def _section_fields(loc: tuple) -> set[str]:
    """The field names of the config section at `loc` (empty where loc is not a section)."""
    model: Any = JobConfig
    for part in loc:
        annotation = getattr(model, "model_fields", {}).get(part)
        model = getattr(annotation, "annotation", None)
    return set(getattr(model, "model_fields", {}))


def parse_config(data: dict[str, Any], source: str = "<config>") -> JobConfig:
    try:
        return JobConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err, source)) from None


def parse_assignments(pairs: list[str], example: str = "parallel.ep=2") -> dict[str, Any]:
    """['a.b=1', 'c=x'] -> {'a.b': 1, 'c': 'x'}, values parsed as YAML (true, 2, 1e-3, [1, 2])."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ConfigError(f"{pair!r}: expected KEY=VALUE, e.g. {example}")
        try:
            out[key] = yaml.safe_load(value)
        except yaml.YAMLError as err:
            raise ConfigError(f"{pair!r}: the value is not valid YAML ({str(err).splitlines()[0]})") from None
    return out


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    """Set data['a']['b'] = value for dotted='a.b' (overrides from the command line)."""
    *parents, leaf = dotted.split(".")
    node = data
    for key in parents:
        node = node.setdefault(key, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {dotted}: {key} is not a section")
    node[leaf] = value


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> JobConfig:
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as err:
        raise ConfigError(f"{path}: cannot read config ({err.strerror})") from None
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    for key, value in (overrides or {}).items():
        set_dotted(data, key, value)
    return parse_config(data, str(path))
