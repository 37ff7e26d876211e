"""`record_mla_forms`: which form (plain or absorbed) each MLA layer attends in, call by call.

(A module of tests/ itself, beside the root conftest.py, so every room's tests can import it by name.)
"""

from __future__ import annotations

import pytest

from k3.model.mla import MLAttention


def record_mla_forms(model, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Wraps every MLA layer's `attend_plain` and `attend_absorbed` so that each call appends "plain" or
    "absorbed" to the returned list (in layer order within a forward), then runs the original."""
    forms: list[str] = []
    for mla in (m for m in model.modules() if isinstance(m, MLAttention)):
        for form in ("plain", "absorbed"):
            attend = getattr(mla, f"attend_{form}")
            monkeypatch.setattr(
                mla, f"attend_{form}", lambda *a, attend=attend, form=form: forms.append(form) or attend(*a)
            )
    return forms
