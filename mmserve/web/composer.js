// The message composer: text, and images attached by file picker, drag-and-drop or paste.
//
// Every file is checked before it is attached: its first bytes must be an image format the
// server decodes (a name or a MIME type says nothing: a text file named .png is not a picture),
// and it must decode here. Images are then sent as the bytes the user chose, except large ones,
// which are downscaled here so that the request stays small. An image is attached once it is
// uploaded (uploads.js): a server that refuses it says why before the question is sent.

import { describe } from "./api.js";

const MAX_IMAGE_BYTES = 8 << 20; // larger files are downscaled before sending
const MAX_IMAGE_PIXELS = 4096 * 4096; // so are larger pictures
const DOWNSCALED_PIXELS = 2048 * 2048;

// Leading bytes of the formats the server decodes (preprocess DEFAULT_FORMATS).
const SIGNATURES = [
  ["PNG", [0x89, 0x50, 0x4e, 0x47, 0x0d, 0x0a, 0x1a, 0x0a]],
  ["JPEG", [0xff, 0xd8, 0xff]],
  ["GIF", [0x47, 0x49, 0x46, 0x38]],
  ["BMP", [0x42, 0x4d]],
  ["TIFF", [0x49, 0x49, 0x2a, 0x00]],
  ["TIFF", [0x4d, 0x4d, 0x00, 0x2a]],
  ["WEBP", [0x52, 0x49, 0x46, 0x46, null, null, null, null, 0x57, 0x45, 0x42, 0x50]],
];

/** The image format `file`'s first bytes announce, or null. */
export async function imageFormat(file) {
  const head = new Uint8Array(await file.slice(0, 12).arrayBuffer());
  const match = SIGNATURES.find(([, bytes]) => bytes.every((b, i) => b === null || head[i] === b));
  return match ? match[0] : null;
}

/**
 * `file` as a data URL to send: as it is, or downscaled (JPEG) when it is large. Throws an Error
 * whose message says why a file cannot be sent.
 */
async function prepareImage(file) {
  if (!(await imageFormat(file))) throw new Error("is not an image (PNG, JPEG, GIF, WebP, BMP or TIFF)");
  let bitmap;
  try {
    bitmap = await createImageBitmap(file);
  } catch {
    throw new Error("looks like an image but could not be decoded");
  }
  const pixels = bitmap.width * bitmap.height;
  if (file.size <= MAX_IMAGE_BYTES && pixels <= MAX_IMAGE_PIXELS) {
    bitmap.close();
    return { url: await readAsDataUrl(file), downscaled: null };
  }
  const scale = Math.min(1, Math.sqrt(DOWNSCALED_PIXELS / pixels));
  const canvas = document.createElement("canvas");
  canvas.width = Math.max(1, Math.round(bitmap.width * scale));
  canvas.height = Math.max(1, Math.round(bitmap.height * scale));
  canvas.getContext("2d").drawImage(bitmap, 0, 0, canvas.width, canvas.height);
  bitmap.close();
  return { url: canvas.toDataURL("image/jpeg", 0.9), downscaled: `${canvas.width}×${canvas.height}` };
}

/**
 * Wire the composer's elements. Images are {url, name, fileId} (uploads.js). upload(image)
 * uploads one, throwing an error whose message says why it was refused; onDiscard(image) is
 * called for an uploaded image the user removes again. onSend({text, images}) returns true when
 * the message was taken (the composer then clears) and false when it was not (nothing is lost).
 * onNotice(text) shows a problem with an attachment.
 */
export function createComposer({
  form,
  textarea,
  fileInput,
  attachButton,
  list,
  dropZone,
  upload,
  onDiscard,
  onSend,
  onNotice,
}) {
  let images = [];
  let attaching = Promise.resolve(); // files still being checked and uploaded, in order

  function showAttachments() {
    list.replaceChildren(
      ...images.map((image, index) => {
        const item = document.createElement("li");
        const img = document.createElement("img");
        img.src = image.url;
        img.alt = `Attached image ${index + 1}`;
        const remove = document.createElement("button");
        remove.type = "button";
        remove.className = "remove";
        remove.textContent = "×";
        remove.setAttribute("aria-label", `Remove image ${index + 1}`);
        remove.addEventListener("click", () => {
          onDiscard(...images.splice(index, 1));
          showAttachments();
          textarea.focus();
        });
        item.append(img, remove);
        return item;
      }),
    );
    list.hidden = images.length === 0;
  }

  /** Attach `files`; resolves once each is attached or refused (with a notice). */
  function addFiles(files) {
    attaching = attaching.then(() => attachAll(files));
    return attaching;
  }

  async function attachAll(files) {
    for (const file of files) {
      let prepared;
      try {
        prepared = await prepareImage(file);
      } catch (error) {
        onNotice(`${file.name} ${error.message}, so it was not attached.`);
        continue;
      }
      const image = { url: prepared.url, name: file.name, fileId: null };
      try {
        await upload(image);
      } catch (error) {
        onNotice(`${describe(error)}, so it was not attached.`);
        continue;
      }
      images.push(image);
      showAttachments();
      if (prepared.downscaled)
        onNotice(`${file.name} is large, so it was downscaled to ${prepared.downscaled} before sending.`);
    }
  }

  function resize() {
    textarea.style.height = "auto";
    textarea.style.height = `${Math.min(textarea.scrollHeight, 240)}px`;
  }

  attachButton.addEventListener("click", () => fileInput.click());
  fileInput.addEventListener("change", async () => {
    await addFiles([...fileInput.files]);
    fileInput.value = ""; // so choosing the same file again fires "change" again
  });
  // Anywhere on the page, not only in the text box: users paste after clicking on the page.
  document.addEventListener("paste", (event) => {
    const files = [...event.clipboardData.files];
    if (!files.length) return; // plain text: let the browser paste it
    event.preventDefault();
    addFiles(files);
  });
  dropZone.addEventListener("dragover", (event) => {
    if (!event.dataTransfer.types.includes("Files")) return;
    event.preventDefault(); // allows the drop
    dropZone.classList.add("dragging");
  });
  dropZone.addEventListener("dragleave", (event) => {
    if (!dropZone.contains(event.relatedTarget)) dropZone.classList.remove("dragging");
  });
  dropZone.addEventListener("drop", (event) => {
    event.preventDefault();
    dropZone.classList.remove("dragging");
    addFiles([...event.dataTransfer.files]);
  });
  textarea.addEventListener("input", resize);
  textarea.addEventListener("keydown", (event) => {
    // isComposing: Enter that confirms an IME composition (Chinese, Japanese, ...) must not send.
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      form.requestSubmit();
    }
  });
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    await attaching; // an image still uploading goes with this message, not the next one
    const text = textarea.value;
    if (!text.trim() && !images.length) return;
    if (!onSend({ text, images: [...images] })) return;
    textarea.value = "";
    images = [];
    showAttachments();
    resize();
  });
  showAttachments();
  return { addFiles, submit: () => form.requestSubmit() };
}

function readAsDataUrl(file) {
  return new Promise((resolve, reject) => {
    const reader = new FileReader();
    reader.onload = () => resolve(reader.result);
    reader.onerror = () => reject(reader.error);
    reader.readAsDataURL(file);
  });
}
