"""How a prompt's images and videos become what its features carry: pixels from the pool, or,
for an image the engine already holds (the mirror, engine_mirror.py), its hash and shape alone,
with no decode, no preprocessing and no pixel copy. Also where the engine's asks for pixels and
uploads are processed, and how pixels reach the engine: by shared-memory handle (the pool pins
the segment until EngineCore reports the handle released), or copied into the message."""

from __future__ import annotations

import asyncio

import numpy as np

from mmserve.frontend.engine_mirror import ByHashImage, EngineMirror, ImageSource
from mmserve.frontend.file_store import StoredImage
from mmserve.frontend.placeholders import pixel_handle
from mmserve.frontend.prompt import ProcessedPrompt
from mmserve.protocol import EngineRequest, MultiModalFeature, PixelHandle
from mmserve.sampling_params import SamplingParams
from preprocess import PreprocessPool, ProcessedImage
from preprocess import mm_hash as hash_image

Processed = ProcessedImage | ByHashImage


class MediaProcessor:
    def __init__(self, pool: PreprocessPool) -> None:
        self.pool = pool
        self.mirror = EngineMirror()
        # Images go to EngineCore by handle; False: their pixels are copied into the messages
        # (as before handles, kept for comparison and for a reader without access to /dev/shm).
        self.by_handle = True

    def engine_request(
        self,
        prompt: ProcessedPrompt,
        request_id: str,
        params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
    ) -> EngineRequest:
        """`prompt` as one engine request, its images pinned for it (or copied); counted. If the
        request is not sent after all, `release_handles(handle_ids(request))`."""
        pin = self.pool.pin if self.by_handle else None
        request = prompt.engine_request(request_id, params, arrival_time, priority, pin)
        self.count_sent(request.mm_features)
        return request

    def answer(self, processed: ProcessedImage, first_answer: bool) -> np.ndarray | PixelHandle:
        """What answers the engine's ask for `processed`'s pixels: the first time, a handle pinned
        for it; if the engine asks again (it could not read that handle), the array (in shared
        memory until `processed` is released: the sender copies it)."""
        if first_answer and self.by_handle:
            return pixel_handle(processed, self.pool.pin(processed))
        self.mirror.pixels_resent_copied += 1
        return processed.pixel_values

    def release_handles(self, use_ids: list[int]) -> None:
        """EngineCore has read these handles (EngineCoreOutputs.released_pixel_handles), or they
        were never sent."""
        if use_ids:
            self.pool.unpin(use_ids)

    def pixels(self, source: ImageSource, mm_hash: str) -> ProcessedImage:
        """The processed image behind `source` (a prompt's `sources` entry), for the engine's
        `pixels_needed`: a pool cache hit unless the pool evicted it. Release it when sent."""
        return self.pool.process(source() if callable(source) else source, mm_hash)

    async def pixels_async(self, source: ImageSource, mm_hash: str) -> ProcessedImage:
        data = await asyncio.to_thread(source) if callable(source) else source
        return await self.pool.process_async(data, mm_hash)

    def preprocess_upload(self, data: bytes) -> str:
        """An uploaded image's mm_hash, after processing it (raising `ImageError` for what is not
        a servable image); its pixels stay in the pool's cache for the first turn that uses it."""
        processed = self._learn(self.pool.process(data))
        processed.release()
        return processed.mm_hash

    async def preprocess_upload_async(self, data: bytes) -> str:
        processed = self._learn(await self.pool.process_async(data))
        processed.release()
        return processed.mm_hash

    def _by_hash(self, item: object) -> tuple[str | None, ByHashImage | None]:
        """(mm_hash, the image as sent by hash if the engine holds it) of an encoded image or a
        stored file; (None, None) for what the pool must identify (PIL images, videos)."""
        if isinstance(item, StoredImage):
            item_hash = item.mm_hash
        elif isinstance(item, bytes):
            item_hash = hash_image(item, self.pool.settings)
        else:
            return None, None
        return item_hash, self.mirror.by_hash(item_hash)

    def process_all(self, inputs: list) -> tuple[list[Processed], dict[str, ImageSource]]:
        processed: list[Processed] = []
        try:
            for item in inputs:
                item_hash, known = self._by_hash(item)
                if known is None:
                    data = item.read() if isinstance(item, StoredImage) else item
                    known = self._learn(self.pool.process(data, item_hash))
                processed.append(known)
        except BaseException:
            for done in processed:
                done.release()
            raise
        return processed, _sources(inputs, processed)

    async def process_all_async(self, inputs: list) -> tuple[list[Processed], dict[str, ImageSource]]:
        results = await asyncio.gather(
            *(self._process_one_async(item) for item in inputs), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r in results:
                if isinstance(r, ProcessedImage):
                    r.release()
            raise errors[0]
        return list(results), _sources(inputs, results)

    async def _process_one_async(self, item) -> Processed:
        item_hash, known = self._by_hash(item)
        if known is not None:
            return known
        data = await asyncio.to_thread(item.read) if isinstance(item, StoredImage) else item
        return self._learn(await self.pool.process_async(data, item_hash))

    def _learn(self, processed: ProcessedImage) -> ProcessedImage:
        if processed.video_info is None:
            self.mirror.learn(processed.mm_hash, processed.grid_thw, processed.num_tokens)
        return processed

    def count_sent(self, features: list[MultiModalFeature]) -> None:
        """Count a request's images by how they go to the engine (by hash, by handle, or with
        pixels copied)."""
        images = [f for f in features if f.modality == "image"]
        self.mirror.images_by_hash += sum(f.by_hash for f in images)
        self.mirror.images_by_handle += sum(f.pixel_handle is not None for f in images)
        self.mirror.images_with_pixels += sum(f.pixel_values is not None for f in images)


def handle_ids(request: EngineRequest) -> list[int]:
    """The use ids of the pins a request's pixel handles hold."""
    return [f.pixel_handle.use_id for f in request.mm_features if f.pixel_handle is not None]


def _sources(inputs: list, processed: list[Processed]) -> dict[str, ImageSource]:
    """mm_hash → the image's bytes (or PIL image, or stored file's reader), for every image."""
    sources: dict[str, ImageSource] = {}
    for item, result in zip(inputs, processed):
        if result.video_info is None:
            sources[result.mm_hash] = item.read if isinstance(item, StoredImage) else item
    return sources
