"""``--dist loadgroup`` that works under pytest 9: tests marked ``xdist_group(NAME)`` run
on one worker, so a module-scoped fixture they share is built once.

pytest-xdist (3.8) tags a grouped item by setting ``item._nodeid`` to ``NODEID@NAME``, which
its scheduler reads; pytest 9 keeps a node's id in ``item._id`` instead, so the tag was lost
and every group was spread over the workers (test_zero.py's ``runs`` was built twice). This
hook sets the tag where pytest 9 reads it, and does nothing where xdist already did.

Hypothesis draws its examples from a fixed seed per test (profile ``make-test``), so that
the property tests take the same time on every run of ``make test``;
``HYPOTHESIS_PROFILE=default`` draws fresh ones.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

settings.register_profile("make-test", derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "make-test"))

try:
    from _pytest.nodeid import NodeId  # pytest >= 9
except ImportError:  # pytest 8: xdist's own tag works
    NodeId = None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if NodeId is None or not getattr(config.option, "loadgroup", False):  # loadgroup workers
        return
    for item in items:
        marks = item.iter_markers("xdist_group")
        names = sorted(
            {str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks}
        )
        tag = f"@{'_'.join(names)}"
        if names and not item.nodeid.endswith(tag) and hasattr(item, "_id"):
            item._id = NodeId.parse(item.nodeid + tag)
