"""Hybrid vs model acceptance at fixed budgets on the calibration prompts (as offspec profile measures it)."""
import sys, offspec
from offspec.profile.measure import measure_acceptance, calibration_prompts
g = offspec.load()
prompts = calibration_prompts(8)
budgets = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]
for mode in sys.argv[1:] or ["hybrid"]:
    run = measure_acceptance(g, budgets, prompts, 4, drafter=mode)
    s = run.section
    print(mode, s["accepted"], s.get("model_share"), f"draft s/pass {run.draft_seconds:.3f}", flush=True)
