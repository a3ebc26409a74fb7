"""Prompt counting with tools, tool calls and media parts (engines.prompt; issue 39
item 1): the simulator's rendering, a model's own template rendered as
transformers renders it with ``tools``, vLLM's handling of tool-call arguments, the
JSON text of what a template cannot render, and the floor per non-text part."""

from __future__ import annotations

import copy
import json
import shutil

import pytest

from config.schema import EnginesConfig
from engines.blocks import fallback_tokenize
from engines.pool import EnginePool
from engines.prompt import (
    FallbackEncoder,
    HFEncoder,
    PromptBlocks,
    PromptInput,
    json_text,
    local_model_folder,
    media_parts,
    template_messages,
)
from loadtest.sim_engine.protocol import parse_chat

WORDS = " ".join(["word"] * 2000)
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": WORDS,
                                           "parameters": {"type": "object", "properties": {
                                               "q": {"type": "string"}}}}}]
CALL = {"id": "call-1", "type": "function",
        "function": {"name": "lookup", "arguments": json.dumps({"q": WORDS})}}
CHAT = [{"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call-1", "content": "found it"},
        {"role": "user", "content": "thanks"}]
IMAGE = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}

#: a tool-capable template in the style of Qwen 2.5's: tools as JSON in a system
#: turn, assistant tool calls as JSON objects (their arguments decoded)
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n"
    "{{ tool | tojson }}{%- endfor %}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>"
    "{% endif %}{%- if message.content is string %}{{ message.content }}{% endif %}"
    "{%- for tc in message.tool_calls or [] %}<tool_call>{\"name\": \"{{ tc.function.name }}\", "
    "\"arguments\": {{ tc.function.arguments | tojson }}}</tool_call>{%- endfor %}"
    "<|im_end|>\n{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def blocks_for(kind: str = "sim", **model) -> PromptBlocks:
    spec = {"name": "e", "model": "m", "kind": kind}
    if kind == "vllm":
        spec["model_path"] = "packaged:gemma3-270m"
    cfg = EnginesConfig.model_validate({"engines": [spec],
                                        "models": [{"name": "m", **model}] if model else []})
    return PromptBlocks(cfg, EnginePool())


def gemma_folder():
    return local_model_folder(EnginesConfig.model_validate({"engines": [
        {"name": "e", "model": "m", "kind": "vllm",
         "model_path": "packaged:gemma3-270m"}]}).engines[0])


needs_gemma = pytest.mark.skipif(gemma_folder() is None,
                                 reason="prepared gemma3-270m model not present")


def test_the_simulators_prompt_holds_tools_and_tool_calls_and_the_count_equals_it() -> None:
    """kind: sim: the gateway's count is exactly the simulator's prompt, which now
    holds the tool definitions and the assistant's tool calls."""
    body = {"model": "m", "messages": CHAT, "tools": TOOLS}
    sim_tokens = len(fallback_tokenize(parse_chat(body, "m").prompt_text))
    m = blocks_for().measure_sync("m", PromptInput.from_body(body), None)
    assert m.exact and m.tokens == sim_tokens
    bare = blocks_for().measure_sync("m", PromptInput(messages=[
        {"role": "user", "content": "hi"}, {"role": "user", "content": "thanks"}]), None)
    assert m.tokens - bare.tokens > 2 * 2000  # the description and the arguments


def test_tools_that_are_not_a_list_are_not_rendered_on_either_side() -> None:
    body = {"model": "m", "messages": CHAT[:1], "tools": {"not": "a list"}}
    assert PromptInput.from_body(body).tools is None
    assert "not" not in parse_chat(body, "m").prompt_text


def test_a_non_text_part_counts_the_models_floor() -> None:
    text = [{"role": "user", "content": [{"type": "text", "text": "what is it?"}]}]
    with_media = [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, IMAGE,
                                               {"type": "input_audio", "input_audio": {}},
                                               {"type": "file", "file": {}}]}]
    assert media_parts(with_media) == 3 and media_parts(text) == 0
    pb = blocks_for()
    base = pb.measure_sync("m", PromptInput(messages=text), None)
    m = pb.measure_sync("m", PromptInput(messages=with_media), None)
    assert m.tokens == base.tokens + 3 * 256 and not m.exact
    assert m.blocks == base.blocks  # the floor is counted, not hashed
    m = blocks_for(media_part_tokens=1000).measure_sync("m", PromptInput(messages=with_media),
                                                        None)
    assert m.tokens == base.tokens + 3 * 1000


