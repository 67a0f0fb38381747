"""Write a tiny random CLIP folder, the stand-in for a real pretrained one in the README's "your own
data" walk-through and its API test (nothing can be downloaded here).

A real folder is saved the same way, on a machine with network::

    from transformers import CLIPModel, CLIPProcessor
    name = "openai/clip-vit-base-patch32"
    CLIPModel.from_pretrained(name).save_pretrained("models/clip-vit-base-patch32")
    CLIPProcessor.from_pretrained(name).save_pretrained("models/clip-vit-base-patch32")

This one: 2 layers of width 32 per tower, 32 px images in 8 px patches, 16-d embeddings, and a
character-level tokenizer (no merges). Usage: ``python examples/tiny_clip.py OUT_FOLDER``.
"""

from __future__ import annotations

import string
import sys


def write_tiny_clip(out: str) -> None:
    from transformers import CLIPConfig, CLIPModel, CLIPTokenizer

    try:  # the PIL processor by name: the default one warns without torchvision
        from transformers import CLIPImageProcessorPil as Processor
    except ImportError:
        from transformers import CLIPImageProcessor as Processor

    chars = list(string.ascii_lowercase + string.digits + ",.'-")
    vocab = {t: i for i, t in enumerate([*chars, *(c + "</w>" for c in chars)])}
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    layers = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2}
    text = {
        **layers,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 64,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    vision = {**layers, "image_size": 32, "patch_size": 8}
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=16)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    Processor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(out)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python examples/tiny_clip.py OUT_FOLDER")
    write_tiny_clip(sys.argv[1])
    print(f"wrote a tiny random CLIP to {sys.argv[1]}")
