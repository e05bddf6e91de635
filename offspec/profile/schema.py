"""The profile file format (versioned JSON) as pydantic models, and `validate`, which checks a file against them.

The models are the one definition: `profiles/schema.json` is the JSON Schema pydantic generates from `Profile`
(`json_schema()`; a test keeps the committed file equal to it, and says how to rewrite it). Validation is strict (JSON types as written:
"2" is no integer, true no number); unknown fields are kept. Errors are one line naming the file and the field:
`profile x.json: field timings.target_pass[2][1]: expected a number, got 'fast'`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_core import PydanticCustomError

from offspec.errors import OffspecError
from offspec.util.files import atomic_write

FORMAT = "offspec-profile"
ACCEPTANCE_FORMAT = "offspec-acceptance"
VERSION = 1

Num = Annotated[float, Field(ge=0)]  # a JSON number >= 0 (an integer is one too)
Int0 = Annotated[int, Field(ge=0)]
Int1 = Annotated[int, Field(ge=1)]
Pairs = Annotated[list[Annotated[list[Num], Field(min_length=2, max_length=2)]], Field(min_length=1)]
Drafter = Literal["model", "suffix", "hybrid"]


def _problem(field: str, what: str) -> PydanticCustomError:
    """A rule of the format beyond a field's type, reported at `field` (relative to where it is raised)."""
    return PydanticCustomError("offspec", "{field}: {what}", {"field": field, "what": what})


class _Section(BaseModel):
    """A section of the file. A field typed `X = None` may be absent but, when present, is an X (never null);
    `Optional[X]` fields may also be null."""

    model_config = ConfigDict(strict=True, extra="allow")


class Acceptance(_Section):
    """Mean accepted draft tokens per target pass vs tree budget (greedy verification)."""

    budgets: Annotated[list[Int1], Field(min_length=1)]
    accepted: Annotated[list[Num], Field(min_length=1)]
    depths: list[Num] = Field(None, description="mean deepest tree level per budget")
    samples: list[list[Int0]] = Field(None, description="per calibration pass: accepted count at each "
                                                                  "budget")
    temperature: Num = None
    prompts: Int0 = None
    passes: Int0 = None
    branch: Int1 = None
    max_depth: Int1 = None
    pair: str = Field(None, description="the draft/target pair this was measured with")
    drafter: Drafter = Field(None, description="who proposed the trees (default model)")
    model_share: Num = Field(None, description="hybrid: share of passes in which the draft model ran")

    @model_validator(mode="after")
    def _one_entry_per_budget(self) -> "Acceptance":
        n = len(self.budgets)
        if len(self.accepted) != n:
            raise _problem("accepted", f"needs one value per budget ({n}), got {len(self.accepted)}")
        if self.depths and len(self.depths) != n:
            raise _problem("depths", f"needs one value per budget ({n}), got {len(self.depths)}")
        for i, sample in enumerate(self.samples or []):
            if len(sample) != n:
                raise _problem(f"samples[{i}]", f"needs one count per budget ({n}), got {len(sample)}")
        if self.budgets != sorted(set(self.budgets)):
            raise _problem("budgets", "must be strictly increasing")
        return self


class Experts(_Section):
    """A mixture's coverage curve and expert reads (offspec/profile/coverage.py): distinct experts per layer a verify
    pass of the root and B tree nodes routes to, measured on the calibration passes."""

    budgets: Annotated[list[Int0], Field(min_length=1, description="tree nodes, strictly increasing, the first 0")]
    distinct: Annotated[list[Num], Field(min_length=1, description="mean distinct experts per layer, per budget")]
    experts_used: Int1 = Field(description="experts one token is routed to in a layer (top k)")
    experts_per_layer: Int1
    layers: Int1 = Field(description="mixture layers")
    read_as_routed: bool = Field(description="the experts are fetched as routed into an expert cache (from SSD or RAM)")
    passes: Int0 = None
    miss_rate: Num = Field(None, description="share of the routed experts the expert cache did not hold")
    read_seconds: Optional[Num] = Field(None, description="seconds one missed expert adds to a pass (null: none "
                                                          "known)")

    @model_validator(mode="after")
    def _consistent(self) -> "Experts":
        n = len(self.budgets)
        if len(self.distinct) != n:
            raise _problem("distinct", f"needs one value per budget ({n}), got {len(self.distinct)}")
        if self.budgets != sorted(set(self.budgets)) or self.budgets[0] != 0:
            raise _problem("budgets", "must start at 0 and be strictly increasing")
        if self.experts_used > self.experts_per_layer:
            raise _problem("experts_used", f"must be <= experts_per_layer ({self.experts_per_layer})")
        if any(d > self.experts_per_layer for d in self.distinct):
            raise _problem("distinct", f"must be <= experts_per_layer ({self.experts_per_layer})")
        if self.miss_rate is not None and self.miss_rate > 1:
            raise _problem("miss_rate", f"must be <= 1, got {self.miss_rate}")
        return self


