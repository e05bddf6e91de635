"""Write offspec/data/acceptance_prior.json (the curves `--budget auto` plans from before a pair is profiled)
from a measured profile of the default pair:

    offspec profile --quick --max-tree 64 --prompts 8 --out prior-profile.json
    python scripts/acceptance_prior.py prior-profile.json "offspec profile --quick --max-tree 64 --prompts 8"

With `--self` last, from a profile of the default target with its own copy as the draft, it writes
offspec/data/acceptance_prior_self.json instead (what `offspec plan --draft-params self` assumes):

    offspec profile --draft self --quick --max-tree 256 --prompts 8 --out self-profile.json --no-save
    python scripts/acceptance_prior.py self-profile.json "offspec profile --draft self --quick --max-tree 256 \
        --prompts 8" --self

Every drafter's curve should reach the same largest budget: the planner never extrapolates acceptance upward,
so a curve that stops at 16 caps that drafter's plans at 16 (the hybrid's prior did, 2026-11-23 to -24).
"""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from offspec.profile.schema import ACCEPTANCE_FORMAT, VERSION, AcceptanceFile, validate  # noqa: E402
from offspec.profile.store import ACCEPTANCE_SECTIONS  # noqa: E402
from offspec.util.files import atomic_write  # noqa: E402


def main(profile_path: str, command: str, self_draft: bool = False) -> None:
    try:
        profile = json.loads(Path(profile_path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        sys.exit(f"error: cannot read the profile {profile_path}: {exc}; write one with `offspec profile --out`")
    sections = {s: profile[s] for s in ACCEPTANCE_SECTIONS.values() if s in profile}
    largest = {s: max(sec["budgets"]) for s, sec in sections.items()}
    if "acceptance" not in sections or len(set(largest.values())) != 1:
        sys.exit(f"error: the profile needs every drafter's curve up to one budget (it has {largest}); "
                 f"measure it with --max-tree")
    pair = sections["acceptance"]["pair"]
    use = ("`offspec plan --draft-params self` assumes it" if self_draft else
           "used by --budget auto before a pair is profiled, and online adaptation rescales it")
    source = (f"measured with `{command}` on {pair}, the calibration prompts (offspec/data/calibration.jsonl), "
              f"greedy, {sections['acceptance']['passes']} passes per drafter; {use}")
    data = {"format": ACCEPTANCE_FORMAT, "version": VERSION, "sources": [source], **sections}
    validate(data, "acceptance prior", AcceptanceFile)
    out = ROOT / "offspec" / "data" / ("acceptance_prior_self.json" if self_draft else "acceptance_prior.json")
    atomic_write(out, json.dumps(data))  # never a half-written prior
    print(f"wrote {out.relative_to(ROOT)}: " + ", ".join(
        f"{s} accepted {sec['accepted'][-1]} at budget {max(sec['budgets'])}" for s, sec in sections.items()))


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[3:] not in ([], ["--self"]):
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2], sys.argv[3:] == ["--self"])
