// Images go to the server once, through OpenAI's Files API, and every later request refers to
// them by file id, so a long conversation does not resend its pictures on every turn.
//
// An image is {url, name, fileId}: `url` is the local copy (a data URL: the thumbnail, and what
// is uploaded again when the server has lost the file), `fileId` the server's id, or null when
// the server has no Files API (then `url` itself is sent, as a data URL part). Whether the
// server has one is decided by the first upload (404 or 405: it has none) and kept for the page.

import { ApiError, deleteFile, fileExists, uploadFile } from "./api.js";

let filesApi = null; // null: not known yet; true / false: the server has / has not a Files API

/**
 * Upload `image` and set its fileId (left null on a server without a Files API). Throws an
 * ApiError that names the image when the server refuses it (too big, not an image, quota).
 */
export async function uploadImage(image, { apiKey, signal } = {}) {
  if (filesApi === false) return image;
  try {
    const blob = await (await fetch(image.url)).blob(); // the data URL's bytes, decoded by the browser
    image.fileId = await uploadFile(blob, image.name || "image", { apiKey, signal });
    filesApi = true;
  } catch (error) {
    if (error.name === "AbortError") throw error;
    if (filesApi === null && (error.status === 404 || error.status === 405)) {
      filesApi = false;
      return image;
    }
    const message = `${image.name || "An image"} could not be uploaded: ${error.message}`;
    throw new ApiError(message, { status: error.status, type: error.type });
  }
  return image;
}

/** Upload every image that has no file id yet (one saved before uploads, or since lost). */
export async function uploadMissing(images, options) {
  for (const image of images) {
    if (!image.fileId) await uploadImage(image, options);
  }
}

/**
 * After a chat request failed with `error`: when it is a 4xx naming one of `images`' files (the
 * server deleted it, it expired, or the server restarted without its files folder), find every
 * file of theirs the server no longer has, upload those images again from their local copies
 * and resolve true (send the request again). Otherwise resolve false.
 */
export async function uploadVanished(error, images, options) {
  if (!(error.status >= 400 && error.status < 500)) return false;
  const ids = new Set(images.map((image) => image.fileId).filter(Boolean));
  if (![...ids].some((id) => error.message.includes(id))) return false;
  const gone = new Set();
  for (const id of ids) {
    if (!(await fileExists(id, options))) gone.add(id);
  }
  if (!gone.size) return false;
  for (const image of images) {
    if (gone.has(image.fileId)) image.fileId = null;
  }
  await uploadMissing(images, options);
  return true;
}

/** Delete `images`' files on the server (they would expire anyway: failures are ignored). */
export function forgetImages(images, { apiKey }) {
  for (const id of new Set(images.map((image) => image.fileId).filter(Boolean))) {
    deleteFile(id, { apiKey }).catch(() => {});
  }
}
