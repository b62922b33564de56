"""Fixtures of the sandbox tests: ``isolation`` runs a test under each way to build the sandbox (a
user namespace, and namespaces created as root), where this host can sandbox at all."""

from __future__ import annotations

import dataclasses
import os

import pytest

from posttrain.tools import sandbox


@pytest.fixture(params=["user-namespace", "root"])
def isolation(request, monkeypatch):
    """The detected setup, with ``user_namespace`` forced to the parameter's."""
    if os.geteuid() != 0:
        pytest.skip("the sandbox needs root")
    detected = sandbox.detect_sandbox()
    user_namespace = request.param == "user-namespace"
    if user_namespace and not detected.user_namespace:
        pytest.skip("unprivileged user namespaces are disabled on this host")
    monkeypatch.setattr(sandbox, "_detected", dataclasses.replace(detected, user_namespace=user_namespace))
    return request.param
