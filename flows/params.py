"""Flow parameters: a preset, an optional full `RunSpec`, and one optional top-level parameter per RunSpec field.

So all of these work against a deployment whose default parameters are just `{"preset": "tiny-cpu"}`:

    prefect deployment run sage-train/tiny-cpu                                    # the preset as is
    prefect deployment run sage-train/tiny-cpu --param max_steps=2 --param method=grpo
    prefect deployment run sage-train/tiny-cpu --params '{"spec": {"max_steps": 2}}'  # partial spec on the preset

Precedence: preset < fields given in `spec` < top-level field parameters (None = not given). Every top-level field
parameter, and every field of `spec` (a `SpecPatch`), carries the RunSpec field's type and constraints (Literal
values, ge/le, ...), so the server-side parameter schema rejects a bad value or an unknown field when the flow run
is created, naming the field ("Validation failed for field 'method' ..."). Cross-field rules (light_min <=
light_max, teacher needed, micro_batch_size dividing a step's rows) are RunSpec validators, checked on the merged
spec when the flow starts: a partial `spec` is not a whole run, so they would judge it against RunSpec's defaults
instead of the preset's values.

The generated parameters are keyword-only and are appended to the flow function's `__signature__`; the function
takes them through `**overrides`. The field list follows RunSpec automatically.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, create_model, model_validator

from sage_core.presets import PRESETS
from sage_core.spec import RunSpec, with_absolute_paths

PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type]
SPEC_FIELDS: tuple[str, ...] = tuple(RunSpec.model_fields)


def _override_annotation(name: str) -> Any:
    field = RunSpec.model_fields[name]
    ann = field.annotation
    if field.metadata:
        ann = Annotated[(ann, *field.metadata)]  # keeps ge/le/gt constraints in the JSON schema
    return Optional[ann]  # noqa: UP007 - runtime construction


class _Patch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _from_spec(cls, value: Any) -> Any:
        """A RunSpec (or another patch) given in Python: the fields it sets."""
        return value.model_dump(exclude_unset=True) if isinstance(value, BaseModel) else value


SpecPatch = create_model(  # every RunSpec field, optional, with its type and constraints; no cross-field rules
    "SpecPatch", __base__=_Patch, __doc__="Some RunSpec fields, applied on top of the preset.",
    **{n: (_override_annotation(n), Field(None, description=RunSpec.model_fields[n].description))
       for n in SPEC_FIELDS})


def override_parameters() -> list[inspect.Parameter]:
    return [inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=_override_annotation(n))
            for n in SPEC_FIELDS]


def override_docs() -> str:
    lines = []
    for n in SPEC_FIELDS:
        f = RunSpec.model_fields[n]
        desc = (f.description or n.replace("_", " ")).replace("\n", " ")
        lines.append(f"    {n}: RunSpec.{n} override ({desc}); None keeps the preset/spec value.")
    return "\n".join(lines)


def with_spec_overrides(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give `fn(*, ..., **overrides)` a signature with one keyword-only parameter per RunSpec field.

    `fn`'s own parameters must be keyword-only and must not clash with RunSpec field names.
    """
    sig = inspect.signature(fn, eval_str=True)  # real types: Prefect's schema needs them, not strings
    own = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.VAR_KEYWORD]
    clash = {p.name for p in own} & set(SPEC_FIELDS)
    if clash:
        raise ValueError(f"{fn.__name__}: parameters {sorted(clash)} clash with RunSpec fields")
    if any(p.kind is not inspect.Parameter.KEYWORD_ONLY for p in own):
        raise ValueError(f"{fn.__name__}: declare its own parameters keyword-only (after `*`)")
    fn.__signature__ = sig.replace(parameters=[*own, *override_parameters()])  # type: ignore[attr-defined]
    ann = {p.name: p.annotation for p in own if p.annotation is not inspect.Parameter.empty}
    if sig.return_annotation is not inspect.Signature.empty:
        ann["return"] = sig.return_annotation
    ann.update({p.name: p.annotation for p in override_parameters()})
    fn.__annotations__ = ann
    doc = inspect.getdoc(fn) or ""
    if "Args:" in doc:
        doc = doc.rstrip() + "\n" + override_docs() + "\n"
    fn.__doc__ = doc
    return fn


def given_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    unknown = set(overrides) - set(SPEC_FIELDS)
    if unknown:
        raise TypeError(f"unknown RunSpec fields {sorted(unknown)}")
    return {k: v for k, v in overrides.items() if v is not None}


def resolve_spec(preset: str | None = "tiny-cpu", spec: BaseModel | Mapping[str, Any] | None = None,
                 overrides: Mapping[str, Any] | None = None) -> RunSpec:
    """preset < spec (a RunSpec, SpecPatch or dict: only the fields it sets) < overrides (the non-None ones),
    validated as a RunSpec."""
    values: dict[str, Any] = {}
    if preset:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
        values.update(PRESETS[preset])
    if spec is not None:
        if isinstance(spec, BaseModel):
            values.update(spec.model_dump(exclude_unset=True))
        else:
            values.update(dict(spec))
    values.update(given_overrides(overrides or {}))
    return with_absolute_paths(RunSpec(**values))
