"""Hardware and model-pair profiles: measure, plan the tree budget, keep profiles, adapt online, project.

Files, one concept each:
- hardware.py   what the machine is (identity) and how fast it moves and multiplies numbers
- timing.py     timing sweeps: target pass vs tokens, draft step vs nodes (early stop when compute-bound)
- measure.py    the pair: timings and the acceptance curve on the shipped calibration prompts
- curves.py     cost and acceptance curves (interpolation, extrapolation rules)
- routing.py    a mixture's routing in the calibration passes: distinct experts per tree budget
- coverage.py   the coverage curve, and the expert reads a pass pays where experts are read as routed
- planner.py    the tree shape maximizing expected tokens/s
- schema.py     the versioned JSON format as pydantic models, and validate() (profiles/schema.json: their JSON Schema)
- store.py      fingerprints, atomic save, validated load, lookup in the config dir, reference profiles
- builder.py    `offspec profile`'s work: measure, plan, assemble the profile
- auto.py       budget="auto" at load: matching profile, else a start-up estimate; attaches the policy
- adapt.py      the online policy: running acceptance statistics, re-plans on drift
- projection.py `offspec plan`: tokens/s for hardware you do not have, from documented figures
- report.py     tables and the PNG plot;  cli.py  `offspec profile` / `offspec plan`

Importing this package does not import torch; the measuring modules do.
"""

from .adapt import AdaptConfig, AdaptiveBudget
from .curves import AcceptanceCurve, CostCurve
from .planner import PairCosts, Plan, PlannerConfig, PlanPoint, plan
from .store import find_profile, load_profile, profiles_dir, reference_dir, save_profile

__all__ = ["AdaptConfig", "AdaptiveBudget", "AcceptanceCurve", "CostCurve", "PairCosts", "Plan", "PlannerConfig",
           "PlanPoint", "plan", "find_profile", "load_profile", "profiles_dir", "reference_dir", "save_profile"]
