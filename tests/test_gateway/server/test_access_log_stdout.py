"""The access log (`loraplex.access`, one JSON line per request on stdout) writes to stdout as it is when a line is
logged: a server embedded in an application that later replaces stdout (pytest's capture did, between tests) must
not write into the closed old one."""
from __future__ import annotations

import io
import logging
import sys
from collections.abc import Iterator

import pytest

from gateway.server.server import StdoutHandler, configure_access_log


@pytest.fixture()
def access_logger() -> Iterator[logging.Logger]:
    """The `loraplex.access` logger with no handler when the test body starts, restored after. (pytest attaches its
    log capture to every non-propagating logger as the test's call begins, and an earlier in-process server left
    this one non-propagating: the body clears it again with `bare`.)"""
    access = logging.getLogger("loraplex.access")
    saved = (access.handlers[:], access.level, access.propagate)
    access.handlers.clear()
    yield access
    access.handlers[:], access.level, access.propagate = saved[0], saved[1], saved[2]


def bare(access: logging.Logger) -> None:
    access.handlers.clear()


def test_the_access_log_follows_a_replaced_stdout(access_logger: logging.Logger,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    first = io.StringIO()
    monkeypatch.setattr(sys, "stdout", first)
    bare(access_logger)
    configure_access_log(True)
    access_logger.info('{"n":1}')
    assert first.getvalue() == '{"n":1}\n'
    first.close()
    second, errors = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", second)
    monkeypatch.setattr(sys, "stderr", errors)        # where logging reports a handler's failure
    access_logger.info('{"n":2}')
    assert errors.getvalue() == ""
    assert second.getvalue() == '{"n":2}\n'


def test_the_access_log_off_writes_nothing(access_logger: logging.Logger, monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    bare(access_logger)
    configure_access_log(False)
    access_logger.info('{"n":1}')
    assert out.getvalue() == "" and not any(isinstance(h, StdoutHandler) for h in access_logger.handlers)
