"""How a prompt's images and videos reach the engine, through its pixel store (one channel).

Building a prompt, an image whose hash the mirror (pixel_store_mirror.py) lists is held and
sent by hash: no decode, no preprocessing, no pixel copy (the pool is not asked). Any other item
is processed by the pool. Making an engine request from the prompt (`engine_request`) decides
with the mirror what the engine's store holds: the items it lacks go with the request — an
image by shared-memory handle (the pool pins the segment until EngineCore reports the handle
released) or copied into the message, a video's pixels copied — and the request names what the
store drops. The request must be sent at once (see `engine_request`).

`apply_engine_outputs` is the one place where what EngineCore reports about images is applied,
for the server (AsyncLLM) and the offline LLM alike; `engine_gone` when it dies.
"""

from __future__ import annotations

import asyncio

import numpy as np

from mmserve.frontend.file_store import StoredImage
from mmserve.frontend.pixel_store_mirror import ByHashImage, Holds, PixelStoreMirror, StoreChange, StoredItem
from mmserve.frontend.placeholders import pixel_handle
from mmserve.frontend.prompt import ProcessedPrompt
from mmserve.protocol import EngineCoreOutputs, EngineRequest, MultiModalFeature, PixelHandle
from mmserve.sampling_params import SamplingParams
from preprocess import PreprocessPool, ProcessedImage
from preprocess import mm_hash as hash_image

Processed = ProcessedImage | ByHashImage


