"""``python -m loadtest token-estimate``: how far the gateway's prompt token count is
from the engine's, on real prompts.

For each prompt (one user message; default the Arena-Hard v0.1 questions) it
compares against the reference count — the model's chat template rendered by
``transformers``' ``apply_chat_template`` and tokenized with the model's tokenizer,
which is what vLLM's chat endpoint does and reports as ``usage.prompt_tokens`` —

* ``before``: the characters/4 estimate (``gateway.openai_api.parse_request``), the
  fallback when no tokenizer is known;
* ``after``: the count the request path now uses (``engines.prompt.PromptBlocks``
  with the model's own encoder).

Prints mean and p90 of the relative error ``|count − reference| / reference``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from config.schema import EnginesConfig
from engines.pool import EnginePool
from engines.prepare import MODEL_DIRNAME, default_cache_dir
from engines.prompt import PromptBlocks, PromptInput
from gateway.openai_api import parse_request

DEFAULT_PROMPTS = Path("/work/shared/data/prompts/arena_hard_v0.1_question.jsonl")


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m loadtest token-estimate")
    ap.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS,
                    help="JSONL with a 'prompt' field per line")
    ap.add_argument("--model-dir", type=Path, default=default_cache_dir() / MODEL_DIRNAME,
                    help="prepared model folder (sluice prepare-model)")
    args = ap.parse_args(argv)
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(args.model_dir))
    engines = EnginesConfig.model_validate({"engines": [
        {"name": "e", "model": "m", "kind": "vllm", "model_path": str(args.model_dir)}]})
    blocks = PromptBlocks(engines, EnginePool())
    before: list[float] = []
    after: list[float] = []
    for line in args.prompts.read_text("utf-8").splitlines():
        messages = [{"role": "user", "content": json.loads(line)["prompt"]}]
        ids = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ref = len(ids["input_ids"] if hasattr(ids, "keys") else ids)  # newer: a BatchEncoding
        estimate = parse_request("chat", {"model": "m", "messages": messages}).prompt_tokens
        exact = blocks.measure_sync("m", PromptInput(messages=messages), None).tokens
        assert exact is not None, "the model's tokenizer was not used"
        before.append(abs(estimate - ref) / ref)
        after.append(abs(exact - ref) / ref)
    print(f"prompts: {len(before)} from {args.prompts}; reference: {args.model_dir.name} "
          "chat template + tokenizer (transformers apply_chat_template)")
    for name, errs in (("before (chars/4 estimate)", before),
                       ("after (model tokenizer)", after)):
        print(f"{name:28s} relative error mean {statistics.fmean(errs):.4f}  "
              f"p90 {p90(errs):.4f}  max {max(errs):.4f}")
    return 0
