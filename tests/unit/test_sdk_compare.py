"""``python -m loadtest sdk-compare``'s summaries: two answers a client cannot tell apart
summarise equal (ids and times differ), a different text or usage does not."""

from __future__ import annotations

from anthropic.types import RawContentBlockDeltaEvent, RawMessageDeltaEvent, RawMessageStartEvent
from openai.types.chat import ChatCompletion

from loadtest.sdk_compare import summarise


def chat(id_: str, text: str, completion: int) -> ChatCompletion:
    return ChatCompletion.model_validate({
        "id": id_, "object": "chat.completion", "created": int(id_[-1]), "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": text}}],
        "usage": {"prompt_tokens": 5, "completion_tokens": completion, "total_tokens": 5}})


def test_answers_differing_only_in_id_and_time_are_the_same():
    a, b = summarise(chat("c1", "red, blue", 3)), summarise(chat("c2", "red, blue", 3))
    assert a == b and a["usage"] == {"prompt_tokens": 5, "completion_tokens": 3}
    assert summarise(chat("c2", "red, green", 3)) != a
    assert summarise(chat("c2", "red, blue", 4)) != a


def test_an_anthropic_stream_is_its_event_types_text_and_usage():
    events = [
        RawMessageStartEvent.model_validate({"type": "message_start", "message": {
            "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
            "content": [], "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": 13, "output_tokens": 0}}}),
        *[RawContentBlockDeltaEvent.model_validate({
            "type": "content_block_delta", "index": 0,
            "delta": {"type": "text_delta", "text": w}}) for w in ("Red", ", blue")],
        RawMessageDeltaEvent.model_validate({
            "type": "message_delta", "delta": {"stop_reason": "end_turn"},
            "usage": {"output_tokens": 2}})]
    out = summarise(events)
    assert out["events"] == ["message_start", "content_block_delta", "message_delta"]
    assert out["usage"] == {"input_tokens": 13, "output_tokens": 2}
    assert out["text"] == summarise([*events[:1], RawContentBlockDeltaEvent.model_validate({
        "type": "content_block_delta", "index": 0,
        "delta": {"type": "text_delta", "text": "Red, blue"}}), events[-1]])["text"]
