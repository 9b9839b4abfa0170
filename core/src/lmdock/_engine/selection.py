"""Partial selection for the reference sampler: top-k, top-p and min-p without sorting the vocabulary.

Every filter keeps a prefix of the row in the order of a stable descending sort (more likely first,
ties by token id): token ``j`` is kept while the weight of the tokens before it is below a target
(``top_k``: a count of 1 per token; ``top_p``: ``top_p`` times the mass left).  :func:`boundary`
finds where that prefix ends by bisecting the values: each round splits the candidates at the middle
value, keeps the side that holds the boundary and adds up the weight of the side above, so the work
is a few passes over shrinking arrays instead of an ``O(V log V)`` sort of the whole row.  Only the
last few hundred candidates are sorted, and only they decide ties.
"""

from __future__ import annotations

import numpy as np

#: Candidates left when the rounds stop and a stable sort decides (sorting this many is cheap).
SMALL = 256
#: Rounds at most (each keeps ~1/8 of the candidates; one that keeps them all stops the rounds).
MAX_ROUNDS = 24


def boundary(values: np.ndarray, weights: np.ndarray | None, target: float, total: float | None = None) -> tuple[float, int]:
    """Where the kept prefix of ``values`` ends: ``(v, c)``, keeping every token whose value is
    above ``v`` and the first ``c`` tokens equal to ``v`` (by index).  A token is kept while the
    weight before it (``weights``; None: 1 each) is below ``target``.  ``values`` may hold -inf
    (weight 0, never needed); the caller makes sure some finite value exists.  ``total``: the
    weights' sum, where the caller has it."""
    v, w = values, weights
    above = 0.0  # weight of the tokens above the candidates (all kept)
    if total is None:  # of the candidates
        total = float(w.sum(dtype=np.float64)) if w is not None else float(v.size)
    for _ in range(MAX_ROUNDS):
        if v.size <= SMALL:
            break
        lo, hi = _bracket(v, w, (target - above) / total if total > 0 else 1.0)
        upper = v > hi
        mass = _mass(upper, w)
        if above + mass >= target:  # the boundary is above hi (the sample missed the top)
            keep, next_above, next_total = upper, above, mass
        else:
            upper_lo = v > lo
            mass_lo = _mass(upper_lo, w)
            if above + mass_lo < target:  # below lo: everything above it is kept
                keep, next_above, next_total = ~upper_lo, above + mass_lo, total - mass_lo
            else:  # between: the expected case, a band of about 1/16 of the candidates
                keep, next_above, next_total = upper_lo & ~upper, above + mass, mass_lo - mass
        idx = np.flatnonzero(keep)
        # none left: the float32 sums of two rounds disagree at a boundary within rounding of the
        # target (the candidates then are all kept); all left: ties.  The sort decides either way.
        if idx.size == 0 or idx.size == v.size:
            break
        above, total = next_above, next_total
        v = v.take(idx)
        w = w.take(idx) if w is not None else None
    return _finish(v, w, above, target)


#: The sample :func:`_bracket` estimates the boundary from, and how many of its places either side
#: of the estimate the bracket spans (so a round keeps about 2 * BRACKET / SAMPLE of the candidates).
SAMPLE, BRACKET = 512, 16


def _bracket(v: np.ndarray, w: np.ndarray | None, share: float) -> tuple[float, float]:
    """Two values ``lo < hi`` that probably hold the boundary between them, from a strided sample
    of the candidates: the boundary is where the weight before a value reaches ``share`` of the
    candidates' weight, estimated as the same share of the sample's."""
    stride = max(1, v.size // SAMPLE)
    sv = v[::stride]
    order = np.argsort(-sv, kind="stable")
    sv = sv[order]
    if w is None:
        before = np.arange(sv.size) / sv.size
    else:
        sw = w[::stride][order].astype(np.float64)
        before = (np.cumsum(sw) - sw) / max(sw.sum(), 1e-300)
    pos = int(np.count_nonzero(before < share))
    hi = float(sv[max(pos - BRACKET, 0)])
    lo = float(sv[pos + BRACKET]) if pos + BRACKET < sv.size else -np.inf
    return lo, hi


def _mass(upper: np.ndarray, w: np.ndarray | None) -> float:
    """The weight of the tokens in ``upper``: a dot product (boolean indexing and ``sum(where=)``
    are ~10x slower), or their count."""
    if w is None:
        return int(np.count_nonzero(upper))
    return float(np.dot(upper.view(np.uint8).astype(w.dtype), w))


def _finish(v: np.ndarray, w: np.ndarray | None, above: float, target: float) -> tuple[float, int]:
    """The boundary among the last candidates (in index order), by a stable sort of them alone."""
    order = np.argsort(-v, kind="stable")
    sv = v[order]
    sw = w[order].astype(np.float64) if w is not None else np.ones(sv.size)
    before = above + np.cumsum(sw) - sw  # weight before each candidate
    kept = int(np.count_nonzero(before < target))
    if kept == 0:  # cannot happen for a target above the weight above; kept for safety
        kept = 1
    value = float(sv[kept - 1])
    ties_before = int(np.count_nonzero(sv[:kept] > value))
    return value, kept - ties_before


def kept_mask(values: np.ndarray, value: float, ties: int) -> np.ndarray:
    """The tokens :func:`boundary` keeps, as a boolean mask over the whole row."""
    keep = values > value
    if ties:
        keep[np.flatnonzero(values == value)[:ties]] = True
    return keep


def top_indices(values: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` largest values' indices, largest first, ties by index (a stable descending sort's
    first ``k``), found by :func:`boundary` rather than a sort of the row."""
    k = min(k, values.shape[-1])
    if k <= 0:
        return np.zeros(0, dtype=np.int64)
    value, ties = boundary(values, None, k)
    idx = np.flatnonzero(kept_mask(values, value, ties))
    return idx[np.argsort(-values[idx], kind="stable")]
