"""Chat messages in (OpenAI's shape), template messages and their image / video inputs out.

Every message and part is validated, and the image and video counts checked against their
limits, before any item is loaded (data URL, file, http, or an uploaded file by id), so a
request over a limit costs no read or fetch. `PromptError` is the error every invalid prompt
or message raises, here and in the input processor.
"""

from __future__ import annotations

from dataclasses import dataclass

from PIL import Image

from mmserve.frontend.file_store import FileResolver, StoredImage
from mmserve.frontend.media import MediaLoader, RawDataUrl
from mmserve.frontend.video_inputs import VideoData, VideoRef

ImageInput = bytes | Image.Image | StoredImage
MediaInput = ImageInput | VideoData  # in the prompt's order

ROLES = ("system", "user", "assistant", "tool")


class PromptError(ValueError):
    """The request's prompt or messages are invalid; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def parse_messages(
    messages: list[dict],
    loader: MediaLoader,
    max_images: int | None = None,
    max_videos: int | None = None,
    files: FileResolver | None = None,
) -> tuple[list[dict], list[MediaInput]]:
    """Validate OpenAI-style messages → (messages for the template, image / video inputs in order).

    Every message is checked, and the image and video counts against their limits, before any
    item is loaded: a request over a limit costs no file read or fetch. `files` resolves the
    file ids of `file` / `image_file` parts (None: such parts are refused)."""
    if not isinstance(messages, list) or not messages:
        raise PromptError("messages must be a non-empty list", "messages")
    template_messages, refs = [], []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise PromptError(f"messages[{i}] must be an object", "messages")
        role = message.get("role")
        if role not in ROLES:
            raise PromptError(
                f"messages[{i}].role must be one of {', '.join(ROLES)}, got {_short(role)}", "messages"
            )
        content = message.get("content")
        if content is None and role == "assistant":
            content = ""
        # A template that renders tools reads these beside the content.
        tool_fields = {key: message[key] for key in ("tool_calls", "tool_call_id", "name") if key in message}
        if isinstance(content, str):
            template_messages.append({"role": role, "content": content, **tool_fields})
            continue
        if not isinstance(content, list):
            raise PromptError(f"messages[{i}].content must be a string or a list of parts", "messages")
        parts = []
        for j, part in enumerate(content):
            parts.append(_parse_part(part, f"messages[{i}].content[{j}]", refs))
        template_messages.append({"role": role, "content": parts, **tool_fields})
    num_videos = sum(isinstance(ref, VideoRef) for ref in refs)
    if max_images is not None and len(refs) - num_videos > max_images:
        raise PromptError(
            f"at most {max_images} images are allowed per prompt, got {len(refs) - num_videos}", "messages"
        )
    if max_videos is not None and num_videos > max_videos:
        raise PromptError(f"at most {max_videos} videos are allowed per prompt, got {num_videos}", "messages")
    return template_messages, [_load(ref, loader, files) for ref in refs]


def _load(
    ref: str | RawDataUrl | Image.Image | VideoRef | FileRef, loader: MediaLoader, files: FileResolver | None
) -> MediaInput:
    if isinstance(ref, VideoRef):
        return VideoData(data=loader.load_video(ref.url))
    if isinstance(ref, FileRef):
        if files is None:
            raise PromptError("file references are not served here (no Files API)", "messages")
        return files(ref.file_id)
    return loader.load(ref) if isinstance(ref, str | RawDataUrl) else ref


@dataclass(frozen=True)
class FileRef:
    file_id: str


def _file_id(part: dict, kind: str, where: str) -> str:
    """The id of a `{"type": "file", "file": {"file_id"}}` or `{"type": "image_file",
    "image_file": {"file_id"}}` part (OpenAI's two shapes)."""
    ref = part.get(kind)
    file_id = ref.get("file_id") if isinstance(ref, dict) else None
    if not isinstance(file_id, str) or not file_id:
        raise PromptError(f"{where}.{kind}.file_id must be a non-empty string", "messages")
    return file_id


def _parse_part(part, where: str, refs: list[str | RawDataUrl | Image.Image | VideoRef | FileRef]) -> dict:
    """One content part → its template form; an image's URL (or PIL image) or a video's URL
    goes to `refs`."""
    if not isinstance(part, dict):
        raise PromptError(f"{where} must be an object", "messages")
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise PromptError(f"{where}.text must be a string", "messages")
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        ref = part.get("image_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str | RawDataUrl):
            raise PromptError(f"{where}.image_url.url must be a string", "messages")
        refs.append(url)
        return {"type": "image"}
    if kind == "image" and isinstance(part.get("image"), Image.Image):
        refs.append(part["image"])
        return {"type": "image"}
    if kind == "video_url":
        ref = part.get("video_url")
        url = ref.get("url") if isinstance(ref, dict) else ref
        if not isinstance(url, str | RawDataUrl):
            raise PromptError(f"{where}.video_url.url must be a string", "messages")
        refs.append(VideoRef(url))
        return {"type": "video"}
    if kind in ("file", "image_file"):
        refs.append(FileRef(_file_id(part, kind, where)))
        return {"type": "image"}
    raise PromptError(
        f"{where}.type {_short(kind)} is not supported (use 'text', 'image_url', 'image_file', 'file' or "
        "'video_url')",
        "messages",
    )


def _short(value: object, limit: int = 64) -> str:
    """repr of a client value for an error message, cut short: errors never echo megabytes."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
