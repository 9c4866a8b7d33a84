// One answer: the conversation put in the API's form, and the reply streamed into a message
// together with its statistics.

import { streamChat } from "./api.js";
import { requestFields, samplingLabel } from "./settings.js";

/** The messages in the API's form: text and image_url parts; failed answers are left out. */
function apiMessages(messages, systemPrompt) {
  const result = systemPrompt.trim() ? [{ role: "system", content: systemPrompt }] : [];
  for (const message of messages) {
    if (message.role === "user") {
      const images = message.images.map((url) => ({ type: "image_url", image_url: { url } }));
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
  const body = { ...requestFields(settings), messages: apiMessages(history, settings.system_prompt) };
  const started = performance.now();
  let firstTokenAt = null;
  let usage = null;
  let timing = null; // the server's own token timing, in the stream's last chunk
  try {
    for await (const chunk of streamChat(body, { apiKey: settings.api_key, signal })) {
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
    else message.error = error.status ? `${error.message} (HTTP ${error.status})` : error.message;
    if (error.status === 401) message.error += ". Enter the server's API key in Settings (⚙, top right).";
  }
  const stats = timings(started, firstTokenAt, usage, timing);
  message.stats = stats && { ...stats, sampling: samplingLabel(settings) };
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
