"""Statistics of the accuracy benches (bench/accuracy.py, bench/ruler.py): percentile bootstrap
intervals of a mean, plain, paired (two methods on the same inputs) and stratified (a mean over
tasks, each task resampled on its own), a score's statistics as result-row fields, and the
``value [low, high]`` text of the tables.

Every interval is seeded, so that a rerun on the same answers prints the same bounds.
"""

from __future__ import annotations

from typing import Sequence

import torch


def _bootstrap_means(x: torch.Tensor, resamples: int, generator: torch.Generator) -> torch.Tensor:
    return x[torch.randint(x.numel(), (resamples, x.numel()), generator=generator)].mean(1)


def _percentiles(means: torch.Tensor, level: float) -> tuple[float, float]:
    low, high = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return float(low), float(high)


def bootstrap_interval(values, resamples: int = 2000, seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values``: the means of ``resamples`` draws of
    as many values with replacement, cut at ``(1 - level) / 2`` and ``(1 + level) / 2``. The draws
    come from a generator seeded with ``seed``, so that a rerun prints the same bounds; all-equal
    values give a zero-width interval."""
    x = torch.as_tensor(values, dtype=torch.float64).flatten()
    if x.numel() == 0:
        raise ValueError("bootstrap_interval needs at least one value")
    generator = torch.Generator().manual_seed(seed)
    return _percentiles(_bootstrap_means(x, resamples, generator), level)


def paired_difference(values, baseline, resamples: int = 2000, seed: int = 0,
                      level: float = 0.95) -> tuple[float, float, float]:
    """``(mean, low, high)`` of ``values - baseline``, entry by entry (two methods on the same
    inputs), with the bootstrap interval of that mean: resampling the pairs rather than each side
    on its own cancels what the two share (how hard each input is), so the interval is as narrow as
    the methods' disagreement allows."""
    a = torch.as_tensor(values, dtype=torch.float64).flatten()
    b = torch.as_tensor(baseline, dtype=torch.float64).flatten()
    if a.shape != b.shape:
        raise ValueError(f"paired_difference needs as many values as baseline entries, got {a.numel()} "
                         f"and {b.numel()}")
    diff = a - b
    return (float(diff.mean()), *bootstrap_interval(diff, resamples, seed, level))


def stratified_interval(groups: Sequence, resamples: int = 2000, seed: int = 0,
                        level: float = 0.95) -> tuple[float, float, float]:
    """``(mean, low, high)`` of the mean over ``groups`` of each group's mean (the average over
    tasks, each task its own sample count), with the bootstrap interval that resamples each group
    within itself: every task weighs the same in every draw, as it does in the average."""
    xs = [torch.as_tensor(g, dtype=torch.float64).flatten() for g in groups]
    if not xs or any(x.numel() == 0 for x in xs):
        raise ValueError("stratified_interval needs at least one group, each with at least one value")
    generator = torch.Generator().manual_seed(seed)
    means = torch.stack([_bootstrap_means(x, resamples, generator) for x in xs]).mean(0)
    return (float(torch.stack([x.mean() for x in xs]).mean()), *_percentiles(means, level))


def score_statistics(scores: Sequence[float], pairs: Sequence[tuple[float, float]] = (),
                     resamples: int = 2000, seed: int = 0) -> dict:
    """A score's result-row fields: the mean of ``scores`` with its bootstrap interval (``score``,
    ``ci_low``, ``ci_high``, ``samples``) and, from ``pairs`` of (this method's score, the
    baseline's score on the same prompt), the paired difference with its interval (``diff``,
    ``diff_ci_low``, ``diff_ci_high``) and whether that interval excludes 0 (``diff_excludes_zero``:
    the two are told apart). Fields without data are None."""
    out = {"score": None, "ci_low": None, "ci_high": None, "samples": len(scores), "diff": None,
           "diff_ci_low": None, "diff_ci_high": None, "diff_excludes_zero": None}
    if scores:
        out["score"] = sum(scores) / len(scores)
        out["ci_low"], out["ci_high"] = bootstrap_interval(scores, resamples, seed)
    if pairs:
        diff, low, high = paired_difference(*zip(*pairs, strict=True), resamples=resamples, seed=seed)
        out.update(diff=diff, diff_ci_low=low, diff_ci_high=high, diff_excludes_zero=low > 0 or high < 0)
    return out


def interval_text(row: dict, field: str, low: str = "ci_low", high: str = "ci_high", mark: str | None = None,
                  digits: int = 3) -> str | None:
    """``value [low, high]`` of a result row (None when the row has no value), ``*`` appended when
    the row's ``mark`` flag is set."""
    if row.get(field) is None:
        return None
    text = f"{row[field]:.{digits}f} [{row[low]:.{digits}f}, {row[high]:.{digits}f}]"
    return text + ("*" if mark and row.get(mark) else "")
