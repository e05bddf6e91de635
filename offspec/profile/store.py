"""Profiles on disk: fingerprints, atomic save, validated load, and where they are found.

Measured profiles live in `<config dir>/profiles/<fingerprint>.json` (`offspec.util.paths.config_dir()`), one per
(hardware, model pair, placement): `--budget auto` finds the one that matches the loaded set-up by its
fingerprint. Reference profiles (documented figures of common hardware) ship in the repository's
`profiles/` (or `OFFSPEC_PROFILES_DIR`). Writes go to a temp file that is renamed into place, so an
interrupted run (Ctrl-C) never leaves a partial profile.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Optional

from offspec.errors import OffspecError
from offspec.util.paths import config_dir
from offspec.util.files import atomic_write, remove_stale_temps
from offspec.util.writable import check_writable_dir

from .coverage import expert_reads_of
from .curves import AcceptanceCurve, CostCurve
from .planner import PairCosts
from .schema import ACCEPTANCE_FORMAT, AcceptanceFile, validate

_VOLATILE = ("predicted", "seconds", "time", "bandwidth", "created", "budget")  # measured or derived from free memory
_PLACEMENT_KEYS = ("device", "quant", "layers", "tiers")  # of `info.extra["placement"]` (offspec.offload)


def profiles_dir() -> Path:
    """Where measured profiles are saved and looked up."""
    return config_dir() / "profiles"


def reference_dir() -> Path:
    """The shipped reference profiles: `OFFSPEC_PROFILES_DIR`, else the repository's `profiles/`."""
    if os.environ.get("OFFSPEC_PROFILES_DIR"):
        return Path(os.environ["OFFSPEC_PROFILES_DIR"]).expanduser()
    return Path(__file__).resolve().parents[2] / "profiles"


def _canonical(value: Any) -> Any:
    """JSON-safe, order-independent form; drops fields of a placement summary that are measurements."""
    if isinstance(value, dict):
        return {str(k): _canonical(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
                if not any(word in str(k) for word in _VOLATILE)}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, float):
        return round(value, 6)
    if value is None or isinstance(value, (int, str, bool)):
        return value
    return str(value)


def placement_key(placement: Any) -> Any:
    """The stable part of an offloading placement summary: where each layer lives and in which format.

    Budgets derived from free memory and predicted times change from run to run and are left out."""
    if placement is None:
        return "resident"
    if isinstance(placement, dict) and any(k in placement for k in _PLACEMENT_KEYS):
        return _canonical({k: placement[k] for k in _PLACEMENT_KEYS if k in placement})
    return _canonical(placement)


def profile_key(hardware_identity: dict, models: dict, placement: Any) -> dict:
    """What a profile is valid for: the machine, the model pair (names, dtype, quantization), the placement."""
    return {"hardware": _canonical(hardware_identity), "models": _canonical(models),
            "placement": placement_key(placement)}


def fingerprint(key: dict) -> str:
    text = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def profile_path(key: dict) -> Path:
    return profiles_dir() / f"{fingerprint(key)}.json"


def find_profile(key: dict) -> Optional[Path]:
    """The saved measured profile for `key`, or None."""
    path = profile_path(key)
    return path if path.is_file() else None


# what a profile's timings depend on beside the machine, the pair and the placement: the build of the CPU kernels
# and the rows of the draft's LM head (offspec/models/draft_vocab.py; absent: all). Saved profiles that differ only there
# are named at load as measured with something else (`stale_profiles`).
MEASURED_WITH = {"kernels": "another build of offspec's CPU kernels",
                 "draft_vocab": "another draft vocabulary (--draft-vocab)"}


def _without_build(key: dict) -> str:
    """A profile key as text, leaving out what it was measured with (MEASURED_WITH)."""
    models = key.get("models")
    models = {k: v for k, v in models.items() if k not in MEASURED_WITH} if isinstance(models, dict) else models
    return json.dumps(_canonical({**key, "models": models}), sort_keys=True)


def _saved_keys() -> list[tuple[Path, dict, str]]:
    """Every saved profile's (path, key, created) whose key can be read; unreadable files and other JSON are left
    out (`offspec profile` and `find_profile` report those)."""
    found = []
    for path in sorted(profiles_dir().glob("*.json")) if profiles_dir().is_dir() else []:
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            saved = data.get("key")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(saved, dict):
            found.append((path, saved, str(data.get("created", ""))))
    return found


def stale_profiles(key: dict) -> list[tuple[Path, str]]:
    """Saved profiles of this machine, pair and placement measured with another build of the CPU kernels or another
    draft vocabulary (their timings no longer hold, so `find_profile` does not match them; `offspec profile`
    measures again), each with what it was measured with ("another build of offspec's CPU kernels", ...)."""
    want, found = _without_build(key), []
    models = key.get("models") if isinstance(key.get("models"), dict) else {}
    for path, saved, _ in _saved_keys():
        if saved != key and _without_build(saved) == want:
            other = saved.get("models", {})
            found.append((path, " and ".join(what for name, what in MEASURED_WITH.items()
                                             if other.get(name) != models.get(name))))
    return found


def _pair_of(key: dict) -> str:
    """What a pair's acceptance depends on, as text: the models, their types, the draft's head and mapping; not the
    machine, the placement or the kernels' build (those change timings only)."""
    models = key.get("models")
    models = {k: v for k, v in models.items() if k != "kernels"} if isinstance(models, dict) else models
    return json.dumps(_canonical(models), sort_keys=True)