class Hardware(_Section):
    device_type: Literal["cpu", "cuda"]
    device_name: str
    device_memory_bytes: Optional[Int0] = None
    device_memory_bandwidth: Optional[Num] = Field(None, description="bytes/s the device reads its own memory")
    device_flops: Optional[Num] = Field(None, description="dense matmul FLOP/s in the compute dtype (peak for "
                                                          "reference profiles, measured for measured ones)")
    host_ram_bytes: Int0
    host_memory_bandwidth: Optional[Num] = None
    cpu: str = None
    cpu_cores: Int1
    disk_read_bytes_per_s: Optional[Num] = Field(None, description="sequential read of the offload dir (page "
                                                                   "cache bypassed)")
    h2d_pinned_bytes_per_s: Optional[Num] = None
    h2d_pageable_bytes_per_s: Optional[Num] = None
    link: str = Field(None, description="host-device link, e.g. PCIe 4.0 x16")


class Key(_Section):
    hardware: Any
    models: Any
    placement: Any


class Models(_Section):
    target: str
    draft: str
    dtype: str
    target_params: Optional[Int0] = None
    draft_params: Optional[Int0] = None
    quant: str = None
    draft_quant: str = None
    draft_vocab: Optional[Int0] = Field(None, description="tokens the draft's reduced LM head scores (null: all)")
    placement: Union[dict[str, Any], str, None] = None

    @field_validator("placement", mode="wrap")
    @classmethod
    def _placement(cls, value: Any, handler: Any) -> Any:
        if value is not None and not isinstance(value, (dict, str)):
            raise PydanticCustomError("offspec_type", "", {"expected": "an object or a string or null"})
        return value


class Timings(_Section):
    context_tokens: Int0
    target_pass: Pairs = Field(description="[tokens, seconds] of one target forward")
    target_head_seconds: Num = Field(description="LM head + token choice, one call (of one walk position)")
    head_rows: Int1 = Field(None, description="walk positions one LM-head call covers (absent: 1)")
    draft_step: Pairs = Field(None, description="[nodes expanded at once, seconds] of one draft step "
                                                          "(absent without a draft model)")
    draft_propose: Pairs = Field(None, description="[budget, seconds] to grow a whole tree (auto beams)")
    expand_ratio: Num = None
    calibration_depth: Int1 = None
    compute_bound_from: Optional[Int0] = None
    suffix_propose_seconds: Num = Field(None, description="one suffix-drafter proposal, per pass")
    target_flop_seconds: Num = Field(None, description="a target pass's matrix products per token at the "
                                                         "device's usable FLOP/s (the planner's FLOP term)")
    draft_flop_seconds: Num = Field(None, description="the same for a draft step, per node")


class PlanSection(_Section):
    budget: Int1
    max_beams: Int1
    max_depth: Int1
    branch: Int1 = None
    drafter: Drafter = Field(None, description="the drafter planned for")
    predicted_tokens_per_second: Num
    autoregressive_tokens_per_second: Num = None
    predicted_speedup: Num = None
    speculate: bool = Field(None, description="false: no tree is predicted to beat the target alone, "
                                                        "and --budget auto decodes without one")
    no_tree_reason: str = Field(None, description="why no tree pays, where the experts a tree touches are the "
                                                   "reason (a mixture read as routed)")


