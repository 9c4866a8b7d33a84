// One answer: the conversation put in the API's form, and the reply streamed into a message
// together with its statistics.

import { describe, streamChat } from "./api.js";
import { requestFields, samplingLabel } from "./settings.js";
import { uploadMissing, uploadVanished } from "./uploads.js";

/** An image as a content part: by file id once uploaded, else as its data URL. */
function imagePart({ url, fileId }) {
  if (fileId) return { type: "image_file", image_file: { file_id: fileId } };
  return { type: "image_url", image_url: { url } };
}

/** The messages in the API's form: text and image parts; failed answers are left out. */
function apiMessages(messages, systemPrompt) {
  const result = systemPrompt.trim() ? [{ role: "system", content: systemPrompt }] : [];
  for (const message of messages) {
    if (message.role === "user") {
      const images = message.images.map(imagePart);
      const text = message.text ? [{ type: "text", text: message.text }] : [];
      result.push({ role: "user", content: [...images, ...text] });
    } else if (!message.error) {
      result.push({ role: "assistant", content: message.text });
    }
  }
  return result;
}

/**
 * Stream the answer to `history` into `message` ({text}), calling onText() as text arrives.
 * It ends with message.stats set, and message.stopped (the signal aborted) or message.error (a
 * readable sentence) when it did not finish. It never throws: every failure lands on `message`.
 */
export async function streamAnswer(message, history, settings, { signal, onText }) {
  const started = performance.now();
  let firstTokenAt = null;
  let usage = null;
  let timing = null; // the server's own token timing, in the stream's last chunk
  try {
    for await (const chunk of answerChunks(history, settings, signal)) {
      const delta = chunk.choices?.[0]?.delta?.content;
      if (delta) {
        firstTokenAt ??= performance.now();
        message.text += delta;
        onText();
      }
      if (chunk.usage) usage = chunk.usage;
      if (chunk.timing) timing = chunk.timing;
    }
  } catch (error) {
    if (error.name === "AbortError") message.stopped = true;
    else message.error = describe(error);
    if (error.status === 401) message.error += ". Enter the server's API key in Settings (⚙, top right).";
  }
  const stats = timings(started, firstTokenAt, usage, timing);
  message.stats = stats && { ...stats, sampling: samplingLabel(settings) };
}

/**
 * The answer's chunks. Images without a file id are uploaded first. A saved conversation may
 * name files the server no longer has (deleted, expired, a restart without its files folder):
 * the server refuses the request before any answer, the lost images are uploaded again from
 * their local copies (their ids change in `history`'s messages, saved with the answer), and
 * the request is sent once more.
 */
async function* answerChunks(history, settings, signal) {
  const options = { apiKey: settings.api_key, signal };
  const images = history.flatMap((message) => (message.role === "user" ? message.images : []));
  await uploadMissing(images, options);
  const body = () => ({ ...requestFields(settings), messages: apiMessages(history, settings.system_prompt) });
  try {
    yield* streamChat(body(), options);
  } catch (error) {
    if (!(await uploadVanished(error, images, options))) throw error;
    yield* streamChat(body(), options);
  }
}

// Decode speed counts the tokens after the first over the time from the first to the last, as
// the server timed them: tokens often reach the page several at a time (one network read), so
// the page's own clock would divide by almost nothing. Without the server's timing, no figure.
function timings(started, firstTokenAt, usage, timing) {
  if (firstTokenAt === null) return usage && { ttft_s: null, tokens_per_s: null, usage };
  const decoded = (usage?.completion_tokens ?? 0) - 1;
  const decode_s = timing?.decode_time_s;
  return {
    ttft_s: (firstTokenAt - started) / 1000,
    tokens_per_s: decoded > 0 && decode_s > 0 ? decoded / decode_s : null,
    usage,
  };
}
