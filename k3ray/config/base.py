"""What every config section shares: strict parsing (unknown keys and YAML booleans for numbers are errors) and the
one error type every configuration problem is raised as."""
from __future__ import annotations

from typing import Annotated, Any, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ConfigError(ValueError):
    """A configuration problem, with the file and field it concerns."""


class Section(BaseModel):
    # inf and nan are never a setting (`optimizer.lr: .inf` would train to nothing but guard trips)
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        """YAML's `true` is not a number: pydantic would read it as 1."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and field.annotation is not bool \
                        and bool not in get_args(field.annotation):
                    raise ValueError(f"{name}: expected {_type_name(field.annotation)}, got {str(value).lower()}")
        return data


def _type_name(annotation: Any) -> str:
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


Beta = Annotated[float, Field(ge=0, lt=1)]
