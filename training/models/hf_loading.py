"""Loading Hugging Face models from local folders, and rebuilding them from a stored config dict.

transformers is imported inside the functions: it takes seconds to import, and the embedded
default (CNN + GRU) must not pay for it.

A checkpoint stores the network's HF config as a plain dict (:func:`config_dict`) and rebuilds
the network with random weights from it (:func:`model_from_config_dict`); the checkpoint's
safetensors then supplies every weight, so the original folder is not needed at load time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from icr.training.data.vocab import tokenize

if TYPE_CHECKING:  # annotations only: transformers is imported inside the functions (see above)
    from transformers import PreTrainedModel

# Label maps describe a classification head we never use; for microsoft/resnet-50 they are 2,000
# lines of config.json.
_DROPPED_KEYS = ("id2label", "label2id", "_name_or_path")


def _transformers() -> Any:
    try:
        import transformers  # noqa: PLC0415 (transformers: seconds to import, only for pretrained towers)
    except ImportError as err:  # pragma: no cover - transformers is a declared dependency
        raise ValueError(f"this model needs the transformers package ({err}); reinstall icr") from None
    return transformers


def config_dict(config: Any) -> dict[str, Any]:
    """JSON-serialisable dict of an HF ``PretrainedConfig`` (label maps and local path dropped)."""
    data = {k: v for k, v in config.to_dict().items() if k not in _DROPPED_KEYS}
    plain: dict[str, Any] = json.loads(json.dumps(data))  # fails loudly on anything that is not plain JSON
    return plain


def _attn_kwargs(attention: bool) -> dict[str, str]:
    # Pin the attention implementation so that a model rebuilt from a checkpoint runs exactly the
    # kernels of the model that wrote it (sdpa and eager differ in the last bits).
    return {"attn_implementation": "sdpa"} if attention else {}


def load_config(path: str | Path, what: str) -> Any:
    """``AutoConfig.from_pretrained`` on a local folder (every default filled in, no weights read);
    ValueError naming the folder otherwise."""
    transformers = _transformers()
    try:
        return transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{path}: cannot read the config of {what}: {err}") from None


def load_pretrained(path: str | Path, what: str, *, attention: bool) -> PreTrainedModel:
    """``AutoModel.from_pretrained`` on a local folder; ValueError naming the folder otherwise."""
    transformers = _transformers()
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(
            f"{folder}: not a Hugging Face model folder (no config.json) for {what}; point it at a local "
            "folder saved with save_pretrained (config.json + model.safetensors)"
        )
    try:
        # transformers is imported untyped (see _transformers), so name what AutoModel returns
        model: PreTrainedModel = transformers.AutoModel.from_pretrained(
            str(folder), local_files_only=True, **_attn_kwargs(attention)
        )
        return model
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise ValueError(f"{folder}: cannot load {what} from this folder: {err}") from None


def model_from_config_dict(data: dict[str, Any], what: str, *, attention: bool) -> PreTrainedModel:
    """A randomly initialised HF model with the structure described by :func:`config_dict`."""
    transformers = _transformers()
    fields = dict(data)
    model_type = fields.pop("model_type", None)
    if not isinstance(model_type, str):
        raise ValueError(f"the stored {what} config has no model_type; re-create the model from its folder")
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
        model: PreTrainedModel = transformers.AutoModel.from_config(config, **_attn_kwargs(attention))
        return model
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"cannot rebuild {what} from the stored config ({err})") from None


def load_tokenizer(path: str | Path) -> Any:
    """``AutoTokenizer.from_pretrained`` on a local folder; ValueError naming the folder otherwise."""
    transformers = _transformers()
    try:
        return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"{path}: cannot load a tokenizer from this folder: {err}") from None


def unknown_words(tokenizer: Any, text: str) -> list[str]:
    """The words of ``text`` that ``tokenizer`` maps to its unknown token, in order (none for a
    byte-level BPE such as CLIP's, which can spell any text)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return []
    return [w for w in tokenize(text) if unk in tokenizer(w, add_special_tokens=False)["input_ids"]]
