// The server's public OpenAI-compatible API, as any client sees it: no private endpoints.
// URLs are relative to the page, so it also works behind a proxy that adds a path prefix.

/** An error the server reported ({"error": {message, type, ...}}), or a transport failure. */
export class ApiError extends Error {
  constructor(message, { status = null, type = null } = {}) {
    super(message);
    this.name = "ApiError";
    this.status = status;
    this.type = type;
  }
}

function authorization(apiKey) {
  return apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
}

function headers(apiKey) {
  return { "Content-Type": "application/json", ...authorization(apiKey) };
}

/** An error in words, with the HTTP status when the server sent one. */
export function describe(error) {
  return error.status ? `${error.message} (HTTP ${error.status})` : error.message;
}

// fetch() only rejects when the server cannot be reached; say so in words a user can act on.
async function send(path, init) {
  try {
    return await fetch(path, init);
  } catch (error) {
    if (error.name === "AbortError") throw error;
    throw new ApiError(`could not reach the server (${error.message})`);
  }
}

async function errorFrom(response) {
  let body = null;
  try {
    body = await response.json();
  } catch {
    // not JSON (a proxy's error page, say): fall back to the status line below
  }
  const error = body?.error;
  const message = error?.message ?? `${response.status} ${response.statusText}`.trim();
  return new ApiError(message, { status: response.status, type: error?.type ?? null });
}

/** The ids of the served models. */
export async function listModels({ apiKey }) {
  const response = await send("v1/models", { headers: headers(apiKey) });
  if (!response.ok) throw await errorFrom(response);
  return (await response.json()).data.map((model) => model.id);
}

/** POST /v1/files (multipart, purpose "vision", OpenAI's Files API): the stored file's id. */
export async function uploadFile(blob, name, { apiKey, signal }) {
  const form = new FormData();
  form.append("purpose", "vision");
  form.append("file", blob, name);
  // No Content-Type of our own: the browser writes the multipart boundary into it.
  const response = await send("v1/files", { method: "POST", headers: authorization(apiKey), body: form, signal });
  if (!response.ok) throw await errorFrom(response);
  return (await response.json()).id;
}

/** Whether the server still has file `id` for this key (GET /v1/files/{id}: 404 when not). */
export async function fileExists(id, { apiKey, signal }) {
  const response = await send(`v1/files/${encodeURIComponent(id)}`, { headers: authorization(apiKey), signal });
  if (response.status === 404) return false;
  if (!response.ok) throw await errorFrom(response);
  return true;
}

/** DELETE /v1/files/{id}. */
export async function deleteFile(id, { apiKey }) {
  const response = await send(`v1/files/${encodeURIComponent(id)}`, {
    method: "DELETE",
    headers: authorization(apiKey),
  });
  if (!response.ok && response.status !== 404) throw await errorFrom(response);
}

/**
 * POST /v1/chat/completions with stream: true and yield each chunk object as it arrives.
 * Throws ApiError for an error status or a mid-stream error frame, and the fetch AbortError when
 * `signal` aborts (closing the connection, which makes the server abort the request).
 */
export async function* streamChat(body, { apiKey, signal }) {
  const response = await send("v1/chat/completions", {
    method: "POST",
    headers: headers(apiKey),
    body: JSON.stringify({ ...body, stream: true, stream_options: { include_usage: true } }),
    signal,
  });
  if (!response.ok) throw await errorFrom(response);
  for await (const data of serverSentData(response.body)) {
    if (data === "[DONE]") return;
    const chunk = JSON.parse(data);
    if (chunk.error) throw new ApiError(chunk.error.message, { type: chunk.error.type });
    yield chunk;
  }
  throw new ApiError("the answer stream ended early (the server closed the connection)");
}

// The data of each server-sent event. The server separates events with "\n\n".
async function* serverSentData(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return;
      buffer += value;
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const event = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const data = event
          .split("\n")
          .filter((line) => line.startsWith("data:"))
          .map((line) => line.slice(5).trimStart())
          .join("\n");
        if (data) yield data;
      }
    }
  } finally {
    // Let the connection go when the consumer stops early; on an errored stream this rejects.
    reader.cancel().catch(() => {});
  }
}
