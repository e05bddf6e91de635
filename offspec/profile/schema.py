"""The profile file format (versioned JSON) as a JSON Schema, and the small validator that checks it.

`SCHEMA` is the one definition: `profiles/schema.json` is its dump (a test keeps them equal), and
`validate()` interprets the subset of JSON Schema it uses (type, const, enum, required, properties,
items, minItems, maxItems, minimum, allOf, if/then/else), so no extra dependency is needed. Errors name the
file and the field: `profile x.json: field timings.target_pass[2][1]: expected a number, got "fast"`.
"""

from __future__ import annotations

from typing import Any

from offspec.errors import OffspecError

FORMAT = "offspec-profile"
ACCEPTANCE_FORMAT = "offspec-acceptance"
VERSION = 1

_NUM = {"type": "number", "minimum": 0}
_OPT_NUM = {"type": ["number", "null"], "minimum": 0}
_OPT_INT = {"type": ["integer", "null"], "minimum": 0}
_PAIRS = {"type": "array", "minItems": 1,
          "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "number", "minimum": 0}}}

ACCEPTANCE = {
    "type": "object",
    "description": "Mean accepted draft tokens per target pass vs tree budget (greedy verification).",
    "required": ["budgets", "accepted"],
    "properties": {
        "budgets": {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 1}},
        "accepted": {"type": "array", "minItems": 1, "items": _NUM},
        "depths": {"type": "array", "items": _NUM, "description": "mean deepest tree level per budget"},
        "samples": {"type": "array", "description": "per calibration pass: accepted count at each budget",
                    "items": {"type": "array", "items": {"type": "integer", "minimum": 0}}},
        "temperature": _NUM,
        "prompts": {"type": "integer", "minimum": 0},
        "passes": {"type": "integer", "minimum": 0},
        "branch": {"type": "integer", "minimum": 1},
        "max_depth": {"type": "integer", "minimum": 1},
        "pair": {"type": "string", "description": "the draft/target pair this was measured with"},
        "drafter": {"enum": ["model", "suffix", "hybrid"], "description": "who proposed the trees (default model)"},
        "model_share": {**_NUM, "description": "hybrid: share of passes in which the draft model ran"},
    },
}

HARDWARE = {
    "type": "object",
    "required": ["device_type", "device_name", "host_ram_bytes", "cpu_cores"],
    "properties": {
        "device_type": {"enum": ["cpu", "cuda"]},
        "device_name": {"type": "string"},
        "device_memory_bytes": _OPT_INT,
        "device_memory_bandwidth": {**_OPT_NUM, "description": "bytes/s the device reads its own memory"},
        "device_flops": {**_OPT_NUM, "description": "dense matmul FLOP/s in the compute dtype (peak for reference "
                                                    "profiles, measured for measured ones)"},
        "host_ram_bytes": {"type": "integer", "minimum": 0},
        "host_memory_bandwidth": _OPT_NUM,
        "cpu": {"type": "string"},
        "cpu_cores": {"type": "integer", "minimum": 1},
        "disk_read_bytes_per_s": {**_OPT_NUM,
                                  "description": "sequential read of the offload dir (page cache bypassed)"},
        "h2d_pinned_bytes_per_s": _OPT_NUM,
        "h2d_pageable_bytes_per_s": _OPT_NUM,
        "link": {"type": "string", "description": "host-device link, e.g. PCIe 4.0 x16"},
    },
}

SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://offspec.invalid/schema/profile-v1.json",
    "title": "offspec profile (version 1)",
    "description": "A hardware profile: a reference profile documents a machine's figures; a measured profile "
                   "(`offspec profile`) adds the model pair's timings, acceptance curve and chosen plan.",
    "type": "object",
    "required": ["format", "version", "kind", "name", "sources", "hardware"],
    "properties": {
        "format": {"const": FORMAT},
        "version": {"const": VERSION},
        "kind": {"enum": ["measured", "reference"]},
        "name": {"type": "string"},
        "description": {"type": "string"},
        "created": {"type": "string"},
        "offspec_version": {"type": "string"},
        "sources": {"type": "array", "minItems": 1, "items": {"type": "string"},
                    "description": "where every figure comes from"},
        "fingerprint": {"type": "string"},
        "key": {"type": "object", "required": ["hardware", "models", "placement"]},
        "quick": {"type": "boolean"},
        "hardware": HARDWARE,
        "models": {
            "type": "object",
            "required": ["target", "draft", "dtype"],
            "properties": {
                "target": {"type": "string"}, "draft": {"type": "string"}, "dtype": {"type": "string"},
                "target_params": _OPT_INT, "draft_params": _OPT_INT,
                "quant": {"type": "string"}, "draft_quant": {"type": "string"},
                "draft_vocab": {**_OPT_INT, "description": "tokens the draft's reduced LM head scores (null: all)"},
                "placement": {"type": ["object", "string", "null"]},
            },
        },
        "timings": {
            "type": "object",
            "required": ["context_tokens", "target_pass", "target_head_seconds"],
            "properties": {
                "context_tokens": {"type": "integer", "minimum": 0},
                "target_pass": {**_PAIRS, "description": "[tokens, seconds] of one target forward"},
                "target_head_seconds": {**_NUM, "description": "LM head + token choice per walk position"},
                "draft_step": {**_PAIRS, "description": "[nodes expanded at once, seconds] of one draft step "
                                                        "(absent without a draft model)"},
                "draft_propose": {**_PAIRS, "description": "[budget, seconds] to grow a whole tree (auto beams)"},
                "expand_ratio": _NUM,
                "calibration_depth": {"type": "integer", "minimum": 1},
                "compute_bound_from": _OPT_INT,
                "suffix_propose_seconds": {**_NUM, "description": "one suffix-drafter proposal, per pass"},
                "target_flop_seconds": {**_NUM, "description": "a target pass's matrix products per token at the "
                                                               "device's usable FLOP/s (the planner's FLOP term)"},
                "draft_flop_seconds": {**_NUM, "description": "the same for a draft step, per node"},
            },
        },
        "acceptance": {**ACCEPTANCE, "description": "the draft model's acceptance (absent without a draft model)"},
        "acceptance_suffix": {**ACCEPTANCE, "description": "the suffix drafter's acceptance"},
        "acceptance_hybrid": {**ACCEPTANCE, "description": "the hybrid drafter's acceptance"},
        "plan": {
            "type": "object",
            "required": ["budget", "max_beams", "max_depth", "predicted_tokens_per_second"],
            "properties": {
                "budget": {"type": "integer", "minimum": 1}, "max_beams": {"type": "integer", "minimum": 1},
                "max_depth": {"type": "integer", "minimum": 1}, "branch": {"type": "integer", "minimum": 1},
                "drafter": {"enum": ["model", "suffix", "hybrid"], "description": "the drafter planned for"},
                "predicted_tokens_per_second": _NUM, "autoregressive_tokens_per_second": _NUM,
                "predicted_speedup": _NUM,
                "speculate": {"type": "boolean", "description": "false: no tree is predicted to beat the target "
                                                                "alone, and --budget auto decodes without one"},
            },
        },
    },
    "allOf": [{"if": {"properties": {"kind": {"const": "measured"}}},
               "then": {"required": ["fingerprint", "key", "models", "timings", "plan"],
                        "allOf": [{"if": {"properties": {"models": {"properties": {"draft": {"const": "none"}}}}},
                                   "then": {"required": ["acceptance_suffix"]},
                                   "else": {"required": ["acceptance", "timings"],
                                            "properties": {"timings": {"required": ["draft_step"]}}}}]}}],
}

