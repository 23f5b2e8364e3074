"""The plugin contract states itself: ``algorithms/base.py``'s module docstring names, as code, every public method
and attribute of :class:`SyncAlgorithm` (those ``setup()`` sets included), of :class:`SyncContext` and of
:class:`Guests`."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import algorithms.base as base
from algorithms.base import Guests, SyncAlgorithm, SyncContext


def _public(names) -> list[str]:
    return sorted({name for name in names if not name.startswith("_")})


def _set_up() -> list[str]:
    """The attributes :meth:`SyncAlgorithm.setup` sets on the instance (``self.module``, ``self.ctx``, ...)."""
    sync = SyncAlgorithm()
    sync.setup(torch.nn.Linear(2, 2), None, ctx=None)
    return list(vars(sync))


NAMES = (
    [("SyncAlgorithm", name) for name in _public([*vars(SyncAlgorithm), *_set_up()])]
    + [
        ("SyncContext", name)
        for name in _public([*vars(SyncContext), *(f.name for f in dataclasses.fields(SyncContext))])
    ]
    + [("Guests", name) for name in _public(vars(Guests))]
)


def _named_as_code(doc: str) -> set[str]:
    """Every word inside the docstring's inline literals (````...````), roles (``:meth:`...```) and literal blocks
    (indented after ``::``)."""
    spans = re.findall(r"``(.+?)``", doc, re.DOTALL) + re.findall(r":\w+:`([^`]+)`", doc)
    spans += re.findall(r"::\n\n((?:(?:    .*)?\n)+)", doc)
    return {word for span in spans for word in re.findall(r"\w+", span)}


def test_the_contract_covers_the_hooks_and_flags():
    names = {name for _, name in NAMES}
    assert {"name", "evaluates_replicas", "late_shared_state", "module", "validate", "setup", "finalize"} <= names
    assert {"take_share", "guest_state", "agreement_at", "guests", "comm", "sum"} <= names


@pytest.mark.parametrize("owner, name", NAMES, ids=[f"{owner}.{name}" for owner, name in NAMES])
def test_the_module_docstring_names_every_public_name(owner, name):
    assert name in _named_as_code(base.__doc__), f"{owner}.{name} is missing from algorithms/base.py's docstring"


def test_joins_are_one_optional_section():
    """The join hooks are stated together, in the section titled for them."""
    doc = base.__doc__
    sections = re.split(r"\n\n(?=\*\*)", doc)
    joins = [s for s in sections if s.startswith("**Joins (optional).**")]
    assert len(joins) == 1
    for name in ("agreement_at", "guest_state", "take_share", "late_shared_state", "ctx.guests", "Guests.sum"):
        assert f"``{name}" in joins[0], name


def test_take_share_is_not_offered_by_default():
    """Only an algorithm that asks ``ctx.guests`` is asked to take a share; the base class offers none."""
    with pytest.raises(NotImplementedError, match="ctx.guests"):
        SyncAlgorithm().take_share(torch.nn.Linear(2, 2), torch.zeros(6), {"names": [], "contributors": 1}, None)