class MediaProcessor:
    def __init__(self, pool: PreprocessPool, pixel_store_bytes: int = 1 << 30) -> None:
        self.pool = pool
        self.mirror = PixelStoreMirror(pixel_store_bytes)
        # Images go to EngineCore by handle; False: their pixels are copied into the messages
        # (as before handles, kept for comparison and for a reader without access to /dev/shm).
        self.by_handle = True
        self._last_change = ("", StoreChange())  # (request id, its store changes), for `not_sent`

    # ------------------------------------------------------------------ building a prompt

    def process_all(self, inputs: list) -> tuple[list[Processed], Holds | None]:
        """Each input as sent by hash (the engine holds it: held for the prompt) or processed by
        the pool; release the processed items and the holds (None: no inputs) when done."""
        if not inputs:
            return [], None
        holds = self.mirror.holds()
        processed: list[Processed] = []
        try:
            for item in inputs:
                item_hash, known = self._by_hash(item, holds)
                if known is None:
                    data = item.read() if isinstance(item, StoredImage) else item
                    known = self.pool.process(data, item_hash)
                processed.append(known)
        except BaseException:
            for done in processed:
                done.release()
            holds.release()
            raise
        return processed, holds

    async def process_all_async(self, inputs: list) -> tuple[list[Processed], Holds | None]:
        if not inputs:
            return [], None
        holds = self.mirror.holds()
        results = await asyncio.gather(
            *(self._process_one_async(item, holds) for item in inputs), return_exceptions=True
        )
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            for r in results:
                if isinstance(r, ProcessedImage):
                    r.release()
            holds.release()
            raise errors[0]
        return list(results), holds

    async def _process_one_async(self, item, holds: Holds) -> Processed:
        item_hash, known = self._by_hash(item, holds)
        if known is not None:
            return known
        data = await asyncio.to_thread(item.read) if isinstance(item, StoredImage) else item
        return await self.pool.process_async(data, item_hash)

    def _by_hash(self, item: object, holds: Holds) -> tuple[str | None, ByHashImage | None]:
        """(mm_hash, the image as sent by hash if the engine holds it) of an encoded image or a
        stored file; (None, None) for what the pool must identify (PIL images, videos)."""
        if isinstance(item, StoredImage):
            item_hash = item.mm_hash
        elif isinstance(item, bytes):
            item_hash = hash_image(item, self.pool.settings)
        else:
            return None, None
        stored = self.mirror.hold(item_hash, holds)
        if stored is None:
            return item_hash, None
        return item_hash, ByHashImage(item_hash, stored.grid_thw, stored.num_tokens)

    def preprocess_upload(self, data: bytes) -> str:
        """An uploaded image's mm_hash, after processing it (raising `ImageError` for what is not
        a servable image); its pixels stay in the pool's cache for the first turn that uses it."""
        with self.pool.process(data) as processed:
            return processed.mm_hash

    async def preprocess_upload_async(self, data: bytes) -> str:
        with await self.pool.process_async(data) as processed:
            return processed.mm_hash

    # ------------------------------------------------------------------ sending it

    def engine_request(
        self,
        prompt: ProcessedPrompt,
        request_id: str,
        params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
    ) -> EngineRequest:
        """`prompt` as one engine request (one per sample when n > 1), with the pixel-store
        changes the mirror has just committed for it. Send it before anything else commits —
        on an event loop, without yielding between this call and the socket send — or, if it
        cannot be sent, call `not_sent(request)` at once."""
        if not prompt.features:  # nothing to decide (what the store drops goes with the next image)
            return EngineRequest(
                request_id=request_id,
                prompt_token_ids=prompt.token_ids,
                mm_features=[],
                sampling_params=params,
                arrival_time=arrival_time,
                priority=priority,
            )
        items = {f.mm_hash: self._stored_item(prompt, f) for f in prompt.features}
        if prompt.holds is None:
            prompt.holds = self.mirror.holds()
        change = self.mirror.commit(items, prompt.holds)
        handles: dict[str, PixelHandle] = {}
        arrays: dict[str, np.ndarray] = {}
        try:
            for mm_hash in change.add:
                image = prompt.shared.get(mm_hash)
                if image is None:
                    arrays[mm_hash] = prompt.arrays[mm_hash]
                elif self.by_handle:
                    handles[mm_hash] = pixel_handle(image, self.pool.pin(image))
                else:
                    arrays[mm_hash] = np.array(image.pixel_values)  # the segment goes with the prompt
        except BaseException:
            self.release_handles([handle.use_id for handle in handles.values()])
            self.mirror.undo(change)
            raise
        request = EngineRequest(
            request_id=request_id,
            prompt_token_ids=prompt.token_ids,
            mm_features=prompt.features,
            sampling_params=params,
            arrival_time=arrival_time,
            priority=priority,
            mm_evict=change.evict,
            mm_handles=handles,
            mm_arrays=arrays,
        )
        self._count_sent(request)
        self._last_change = (request_id, change)
        return request

    def not_sent(self, request: EngineRequest) -> None:
        """`request`, the last `engine_request` made, could not be sent: its store changes are
        undone and its handles unpinned."""
        if not request.mm_features:
            return
        request_id, change = self._last_change
        if request_id != request.request_id:
            raise RuntimeError(f"{request.request_id} is not the last request made: it cannot be undone")
        self._last_change = ("", StoreChange())
        self.mirror.undo(change)
        self.release_handles(handle_ids(request))

    @staticmethod
    def _stored_item(prompt: ProcessedPrompt, feature: MultiModalFeature) -> StoredItem | None:
        """The item as the store would list it, if the prompt has its pixels (None: by hash)."""
        image = prompt.shared.get(feature.mm_hash)
        if image is not None and not image.released:
            return StoredItem(feature.grid_thw, feature.length, image.pixel_values.nbytes)
        pixels = prompt.arrays.get(feature.mm_hash)
        if pixels is not None:
            return StoredItem(feature.grid_thw, feature.length, pixels.nbytes)
        return None

    def _count_sent(self, request: EngineRequest) -> None:
        """Count a request's images by how they go to the engine (by hash, by handle, or with
        pixels copied)."""
        for f in request.mm_features:
            if f.modality != "image":
                continue
            if f.mm_hash in request.mm_handles:
                self.mirror.images_by_handle += 1
            elif f.mm_hash in request.mm_arrays:
                self.mirror.images_with_pixels += 1
            else:
                self.mirror.images_by_hash += 1

    # ------------------------------------------------------------------ what the engine says

    def apply_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
        """What EngineCore reports about images: the handles it has read are unpinned, and the
        items it could not read leave the mirror."""
        self.release_handles(outputs.released_pixel_handles)
        if outputs.unreadable_pixels:
            self.mirror.drop(outputs.unreadable_pixels)

    def engine_gone(self) -> None:
        """EngineCore died or stopped: nothing will read the handles in flight, and its store is
        empty."""
        self.pool.unpin_all()
        self.mirror.reset()

    def release_handles(self, use_ids: list[int]) -> None:
        """EngineCore has read these handles (EngineCoreOutputs.released_pixel_handles), or they
        were never sent."""
        if use_ids:
            self.pool.unpin(use_ids)


def handle_ids(request: EngineRequest) -> list[int]:
    """The use ids of the pins a request's pixel handles hold."""
    return [handle.use_id for handle in request.mm_handles.values()]
