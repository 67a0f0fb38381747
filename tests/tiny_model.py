"""Config overrides for the smallest model the tests train (seconds on a 2-core CPU)."""

TINY_MODEL = [
    "model.embed_dim=32",
    'model.image.kind="cnn"',
    "model.image.width=8",
    "model.image.image_size=32",
    'model.text.kind="gru"',
    "model.text.word_dim=16",
    "model.text.hidden=32",
]