def acceptance_profiles(key: dict) -> list[Path]:
    """Saved profiles of this model pair measured with another placement (other --device-mem, --max-budget or
    --max-context), machine or kernel build: their timings do not hold for `key`, their acceptance curves do (a
    tree's acceptance is the pair's). Oldest first, by when they were measured."""
    want = _pair_of(key)
    found = [(created, path) for path, saved, created in _saved_keys() if saved != key and _pair_of(saved) == want]
    return [path for _, path in sorted(found)]


def read_json(path: Path, what: str = "profile") -> Any:
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise OffspecError(f"{what} {path} not found") from None
    except UnicodeDecodeError:
        raise OffspecError(f"{what} {path} is not text (damaged?); delete it, or measure again with "
                           f"`offspec profile`") from None
    except OSError as exc:
        raise OffspecError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise OffspecError(f"{what} {path}: not valid JSON at line {exc.lineno} column {exc.colno} ({exc.msg}); "
                           f"fix it or measure again with `offspec profile`") from None


def load_profile(path: Path) -> dict:
    """Read and validate a profile (measured or reference); errors name the file and the field."""
    return validate(read_json(path), str(path))


def load_acceptance(path: Path) -> tuple[AcceptanceCurve, str]:
    """An acceptance curve from a measured profile or an acceptance file; returns it with a description."""
    data = read_json(path)
    if isinstance(data, dict) and data.get("format") == ACCEPTANCE_FORMAT:
        validate(data, str(path), AcceptanceFile)
    else:
        validate(data, str(path))
        if "acceptance" not in data:
            raise OffspecError(f"profile {path}: field acceptance is missing (a reference profile has none; "
                               f"pass a measured profile)")
    acc = data["acceptance"]
    pair = acc.get("pair") or (f"{data['models']['target']} / {data['models']['draft']}" if "models" in data else "?")
    return acceptance_of(data, str(path)), f"{pair} ({path})"


def save_profile(data: dict, path: Path) -> Path:
    """Validate, then write atomically: a temp file in the same directory, fsync, rename. A failed write
    (full disk, read-only directory) is one OffspecError line and leaves the previous file as it was; temp
    files of runs that were killed are removed first."""
    path = Path(path)
    validate(data, str(path))
    check_writable_dir(path.parent, "the profile directory", "make it writable, or save the profile "
                       "elsewhere (OFFSPEC_CONFIG_DIR, or --no-save with --out FILE)")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path.parent)

    def write(f) -> None:
        json.dump(data, f, indent=1, ensure_ascii=False)
        f.write("\n")

    try:
        atomic_write(path, write, encoding="utf-8")  # fsync'd; Ctrl-C included, never a partial file
    except OSError as exc:
        raise OffspecError(f"cannot write profile {path}: {exc.strerror or exc}; free space or make "
                           f"{path.parent} writable (nothing was changed)") from None
    return path


def costs_of(data: dict, source: str = "profile") -> PairCosts:
    """The planner's cost model from a measured profile's `timings` (no draft_step: no draft model) and, for a
    mixture read as routed, its `experts` section (the expert reads a pass pays)."""
    t = data["timings"]
    propose = t.get("draft_propose")
    return PairCosts(target_pass=CostCurve.of(t["target_pass"], f"{source}: timings.target_pass"),
                     target_head=float(t["target_head_seconds"]),
                     draft_step=CostCurve.of(t["draft_step"], f"{source}: timings.draft_step") if "draft_step" in t
                     else None,
                     draft_propose=CostCurve.of(propose, f"{source}: timings.draft_propose") if propose else None,
                     expand_ratio=float(t.get("expand_ratio", 1.0)),
                     calibration_depth=int(t.get("calibration_depth", 64)),
                     suffix_seconds=float(t.get("suffix_propose_seconds", 0.0)),
                     target_flop_seconds=float(t.get("target_flop_seconds", 0.0)),
                     draft_flop_seconds=float(t.get("draft_flop_seconds", 0.0)),
                     head_rows=int(t.get("head_rows") or 1),
                     expert_reads=expert_reads_of(data.get("experts"), source))


ACCEPTANCE_SECTIONS = {"model": "acceptance", "suffix": "acceptance_suffix", "hybrid": "acceptance_hybrid"}


def acceptance_of(data: dict, source: str = "profile", drafter: str = "model") -> AcceptanceCurve:
    """The acceptance curve of one drafter (`ACCEPTANCE_SECTIONS` names its section of the profile)."""
    section = ACCEPTANCE_SECTIONS[drafter]
    acc = data[section]
    return AcceptanceCurve.of(acc["budgets"], acc["accepted"], acc.get("depths", ()), acc.get("samples", ()),
                              what=f"{source}: {section}", model_share=float(acc.get("model_share", 1.0)))


def acceptance_curves(data: dict, source: str = "profile") -> dict[str, AcceptanceCurve]:
    """Every drafter's curve that `data` (a profile or an acceptance file) holds, by drafter."""
    return {d: acceptance_of(data, source, d) for d, section in ACCEPTANCE_SECTIONS.items() if section in data}


def reference_profiles() -> list[Path]:
    return sorted(p for p in reference_dir().glob("*.json") if p.name != "schema.json")


def resolve_reference(name: str) -> Path:
    """A reference profile by path, file name or stem (`rtx4090`)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    for candidate in reference_profiles():
        if name in (candidate.name, candidate.stem):
            return candidate
    names = ", ".join(p.stem for p in reference_profiles()) or "none found"
    raise OffspecError(f"hardware profile {name!r} not found; pass a file or one of: {names}")
