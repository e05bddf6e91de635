"""The exact-distribution sampling test shared by the drafters' suites: the target's exact P(t1, t2) from plain
forwards, and a chi-square of sampled outcomes against it."""

from __future__ import annotations

import collections

import torch

from offspec.spec.sampling import TokenChooser

# an earlier turn: the suffix drafter proposes what followed "<|assistant|>" there, so its trees are not empty
MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"},
            {"role": "user", "content": "Hi"}]


def exact_two_token_distribution(gen, prompt_ids, sampling, allowed=None):
    """P(t1, t2) of the target alone, from plain full-sequence forwards (no cache, no tree). `allowed(prefix)`: the
    (V,) bool mask of the tokens a grammar allows after the generated `prefix` (None: every token)."""
    model = gen.engine.target.model
    chooser = TokenChooser(sampling, torch.device("cpu"))

    def probs(prefix):
        logits = model(torch.tensor([prompt_ids + prefix])).logits[0, -1].float()
        if allowed is not None:
            logits = logits.masked_fill(~allowed(prefix)[: logits.shape[-1]], float("-inf"))
        return chooser.probs(logits)

    dist = {}
    with torch.no_grad():
        p1 = probs([])
        for t1 in torch.nonzero(p1 > 0).flatten().tolist():
            p2 = probs([t1])
            for t2 in torch.nonzero(p2 > 0).flatten().tolist():
                dist[(t1, t2)] = float(p1[t1] * p2[t2])
    return dist


def chi_square(counts: collections.Counter, exact: dict, n: int) -> tuple[float, int, float]:
    """(chi2, bins, p-value) of `counts` (n samples) against the exact distribution, the outcomes with an
    expected count below 5 lumped into one bin."""
    from scipy.stats import chi2 as chi2_dist  # noqa: PLC0415  (scipy comes with the test extra)

    chi2, lump_obs, lump_exp, bins = 0.0, 0, 0.0, 0
    for outcome, p in exact.items():
        if n * p >= 5:
            chi2, bins = chi2 + (counts[outcome] - n * p) ** 2 / (n * p), bins + 1
        else:
            lump_obs, lump_exp = lump_obs + counts[outcome], lump_exp + n * p
    if lump_exp > 0:
        chi2, bins = chi2 + (lump_obs - lump_exp) ** 2 / lump_exp, bins + 1
    return chi2, bins, float(chi2_dist.sf(chi2, bins - 1)) if bins > 1 else 0.0
