"""The gallery's pixels as the server shows them: a stored file opened within the server's limits,
a generated distractor rendered again from its seed, thumbnails from a bounded LRU cache."""

from __future__ import annotations

import io
import threading
from collections import OrderedDict
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

from PIL import Image

from icr.core.image_input import GALLERY_FORMATS, ImageLimits, ImageRefused, open_image
from icr.index.live_writes import UPLOAD_PREFIX
from icr.service.loaded_index import LoadedIndex, public_source
from icr.training.data.synthetic.generate import DistractorStream

DISTRACTOR_PREFIX = "distractor:"
THUMB_CACHE_BYTES = 64 << 20
GALLERY_LIMITS = ImageLimits(formats=GALLERY_FORMATS)  # the server passes its own pixel and aspect limits


class BytesLRU:
    """A thread-safe LRU of byte strings bounded by their total size."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.size = 0
        self._items: OrderedDict[Any, bytes] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> bytes | None:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Any, value: bytes) -> None:
        if len(value) > self.capacity:
            return
        with self._lock:
            old = self._items.pop(key, None)
            self.size += len(value) - (len(old) if old is not None else 0)
            self._items[key] = value
            while self.size > self.capacity:
                _, dropped = self._items.popitem(last=False)
                self.size -= len(dropped)


class GalleryImages:
    """The pixels of an image index's items (thread-safe: the cache locks, decoding is per call)."""

    def __init__(self, images: LoadedIndex) -> None:
        self.images = images
        self._distractors: Any = None
        self._thumbs = BytesLRU(THUMB_CACHE_BYTES)

    def has_pixels(self, row: dict[str, Any]) -> bool:
        """Whether the row's image can be shown: a built gallery file or distractor, or an upload. An
        image added by its embedding alone has a source the caller named, which is never opened."""
        source = str(row["source"])
        if source.startswith(UPLOAD_PREFIX):  # added online (a compacted folder holds some too)
            return True
        if row["id"] >= self.images.manifest.built:
            return False  # added by its embedding: a source the caller named, never opened
        return source.startswith(DISTRACTOR_PREFIX) or "#" not in source

    @property
    def uploads(self) -> Path | None:
        """Where uploaded images are kept (beside the write log), None for an index without writes."""
        return self.images.live.uploads

    def image(self, image_id: int, limits: ImageLimits = GALLERY_LIMITS) -> Any:
        """The PIL image of an image-index id; KeyError if unknown, OSError without pixels or when
        its file is outside ``limits`` (a file replaced since the build is as untrusted as an upload)."""
        state = self.images.live.state
        if not state.is_live(image_id):
            raise KeyError(image_id)
        row = self.images.live.rows([image_id], state)[0]
        source = row["source"]
        if image_id >= self.images.manifest.built and not source.startswith(UPLOAD_PREFIX):
            raise FileNotFoundError(f"image {image_id} was added by its embedding: no pixels are stored")
        if source.startswith(UPLOAD_PREFIX):
            assert self.uploads is not None
            try:
                return open_image(self.uploads / source[len(UPLOAD_PREFIX) :], limits)
            except (ImageRefused, OSError) as err:
                raise OSError(f"{source}: {err}") from None
        if source.startswith(DISTRACTOR_PREFIX):
            return Image.fromarray(self._distractor_stream().image(int(source[len(DISTRACTOR_PREFIX) :])))
        shown = public_source(source, self.images.source_root)  # errors reach clients: never a server path
        if "#" in source:
            raise FileNotFoundError(f"item {image_id} is a row of precomputed features ({shown}): no image")
        try:
            return open_image(source, limits)
        except ImageRefused as err:  # over the limits, another format, or damaged since the build
            raise OSError(f"{shown}: {err}") from None
        except OSError as err:  # moved or unreadable since the build (its message names the path)
            raise OSError(f"{shown}: {err.strerror or 'not a readable image'}") from None

    def _distractor_stream(self) -> Any:
        if self._distractors is None:
            data = Path(self.images.manifest.data["path"])
            self._distractors = DistractorStream.for_dataset(data, self.images.manifest.distractor_count)
        return self._distractors

    def png(
        self,
        image_id: int,
        thumb_size: int | None,
        limits: ImageLimits = GALLERY_LIMITS,
        decoding: AbstractContextManager[Any] | None = None,
    ) -> bytes:
        """The image as PNG; thumbnails (a results page asks for the same ones again and again) come
        from an LRU cache of :data:`THUMB_CACHE_BYTES`. ``decoding`` is held while the image is
        decoded and encoded (the server's bound on concurrent decodes), not for a cached thumbnail."""
        if not self.images.live.state.is_live(image_id):  # deleted since its thumbnail was cached
            raise KeyError(image_id)
        if thumb_size is not None:
            cached = self._thumbs.get((image_id, thumb_size))
            if cached is not None:
                return cached
        out = io.BytesIO()
        with decoding or nullcontext():
            image = self.image(image_id, limits)
            if thumb_size is not None:
                image.thumbnail((thumb_size, thumb_size))
            image.save(out, format="PNG")
            del image
        data = out.getvalue()
        if thumb_size is not None:
            self._thumbs.put((image_id, thumb_size), data)
        return data