ACCEPTANCE_FILE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["format", "version", "sources", "acceptance"],
    "properties": {"format": {"const": ACCEPTANCE_FORMAT}, "version": {"const": VERSION},
                   "sources": {"type": "array", "minItems": 1, "items": {"type": "string"}},
                   "acceptance": ACCEPTANCE, "acceptance_suffix": ACCEPTANCE, "acceptance_hybrid": ACCEPTANCE},
}

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}


def _is(value: Any, name: str) -> bool:
    if name == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if name == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, _TYPES[name])


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) < 60 else text[:57] + "..."


def _errors(value: Any, schema: dict, path: str) -> list[str]:
    """Problems of `value` against `schema`, each as 'field PATH: what is wrong'. Stops at the first per path."""
    where = f"field {path}" if path else "the top level"
    if "const" in schema and value != schema["const"]:
        return [f"{where}: expected {schema['const']!r}, got {_show(value)}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: expected one of {', '.join(map(repr, schema['enum']))}, got {_show(value)}"]
    if "type" in schema:
        names = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        if not any(_is(value, n) for n in names):
            article = "an" if names[0][0] in "aeiou" else "a"
            return [f"{where}: expected {article} {' or '.join(names)}, got {_show(value)}"]
    if "minimum" in schema and _is(value, "number") and value < schema["minimum"]:
        return [f"{where}: must be >= {schema['minimum']}, got {value!r}"]
    problems: list[str] = []
    if isinstance(value, dict):
        for name in schema.get("required", []):
            if name not in value:
                problems.append(f"field {path + '.' if path else ''}{name} is missing")
        for name, sub in schema.get("properties", {}).items():
            if name in value:
                problems += _errors(value[name], sub, f"{path}.{name}" if path else name)
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0):
            problems.append(f"{where}: needs at least {schema['minItems']} item(s), got {len(value)}")
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            problems.append(f"{where}: allows at most {schema['maxItems']} item(s), got {len(value)}")
        if "items" in schema:
            for i, item in enumerate(value):
                problems += _errors(item, schema["items"], f"{path}[{i}]")
    for rule in schema.get("allOf", []):
        if "if" in rule:
            problems += _errors(value, rule.get("then" if not _errors(value, rule["if"], path) else "else", {}), path)
        else:
            problems += _errors(value, rule, path)
    return problems


def validate(data: Any, source: str, schema: dict = SCHEMA) -> Any:
    """Raise a one-line OffspecError naming `source` and the first bad field; return `data` when valid."""
    if isinstance(data, dict) and "version" in data and _is(data["version"], "integer") and data["version"] > VERSION:
        raise OffspecError(f"profile {source}: version {data['version']} is newer than this offspec understands "
                           f"({VERSION}); upgrade offspec or measure again with `offspec profile`")
    problems = _errors(data, schema, "")
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise OffspecError(f"profile {source}: {problems[0]}{more}; fix it or measure again with `offspec profile`")
    _check_lengths(data, source)
    return data


def _check_lengths(data: dict, source: str) -> None:
    """What JSON Schema cannot say: per-budget lists have one entry per budget."""
    for section in ("acceptance", "acceptance_suffix", "acceptance_hybrid"):
        if isinstance(data.get(section), dict):
            _check_section(data[section], source, section)


def _check_section(acc: dict, source: str, section: str) -> None:
    n = len(acc["budgets"])
    for name in ("accepted", "depths"):
        if name in acc and len(acc[name]) != n and (name == "accepted" or acc[name]):
            raise OffspecError(f"profile {source}: field {section}.{name}: needs one value per budget "
                               f"({n}), got {len(acc[name])}")
    for i, sample in enumerate(acc.get("samples", [])):
        if len(sample) != n:
            raise OffspecError(f"profile {source}: field {section}.samples[{i}]: needs one count per budget "
                               f"({n}), got {len(sample)}")
    if list(acc["budgets"]) != sorted(set(acc["budgets"])):
        raise OffspecError(f"profile {source}: field {section}.budgets: must be strictly increasing")
