"""A cluster that does not answer: one error that says what to do (`Client.connect`)."""

from __future__ import annotations

import pytest

from orchestrator.errors import ClusterError
from orchestrator.user.client import Client


def test_an_address_that_does_not_answer_says_how_busy_the_machine_is_and_where_to_look(tmp_path, monkeypatch):
    import ray

    calls = []

    def refuse(**kw):
        calls.append(kw["address"])
        raise ConnectionError("Could not find any running Ray instance")

    monkeypatch.setattr(ray, "init", refuse)
    client = Client(address="127.0.0.1:1", home=tmp_path / "home")
    with pytest.raises(ClusterError) as e:
        client.connect()
    said = str(e.value)
    assert said.startswith("cannot reach the Ray cluster at 127.0.0.1:1 (1 try): Could not find any running Ray")
    assert "load average is" in said and "`orchestrator down` then `orchestrator up`" in said
    assert str(tmp_path / "home" / "logs" / "head.log") in said
    assert calls == ["127.0.0.1:1"]  # a cluster it did not start: asked once
