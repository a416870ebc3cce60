"""Image (and other non-text) content parts get a clear 400 naming the part's type: a multimodal checkpoint
such as Gemma 3 is served as its text model only."""
from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from gateway.http.body import parse_body
from gateway.errors import from_validation_error
from gateway.protocol import ChatCompletionRequest


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                                  {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}])
def test_non_text_content_part_is_refused_clearly(part: dict) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]}
    with pytest.raises(ValidationError) as info:
        parse_body(json.dumps(body).encode(), ChatCompletionRequest)
    err = from_validation_error(info.value)
    assert err.status == 400 and err.param == "messages.0.content"
    assert f"content parts of type {part['type']!r} are not supported" in str(err)
