"""Statistics for the sampling tests."""
from __future__ import annotations

import math


def chi2_sf(x: float, dof: int) -> float:
    """Upper tail of chi-square (Wilson-Hilferty): enough for a 1e-3 threshold."""
    z = ((x / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))