class Profile(_Section):
    """A hardware profile: a reference profile documents a machine's figures; a measured profile (`offspec profile`)
    adds the model pair's timings, acceptance curve and chosen plan. A measured profile also needs fingerprint, key,
    models, timings and plan; with a draft model acceptance and timings.draft_step, without one (draft "none")
    acceptance_suffix."""

    model_config = ConfigDict(title="offspec profile (version 1)")

    format: Literal["offspec-profile"]
    version: Literal[1]
    kind: Literal["measured", "reference"]
    name: str
    description: str = None
    created: str = None
    offspec_version: str = None
    sources: Annotated[list[str], Field(min_length=1, description="where every figure comes from")]
    fingerprint: str = None
    key: Key = None
    quick: bool = None
    hardware: Hardware
    models: Models = None
    timings: Timings = None
    acceptance: Acceptance = Field(None, description="the draft model's acceptance (absent without a "
                                                               "draft model)")
    acceptance_suffix: Acceptance = Field(None, description="the suffix drafter's acceptance")
    acceptance_hybrid: Acceptance = Field(None, description="the hybrid drafter's acceptance")
    experts: Experts = Field(None, description="a mixture of experts' coverage curve (absent: a dense model)")
    plan: PlanSection = None

    @model_validator(mode="after")
    def _measured_has_its_sections(self) -> "Profile":
        if self.kind != "measured":
            return self
        for name in ("fingerprint", "key", "models", "timings", "plan"):
            if getattr(self, name) is None:
                raise _problem(name, "is missing")
        if self.models.draft == "none":
            needed = ["acceptance_suffix"]
        else:
            needed = ["acceptance", "timings.draft_step"]
        for name in needed:
            section, _, field = name.partition(".")
            value = getattr(self, section)
            if value is None or (field and getattr(value, field) is None):
                raise _problem(name, "is missing")
        return self


class AcceptanceFile(_Section):
    """Acceptance curves alone (offspec/data/acceptance_prior.json, `offspec plan --acceptance`)."""

    format: Literal["offspec-acceptance"]
    version: Literal[1]
    sources: Annotated[list[str], Field(min_length=1)]
    acceptance: Acceptance
    acceptance_suffix: Acceptance = None
    acceptance_hybrid: Acceptance = None


_EXPECTED = {"int_type": "an integer", "float_type": "a number", "string_type": "a string", "bool_type": "a boolean",
             "list_type": "an array", "dict_type": "an object", "model_type": "an object", "model_attributes_type":
             "an object", "none_required": "null"}


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a profile, as profiles/schema.json holds it (`write_json_schema` writes it there)."""
    return {"$schema": "https://json-schema.org/draft/2020-12/schema",
            "$id": "https://offspec.invalid/schema/profile-v1.json", **Profile.model_json_schema()}


def write_json_schema(path: Path) -> Path:
    """Write `json_schema()` to `path` (the repository's profiles/schema.json)."""
    atomic_write(path, json.dumps(json_schema(), indent=1) + "\n")
    return path


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) < 60 else text[:57] + "..."


def _path(loc: tuple) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _message(error: dict) -> str:
    """One pydantic error as 'field PATH: what is wrong'."""
    kind, ctx, loc = error["type"], error.get("ctx") or {}, tuple(error["loc"])
    if kind == "offspec":  # a rule of the format (_problem): its field is relative to where it was raised
        path = _path(loc + (ctx["field"],))
        return f"field {path} is missing" if ctx["what"] == "is missing" else f"field {path}: {ctx['what']}"
    path = _path(loc)
    where = f"field {path}" if path else "the top level"
    got = _show(error.get("input"))
    if kind == "missing":
        return f"field {path} is missing"
    if kind == "literal_error":
        expected = ctx["expected"]
        return f"{where}: expected {'one of ' if ' or ' in expected else ''}{expected}, got {got}"
    if kind in ("greater_than_equal", "greater_than"):
        return f"{where}: must be {'>=' if kind == 'greater_than_equal' else '>'} {ctx.get('ge', ctx.get('gt'))}, " \
               f"got {got}"
    if kind == "too_short":
        return f"{where}: needs at least {ctx['min_length']} item(s), got {ctx['actual_length']}"
    if kind == "too_long":
        return f"{where}: allows at most {ctx['max_length']} item(s), got {ctx['actual_length']}"
    if kind == "offspec_type":
        return f"{where}: expected {ctx['expected']}, got {got}"
    if kind in _EXPECTED:
        return f"{where}: expected {_EXPECTED[kind]}, got {got}"
    return f"{where}: {error['msg']}"


def validate(data: Any, source: str, model: type[BaseModel] = Profile) -> Any:
    """Raise a one-line OffspecError naming `source` and the first bad field; return `data` (as it was) when valid.
    `model`: Profile, or AcceptanceFile for a file of acceptance curves."""
    version = data.get("version") if isinstance(data, dict) else None
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        raise OffspecError(f"profile {source}: version {version} is newer than this offspec understands "
                           f"({VERSION}); upgrade offspec or measure again with `offspec profile`")
    try:
        model.model_validate(data)
    except ValidationError as exc:
        problems = [_message(e) for e in exc.errors()]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise OffspecError(f"profile {source}: {problems[0]}{more}; fix it or measure again with `offspec profile`"
                           ) from None
    return data