def test_tool_call_arguments_are_decoded_as_vllm_does() -> None:
    """:func:`template_messages` decodes arguments as vLLM 0.32's own
    ``_postprocess_messages`` does, malformed and non-object arguments included;
    the input is not modified."""
    chat_utils = pytest.importorskip("vllm.renderers.chat_utils")
    bad = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": "{oops"}},
           {"id": "b", "type": "function", "function": {"name": "g", "arguments": "[1, 2]"}},
           {"id": "c", "type": "function", "function": {"name": "h", "arguments": ""}},
           {"id": "d", "type": "function", "function": {"name": "i"}}]
    messages = [*CHAT, {"role": "assistant", "content": "x", "tool_calls": bad},
                {"role": "assistant", "content": "y", "tool_calls": []}]
    before = copy.deepcopy(messages)
    ours = template_messages(messages)
    theirs = copy.deepcopy(messages)
    chat_utils._postprocess_messages(theirs)
    theirs[1]["content"] = ""  # vLLM's parser: a null content is no parts, ""
    assert ours == theirs and messages == before


@pytest.fixture
def tool_model(tmp_path):
    """A model folder with Gemma 3's tokenizer and a tool-capable chat template."""
    folder = gemma_folder()
    if folder is None:
        pytest.skip("prepared gemma3-270m model not present")
    shutil.copy(folder / "tokenizer.json", tmp_path / "tokenizer.json")
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg["chat_template"] = TOOL_TEMPLATE
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return tmp_path


def test_a_tool_template_renders_tools_and_calls_as_transformers_does(tool_model) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(tool_model))
    enc = HFEncoder(tool_model)
    text = enc.render_chat(CHAT, TOOLS)
    # vLLM hands the template the decoded arguments and the tools, as transformers renders
    assert text == tok.apply_chat_template(template_messages(CHAT), tools=TOOLS, tokenize=False,
                                           add_generation_prompt=True)
    assert WORDS in text and '"q": "word word' in text
    assert enc.left_out(CHAT, TOOLS) == ""  # everything rendered: nothing added
    assert enc.encode_chat(CHAT, TOOLS) == tok.encode(text, add_special_tokens=False)


@needs_gemma
def test_a_template_without_tools_counts_their_json_text() -> None:
    """The packaged Gemma template reads neither ``tools`` nor ``tool_calls``: the
    count adds their JSON text, tokenized by the model's tokenizer."""
    enc = HFEncoder(gemma_folder())
    assert WORDS not in enc.render_chat(CHAT, TOOLS)
    assert enc.left_out(CHAT, TOOLS) == json_text(TOOLS) + json_text([CALL])
    pb = blocks_for("vllm")
    m = pb.measure_sync("m", PromptInput(messages=CHAT, tools=TOOLS), None)
    rendered = len(enc.encode_chat(CHAT, TOOLS))
    assert m.tokens == rendered + len(enc.encode_text(enc.left_out(CHAT, TOOLS)))
    assert m.tokens > rendered + 4000 and not m.exact
    plain = pb.measure_sync("m", PromptInput(messages=CHAT[:1]), None)
    assert plain.exact and plain.tokens == len(enc.encode_chat(CHAT[:1]))


async def test_a_template_that_fails_still_counts_everything() -> None:
    """An encoder that raises (a template refusing the conversation) gives the
    fallback rendering's count, tools included, not the characters/4 estimate."""
    class Refusing(FallbackEncoder):
        def encode_chat(self, messages, tools=None):
            raise ValueError("Conversation roles must alternate")

    cfg = EnginesConfig.model_validate({"engines": [{"name": "e", "model": "m", "kind": "sim"}]})
    pb = PromptBlocks(cfg, EnginePool(), encoders={"m": Refusing()})
    m = await pb.measure("m", PromptInput(messages=CHAT, tools=TOOLS), None)
    assert m.tokens > 4000 and not m.exact and m.blocks == ()


def test_a_thinking_turn_reaches_the_template_under_both_names(tool_model) -> None:
    """vLLM hands an assistant turn's ``reasoning`` (or the deprecated
    ``reasoning_content``) to the template as both fields: a template that renders
    the thinking renders it, and the count holds it."""
    enc = HFEncoder(tool_model)
    for field in ("reasoning", "reasoning_content"):
        turns = [CHAT[0], {"role": "assistant", "content": "4", field: WORDS}, CHAT[-1]]
        assert f"<think>{WORDS}</think>" in enc.render_chat(turns)
    assert template_messages([{"role": "user", "content": "x", "reasoning": "y"}])[0] \
        == {"role": "user", "content": "x", "reasoning": "y"}  # assistant turns only
